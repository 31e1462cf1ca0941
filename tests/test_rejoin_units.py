"""Rejoin and overlapping losses in one process: 4 host transports (8 experts, every expert on 3
ranks), rank 0's prefetcher checked byte for byte against the reference copy of the original plan.

Liveness is a fake whose states the test sets; the board, the segments and the copies are real.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dwdp.runtime.board import BOARD_PREFIX, Board, _start_time
from dwdp.runtime.failover import Failover
from dwdp.runtime.liveness import PeerStatus
from dwdp.runtime.placement import build_placement, surviving_sources
from dwdp.runtime.plan import PlanCache, SegmentLayout, slot_layout
from dwdp.runtime.prefetch import Prefetcher
from dwdp.runtime.model import check_same_dense_as_peers
from dwdp.runtime.rejoin import PeerEntries, live_owner_of_each
from dwdp.runtime.transport import HostTransport, connect_in_process
from dwdp.runtime.transport.reference import execute_plan_reference
from dwdp.serve.restarts import RestartPolicy
from test_plan import _expert_bytes, _segment

TENSOR_NBYTES = (3000, 1500)
NUM_LAYERS = 3
E, G, REPLICAS = 8, 4, 3


class _Liveness:
    """Peers' states as the test sets them; `watch` (a rejoin) makes a peer alive again."""

    def __init__(self, peers):
        self.states = {p: "alive" for p in peers}
        self.pids = {}  # peer -> the pid its record names, when not 4242
        self.watched = []

    @property
    def peers(self):
        return tuple(sorted(self.states))

    def status(self, peer):
        return PeerStatus(self.states[peer], 4242, 0.0)

    def pid(self, peer):
        return self.pids.get(peer, 4242)  # 4242, not this process: an entry this process publishes is a new one

    def identity(self, peer):
        return self.pid(peer), None

    def node_of(self, peer):
        return None

    def forget(self, peer):
        self.states.pop(peer, None)

    def watch(self, peer, handle):
        self.states[peer] = handle.get("state", "alive")  # what the mapped record says
        self.watched.append((peer, handle["path"]))


@pytest.fixture
def group(tmp_path):
    p = build_placement(E, G, replicas=REPLICAS)
    seg = SegmentLayout(NUM_LAYERS, p.num_local_experts, TENSOR_NBYTES)
    full = _expert_bytes(NUM_LAYERS, E, TENSOR_NBYTES, seed=3)
    transports = [HostTransport(r, inflight=2, shm_dir=str(tmp_path)) for r in range(G)]
    for r, t in enumerate(transports):
        t.alloc_segment(seg.total_nbytes).copy_(_segment(full, p.owned[r]))
    connect_in_process(transports)
    nbytes = slot_layout(p, 0, TENSOR_NBYTES).total_nbytes
    plans = PlanCache(p, 0, seg, slice_bytes=700)
    liveness = _Liveness(range(1, G))
    board = Board("units-g0", tmp_path)
    failover = Failover(p, 0, plans, transports[0], liveness, 5.0, board=board)
    prefetcher = Prefetcher(transports[0], plans, [transports[0].alloc_slot(nbytes) for _ in range(2)], NUM_LAYERS,
                            10.0, failover)
    segments = [_segment(full, p.owned[r]) for r in range(G)]
    original = PlanCache(p, 0, seg, slice_bytes=700)

    def expected(layer):
        return execute_plan_reference(original.get(layer, 0), segments, torch.zeros(nbytes, dtype=torch.uint8))

    made = list(transports)
    yield dict(p=p, seg=seg, full=full, transports=transports, made=made, liveness=liveness, board=board,
               failover=failover, prefetcher=prefetcher, expected=expected, tmp=tmp_path)
    for rank in range(1, G):
        board.withdraw(rank)
    for t in made:
        t.close()
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def _forward(prefetcher, expected, mid_forward=None) -> list[int]:
    """One forward's layers; `mid_forward()` runs after the first layer. Returns the wrong layers."""
    bad = []
    prefetcher.start_forward()
    for layer in range(NUM_LAYERS):
        slot = prefetcher.begin(layer)
        prefetcher.wait(layer, slot)
        if not torch.equal(prefetcher.slots[slot].buffer, expected(layer)):
            bad.append(layer)
        prefetcher.release(slot)
        if layer == 0 and mid_forward is not None:
            mid_forward()
    prefetcher.end_forward()
    return bad


