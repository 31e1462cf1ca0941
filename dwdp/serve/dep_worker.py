"""One DEP prefill worker: a rank of an expert-parallel group that steps together with its peers.

Legend: G = ranks, P = prompts in this rank's forward, V = vocabulary.

What a DEP prefill server does (attention data parallel + expert parallel, dwdp.runtime.baselines.dep): the
router hands each request to the rank with the fewest outstanding tokens, exactly as in DWDP mode;
each rank runs attention on its own prompts, and every MoE layer exchanges tokens among all ranks
(two all-to-alls). So the ranks step together. In each step:
  1. every rank takes its next forward from its own queue (dwdp.serve.scheduling), without waiting:
     packed (prompts back to back, long ones in chunks, at most max_num_tokens real tokens), or
     left-padded for a family whose attention cannot pack;
  2. the ranks agree, with one all-gather of [prompts taken, is finished] per rank, whether anyone
     has work;
  3. if anyone has, each rank runs its forward, or `DEPModel.idle_step()` when it took none (its
     experts still serve the others' tokens); if nobody has, each waits up to IDLE_POLL_S for a
     request on its queue and they agree again.
Every collective of a step runs on process groups whose timeout is `step_timeout_s`. A rank whose
step fails (a peer died or stopped, or its own forward raised) answers every prompt it holds with
error type `dep_group_broken`, naming the peers it found dead or stopped, and exits: the group
cannot step without every rank (each holds experts no other has), and a rank that leaves closes
its connections, which ends its peers' waits at once rather than at their timeout.
"""
from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import queue
import signal
import threading
import time
import traceback
from collections import deque

import torch
import torch.distributed as dist

from dwdp.serve.config import ServeConfig
from dwdp.serve.kv import latent_layout
from dwdp.serve.packcheck import worker_forwards
from dwdp.serve.protocol import (STOP, BatchStarted, PrefillError, PrefillJob, WorkerFailed, WorkerHealth, WorkerReady,
                                 greedy_first)
from dwdp.serve.prefill import InProgress
from dwdp.serve.scheduling import take_forward, take_pieces
from dwdp.serve.worker import ForwardGaps, answer_forward, model_info, pad_left, run_packed, worker_info

log = logging.getLogger("dwdp")

IDLE_POLL_S = 0.005    # an idle rank looks at its queue this long between agreements (added TTFT <= this)
PARENT_CHECK_S = 1.0   # how often an idle rank checks that the router still lives
BROKEN_EXIT_CODE = 3   # a rank that left a broken group


class DEPGroupBroken(RuntimeError):
    """A step could not complete on every rank; the message names the step and the peers."""


PF_EXITING = 0x4  # /proc/<pid>/stat flags: set as a process starts to exit, before it closes its sockets


def state_from_stat(stat: str) -> str:
    """'exited', 'stopped' or 'alive' from the text of /proc/<pid>/stat.

    A SIGKILLed peer closes its sockets while it exits, before it becomes a zombie: a step that fails
    on the reset connection must already see that peer as exited, so PF_EXITING counts as exited."""
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, session, tty, tpgid, flags
    state, flags = fields[0], int(fields[6])
    if flags & PF_EXITING:
        return "exited"
    return {"Z": "exited", "X": "exited", "T": "stopped", "t": "stopped"}.get(state, "alive")


