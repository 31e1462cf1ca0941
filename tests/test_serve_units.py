"""The context server's pieces in-process: batching, left padding, routing, KV artifacts, config."""
from __future__ import annotations

from collections import deque

import pytest
import torch

from dwdp.serve.config import ServeConfig
from dwdp.serve.kv import read_kv_artifact, write_kv_artifact
from dwdp.serve.protocol import PrefillJob
from dwdp.serve.routing import NoHealthyWorker, Overloaded, WorkerLoad, pick_worker
from dwdp.serve.scheduling import take_batch
from dwdp.serve.worker import pad_left


def jobs(*lengths):
    return deque(PrefillJob(f"r{i}", tuple(range(3, 3 + n)), 0.0) for i, n in enumerate(lengths))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("lengths,budget,first_batch", [
    ((5,), 8, ["r0"]),
    ((4, 4, 4), 8, ["r0", "r1"]),              # 3 x 4 = 12 padded tokens would pass 8
    ((2, 6), 8, ["r0"]),                       # padding to 6 makes 2 x 6 = 12
    ((8, 1), 8, ["r0"]),                       # a prompt of the whole budget rides alone
    ((1, 1, 1, 1, 1, 1, 1, 1, 1), 8, [f"r{i}" for i in range(8)]),
])
def test_take_batch_keeps_padded_tokens_within_budget(lengths, budget, first_batch):
    pending = jobs(*lengths)
    batch = take_batch(pending, budget)
    assert [j.request_id for j in batch] == first_batch
    assert len(batch) * max(len(j.input_ids) for j in batch) <= budget or len(batch) == 1
    assert len(pending) == len(lengths) - len(first_batch)


@pytest.mark.timeout(10)
def test_pad_left_puts_last_tokens_in_the_last_column():
    ids, mask, positions, pads = pad_left([(7,), (4, 5, 6)])
    assert ids.tolist() == [[0, 0, 7], [4, 5, 6]]
    assert mask.tolist() == [[0, 0, 1], [1, 1, 1]]
    assert positions.tolist() == [[0, 0, 0], [0, 1, 2]]
    assert pads == [2, 0]


def load(rank, outstanding, last=-1, alive=True):
    return WorkerLoad(rank, alive, outstanding, last)


@pytest.mark.timeout(10)
def test_router_picks_fewest_outstanding_tokens_not_round_robin():
    loads = [load(0, 300, last=0), load(1, 10, last=2), load(2, 50, last=1)]
    assert pick_worker(loads, 20, 1000) == 1
    assert pick_worker(loads, 20, 1000, exclude=frozenset({1})) == 2


@pytest.mark.timeout(10)
def test_router_breaks_ties_by_least_recently_assigned():
    assert pick_worker([load(0, 0, last=5), load(1, 0, last=3), load(2, 0, last=4)], 1, 10) == 1