@pytest.mark.timeout(60)
def test_two_simultaneous_losses_with_redundancy_3_keep_every_expert(group):
    """Rank 1 exits and rank 2's memory turns unreadable before the same forward."""
    pf, failover = group["prefetcher"], group["failover"]
    assert _forward(pf, group["expected"]) == []
    group["liveness"].states[1] = "exited"
    group["transports"][0].fail_copies_from(2, "test fault: device lost")
    assert _forward(pf, group["expected"]) == []
    status = failover.status()
    assert sorted(status.lost) == [1, 2] and status.can_serve_all and status.unservable_experts == (), status
    assert "exited" in status.lost[1] and "test fault" in status.lost[2], status.lost
    assert min(status.redundancy) == 1 and max(status.redundancy) <= REPLICAS, status.redundancy
    pf.stats.reset()
    assert _forward(pf, group["expected"]) == []
    assert pf.stats.bytes_from_peer.get(1, 0) == pf.stats.bytes_from_peer.get(2, 0) == 0, pf.stats.bytes_from_peer
    assert pf.stats.bytes_from_peer.get(3, 0) > 0, pf.stats.bytes_from_peer
    _replacement(group, 2)  # the rank whose memory was unreadable comes back as a new process
    retried = failover.status().retried_slices
    pf.stats.reset()
    assert _forward(pf, group["expected"]) == []
    status = failover.status()
    assert list(status.lost) == [1] and status.rejoins == {2: 1}, status
    assert pf.stats.bytes_from_peer.get(2, 0) > 0 and status.retried_slices == retried, (pf.stats.bytes_from_peer, status)


def _replacement(group, rank: int) -> HostTransport:
    """A new process of `rank`: its own segment, filled as a rejoining rank fills it, on the board."""
    new = HostTransport(rank, inflight=2, shm_dir=str(group["tmp"]))
    new.alloc_segment(group["seg"].total_nbytes).copy_(_segment(group["full"], group["p"].owned[rank]))
    group["made"].append(new)
    group["board"].publish(rank, new.board_handle(), {"path": f"fake-record-of-new-rank-{rank}", "pid": 0}, 7)
    return new


def _publish_as(board, rank: int, pid: int, segment: dict, record: dict) -> None:
    """Write `rank`'s board entry as process `pid` wrote it (Board.publish writes this process's own)."""
    entry = {"pid": pid, "start_time": _start_time(pid), "segment": segment, "record": record, "dense_checksum": 7}
    board.path.mkdir(exist_ok=True)
    (board.path / f"rank{rank}.json").write_text(json.dumps(entry))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["memory unreadable", "reports its device lost"])
def test_a_peer_lost_while_its_process_lives_is_not_taken_back_through_its_own_board_entry(group, how):
    """Regression: rank 2 is lost while its process lives on, its board entry still there. Taking that
    entry for a rejoin would map the same faulty peer again at every look (a flap: one more re-plan
    each time). It comes back only when a new process of rank 2 publishes itself."""
    pf, failover, liveness, board = group["prefetcher"], group["failover"], group["liveness"], group["board"]
    old = group["transports"][2]
    liveness.pids[2] = os.getpid()  # the process that wrote rank 2's entry below: this one
    record = {"path": "fake-record-of-rank-2", "pid": os.getpid(), "state": "failed"}
    board.publish(2, old.board_handle(), record, 7)
    assert _forward(pf, group["expected"]) == []
    if how == "memory unreadable":
        group["transports"][0].fail_copies_from(2, "test fault: device lost")
    else:
        liveness.states[2] = "failed"
    assert _forward(pf, group["expected"]) == []
    status = failover.status()
    assert list(status.lost) == [2] and status.replans == 1, status
    assert board.read(2) is not None, "rank 2's own entry must still be on the board: it lives"
    for _ in range(3):  # forwards and health-loop looks: each reads the board
        pf.stats.reset()
        assert _forward(pf, group["expected"]) == []
        status = pf.poll_peers()
        assert pf.stats.bytes_from_peer.get(2, 0) == 0, pf.stats.bytes_from_peer
    assert list(status.lost) == [2] and status.rejoins == {} and status.rejoining == (), status
    assert status.replans == 1, f"re-planned {status.replans} times for one loss: the lost peer flapped back"
    assert liveness.watched == [], liveness.watched

    # A new process of rank 2 publishes itself: that one is taken back, once.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        new = HostTransport(2, inflight=2, shm_dir=str(group["tmp"]))
        new.alloc_segment(group["seg"].total_nbytes).copy_(_segment(group["full"], group["p"].owned[2]))
        group["made"].append(new)
        _publish_as(board, 2, child.pid, new.board_handle(), {"path": "fake-record-of-new-rank-2", "pid": child.pid})
        pf.stats.reset()
        status = pf.poll_peers()
        assert status.lost == {} and status.rejoins == {2: 1} and status.replans == 2, status
        assert _forward(pf, group["expected"]) == [] and pf.stats.bytes_from_peer.get(2, 0) > 0, pf.stats.bytes_from_peer
        assert liveness.watched == [(2, "fake-record-of-new-rank-2")], liveness.watched
    finally:
        child.kill()
        child.wait()
    (board.path / "rank2.json").unlink(missing_ok=True)  # its process is gone; the fixture withdraws the rest