def process_state(pid: int) -> str:
    """'exited' (gone, exiting, or a zombie not reaped yet), 'stopped' (SIGSTOP, a debugger) or 'alive'."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return state_from_stat(f.read())
    except FileNotFoundError:
        return "exited"
    except (OSError, IndexError, ValueError):  # no procfs: only existence can be read
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "exited"
        return "alive"


def describe_peers(rank: int, pids: list[int]) -> str:
    """Why the group may be stuck, peer by peer: the dead and stopped ones, else every peer alive."""
    states = [(r, pid, process_state(pid)) for r, pid in enumerate(pids) if r != rank]
    bad = [f"rank {r} (pid {pid}) {state}" for r, pid, state in states if state != "alive"]
    if bad:
        return ", ".join(bad)
    alive = ", ".join(f"rank {r} (pid {pid})" for r, pid, _ in states)
    return f"every peer is alive ({alive}): the step failed here, or a peer did not take part in time"


def dep_backend(device: str, ranks: int, num_gpus: int) -> str:
    """Backend of the all-to-alls: gloo on CPU; NCCL when every rank has a GPU of its own; on GPUs
    shared by several ranks (NCCL refuses two ranks on one device) gloo, whose all-to-all stages
    CUDA tensors through pinned host memory: DEP runs, but no faster than host copies allow."""
    if not device.startswith("cuda"):
        return "gloo"
    if num_gpus < 1:
        raise ValueError(f"device={device!r} but no CUDA device is visible")
    return "nccl" if ranks <= num_gpus else "gloo"


def agree(step_group, rank: int, num_prompts: int, is_finished: bool) -> torch.Tensor:
    """Every rank's [prompts in its next forward, is finished]: [G, 2] int64."""
    mine = torch.tensor([num_prompts, int(is_finished)], dtype=torch.long)  # [2]
    if step_group is None:
        return mine[None]
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(step_group))]
    dist.all_gather(every, mine, group=step_group)
    return torch.stack(every)                                                # [G, 2]


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def run_dep_step(model, batch: list, rank: int, kv_dir: str, model_name: str, results,
                 gaps: ForwardGaps | None = None):
    """One step of this rank: a forward over `batch`, answering each finished job, or an idle step
    when `batch` is empty. `batch`: PrefillJobs (a padded forward) or (InProgress, tokens) pairs (a
    packed one, dwdp.serve.scheduling.take_pieces). Returns the padded forward's last-position
    logits [P, V], the packed forward's [(finished prompt, its last logits [V])], or None when idle. Raises what the forward
    or its collectives raised: the caller breaks the group. gaps: this rank's ForwardGaps (time
    between two forwards of its own; an idle step in between leaves that gap unmeasured)."""
    if not batch:
        model.idle_step()
        model.stats.reset()
        if gaps is not None:
            gaps.forget()
        return None
    if isinstance(batch[0], tuple):
        # comm_s: inside the all-to-alls, own transfers plus waiting for the slowest rank
        done = run_packed(model, batch, rank, kv_dir, model_name, results, 0.0, lambda: model.stats.comm_s, gaps)
        model.stats.reset()  # a long-lived server keeps no per-call history
        return done
    results.put(BatchStarted(rank, tuple(job.request_id for job in batch)))
    started = time.monotonic()
    outside_s = gaps.start(started) if gaps is not None else None
    ids, mask, positions, pads = pad_left([job.input_ids for job in batch])
    device = model_device(model)
    with torch.inference_mode():
        out = model(input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=positions.to(device),
                    use_cache=True, logits_to_keep=1)
    logits = out.logits[:, -1]                                               # [P, V]
    first = [greedy_first(row, job.banned_first) for row, job in zip(logits, batch)]
    ended = time.monotonic()
    if gaps is not None:
        gaps.end(ended)
    comm_s = model.stats.comm_s  # inside the all-to-alls: own transfers plus waiting for the slowest rank
    model.stats.reset()          # a long-lived server keeps no per-call history
    answer_forward(out.past_key_values, first, batch, pads, int(ids.numel()), rank, kv_dir, model_name, results,
                   started, ended - started, comm_s, outside_s, latent_layout(model.config))
    return logits


def _collect(requests, pending: deque, stopping: bool, wait_s: float) -> bool:
    """Move what arrived on `requests` into `pending`, waiting up to `wait_s` for a first message;
    returns whether STOP came (now or before)."""
    wait = wait_s if wait_s > 0 and not stopping else None
    while True:
        try:
            job = requests.get(timeout=wait) if wait is not None else requests.get_nowait()
        except queue.Empty:
            return stopping
        wait = None  # after the first message, take only what is already there
        if job is STOP:
            stopping = True
        else:
            pending.append(job)


def serve_dep_queue(model, rank: int, config: ServeConfig, kv_dir: str, requests, results, step_group,
                    pids: list[int], is_packed: bool, on_step=None) -> None:
    """Step with the peers until every rank has STOP and nothing left, or the router is gone.
    is_packed: packed forwards (dwdp.serve.packcheck.worker_forwards), else padded ones.
    `on_step(batch, out)`: called after each step of this rank with what run_dep_step took and returned (tests). Raises DEPGroupBroken
    after answering every prompt it holds with a `dep_group_broken` error."""
    parent = multiprocessing.parent_process()
    pending: deque[PrefillJob] = deque()
    active: list[InProgress] = []  # prompts with chunks prefilled and chunks to go
    gaps = ForwardGaps()
    stopping, is_busy, step, last_check = False, False, 0, time.monotonic()
    while True:
        stopping = _collect(requests, pending, stopping, 0.0 if pending or active or is_busy else IDLE_POLL_S)
        if not is_busy and time.monotonic() - last_check > PARENT_CHECK_S:
            last_check = time.monotonic()
            if parent is not None and not parent.is_alive():
                return  # the router died without stopping us: nobody reads our answers (peers see us leave)
        if is_packed:
            batch = take_pieces(active, pending, config.max_num_tokens, config.batch_order, config.fairness_s,
                                time.monotonic()) if pending or active else []
        else:
            batch = take_forward(pending, config.max_num_tokens, config.batch_order, config.fairness_s,
                                 time.monotonic()) if pending else []
        what = f"the agreement on step {step + 1}"
        try:
            plan = agree(step_group, rank, len(batch), stopping and not pending and not batch and not active)
            if int(plan[:, 0].sum()) == 0:
                if bool(plan[:, 1].all()):
                    return
                is_busy = False
                gaps.forget()  # the group waits for work: not time outside a forward
                continue
            is_busy, step = True, step + 1
            what = f"step {step} (its forward of {len(batch)} prompts)" if batch else f"step {step} (an idle step)"
            logits = run_dep_step(model, batch, rank, kv_dir, config.model_name, results, gaps)
        except Exception as exc:
            detail = str(exc).splitlines()[0] if str(exc) else ""
            why = (f"DEP rank {rank} failed in {what}: {describe_peers(rank, pids)}. A DEP group cannot step without "
                   f"every rank (each holds experts no other has); rank {rank} leaves. "
                   f"({type(exc).__name__}: {detail})")
            _collect(requests, pending, True, 0.0)
            held = [state.job for state in active] if is_packed else list(batch)
            for job in held + list(pending):
                results.put(PrefillError(job.request_id, rank, "dep_group_broken", why))
            raise DEPGroupBroken(why) from exc
        if is_packed and logits:
            gone = {id(state) for state, _ in logits}
            active[:] = [state for state in active if id(state) not in gone]
        if on_step is not None:
            on_step(batch, logits)