@pytest.mark.timeout(10)
def test_router_skips_dead_and_full_workers():
    assert pick_worker([load(0, 0, alive=False), load(1, 90)], 10, 100) == 1
    with pytest.raises(Overloaded, match="max_queue_tokens=100"):
        pick_worker([load(0, 95), load(1, 91), load(2, 0, alive=False)], 10, 100)
    with pytest.raises(NoHealthyWorker):
        pick_worker([load(0, 0, alive=False)], 1, 100)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_artifact_round_trip_is_bit_exact(tmp_path, dtype):
    gen = torch.Generator().manual_seed(0)
    layers = [(torch.randn(1, 2, 5, 12, generator=gen).to(dtype), torch.randn(1, 2, 5, 8, generator=gen).to(dtype))
              for _ in range(3)]
    desc = write_kv_artifact(tmp_path, "req-1", layers, {"rank": 1})
    assert desc["num_layers"] == 3 and desc["num_tokens"] == 5 and desc["dtype"] == str(dtype).removeprefix("torch.")
    assert [t["shape"] for t in desc["tensors"][:2]] == [[1, 2, 5, 12], [1, 2, 5, 8]]
    got, meta = read_kv_artifact(desc["path"])
    assert meta["rank"] == "1" and meta["request_id"] == "req-1"
    for (k, v), (rk, rv) in zip(got, layers):
        assert torch.equal(k, rk) and torch.equal(v, rv)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["req-1.safetensors"]  # no temporary file left


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kwargs,field", [
    ({"ranks": 0}, "ranks"), ({"port": 70000}, "port"), ({"preset": "huge"}, "preset"),
    ({"max_num_tokens": 0}, "max_num_tokens"), ({"max_num_tokens": 64, "max_queue_tokens": 32}, "max_queue_tokens"),
    ({"drain_timeout_s": 0}, "drain_timeout_s"), ({"mode": "ep"}, "mode"),
    ({"mode": "dep", "expert_replicas": 2}, "expert_replicas"), ({"mode": "dep", "fault_injection": True},
                                                                 "fault_injection"),
    ({"step_timeout_s": 0}, "step_timeout_s"), ({"batch_order": "lifo"}, "batch_order"),
    ({"fairness_s": -1}, "fairness_s"), ({"forwards": "packed"}, "forwards"),
])
def test_serve_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ServeConfig(**kwargs)


def _pool(ranks: int = 3, stall_timeout_s: float = 2.0):
    """A WorkerPool whose workers are plain queues: messages are fed to it by hand."""
    import queue

    from dwdp.serve.pool import WorkerPool, _Rank
    from dwdp.serve.protocol import WorkerReady

    pool = WorkerPool(ServeConfig(ranks=ranks, stall_timeout_s=stall_timeout_s), kv_dir="unused")
    for r in range(ranks):
        pool._ranks.append(_Rank(r, process=None, requests=queue.Queue()))
        pool._handle(WorkerReady(r, 1000 + r, {}, {}))
    return pool


def _queued(pool) -> list[list[str]]:
    return [sorted(r.queued) for r in pool._ranks]


def _health(rank: int, **status) -> "WorkerHealth":
    from dwdp.serve.protocol import WorkerHealth

    base = {"rank": rank, "lost": {}, "stalled": (), "replans": 0, "retried_slices": 0, "unservable_experts": (),
            "device_lost": None, "can_serve_all": True}
    return WorkerHealth(rank, {**base, **status})


@pytest.mark.timeout(10)
def test_router_sends_nothing_to_a_degraded_worker_and_hands_its_failures_on():
    import asyncio

    from dwdp.serve.errors import ServeError
    from dwdp.serve.protocol import PrefillError

    pool = _pool(3)
    pool._handle(_health(1, lost={2: "rank 2 (pid 7) exited without closing"}, replans=1, unservable_experts=(4, 5),
                         can_serve_all=False))
    why = "rank 0: MoE layer 1 routes tokens to experts [4], which no surviving rank owns (lost ranks [2])"

    async def run() -> ServeError:
        for _ in range(4):
            pool.submit([5] * 8)
        queued = _queued(pool)
        assert queued[1] == [] and len(queued[0]) == len(queued[2]) == 2, queued
        victim = queued[0][0]
        future = pool._requests[victim].future
        pool._handle(PrefillError(victim, 0, "rank_degraded", why, retryable=True))
        assert victim in pool._ranks[2].queued and pool.num_retried == 1, _queued(pool)
        pool._handle(PrefillError(victim, 2, "rank_degraded", why.replace("rank 0", "rank 2"), retryable=True))
        with pytest.raises(ServeError) as info:
            await asyncio.wait_for(future, 5)
        return info.value

    error = asyncio.run(run())
    assert error.status == 503 and "rank 2" in error.message and "no other worker can take it" in error.message, \
        (error.status, error.message)
    assert pool.num_failed == 1 and pool.snapshot()["failed"] == 1