@pytest.mark.timeout(60)
def test_a_loss_while_another_rank_rejoins_and_the_old_segment_is_never_read(group):
    """Rank 1 dies (its old segment is then poisoned), comes back while rank 0 is mid-forward, and
    rank 2 dies during that same forward: the loss is planned around at once, the rejoin at the
    next forward."""
    pf, failover, liveness, p = group["prefetcher"], group["failover"], group["liveness"], group["p"]
    assert _forward(pf, group["expected"]) == []
    liveness.states[1] = "exited"
    assert _forward(pf, group["expected"]) == [] and list(failover.status().lost) == [1]
    group["transports"][1].peer_segment(1).fill_(255)  # the dead incarnation's memory: never read again

    def mid_forward():
        _replacement(group, 1)
        liveness.states[2] = "exited"
        status = pf.poll_peers()  # the health loop, while this forward runs
        mid_forward.status = status

    pf.stats.reset()
    assert _forward(pf, group["expected"], mid_forward) == []
    status = mid_forward.status
    assert sorted(status.lost) == [1, 2] and status.rejoining == (1,) and status.rejoins == {}, status
    assert pf.stats.bytes_from_peer.get(1, 0) == 0, "the rejoin entered the plans in the middle of a forward"
    pf.stats.reset()
    assert _forward(pf, group["expected"]) == []  # would read 0xFF from a stale mapping of rank 1
    status = failover.status()
    assert list(status.lost) == [2] and status.rejoins == {1: 1} and status.rejoining == (), status
    assert pf.stats.bytes_from_peer.get(1, 0) > 0 and pf.stats.bytes_from_peer.get(2, 0) == 0, pf.stats.bytes_from_peer
    assert failover.plans.sources == surviving_sources(p, {2})[0], failover.plans.sources
    assert liveness.watched == [(1, "fake-record-of-new-rank-1")], liveness.watched
    assert status.redundancy == tuple(sum(o != 2 for o in p.owners(e)) for e in range(E)), status.redundancy


@pytest.mark.timeout(60)
def test_a_rank_found_back_is_taken_back_at_once_between_forwards_and_its_plan_is_the_fresh_one(group):
    pf, failover, liveness, p = group["prefetcher"], group["failover"], group["liveness"], group["p"]
    fresh = [pf.plans.get(layer, 0).slices for layer in range(NUM_LAYERS)]
    liveness.states[1] = "exited"
    assert _forward(pf, group["expected"]) == []
    _replacement(group, 1)
    status = pf.poll_peers()  # no forward running: taken back now
    assert status.lost == {} and status.rejoins == {1: 1}, status
    assert [pf.plans.get(layer, 0).slices for layer in range(NUM_LAYERS)] == fresh
    assert status.redundancy == tuple(len(p.owners(e)) for e in range(E)), status.redundancy


def test_a_rejoining_rank_copies_its_experts_from_live_owners_only_when_each_has_one():
    p = build_placement(6, 3, replicas=2)
    owner_of = live_owner_of_each(p, 1, live=(0, 2))
    assert set(owner_of) == set(p.local_experts(1)), owner_of
    assert all(owner_of[e] in p.owners(e) and owner_of[e] != 1 for e in owner_of), owner_of
    assert live_owner_of_each(p, 1, live=(2,)) is None  # some expert of rank 1 is owned by 0 and 1 only
    assert live_owner_of_each(build_placement(6, 3), 1, live=(0, 2)) is None  # no redundancy: checkpoint


def test_restart_policy_backs_off_then_leaves_a_rank_down():
    policy = RestartPolicy(backoff_s=0.5, max_per_minute=2)
    assert policy.delay(1, now=0.0) == 0.5
    policy.started(1, now=0.5)
    assert policy.delay(1, now=1.0) == 1.0
    policy.started(1, now=2.0)
    assert policy.delay(1, now=2.5) is None
    assert "after 2 restart(s) within 60 s (at most 2); left down" in policy.down_reason(1, 2.5, -9, "boom\nOSError: x")
    assert policy.delay(1, now=62.1) == 0.5, "restarts older than a minute no longer count"
    assert policy.delay(0, now=2.5) == 0.5, "ranks are counted apart"
    with pytest.raises(ValueError, match="max_per_minute=0"):
        RestartPolicy(0.5, 0)