class DEPHealthReporter:
    """Tells the router every `interval_s` that this rank is serving (its silence means a stall);
    `broken(reason)` sends one last report that takes the rank out of routing."""

    def __init__(self, rank: int, results, interval_s: float):
        self.rank, self.results, self.interval_s = rank, results, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"dwdp-dep-health-{rank}", daemon=True)

    def start(self) -> "DEPHealthReporter":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.results.put(WorkerHealth(self.rank, {"mode": "dep", "can_serve_all": True}))

    def broken(self, reason: str) -> None:
        self.stop()
        self.results.put(WorkerHealth(self.rank, {"mode": "dep", "can_serve_all": False, "broken": reason}))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def build_dep_model(config: ServeConfig, rank_hint: int = 0):
    """(this rank's DEPModel, the gloo group its steps agree on, every rank's pid); joins the
    env:// world, so every rank must call it together. A checkpoint is loaded whole, then each
    rank drops the experts of the others (DEP holds a disjoint share per rank)."""
    from dwdp.runtime.baselines.dep import DEPModel
    from dwdp.runtime.devices import model_dtype, rank_device
    from dwdp.runtime.group import DWDPGroup, init_group

    num_gpus = torch.cuda.device_count() if config.device == "cuda" else 0
    backend = dep_backend(config.device, config.ranks, num_gpus)
    device = rank_device(config.device, rank_hint)
    dtype = model_dtype(config.device, config.dtype)
    world = init_group(timeout_s=config.startup_timeout_s)
    timeout = datetime.timedelta(seconds=config.step_timeout_s)
    ranks = list(range(world.size))
    step_group = dist.new_group(ranks, backend="gloo", timeout=timeout) if world.size > 1 else None
    exchange = step_group if backend == "gloo" or world.size == 1 else dist.new_group(ranks, backend="nccl",
                                                                                        timeout=timeout)
    if config.model is not None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(config.model, local_files_only=True, dtype=dtype)
    else:
        from dwdp.serve.presets import preset_model

        model = preset_model(config.preset, config.seed, dtype)
    model = model.to(device).eval()
    dep = DEPModel(model, DWDPGroup(world.rank, world.size, world.global_rank, world.world_size, exchange))
    pids = world.all_gather_object(os.getpid())
    world.barrier()  # every rank built: the first step's timeout starts from here
    return dep, step_group, pids


def dep_worker_main(rank: int, world_size: int, store_env: dict, config: ServeConfig, kv_dir: str,
                    requests, results) -> None:
    """Entry point of a spawned DEP worker process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the router drains and stops the workers itself
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), **store_env})
    torch.set_num_threads(config.threads_per_worker)
    reporter, exit_code = None, 0
    try:
        started = time.monotonic()
        model, step_group, pids = build_dep_model(config, rank)
        # Through DEPModel, every rank at once (its forwards are collective): the forward it will serve with.
        packing = worker_forwards(model, config, rank)
        model.stats.reset()  # the first step's exposed wait starts from zero
        worker = worker_info(model, time.monotonic() - started, "dep", "torch")
        results.put(WorkerReady(rank, os.getpid(), {**model_info(model, packing), "mode": "dep"}, worker))
        reporter = DEPHealthReporter(rank, results, config.health_interval_s).start()
        serve_dep_queue(model, rank, config, kv_dir, requests, results, step_group, pids, packing[0])
    except DEPGroupBroken as exc:
        log.error("%s", exc)
        if reporter is not None:
            reporter.broken(str(exc))
            reporter = None
        exit_code = BROKEN_EXIT_CODE
    except BaseException:
        results.put(WorkerFailed(rank, traceback.format_exc()))
        exit_code = 1
    finally:
        if reporter is not None:
            reporter.stop()
        if dist.is_initialized() and exit_code == 0:
            dist.destroy_process_group()
    if exit_code:
        raise SystemExit(exit_code)