@pytest.mark.timeout(10)
def test_a_silent_worker_gets_no_new_requests_until_it_reports_again():
    import time

    pool = _pool(2, stall_timeout_s=0.5)
    pool._ranks[0].last_heard = time.monotonic() - 1.0  # a SIGSTOPped worker: nothing heard for 1 s
    pool._check_stalls()
    snap = pool.snapshot()
    assert snap["workers"][0]["stalled"] and not snap["workers"][0]["routable"], snap["workers"][0]
    assert snap["status"] == "degraded" and snap["workers"][1]["routable"], snap
    pool._handle(_health(0))
    assert pool.snapshot()["workers"][0]["routable"] and pool.snapshot()["status"] == "ok"


@pytest.mark.timeout(10)
def test_a_forward_failing_for_lost_experts_answers_retryable_and_reports_at_once():
    import queue
    from types import SimpleNamespace

    from dwdp.runtime.failover import ExpertsUnavailable, FailoverStatus
    from dwdp.serve.protocol import BatchStarted, PrefillError, WorkerHealth
    from dwdp.serve.worker import run_batch

    status = FailoverStatus(0, {2: "rank 2 (pid 7) exited without closing"}, (), 1, 0, (4,), None)
    why = "rank 0: MoE layer 1 routes tokens to experts [4], which no surviving rank owns (lost ranks [2])"

    class Degraded:
        stats = SimpleNamespace(wait_s=0.0)
        device = torch.device("cpu")
        compiles_after_warmup = 0

        def __call__(self, **inputs):
            raise ExpertsUnavailable(why, (4,), dict(status.lost))

        def check_peers(self):
            return status

    results = queue.Queue()
    run_batch(Degraded(), list(jobs(3, 4)), 0, "unused", "dwdp-tiny", results)
    messages = [results.get_nowait() for _ in range(results.qsize())]
    assert isinstance(messages[0], BatchStarted), messages
    errors = [m for m in messages if isinstance(m, PrefillError)]
    assert [e.request_id for e in errors] == ["r0", "r1"], errors
    assert all(e.retryable and e.error_type == "rank_degraded" and e.message == why for e in errors), errors
    health = [m for m in messages if isinstance(m, WorkerHealth)]
    assert len(health) == 1 and not health[0].status["can_serve_all"], health
    assert health[0].status["unservable_experts"] == (4,) and health[0].status["lost"] == status.lost, health


def aged_jobs(*specs):
    """PrefillJob per (length, seconds queued at now=10)."""
    return deque(PrefillJob(f"r{i}", tuple(range(3, 3 + n)), 10.0 - age) for i, (n, age) in enumerate(specs))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("specs,budget,first,left", [
    # shortest first, and similar lengths together: 3 x 4 fits 12, the 9 does not join them
    (((9, 0.1), (4, 0.1), (4, 0.1), (4, 0.1)), 12, ["r1", "r2", "r3"], ["r0"]),
    # the 9 has waited past the fairness bound: it goes first, then what still fits (2 x 9 > 12)
    (((9, 0.6), (4, 0.1), (4, 0.1), (4, 0.1)), 12, ["r0"], ["r1", "r2", "r3"]),
    # two aged prompts go oldest first, then fresh ones by length
    (((2, 0.7), (5, 0.1), (1, 0.1), (3, 0.9)), 12, ["r3", "r0", "r2"], ["r1"]),
    # an aged prompt that does not fit beside the first aged one waits, still ahead of fresh ones
    (((3, 0.8), (12, 0.7), (1, 0.1)), 12, ["r0"], ["r1", "r2"]),
])
def test_shortest_first_within_the_fairness_bound(specs, budget, first, left):
    from dwdp.serve.scheduling import take_forward

    pending = aged_jobs(*specs)
    batch = take_forward(pending, budget, "shortest", fairness_s=0.5, now=10.0)
    assert [j.request_id for j in batch] == first, [j.request_id for j in batch]
    assert [j.request_id for j in pending] == left, "the rest must stay queued in arrival order"
    assert len(batch) * max(len(j.input_ids) for j in batch) <= budget