@pytest.mark.timeout(60)
def test_a_replacement_that_dies_before_it_is_taken_back_is_not_reported_rejoining(group):
    pf, failover, liveness = group["prefetcher"], group["failover"], group["liveness"]
    liveness.states[1] = "exited"
    assert _forward(pf, group["expected"]) == []
    seen = []

    def mid_forward():
        new = _replacement(group, 1)
        seen.append(pf.poll_peers().rejoining)
        group["board"].withdraw(1)  # its entry goes with its process
        new.close()
        seen.append(pf.poll_peers().rejoining)

    assert _forward(pf, group["expected"], mid_forward) == []
    assert seen == [(1,), ()], seen
    assert _forward(pf, group["expected"]) == []
    status = failover.status()
    assert list(status.lost) == [1] and status.rejoins == {}, status


def test_a_replacement_with_other_dense_weights_is_refused_naming_the_ranks():
    peers = PeerEntries(1, ({"dense_checksum": 5}, None, {"dense_checksum": 5}, {"dense_checksum": 6}))
    check_same_dense_as_peers(1, 5, PeerEntries(1, ({"dense_checksum": 5}, None)))
    with pytest.raises(ValueError, match=r"rank 1 rejoins .* but ranks \[0, 2, 3\] hold"):
        check_same_dense_as_peers(1, 4, peers)


def test_boards_of_dead_processes_are_swept_by_the_next_board(tmp_path):
    stale = tmp_path / f"{BOARD_PREFIX}old-g0"
    stale.mkdir()
    (stale / "rank0.json").write_text('{"pid": 999999999, "segment": {}, "record": {}, "dense_checksum": 0}')
    board = Board("new-g0", tmp_path)
    assert not stale.exists(), list(stale.iterdir())
    board.withdraw(0)
    assert list(tmp_path.iterdir()) == []


def test_an_entry_whose_pid_now_names_another_process_reads_as_gone(tmp_path):
    """A dead rank's pid reused by an unrelated process: its /proc/<pid>/fd paths would open that
    process's files, so the entry must not pass for alive."""
    import json

    board = Board("reuse-g0", tmp_path)
    board.publish(0, {"path": "seg"}, {"path": "rec"}, 1)
    assert board.read(0)["segment"] == {"path": "seg"}
    entry = json.loads((board.path / "rank0.json").read_text())
    entry["start_time"] -= 1  # same pid, started at another time: another process
    (board.path / "rank0.json").write_text(json.dumps(entry))
    assert board.read(0) is None
    board.sweep(0)
    assert list(tmp_path.iterdir()) == []


def test_the_last_rank_to_withdraw_removes_a_board_a_dead_incarnation_left_its_entry_on(tmp_path):
    """A worker killed after its survivors last looked leaves its entry; the last live rank to close
    removes it with the board."""
    board = Board("left-g0", tmp_path)
    board.publish(0, {"path": "seg"}, {"path": "rec"}, 1)
    (board.path / "rank2.json").write_text('{"pid": 999999999, "segment": {}, "record": {}, "dense_checksum": 1}')
    board.withdraw(0)
    assert list(tmp_path.iterdir()) == [], list(board.path.iterdir())


def test_a_server_sweeps_boards_its_stopped_workers_left(tmp_path, monkeypatch):
    from dwdp.serve.config import ServeConfig
    from dwdp.serve.pool import WorkerPool

    monkeypatch.setenv("DWDP_SHM_DIR", str(tmp_path))
    left = tmp_path / f"{BOARD_PREFIX}127.0.0.1-1-g0"
    left.mkdir()
    (left / "rank1.json").write_text('{"pid": 999999999, "segment": {}, "record": {}, "dense_checksum": 1}')
    pool = WorkerPool(ServeConfig(ranks=1), str(tmp_path / "kv"))  # never started: close stops nobody
    pool.close()
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_the_chaos_bench_fails_a_case_whose_survivors_re_plan_more_than_once_per_loss(monkeypatch):
    """bench/chaos.py counts each survivor's re-plans from the fault to the end: one per loss, none
    for a stall; a lost rank taken back and lost again shows as more, and fails the run."""
    import importlib
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    chaos = importlib.import_module("chaos")
    health = lambda replans: {"workers": [{"rank": r, "replans": n} for r, n in enumerate(replans)]}
    row = lambda case, after, rejoins: {"case": case, "survivor_replans": chaos.replans_since(
        health([0, 0, 0]), health(after), [0, 2]), "survivors_after": {0: {"peer_rejoins": rejoins}, 2: {"peer_rejoins": {}}}}
    assert chaos.unexpected_replans(row("unreadable", [1, 0, 1], {})) is None
    assert chaos.unexpected_replans(row("stall", [0, 0, 0], {})) is None
    flap = chaos.unexpected_replans(row("unreadable", [7, 0, 1], {1: 3}))
    assert flap is not None and "re-planned {0: 7} times" in flap and "{0: {1: 3}, 2: {}}" in flap, flap
    assert "expected 0 each" in chaos.unexpected_replans(row("stall", [1, 0, 0], {}))
