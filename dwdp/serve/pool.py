"""WorkerPool: the router's side of the workers, in the router process.

Spawns one worker process per DWDP rank (one env:// world on a free loopback port), assigns each
request to the least-loaded healthy worker, tracks every request from admission to answer, and
notices dead workers: requests already running on one fail with a clear error (a prompt that
killed one worker is not handed to the next), requests still waiting in its queue are handed to
another worker.

Workers report their failover status several times per stall bound. A worker is routable while it
is alive, has spoken within `stall_timeout_s`, and can still reach every expert; a degraded one
(lost experts or its own device) gets no new requests, and the requests it fails for that reason
are handed to another worker, or answered 503 with its reason when none is left.

With restarts on (dwdp.serve.restarts), a dead worker, or one whose own device is lost (stopped
first), is started again as the same rank after a back-off: the new process rejoins the DWDP group
without a collective and gets requests only once it reports ready. A rank that keeps dying is left
down with its reason; the others keep serving.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import multiprocessing as mp
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from dwdp import envs
from dwdp.runtime.board import sweep_stale_boards
from dwdp.runtime.group import LoopbackStore, store_env
from dwdp.serve.config import ServeConfig, prompt_limit, split_address
from dwdp.serve.errors import ServeError
from dwdp.serve.restarts import RestartPolicy
from dwdp.serve.protocol import (STOP, BatchDone, BatchStarted, InjectFault, PrefillError, PrefillJob, PrefillResult,
                                ResultsChannel, WorkerFailed, WorkerHealth, WorkerReady)
from dwdp.serve.routing import NoHealthyWorker, Overloaded, WorkerLoad, pick_worker
from dwdp.serve.worker import worker_main

log = logging.getLogger("dwdp")

THROUGHPUT_WINDOW_S = 10.0  # tokens/s is averaged over this many recent seconds
FIRST_FORWARDS = 64  # forwards after ready whose times /health keeps: a stall after start shows there
RETRY_AFTER_S = 1


class StartupError(RuntimeError):
    """A worker failed (or did not finish) building its model and joining the group."""


@dataclass
class _Request:
    job: PrefillJob
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    rank: int = -1
    tried: set = field(default_factory=set)
    done_tokens: int = 0  # tokens its worker has prefilled so far (chunks done); they no longer count as outstanding

    @property
    def left_tokens(self) -> int:
        return len(self.job.input_ids) - self.done_tokens


@dataclass
class _Rank:
    rank: int
    process: mp.Process | None                          # None only until start() starts it
    requests: object                                   # its multiprocessing queue of PrefillJob
    pid: int | None = None
    is_ready: bool = False
    is_alive: bool = True
    exit_code: int | None = None
    failure: str | None = None
    queued: dict = field(default_factory=dict)          # request id -> _Request, not started yet
    running: dict = field(default_factory=dict)         # request id -> _Request, in a forward
    outstanding_tokens: int = 0
    last_assigned: int = -1
    served_requests: int = 0
    served_tokens: int = 0
    prefetch_wait_s: float = 0.0                        # exposed prefetch wait of its forwards
    forwards: int = 0
    forward_s: float = 0.0                              # time in its forwards
    outside_s: float = 0.0                              # time between its forwards, waits for work left out
    outside_forwards: int = 0                           # forwards that time was measured before
    kv_write_s: float = 0.0                             # time writing its answers' KV artifacts
    computed_tokens: int = 0                            # tokens its forwards computed (padding included)
    real_tokens: int = 0                                # prompt tokens of its forwards
    health: dict = field(default_factory=dict)          # its latest failover status (WorkerHealth)
    info: dict = field(default_factory=dict)            # its device and memory, from WorkerReady
    first_forwards: list = field(default_factory=list)  # (seconds, padded tokens) of its first forwards
    last_heard: float = 0.0                             # monotonic time of its latest message
    is_stalled: bool = False                            # silent for longer than stall_timeout_s
    restarts: int = 0                                   # times its process was started again
    rejoins: int = 0                                    # restarts that rejoined the group and got ready
    restart_at: float | None = None                     # monotonic time of its next start, while dead
    down_reason: str | None = None                      # why it is left down for good

    @property
    def is_routable(self) -> bool:
        return self.is_alive and self.is_ready and not self.is_stalled and self.health.get("can_serve_all", True)


class WorkerPool:
    def __init__(self, config: ServeConfig, kv_dir: str):
        self.config = config
        self.kv_dir = kv_dir
        self.model_info: dict = {}
        self._ctx = mp.get_context("spawn")
        self._ranks: list[_Rank] = []
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # readiness, deaths, requests finishing
        self._sequence = itertools.count()
        self._recent = collections.deque()               # (monotonic time, prompt tokens) of answers
        self.num_retried = 0                             # requests moved off a dead or degraded worker
        self.num_failed = 0                              # admitted requests answered with an error
        self._is_draining = False
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._restarts = (RestartPolicy(config.restart_backoff_s, config.max_restarts_per_minute)
                          if config.restarts_workers else None)
        self._is_serving = False                         # every worker was ready once: a dead one may restart
        self._store: LoopbackStore | None = None          # the workers' rendezvous (on node 0 of several)
        self._store_env: dict = {}                       # how the workers reach it
        self.node = envs.node_name()
        self._old_queues: list = []                      # request queues of dead processes, closed at the end

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        """Spawn the workers and the threads that read their answers and watch their health."""
        if self.config.device == "cuda":
            from dwdp.runtime.devices import require_gpu, sharing_line

            line = sharing_line(self.config.ranks, require_gpu("dwdp serve"))
            if line:
                log.info("%s", line)
        self._open_store()
        for rank in range(self.config.first_rank, self.config.first_rank + self.config.ranks):
            requests = self._ctx.Queue()
            self._ranks.append(_Rank(rank, None, requests))
        for r in self._ranks:
            r.process = self._start_worker(r.rank, r.requests, rejoin=False)
        thread = threading.Thread(target=self._watch_processes, name="dwdp-router-watch", daemon=True)
        thread.start()
        self._threads.append(thread)

    def _open_store(self) -> None:
        """The world's store: on loopback for one node; over several, node 0 hosts it at dist_init_addr and
        the others' workers join it there (it outlives any worker: the board and beats live in it)."""
        config = self.config
        if config.nnodes == 1:
            self._store = LoopbackStore(config.startup_timeout_s)
            self._store_env = self._store.env()
            return
        host, port = split_address(config.dist_init_addr)
        if config.node_rank == 0:
            self._store = LoopbackStore(config.startup_timeout_s, host, port)
        self._store_env = store_env(host, port)

    def _rank(self, rank: int) -> _Rank:
        """This node's worker of group rank `rank`."""
        return self._ranks[rank - self.config.first_rank]

    def _start_worker(self, rank: int, requests, rejoin: bool) -> mp.Process:
        """Start one worker process with a results pipe of its own, and the thread that reads it."""
        reader, writer = self._ctx.Pipe(duplex=False)
        results = ResultsChannel(writer)
        if self.config.mode == "dep":
            from dwdp.serve.dep_worker import dep_worker_main

            process = self._ctx.Process(target=dep_worker_main, name=f"dwdp-serve-dep-rank{rank}", daemon=False,
                                        args=(rank, self.config.ranks, self._store_env, self.config, self.kv_dir,
                                              requests, results))
        else:
            process = self._ctx.Process(target=worker_main, name=f"dwdp-serve-dwdp-rank{rank}", daemon=False,
                                        args=(rank, self.config.group_ranks, self._store_env, self.config,
                                              self.kv_dir, requests, results, rejoin))
        process.start()
        writer.close()  # the worker holds the only write end: its death reads as the pipe's end
        thread = threading.Thread(target=self._read_results, args=(reader,), daemon=True,
                                  name=f"dwdp-router-results-{rank}-{process.pid}")
        thread.start()
        self._threads.append(thread)
        return process

    def _restart_locked(self, r: _Rank, now: float) -> None:
        """Start rank `r` again: a new process (and queues) that rejoins the group; not routable
        until it reports ready."""
        self._old_queues.append(r.requests)
        r.requests = self._ctx.Queue()
        r.process = self._start_worker(r.rank, r.requests, rejoin=True)
        self._restarts.started(r.rank, now)
        r.restarts += 1
        r.restart_at, r.is_alive, r.is_ready, r.is_stalled = None, True, False, False
        r.pid, r.exit_code, r.failure, r.health, r.last_heard = r.process.pid, None, None, {}, now
        log.warning("worker rank %d started again (restart %d, pid %d): it rejoins its group", r.rank, r.restarts,
                    r.pid)

    def wait_ready(self) -> None:
        """Block until every worker is serving; raises StartupError (naming the rank) otherwise."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        with self._changed:
            while not all(r.is_ready for r in self._ranks):
                broken = [r for r in self._ranks if not r.is_alive or r.failure]
                if broken:
                    r = broken[0]
                    raise StartupError(f"worker rank {r.rank} failed during startup (exit code {r.exit_code}):\n"
                                       f"{r.failure or 'no traceback (killed?)'}")
                left = deadline - time.monotonic()
                if left <= 0:
                    slow = [r.rank for r in self._ranks if not r.is_ready]
                    raise StartupError(f"workers {slow} were not ready within {self.config.startup_timeout_s:.0f} s")
                self._changed.wait(timeout=min(left, 0.5))
        try:
            prompt_limit(self.config, self.model_info)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        with self._changed:
            self._is_serving = True

    def close(self) -> None:
        """Refuse new requests, let admitted ones finish (up to drain_timeout_s), then stop every
        worker (STOP after its queue; terminate if it does not exit) and the helper threads."""
        deadline = time.monotonic() + self.config.drain_timeout_s
        with self._changed:
            self._is_draining = True
            while self._requests and time.monotonic() < deadline:
                self._changed.wait(timeout=0.1)
            for r in self._ranks:
                if r.is_alive:
                    r.requests.put(STOP)
        for r in self._ranks:
            r.process.join(timeout=max(1.0, deadline - time.monotonic()) + 10.0)
            if r.process.is_alive():
                r.process.terminate()
                r.process.join(timeout=5.0)
                if r.process.is_alive():
                    r.process.kill()
                    r.process.join(timeout=5.0)
        # A worker killed after its peers last looked leaves its board entry (and so the board) behind.
        sweep_stale_boards(Path(envs.shm_dir()))
        if self._store is not None:
            self._store.close()
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5.0)
        with self._lock:
            left = list(self._requests.values())
            self._requests.clear()
        for req in left:
            self._resolve(req, ServeError(503, "shutting_down", "the server stopped before this request finished",
                                          retry_after=RETRY_AFTER_S))
        for q in [r.requests for r in self._ranks] + self._old_queues:
            q.cancel_join_thread()  # a dead reader must not block our exit on unflushed data
            q.close()

    # -- requests ------------------------------------------------------------------------------
    def submit(self, input_ids: list[int], banned_first: tuple[int, ...] = ()) -> asyncio.Future:
        """Admit one validated prompt and return a future of its PrefillResult (or ServeError).
        banned_first: token ids the first token may not be (min_tokens). Raises ServeError 429 when every
        queue is full and 503 when no worker can take it."""
        loop = asyncio.get_running_loop()
        job = PrefillJob(f"pf-{uuid.uuid4().hex}", tuple(input_ids), time.monotonic(), tuple(banned_first))
        req = _Request(job, loop.create_future(), loop)
        with self._lock:
            if self._is_draining:
                raise ServeError(503, "shutting_down", "the server is shutting down", retry_after=RETRY_AFTER_S)
            self._assign_locked(req, self.config.max_queue_tokens)
            self._requests[job.request_id] = req
        return req.future

    def _assign_locked(self, req: _Request, max_queue_tokens: float) -> None:
        num_tokens = len(req.job.input_ids)
        loads = [WorkerLoad(r.rank, r.is_routable, r.outstanding_tokens, r.last_assigned) for r in self._ranks]
        try:
            rank = pick_worker(loads, num_tokens, max_queue_tokens, frozenset(req.tried))
        except NoHealthyWorker as exc:
            raise ServeError(503, "no_healthy_worker", str(exc), retry_after=RETRY_AFTER_S) from None
        except Overloaded as exc:
            raise ServeError(429, "overloaded", str(exc), retry_after=RETRY_AFTER_S) from None
        r = self._rank(rank)
        req.rank = rank
        req.done_tokens = 0  # a worker that takes it over prefills it from the start
        req.tried.add(rank)
        r.queued[req.job.request_id] = req
        r.outstanding_tokens += num_tokens
        r.last_assigned = next(self._sequence)
        r.requests.put(req.job)

    def _finish_locked(self, request_id: str):
        """Forget a request everywhere; returns it (None if already finished)."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            r = self._rank(req.rank)
            if r.queued.pop(request_id, None) is not None or r.running.pop(request_id, None) is not None:
                r.outstanding_tokens -= req.left_tokens
            self._changed.notify_all()
        return req

    def _resolve(self, req: _Request, outcome) -> None:
        if isinstance(outcome, BaseException):
            with self._lock:
                self.num_failed += 1

        def settle():
            if req.future.done():
                return
            if isinstance(outcome, BaseException):
                req.future.set_exception(outcome)
            else:
                req.future.set_result(outcome)

        try:
            req.loop.call_soon_threadsafe(settle)
        except RuntimeError:
            pass  # the event loop is closed: nobody awaits this request any more

    # -- helper threads ------------------------------------------------------------------------
    def _read_results(self, reader) -> None:
        """Handle one worker process's messages until its pipe ends (the process exited, or was killed
        in the middle of a message) or the pool stops."""
        try:
            while not self._stop.is_set():
                if not reader.poll(0.2):
                    continue
                try:
                    msg = reader.recv()
                except (EOFError, OSError):
                    return
                self._handle(msg)
        finally:
            reader.close()

    def _handle(self, msg) -> None:
        outcome, req = None, None
        with self._changed:
            if isinstance(getattr(msg, "rank", None), int):
                self._rank(msg.rank).last_heard = time.monotonic()
            if isinstance(msg, WorkerHealth):
                r = self._rank(msg.rank)
                r.health = msg.status
                if msg.status.get("device_lost") and self._restarts is not None and r.is_alive and r.is_ready:
                    log.warning("worker rank %d reports its device lost (%s): stopping it to start it again", r.rank,
                                msg.status["device_lost"])
                    r.is_ready = False  # nothing new goes to it; its death is handled as any other
                    r.process.kill()
                if r.is_stalled:
                    r.is_stalled = False
                    log.warning("worker rank %d reports again: routable once more", r.rank)
                self._changed.notify_all()
            elif isinstance(msg, WorkerReady):
                r = self._rank(msg.rank)
                if r.restarts:
                    r.rejoins += 1
                    log.warning("worker rank %d (pid %d) rejoined its group and is ready", r.rank, msg.pid)
                r.pid, r.is_ready, r.info = msg.pid, True, msg.worker
                self.model_info = self.model_info or msg.model_info
                self._changed.notify_all()
            elif isinstance(msg, WorkerFailed):
                self._rank(msg.rank).failure = msg.error
                self._changed.notify_all()
            elif isinstance(msg, BatchStarted):
                r = self._rank(msg.rank)
                for request_id in msg.request_ids:
                    started = r.queued.pop(request_id, None)
                    if started is not None:
                        r.running[request_id] = started
            elif isinstance(msg, PrefillResult):
                r = self._rank(msg.rank)
                req = self._finish_locked(msg.request_id)
                r.kv_write_s += msg.kv_write_s
                if req is not None:
                    r.served_requests += 1
                    r.served_tokens += msg.prompt_tokens
                    self._recent.append((time.monotonic(), msg.prompt_tokens))
                    outcome = msg
            elif isinstance(msg, BatchDone):
                r = self._rank(msg.rank)
                r.forwards += 1
                r.forward_s += msg.prefill_s
                if msg.outside_s is not None:
                    r.outside_s += msg.outside_s
                    r.outside_forwards += 1
                r.prefetch_wait_s += msg.prefetch_wait_s
                r.computed_tokens += msg.padded_tokens
                r.real_tokens += msg.real_tokens
                for request_id, n in msg.prefilled:  # chunks done leave the worker's outstanding tokens
                    done = self._requests.get(request_id)
                    if done is not None and done.rank == msg.rank and request_id in r.running:
                        done.done_tokens += n
                        r.outstanding_tokens -= n
                if len(r.first_forwards) < FIRST_FORWARDS:
                    r.first_forwards.append((msg.prefill_s, msg.padded_tokens))
            elif isinstance(msg, PrefillError) and msg.retryable:
                req, outcome = self._hand_on_locked(msg)
            elif isinstance(msg, PrefillError):
                req = self._finish_locked(msg.request_id)
                unavailable = msg.error_type == "dep_group_broken"  # the server, not the prompt: try later
                outcome = ServeError(503 if unavailable else 500, msg.error_type, msg.message,
                                     retry_after=RETRY_AFTER_S if unavailable else None)
        if req is not None:
            self._resolve(req, outcome)

    def _hand_on_locked(self, msg: PrefillError):
        """A degraded worker failed a request for what it lost: give it to another worker. Returns
        (request, ServeError) when none can take it, (None, None) when handed on."""
        req = self._requests.get(msg.request_id)
        if req is None:
            return None, None
        r = self._rank(req.rank)
        if r.queued.pop(msg.request_id, None) is not None or r.running.pop(msg.request_id, None) is not None:
            r.outstanding_tokens -= req.left_tokens
        try:
            self._assign_locked(req, float("inf"))  # admitted already: the queue bound is for new requests
            self.num_retried += 1
            return None, None
        except ServeError as exc:
            self._requests.pop(msg.request_id, None)
            self._changed.notify_all()
            return req, ServeError(503, msg.error_type, f"{msg.message}; no other worker can take it: {exc.message}",
                                   retry_after=RETRY_AFTER_S)

    def _watch_processes(self) -> None:
        while not self._stop.wait(0.1):
            for r in self._ranks:
                if r.is_alive and r.process.exitcode is not None:
                    self._on_death(r)
            self._check_stalls()
            with self._changed:
                now = time.monotonic()
                for r in self._ranks:
                    if r.restart_at is not None and now >= r.restart_at and not self._is_draining:
                        self._restart_locked(r, now)

    def _check_stalls(self) -> None:
        """A ready worker silent for stall_timeout_s gets no new requests until it speaks again."""
        now = time.monotonic()
        with self._changed:
            for r in self._ranks:
                silent = now - r.last_heard
                if r.is_alive and r.is_ready and not r.is_stalled and silent > self.config.stall_timeout_s:
                    r.is_stalled = True
                    log.warning("worker rank %d (pid %s) silent for %.1f s: no new requests until it reports",
                                r.rank, r.pid, silent)

    def _on_death(self, r: _Rank) -> None:
        """Mark `r` dead, fail its running requests, hand its queued ones to other workers."""
        failed = []
        with self._changed:
            r.is_alive = False
            r.exit_code = r.process.exitcode
            if self._is_draining and r.exit_code == 0:
                return  # a normal exit after STOP
            self._schedule_restart_locked(r)
            for request_id in list(r.running):
                req = self._finish_locked(request_id)
                if req is not None:
                    failed.append((req, ServeError(
                        503, "worker_died",
                        f"worker rank {r.rank} (pid {r.pid}) died with exit code {r.exit_code} while running "
                        "this request; it was not retried elsewhere", retry_after=RETRY_AFTER_S)))
            for request_id in list(r.queued):
                req = r.queued.pop(request_id)
                r.outstanding_tokens -= req.left_tokens
                try:
                    # Admitted already: the queue bound keeps new requests out, not retried ones.
                    self._assign_locked(req, float("inf"))
                    self.num_retried += 1
                except ServeError as exc:
                    self._requests.pop(request_id, None)
                    failed.append((req, exc))
            self._changed.notify_all()
        for req, exc in failed:
            self._resolve(req, exc)

    def _schedule_restart_locked(self, r: _Rank) -> None:
        if self._restarts is None or not self._is_serving or self._is_draining:
            return
        now = time.monotonic()
        delay = self._restarts.delay(r.rank, now)
        if delay is None:
            r.down_reason = self._restarts.down_reason(r.rank, now, r.exit_code, r.failure)
            log.error("%s", r.down_reason)
            return
        r.restart_at = now + delay
        log.warning("worker rank %d (pid %s) died with exit code %s: starting it again in %.2f s", r.rank, r.pid,
                    r.exit_code, delay)

    def inject_fault(self, rank: int) -> list[int]:
        """Chaos testing: tell every live worker that `rank`'s memory is unreadable from now on;
        returns the ranks told."""
        if not 0 <= rank < self.config.group_ranks:
            raise ServeError(400, "invalid_request_error", f"rank={rank} is not a worker rank [0, "
                             f"{self.config.group_ranks})", param="rank")
        with self._lock:
            told = [r for r in self._ranks if r.is_alive]
            for r in told:
                r.requests.put(InjectFault(rank))
        return [r.rank for r in told]

    # -- observability -------------------------------------------------------------------------
    def _redundancy_locked(self) -> list[int]:
        """Per expert, how many routable workers hold it locally (empty before any reported); over several
        nodes, how many owners a routable worker of this node sees alive."""
        if self.config.nnodes > 1:
            seen = [r.health.get("redundancy") for r in self._ranks if r.is_routable and r.health.get("redundancy")]
            return list(seen[0]) if seen else []
        owned = [r.info.get("local_experts") for r in self._ranks]
        if any(o is None for o in owned):
            return []
        num_experts = 1 + max((e for o in owned for e in o), default=-1)
        counts = [0] * num_experts
        for r, experts in zip(self._ranks, owned):
            if r.is_routable:
                for e in experts:
                    counts[e] += 1
        return counts

    def _group_locked(self) -> list[dict]:
        """Every rank of the group and where it runs: this node's workers as the router sees them, the
        others as this node's first reporting worker sees them (their liveness: shared memory, or beats)."""
        seen = next((r.health.get("peers") for r in self._ranks if r.is_alive and r.health.get("peers")), {})
        out = []
        for rank in range(self.config.group_ranks):
            if self.config.first_rank <= rank < self.config.first_rank + self.config.ranks:
                r = self._rank(rank)
                state = "serving" if r.is_routable else "ready" if r.is_alive and r.is_ready else \
                    "starting" if r.is_alive else "down"
                out.append({"rank": rank, "node": self.node, "state": state, "here": True})
            else:
                node, state = seen.get(rank, seen.get(str(rank), (None, "unknown")))
                out.append({"rank": rank, "node": node, "state": state, "here": False})
        return out

    def snapshot(self) -> dict:
        """Health and load of every worker, for /health and /metrics."""
        with self._lock:
            now = time.monotonic()
            while self._recent and now - self._recent[0][0] > THROUGHPUT_WINDOW_S:
                self._recent.popleft()
            workers = [{
                "rank": r.rank, "pid": r.pid, "alive": r.is_alive and r.is_ready, "ready": r.is_ready,
                "exit_code": r.exit_code, "queued": len(r.queued), "running": len(r.running),
                "outstanding_tokens": r.outstanding_tokens, "served_requests": r.served_requests,
                "served_tokens": r.served_tokens, "forwards": r.forwards,
                "computed_tokens": r.computed_tokens, "real_tokens": r.real_tokens,
                "prefetch_wait_s": r.prefetch_wait_s, "forward_s": r.forward_s, "outside_s": r.outside_s,
                "outside_forwards": r.outside_forwards, "kv_write_s": r.kv_write_s,
                "routable": r.is_routable, "stalled": r.is_stalled,
                "lost_peers": r.health.get("lost", {}), "replans": r.health.get("replans", 0),
                "retried_slices": r.health.get("retried_slices", 0),
                "unservable_experts": list(r.health.get("unservable_experts", ())),
                "device_lost": r.health.get("device_lost"),
                "kernel_compiles_after_ready": r.health.get("kernel_compiles_after_ready") or 0,
                "first_forwards_ms": [round(s * 1e3, 3) for s, _ in r.first_forwards],
                "first_forwards_tokens": [n for _, n in r.first_forwards],
                "restarts": r.restarts, "rejoins": r.rejoins, "down_reason": r.down_reason,
                "restarting_in_s": None if r.restart_at is None else max(0.0, r.restart_at - now),
                "peer_rejoins": r.health.get("rejoins", {}),
                **r.info,
            } for r in self._ranks]
            redundancy = self._redundancy_locked()
            routable = sum(w["routable"] for w in workers)
            if self._is_draining:
                status = "draining"
            elif routable == 0:
                status = "unavailable"
            else:
                status = "ok" if routable == len(workers) else "degraded"
            forwards = {"forwards": self.model_info.get("forwards"), "padded_reason": self.model_info.get("padded_reason")}
            return {"status": status, "mode": self.config.mode, **forwards, "workers": workers,
                    "node": self.node, "nnodes": self.config.nnodes, "node_rank": self.config.node_rank,
                    "group": self._group_locked(),
                    "in_flight": len(self._requests),
                    "retried": self.num_retried, "failed": self.num_failed,
                    "restarts": sum(r.restarts for r in self._ranks), "rejoins": sum(r.rejoins for r in self._ranks),
                    "redundancy": redundancy,
                    "min_redundancy": min(redundancy) if redundancy else None,
                    "tokens_per_s": sum(n for _, n in self._recent) / THROUGHPUT_WINDOW_S}