@pytest.mark.timeout(10)
def test_fifo_order_is_take_batch():
    from dwdp.serve.scheduling import take_forward

    pending = aged_jobs((9, 0.1), (4, 0.1), (4, 0.1))
    assert [j.request_id for j in take_forward(pending, 12, "fifo")] == ["r0"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("device,ranks,gpus,backend", [
    ("cpu", 4, 0, "gloo"), ("cuda", 2, 2, "nccl"), ("cuda", 2, 8, "nccl"),
    ("cuda", 2, 1, "gloo"),   # two ranks on one GPU: NCCL refuses it, gloo stages through host memory
])
def test_dep_backend_per_device(device, ranks, gpus, backend):
    from dwdp.serve.dep_worker import dep_backend

    assert dep_backend(device, ranks, gpus) == backend


@pytest.mark.timeout(10)
def test_dep_backend_on_cuda_without_a_gpu_says_so():
    from dwdp.serve.dep_worker import dep_backend

    with pytest.raises(ValueError, match="no CUDA device"):
        dep_backend("cuda", 2, 0)


@pytest.mark.timeout(10)
def test_peers_are_named_with_their_state():
    import signal
    import subprocess
    import sys
    import time

    from dwdp.serve.dep_worker import describe_peers, process_state

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert process_state(child.pid) == "alive"
        assert "every peer is alive" in describe_peers(0, [0, child.pid])
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while process_state(child.pid) != "stopped":
            assert time.monotonic() < deadline, process_state(child.pid)
        assert describe_peers(0, [0, child.pid]) == f"rank 1 (pid {child.pid}) stopped"
        child.kill()
        deadline = time.monotonic() + 5
        while process_state(child.pid) != "exited":  # a zombie until reaped: exited already
            assert time.monotonic() < deadline, process_state(child.pid)
        assert describe_peers(1, [child.pid, 0]) == f"rank 0 (pid {child.pid}) exited"
    finally:
        child.kill()
        child.wait()
    assert process_state(child.pid) == "exited"


def test_a_peer_that_is_exiting_counts_as_exited():
    """Regression: a SIGKILLed DEP peer resets its sockets before it is a zombie; the survivor's
    message must already name it exited, not "every peer is alive"."""
    from dwdp.serve.dep_worker import PF_EXITING, state_from_stat

    def stat(state: str, flags: int) -> str:
        return f"4242 (python (x)) {state} 1 4242 4242 0 -1 {flags} 0 0 0 0 12 3 0 0 20 0 1 0"

    assert state_from_stat(stat("R", 0x400000)) == "alive"
    assert state_from_stat(stat("R", 0x400000 | PF_EXITING)) == "exited"
    assert state_from_stat(stat("D", PF_EXITING)) == "exited"
    assert state_from_stat(stat("Z", 0)) == "exited"
    assert state_from_stat(stat("T", 0)) == "stopped"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kwargs,named", [
    ({"max_prompt_tokens": 0}, "max_prompt_tokens=0 must be an int >= 1"),
    ({"max_prompt_tokens": -3}, "max_prompt_tokens=-3 must be an int >= 1"),
    ({"max_prompt_tokens": 9000}, "max_prompt_tokens=9000 must be <= max_queue_tokens=8192"),
])
def test_bad_prompt_bounds_are_refused_with_value_and_limit(kwargs, named):
    with pytest.raises(ValueError, match=named):
        ServeConfig(**kwargs)


