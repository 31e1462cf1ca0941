"""Two ranks of a group lost at once, across real processes: 4 ranks on the host backend with every
expert on 3 of them; rank 3 is killed and rank 2's memory made unreadable at the same moment (rank 0
in the middle of a forward, rank 1 between forwards). The survivors must keep serving every expert
and match the unwrapped model.

Rank 0 hosts the process-group store, so it lives; the survivors and rank 2 coordinate through
process groups created while all four were alive.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from dwdp.models.tiny import build_tiny_model
from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.group import init_group, launch_local
from dwdp.runtime.model import DWDPModel
from test_failover import PEER_TIMEOUT_S, _forward, _inputs, _wait_exit
from test_rejoin import WAIT_S, _expect

KILLED, UNREADABLE = 3, 2
# 12 experts on 4 ranks, each on 3: every survivor pulls some expert from each victim before the losses.
MODEL = dict(num_experts=12, top_k=2, num_layers=3)


def _build(rank: int, steps: int):
    model = build_tiny_model("mixtral", seed=11, **MODEL)
    with torch.no_grad():
        reference = [model(**_inputs(rank, step)).logits for step in range(steps)]
    config = DWDPConfig(slice_bytes=2048, expert_replicas=3, peer_timeout_s=PEER_TIMEOUT_S, wait_timeout_s=30)
    return DWDPModel(model, config, init_group()), reference


def _rank(rank: int) -> dict | None:
    model, reference = _build(rank, steps=4)
    survivors = dist.new_group([0, 1])  # every rank creates both, as torch.distributed requires
    alive = dist.new_group([0, 1, 2])
    out = {"first": _forward(model, rank, 0, reference),
           "pulled_before": dict(model.stats.bytes_from_peer)}
    killed_pid = model.failover.liveness.pid(KILLED) if rank != KILLED else os.getpid()
    dist.barrier()
    if rank == KILLED:
        signal.sigtimedwait([signal.SIGUSR1], 100)  # nobody sends it: rank 0 kills this process meanwhile
        return None
    if rank == UNREADABLE:
        model.inject_fault(UNREADABLE)  # its own device lost: its record says FAILED
        dist.barrier(alive)              # the survivors are done with it
        model.close()
        return None
    dist.barrier(survivors)  # rank 1 is out of the world barrier (gloo's ends unevenly) before the kill

    if rank == 0:
        moe = [m for m in model.model.modules() if hasattr(m, "_dwdp_runtime")]

        def mid_forward(*_):
            hook.remove()
            os.kill(killed_pid, signal.SIGKILL)
            model.inject_fault(UNREADABLE)  # every copy from rank 2 fails from now on, naming it
            _wait_exit(killed_pid)

        hook = moe[1].register_forward_pre_hook(mid_forward)
    else:
        model.inject_fault(UNREADABLE)
        _wait_exit(killed_pid)  # rank 0 kills it in its next forward
    out["during"] = _forward(model, rank, 1, reference)
    model.stats.reset()
    out["after"] = [_forward(model, rank, step, reference) for step in (2, 3)]
    out["pulled_after"] = dict(model.stats.bytes_from_peer)
    status = model.check_peers()
    out["status"] = (dict(status.lost), status.unservable_experts, status.can_serve_all)
    dist.barrier(survivors)
    dist.barrier(alive)
    model.close()
    return out


@pytest.mark.timeout(150)
def test_two_simultaneous_losses_with_redundancy_3_keep_every_expert_served(tmp_path):
    results = launch_local(_rank, 4, timeout_s=120, env={"DWDP_SHM_DIR": str(tmp_path)}, may_die=(KILLED,))
    assert results[KILLED] is None and results[UNREADABLE] is None, results
    for rank in (0, 1):
        r = results[rank]
        for name in ("first", "during"):
            diff, bound = r[name]
            assert diff <= bound, f"rank {rank} {name}: max|diff|={diff:.3e} > {bound:.3e}"
        for step, (diff, bound) in enumerate(r["after"], start=2):
            assert diff <= bound, f"rank {rank} step {step} after the losses: max|diff|={diff:.3e} > {bound:.3e}"
        assert {KILLED, UNREADABLE} <= set(r["pulled_before"]), f"rank {rank} pulled only from {r['pulled_before']}"
        assert set(r["pulled_after"]) == {1 - rank}, f"rank {rank} pulled from {r['pulled_after']} after the losses"
        lost, unservable, can_serve_all = r["status"]
        assert set(lost) == {KILLED, UNREADABLE}, (rank, lost)
        assert "exited without closing" in lost[KILLED], lost
        assert not unservable, unservable
        assert can_serve_all, r["status"]
    assert list(tmp_path.iterdir()) == [], f"left in the shm dir: {list(tmp_path.iterdir())}"


REJOINING, LOST_WHILE_REJOINING = 3, 2


def _gone(pid: int) -> None:
    """Wait until `pid` has ended; one already reaped by the launcher is gone too."""
    try:
        _wait_exit(pid)
    except ProcessLookupError:
        pass


def _replacement(env: dict, inbox, outbox, steps: int) -> None:
    """A new process for rank REJOINING: rejoin (DWDP_REJOIN=1), tell rank 0, run forwards, close when told."""
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        model, reference = _build(REJOINING, steps)
        outbox.put(("serving", model.expert_source_used))
        diffs = [_forward(model, REJOINING, step, reference) for step in range(steps)]
        outbox.put(("forwards", diffs, sorted(model.check_peers().lost), sorted(model.stats.bytes_from_peer)))
        inbox.get(timeout=WAIT_S)
        model.close()
    except BaseException as exc:
        outbox.put(("error", repr(exc)))


def _rank_loss_while_rejoining(rank: int) -> dict | None:
    """Rank 3 is killed and replaced; rank 2 is killed the moment the replacement starts, while it
    reads the board and copies its experts (perhaps from rank 2's segment)."""
    steps = 5
    model, reference = _build(rank, steps)
    survivors = dist.new_group([0, 1])
    out = {"before": _forward(model, rank, 0, reference)}
    pids = {p: model.failover.liveness.pid(p) for p in (LOST_WHILE_REJOINING, REJOINING) if p != rank}
    dist.barrier()
    if rank in (LOST_WHILE_REJOINING, REJOINING):
        signal.sigtimedwait([signal.SIGUSR1], 100)  # nobody sends it: rank 0 kills this process meanwhile
        return None
    dist.barrier(survivors)  # rank 1 is out of the world barrier (gloo's ends unevenly) before any kill
    if rank == 0:
        os.kill(pids[REJOINING], signal.SIGKILL)
    _gone(pids[REJOINING])
    out["first_loss"] = _forward(model, rank, 1, reference)
    dist.barrier(survivors)
    replacement = inbox = outbox = None
    if rank == 0:
        ctx = mp.get_context("spawn")
        inbox, outbox = ctx.Queue(), ctx.Queue()
        env = {"RANK": str(REJOINING), "WORLD_SIZE": "4", "MASTER_ADDR": os.environ["MASTER_ADDR"],
               "MASTER_PORT": os.environ["MASTER_PORT"], "DWDP_REJOIN": "1", "DWDP_SHM_DIR": os.environ["DWDP_SHM_DIR"]}
        replacement = ctx.Process(target=_replacement, args=(env, inbox, outbox, steps), daemon=False)
        replacement.start()
        os.kill(pids[LOST_WHILE_REJOINING], signal.SIGKILL)  # a loss while rank 3 rejoins
        _gone(pids[LOST_WHILE_REJOINING])
        out["replacement"] = _expect(outbox, "serving", REJOINING)
    else:
        _gone(pids[LOST_WHILE_REJOINING])
    out["second_loss"] = _forward(model, rank, 2, reference)
    deadline = time.monotonic() + WAIT_S
    while not model.check_peers().rejoins.get(REJOINING):  # the health loop's view, polled
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank} never saw rank {REJOINING} rejoin within {WAIT_S} s")
        time.sleep(0.05)
    model.stats.reset()
    out["after"] = [_forward(model, rank, step, reference) for step in (3, 4)]
    out["pulled_after"] = sorted(model.stats.bytes_from_peer)
    status = model.check_peers()
    out["status"] = (sorted(status.lost), dict(status.rejoins), status.can_serve_all)
    if rank == 0:
        out["replacement_forwards"] = _expect(outbox, "forwards", REJOINING)
    dist.barrier(survivors)
    if rank == 0:
        inbox.put("close")
        replacement.join(timeout=WAIT_S)
        out["replacement_exit"] = replacement.exitcode
    model.close()
    return out