@pytest.mark.timeout(10)
def test_prompt_bound_above_the_models_positions_is_refused_and_limits_follow_the_forwards():
    from dwdp.serve.config import prompt_limit

    packed = {"max_position_embeddings": 1024, "forwards": "packed", "padded_reason": ""}
    with pytest.raises(ValueError, match="max_prompt_tokens=2048 is above the model's max_position_embeddings=1024"):
        prompt_limit(ServeConfig(max_prompt_tokens=2048), packed)
    assert prompt_limit(ServeConfig(max_num_tokens=64), packed) == (1024, "the model's max_position_embeddings")
    assert prompt_limit(ServeConfig(max_num_tokens=64, max_prompt_tokens=300), packed) == (300, "--max-prompt-tokens")
    padded = {"max_position_embeddings": 1024, "forwards": "padded", "padded_reason": "linear attention"}
    limit, why = prompt_limit(ServeConfig(max_num_tokens=64), padded)
    assert limit == 64 and "not chunked" in why and "linear attention" in why, (limit, why)


@pytest.mark.timeout(10)
def test_take_pieces_continues_chunked_prompts_first_and_fills_the_budget():
    from dwdp.serve.scheduling import take_pieces

    pending, active = jobs(5, 20, 3), []
    plan = take_pieces(active, pending, 16)
    assert [(s.job.request_id, n) for s, n in plan] == [("r0", 5), ("r1", 11)], plan
    for state, n in plan:
        state.done += n
    active = [s for s in active if s.left]
    plan = take_pieces(active, pending, 16)
    assert [(s.job.request_id, n) for s, n in plan] == [("r1", 9), ("r2", 3)], plan
    assert not pending
    long, active = jobs(40), []
    for want in (16, 16, 8):  # a prompt in progress never takes more than a forward's budget
        plan = take_pieces(active, long, 16)
        assert [n for _, n in plan] == [want], plan
        plan[0][0].done += want
        active = [s for s in active if s.left]


@pytest.mark.timeout(10)
def test_router_counts_outstanding_tokens_down_chunk_by_chunk():
    import asyncio

    from dwdp.serve.protocol import BatchDone, BatchStarted

    pool = _pool(ranks=1)

    async def admit():
        return pool.submit(list(range(3, 3 + 40)))

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(admit())
    finally:
        loop.close()
    (rid,) = pool._ranks[0].queued
    assert pool._ranks[0].outstanding_tokens == 40
    pool._handle(BatchStarted(0, (rid,)))
    pool._handle(BatchDone(0, 1, 16, 0.1, 0.0, 16, ((rid, 16),)))
    assert pool._ranks[0].outstanding_tokens == 24, pool._ranks[0].outstanding_tokens
    pool._handle(BatchDone(0, 1, 16, 0.1, 0.0, 16, ((rid, 16),)))
    assert pool._ranks[0].outstanding_tokens == 8
    snap = pool.snapshot()["workers"][0]
    assert snap["real_tokens"] == 32 and snap["computed_tokens"] == 32, snap
    with pool._lock:
        pool._finish_locked(rid)
    assert pool._ranks[0].outstanding_tokens == 0


@pytest.mark.timeout(30)
def test_a_packed_forward_failing_for_lost_experts_answers_retryable_and_forgets_its_prompts():
    import queue
    from types import SimpleNamespace

    from dwdp.models.tiny import tiny_config
    from dwdp.runtime.failover import ExpertsUnavailable, FailoverStatus
    from dwdp.serve.protocol import PrefillError, WorkerHealth
    from dwdp.serve.worker import step_packed

    status = FailoverStatus(0, {2: "rank 2 exited"}, (), 1, 0, (4,), None)

    class Degraded:
        stats = SimpleNamespace(wait_s=0.0)
        config = tiny_config("qwen3_moe")
        compiles_after_warmup = 0
        embeddings = torch.nn.Embedding(4, 2)

        def get_input_embeddings(self):
            return self.embeddings

        def __call__(self, **inputs):
            raise ExpertsUnavailable("lost experts [4]", (4,), dict(status.lost))

        def check_peers(self):
            return status

    results, active, pending = queue.Queue(), [], jobs(3, 30)
    step_packed(Degraded(), active, pending, 0, ServeConfig(max_num_tokens=16), "unused", results)
    messages = [results.get_nowait() for _ in range(results.qsize())]
    errors = [m for m in messages if isinstance(m, PrefillError)]
    assert [e.request_id for e in errors] == ["r0", "r1"] and all(e.retryable for e in errors), errors
    assert any(isinstance(m, WorkerHealth) for m in messages) and active == [] and not pending, (messages, active)


def _half_a_message_then_killed(writer) -> None:
    """A worker killed while it writes a result: a header for 1000 bytes, 10 of them, then SIGKILL."""
    import os
    import signal
    import struct

    os.write(writer.fileno(), struct.pack("!i", 1000) + b"x" * 10)
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.timeout(60)
def test_a_worker_killed_mid_message_cuts_only_its_own_results_pipe(tmp_path):
    """Each worker writes to a pipe of its own: one killed in the middle of a message ends its own
    reader (the pipe's end, not a hang), and another worker's messages still arrive."""
    import multiprocessing as mp
    import threading
    import time

    from dwdp.serve.pool import WorkerPool
    from dwdp.serve.protocol import ResultsChannel

    ctx = mp.get_context("spawn")
    pool = WorkerPool(ServeConfig(ranks=2), str(tmp_path))
    handled = []
    pool._handle = handled.append
    dead_reader, dead_writer = ctx.Pipe(duplex=False)
    live_reader, live_writer = ctx.Pipe(duplex=False)
    victim = ctx.Process(target=_half_a_message_then_killed, args=(dead_writer,))
    victim.start()
    try:
        dead_writer.close()
        readers = [threading.Thread(target=pool._read_results, args=(r,), daemon=True)
                   for r in (dead_reader, live_reader)]
        for t in readers:
            t.start()
        victim.join(timeout=30)
    finally:
        if victim.is_alive():
            victim.kill()
            victim.join(10)
    readers[0].join(timeout=10)
    assert not readers[0].is_alive(), "the reader of a killed worker's pipe hangs on its half message"
    ResultsChannel(live_writer).put(("rank 1", "still heard"))
    deadline = time.monotonic() + 10
    while not handled and time.monotonic() < deadline:
        time.sleep(0.01)
    assert handled == [("rank 1", "still heard")], handled
    pool._stop.set()
    readers[1].join(timeout=5)
    assert not readers[1].is_alive()


def test_forward_gaps_leave_waits_for_work_out():
    from dwdp.serve.worker import ForwardGaps

    gaps = ForwardGaps()
    assert gaps.start(10.0) is None  # the first forward has no previous one
    gaps.end(11.0)
    gaps.waited(0.5)                 # an empty queue: waiting for work, not time outside a forward
    assert gaps.start(12.0) == pytest.approx(0.5)
    gaps.end(13.0)
    gaps.forget()                    # a DEP idle step ran in between
    assert gaps.start(14.0) is None
    gaps.end(15.0)
    assert gaps.start(15.25) == pytest.approx(0.25)


@pytest.mark.timeout(10)
def test_router_sums_time_in_and_outside_forwards_per_rank():
    from dwdp.serve.protocol import BatchDone, PrefillResult

    pool = _pool(ranks=2)
    pool._handle(BatchDone(1, 1, 16, 0.25, 0.0, 16, (), None))
    pool._handle(BatchDone(1, 2, 32, 0.5, 0.0, 32, (), 0.125))
    pool._handle(PrefillResult("gone", 1, 7, 16, 0.0, 0.25, 0.0625, 1, 16, 0.0, {}))
    worker = pool.snapshot()["workers"][1]
    assert (worker["forwards"], worker["forward_s"], worker["outside_s"], worker["outside_forwards"],
            worker["kv_write_s"]) == (2, 0.75, 0.125, 1, 0.0625), worker
    assert pool.snapshot()["workers"][0]["outside_forwards"] == 0