@pytest.mark.timeout(170)
def test_a_loss_while_another_rank_rejoins_across_processes(tmp_path):
    results = launch_local(_rank_loss_while_rejoining, 4, timeout_s=150, env={"DWDP_SHM_DIR": str(tmp_path)},
                           may_die=(LOST_WHILE_REJOINING, REJOINING))
    for rank in (0, 1):
        r = results[rank]
        for name in ("before", "first_loss", "second_loss"):
            diff, bound = r[name]
            assert diff <= bound, f"rank {rank} {name}: max|diff|={diff:.3e} > {bound:.3e}"
        for step, (diff, bound) in enumerate(r["after"], start=3):
            assert diff <= bound, f"rank {rank} step {step} after the rejoin: max|diff|={diff:.3e} > {bound:.3e}"
        lost, rejoins, can_serve_all = r["status"]
        assert lost == [LOST_WHILE_REJOINING] and rejoins == {REJOINING: 1} and can_serve_all, (rank, r["status"])
        assert REJOINING in r["pulled_after"] and LOST_WHILE_REJOINING not in r["pulled_after"], (rank, r["pulled_after"])
    r0 = results[0]
    assert r0["replacement"][1] == "peers", r0["replacement"]
    _, diffs, lost_seen, pulled = r0["replacement_forwards"]
    for step, (diff, bound) in enumerate(diffs):
        assert diff <= bound, f"replacement rank {REJOINING} step {step}: max|diff|={diff:.3e} > {bound:.3e}"
    assert lost_seen == [LOST_WHILE_REJOINING] and LOST_WHILE_REJOINING not in pulled, (lost_seen, pulled)
    assert r0["replacement_exit"] == 0, r0["replacement_exit"]
    assert list(tmp_path.iterdir()) == [], f"left in the shm dir: {list(tmp_path.iterdir())}"
