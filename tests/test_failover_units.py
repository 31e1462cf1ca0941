"""Failover's pieces in one process: new sources after a loss, re-routed plans, the prefetcher's
retry and its bound on slow copies, liveness records, and the cuda backend through its fake."""
from __future__ import annotations

import collections
import itertools
import math
import multiprocessing as mp
import os
import signal
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.failover import ExpertsUnavailable, Failover
from dwdp.runtime.liveness import LivenessRecord, PeerLiveness, PeerStatus, process_exited
from dwdp.runtime.placement import NO_SOURCE, build_placement, local_experts_for_replicas, surviving_sources
from dwdp.runtime.plan import PlanCache, SegmentLayout, build_copy_plan, slot_layout
from dwdp.runtime.prefetch import Prefetcher
from dwdp.runtime.transport import HostTransport, PrefetchTimeout, Ticket, connect_in_process
from dwdp.runtime.transport.reference import execute_plan_reference
from deadlines import assert_fired_after
from test_plan import _expert_bytes, _segment

TENSOR_NBYTES = (3000, 1500)
NUM_LAYERS = 3


# -- placement -----------------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(num_experts=st.integers(2, 24), data=st.data())
def test_surviving_sources_read_only_surviving_owners(num_experts, data):
    group_size = data.draw(st.integers(2, num_experts))
    local = data.draw(st.integers(-(-num_experts // group_size), num_experts))
    p = build_placement(num_experts, group_size, local)
    lost = set(data.draw(st.lists(st.integers(0, group_size - 1), max_size=group_size - 1)))
    sources = surviving_sources(p, lost)
    for r in set(range(group_size)) - lost:
        for e in p.missing_experts(r):
            src, alive = sources[r][e], [o for o in p.owners(e) if o not in lost]
            if alive:
                assert src in alive, f"rank {r} reads expert {e} from {src}; surviving owners {alive}, lost {lost}"
            else:
                assert src == NO_SOURCE, f"rank {r} reads expert {e} from {src}, but every owner is lost {lost}"


def _fewest_on_busiest(p, lost) -> int:
    """Brute force over every choice of surviving owners: the smallest largest source load."""
    pulls = [(r, e) for r in range(p.group_size) if r not in lost for e in p.missing_experts(r)]
    choices = [[o for o in p.owners(e) if o not in lost] for _, e in pulls]
    return min(max(collections.Counter(c).values(), default=0) for c in itertools.product(*choices))


def test_after_a_loss_the_busiest_source_is_as_light_as_any_choice_of_surviving_owners():
    checked = 0
    for num_experts in range(3, 9):
        for group_size in range(3, num_experts + 1):
            p = build_placement(num_experts, group_size, replicas=2)
            for victim in range(group_size):
                lost = {victim}
                pulls = [(r, e) for r in range(group_size) if r != victim for e in p.missing_experts(r)]
                if math.prod(len([o for o in p.owners(e) if o != victim]) for _, e in pulls) > 20_000:
                    continue
                sources = surviving_sources(p, lost)
                load = collections.Counter(sources[r][e] for r, e in pulls)
                got, best = max(load.values(), default=0), _fewest_on_busiest(p, lost)
                assert got == best, f"E={num_experts} G={group_size} lost {victim}: busiest {got}, possible {best}"
                checked += 1
    assert checked > 40, f"only {checked} cases checked"


@pytest.mark.parametrize("num_experts, group_size, replicas", [(6, 3, 2), (16, 3, 2), (16, 4, 2), (7, 4, 3),
                                                               (5, 5, 5), (16, 3, 1)])
def test_expert_replicas_picks_the_fewest_local_experts_that_give_every_expert_that_many_owners(
        num_experts, group_size, replicas):
    local = local_experts_for_replicas(num_experts, group_size, replicas)
    p = build_placement(num_experts, group_size, replicas=replicas)
    assert p.num_local_experts == local and p.min_owners >= replicas, (local, p.min_owners)
    if local > -(-num_experts // group_size):
        fewer = build_placement(num_experts, group_size, local - 1)
        assert fewer.min_owners < replicas, f"{local - 1} local experts already give {fewer.min_owners} owners"


@pytest.mark.parametrize("kwargs, words", [
    (dict(replicas=4), "expert_replicas=4 must be in [1, group_size=3]"),
    (dict(replicas=2, num_local_experts=2), "num_local_experts=2 gives some expert fewer than expert_replicas=2"),
    (dict(replicas=True), "expert_replicas=True must be an int"),
])
def test_bad_replicas_are_refused_naming_the_value(kwargs, words):
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        build_placement(6, 3, **kwargs)
    with pytest.raises(ValueError, match="lost ranks \\[5\\]"):
        surviving_sources(build_placement(6, 3), {5})


@pytest.mark.parametrize("kwargs, field", [(dict(expert_replicas=0), "expert_replicas"),
                                           (dict(group_size=2, expert_replicas=3), "expert_replicas=3"),
                                           (dict(peer_timeout_s=0), "peer_timeout_s"),
                                           (dict(peer_timeout_s=float("inf")), "peer_timeout_s")])
def test_config_refuses_bad_failover_knobs(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DWDPConfig(**kwargs)


# -- plans ---------------------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(num_experts=st.integers(3, 12), data=st.data(), slice_bytes=st.sampled_from([700, 1500, 4096]))
def test_a_rerouted_plan_fills_the_same_slot_layout_with_the_same_bytes(num_experts, data, slice_bytes):
    """Every owner holds the same bytes of an expert, so after a loss the slot must read back exactly
    as before, except the experts nobody can supply any more, which stay untouched."""
    group_size = data.draw(st.integers(2, num_experts))
    replicas = data.draw(st.integers(1, min(2, group_size)))
    p = build_placement(num_experts, group_size, replicas=replicas)
    rank = data.draw(st.integers(0, group_size - 1))
    lost = data.draw(st.sampled_from([r for r in range(group_size) if r != rank]))
    seg = SegmentLayout(NUM_LAYERS, p.num_local_experts, TENSOR_NBYTES)
    full = _expert_bytes(NUM_LAYERS, num_experts, TENSOR_NBYTES, seed=num_experts)
    segments = [_segment(full, p.owned[r]) for r in range(group_size)]
    nbytes = slot_layout(p, rank, TENSOR_NBYTES).total_nbytes
    before = build_copy_plan(p, rank, 1, 0, seg, slice_bytes)
    sources = surviving_sources(p, {lost})[rank]
    after = build_copy_plan(p, rank, 1, 0, seg, slice_bytes, sources)
    assert lost not in after.peers, f"re-routed plan still reads rank {lost}: {after.peers}"
    want = execute_plan_reference(before, segments, torch.zeros(nbytes, dtype=torch.uint8))
    got = execute_plan_reference(after, segments, torch.zeros(nbytes, dtype=torch.uint8))
    gone = {e for e in p.missing_experts(rank) if sources[e] == NO_SOURCE}
    for s in before.slices:
        region = slice(s.dst_offset, s.dst_offset + s.nbytes)
        if s.expert in gone:
            assert not got[region].any(), f"expert {s.expert} has no owner left but its slot bytes were written"
        else:
            assert torch.equal(got[region], want[region]), f"expert {s.expert} differs at {s.dst_offset}"


def test_plan_cache_set_sources_drops_every_plan():
    p = build_placement(6, 3, replicas=2)
    cache = PlanCache(p, 0, SegmentLayout(NUM_LAYERS, p.num_local_experts, TENSOR_NBYTES), 1000)
    old = cache.get(1, 0)
    victim = old.peers[0]
    cache.set_sources(surviving_sources(p, {victim})[0])
    new = cache.get(1, 0)
    assert new is not old and victim not in new.peers and victim in old.peers, (old.peers, new.peers)


# -- the prefetcher's retry ----------------------------------------------------------------------
@pytest.fixture
def host_group(tmp_path):
    """make(replicas) -> rank 0's (prefetcher, failover, transports, expected(layer)) over 3 host
    transports in this process; every owner of an expert holds the same seeded bytes."""
    made = []

    def make(replicas: int, liveness=None, peer_timeout_s=5.0, wait_timeout_s=10.0):
        p = build_placement(6, 3, replicas=replicas)
        seg = SegmentLayout(NUM_LAYERS, p.num_local_experts, TENSOR_NBYTES)
        full = _expert_bytes(NUM_LAYERS, 6, TENSOR_NBYTES, seed=replicas)
        transports = [HostTransport(r, inflight=2, shm_dir=str(tmp_path)) for r in range(3)]
        for r, t in enumerate(transports):
            t.alloc_segment(seg.total_nbytes).copy_(_segment(full, p.owned[r]))
        connect_in_process(transports)
        made.extend(transports)
        nbytes = slot_layout(p, 0, TENSOR_NBYTES).total_nbytes
        plans = PlanCache(p, 0, seg, slice_bytes=700)
        failover = Failover(p, 0, plans, transports[0], liveness, peer_timeout_s)
        buffers = [transports[0].alloc_slot(nbytes) for _ in range(2)]
        prefetcher = Prefetcher(transports[0], plans, buffers, NUM_LAYERS, wait_timeout_s, failover)
        segments = [_segment(full, p.owned[r]) for r in range(3)]
        original = PlanCache(p, 0, seg, slice_bytes=700)

        def expected(layer):
            return execute_plan_reference(original.get(layer, 0), segments, torch.zeros(nbytes, dtype=torch.uint8))

        return prefetcher, failover, transports, expected

    yield make
    for t in made:
        t.close()
    assert list(tmp_path.iterdir()) == []


def _run_layers(prefetcher, expected, visits, routed=None):
    """The experts function's protocol for `visits` layers; returns the layers whose slot was wrong."""
    bad = []
    prefetcher.start_forward()
    for visit in range(visits):
        layer = visit % NUM_LAYERS
        slot = prefetcher.begin(layer, routed)
        prefetcher.wait(layer, slot)
        if not torch.equal(prefetcher.slots[slot].buffer, expected(layer)):
            bad.append(layer)
        prefetcher.release(slot)
    return bad


@pytest.mark.timeout(60)
def test_copies_failing_from_one_peer_are_retried_from_the_other_owners(host_group):
    prefetcher, failover, transports, expected = host_group(replicas=2)
    victim = prefetcher.plans.get(0, 0).peers[0]
    transports[0].fail_copies_from(victim, "test fault")
    assert _run_layers(prefetcher, expected, 2 * NUM_LAYERS) == []
    status = failover.status()
    assert list(status.lost) == [victim] and "test fault" in status.lost[victim], status
    assert status.replans == 1 and status.retried_slices > 0 and status.can_serve_all, status
    prefetcher.stats.reset()
    assert _run_layers(prefetcher, expected, 2 * NUM_LAYERS) == []
    assert prefetcher.stats.bytes_from_peer.get(victim, 0) == 0 < prefetcher.stats.bytes_copied, prefetcher.stats


@pytest.mark.timeout(60)
def test_without_another_owner_the_wait_names_the_experts_and_the_lost_rank(host_group):
    prefetcher, failover, transports, expected = host_group(replicas=1)
    victim = 1
    needed = build_placement(6, 3).pulls_from(0, victim)
    transports[0].fail_copies_from(victim, "test fault")
    prefetcher.start_forward()
    slot = prefetcher.begin(0)
    with pytest.raises(ExpertsUnavailable) as info:
        prefetcher.wait(0, slot, needed[:1])
    prefetcher.release(slot)
    assert info.value.experts == needed[:1] and list(info.value.lost) == [victim], (info.value.experts, info.value.lost)
    assert f"experts [{needed[0]}]" in str(info.value) and f"rank {victim}" in str(info.value), str(info.value)
    # A layer whose tokens avoid the lost experts still runs; one routed to them fails before waiting.
    others = torch.tensor([[e for e in range(6) if e not in needed]])
    slot = prefetcher.begin(1, others)
    prefetcher.wait(1, slot, [e for e in others[0].tolist() if e not in prefetcher.plans.placement.owned[0]])
    prefetcher.release(slot)
    with pytest.raises(ExpertsUnavailable, match=f"MoE layer 2 routes tokens to experts \\[{needed[1]}\\]"):
        prefetcher.begin(2, torch.tensor([[needed[1], 0]]))
    assert not failover.status().can_serve_all


class _HangingTransport:
    """Copies from `hung` never land; others land at once (executed by the reference)."""

    def __init__(self, rank, segments, hung):
        self.rank, self.segments, self.hung, self.forgotten = rank, segments, hung, []

    def submit(self, plan, slot_buffer):
        ticket = Ticket(plan)
        for s in plan.slices:
            if s.peer != self.hung:
                ticket._start_slice()
                slot_buffer[s.dst_offset:s.dst_offset + s.nbytes] = self.segments[s.peer][s.src_offset:s.src_offset + s.nbytes]
                ticket._finish_slice(s.peer, s.expert)
        return ticket

    def forget_peer(self, peer):
        self.forgotten.append(peer)

    def release_slot(self, slot):
        pass


class _Liveness:
    def __init__(self, states):
        self.states = states
        self.peers = tuple(states)

    def status(self, peer):
        return PeerStatus(self.states[peer], 4242, 9.0)

    def pid(self, peer):
        return 4242

    def identity(self, peer):
        return self.pid(peer), None

    def node_of(self, peer):
        return None

    def forget(self, peer):
        pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("state", ["exited", "stalled"])
def test_a_copy_outstanding_past_the_bound_reads_the_peers_liveness(state):
    """A dead source is planned around one bound after the copy began; a stalled one is waited for
    (its memory needs no help to be read) until the layer's own timeout."""
    p = build_placement(6, 3, replicas=2)
    seg = SegmentLayout(NUM_LAYERS, p.num_local_experts, TENSOR_NBYTES)
    full = _expert_bytes(NUM_LAYERS, 6, TENSOR_NBYTES, seed=5)
    segments = [_segment(full, p.owned[r]) for r in range(3)]
    plans = PlanCache(p, 0, seg, slice_bytes=700)
    hung = plans.get(0, 0).peers[0]
    transport = _HangingTransport(0, segments, hung)
    # An exited source is re-planned once it is outstanding past `bound`, long before the wait's timeout
    # (which would raise): a stopped one is waited for until that timeout.
    bound, timeout = 0.2, (60.0 if state == "exited" else 1.5)
    liveness = _Liveness({1: "alive", 2: "alive"})
    failover = Failover(p, 0, plans, transport, liveness, bound)
    nbytes = slot_layout(p, 0, TENSOR_NBYTES).total_nbytes
    buffers = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(2)]
    prefetcher = Prefetcher(transport, plans, buffers, NUM_LAYERS, timeout, failover)
    want = execute_plan_reference(PlanCache(p, 0, seg, 700).get(0, 0), segments, torch.zeros(nbytes, dtype=torch.uint8))
    prefetcher.start_forward()
    slot = prefetcher.begin(0)
    liveness.states[hung] = state  # the source goes after its copy was issued
    start = time.monotonic()
    if state == "exited":
        prefetcher.wait(0, slot)
        took = time.monotonic() - start
        assert took >= bound, f"re-planned after {took:.2f} s, before the {bound} s bound"
        assert torch.equal(buffers[slot], want)
        assert list(failover.lost) == [hung] and "outstanding past 0.2 s" in failover.lost[hung], failover.lost
        assert transport.forgotten == [hung]
    else:
        with pytest.raises(PrefetchTimeout, match=f"{{{hung}: "):
            prefetcher.wait(0, slot)
        assert_fired_after(time.monotonic() - start, timeout, "the wait on a stopped source")
        assert failover.lost == {} and transport.forgotten == [], failover.lost
    prefetcher.release(slot)


# -- liveness ------------------------------------------------------------------------------------
def _live_child(shm_dir, conn):
    record = LivenessRecord(shm_dir, period_s=0.02)
    conn.send(record.handle())
    conn.recv()  # the parent has mapped it
    record.seal()
    record.start()
    conn.send("started")
    conn.recv()  # never answered: the parent stops and kills this process


def _wait_state(liveness, peer, state, timeout_s=20.0) -> PeerStatus:
    deadline = time.monotonic() + timeout_s
    while True:
        status = liveness.status(peer)
        if status.state == state:
            return status
        assert time.monotonic() < deadline, f"peer {peer} still {status} after {timeout_s} s, expected {state}"
        time.sleep(0.01)


@pytest.mark.timeout(60)
def test_a_peer_record_tells_alive_stalled_and_exited_apart(tmp_path):
    ctx = mp.get_context("spawn")
    parent, child_end = ctx.Pipe()
    child = ctx.Process(target=_live_child, args=(str(tmp_path), child_end))
    child.start()
    try:
        assert parent.poll(30), "the child never published its record"
        handle = parent.recv()
        liveness = PeerLiveness(0, [{}, handle], stall_after_s=0.2)
        parent.send("mapped")
        assert parent.poll(30) and parent.recv() == "started"
        assert list(tmp_path.iterdir()) == [], "the record's name outlived the seal"
        assert _wait_state(liveness, 1, "alive").pid == child.pid
        os.kill(child.pid, signal.SIGSTOP)
        assert _wait_state(liveness, 1, "stalled").beat_age_s > 0.2
        os.kill(child.pid, signal.SIGCONT)
        _wait_state(liveness, 1, "alive")
        os.kill(child.pid, signal.SIGKILL)
        status = _wait_state(liveness, 1, "exited")  # a zombie: nobody has reaped it yet
        assert status.is_lost and "exited without closing" in status.describe(1), status
        assert process_exited(child.pid, None), "the /proc fallback takes the zombie for alive"
        liveness.close()
    finally:
        if child.is_alive():
            child.kill()
        child.join(10)


def test_own_record_reads_closed_or_failed_and_a_closed_rank_is_not_lost(tmp_path):
    for end, state in ((LivenessRecord.close, "closed"), (LivenessRecord.mark_failed, "failed")):
        record = LivenessRecord(tmp_path, period_s=0.05)
        liveness = PeerLiveness(1, [record.handle(), {}], stall_after_s=1.0)  # this process plays rank 0
        record.seal()
        record.start()
        assert liveness.status(0).state == "alive"
        end(record)
        assert liveness.status(0).state == state and liveness.status(0).is_lost == (state == "failed")
        record.close()
        assert liveness.status(0).state == state, "closing after a failure must not hide it"
        liveness.close()
    assert list(tmp_path.iterdir()) == []


# -- the cuda backend, through the recording fake -------------------------------------------------
def test_cuda_fault_hook_re_plans_and_unmaps_the_lost_peer_after_its_copies():
    from fake_cuda import FakeGroup

    group = FakeGroup(6, 3, num_layers=NUM_LAYERS, num_local=4).open()
    rank, victim = 0, 2
    transport = group.transports[rank]
    nbytes = group.slot_nbytes(rank)
    plans = PlanCache(group.placement, rank, group.layout, 900)
    assert victim in plans.get(0, 0).peers
    failover = Failover(group.placement, rank, plans, transport, None, 1.0)
    buffers = [transport.alloc_slot(nbytes) for _ in range(2)]
    prefetcher = Prefetcher(transport, plans, buffers, NUM_LAYERS, 5.0, failover)
    victim_seg = group.transports[victim]._segment
    lo, hi = victim_seg.data_ptr(), victim_seg.data_ptr() + victim_seg.numel()
    transport.fail_copies_from(victim, "test fault")
    start = len(group.device.calls)
    prefetcher.start_forward()
    for layer in range(NUM_LAYERS):
        slot = prefetcher.begin(layer)
        prefetcher.wait(layer, slot)
        group.device.run()
        # Every expert still has an owner, so the re-routed plan covers the whole slot.
        want = group.expected(plans.get(layer, slot), nbytes, torch.zeros(nbytes, dtype=torch.uint8))
        assert torch.equal(buffers[slot], want), f"layer {layer}: {int(buffers[slot].ne(want).sum())} bytes differ"
        prefetcher.release(slot)
    group.device.run()
    assert list(failover.lost) == [victim] and failover.retried_slices > 0, (failover.lost, failover.retried_slices)
    read = [s for r, n, a in group.device.calls[start:] if r == rank and n == "memcpy_prepared_batch"
            for s in a[0].srcs]
    assert read and not any(lo <= s < hi for s in read), "a copy from the faulty peer was enqueued"
    bases = dict(transport.mapper.peer_bases)
    closes = [a[0] for r, n, a in group.device.calls if r == rank and n == "ipc_close"]
    assert closes == [bases[victim]], f"the lost peer's mapping was not closed once after its fence: {closes}"
    group.close()
    closes = [a[0] for r, n, a in group.device.calls if r == rank and n == "ipc_close"]
    assert sorted(closes) == sorted(bases.values()), f"each peer mapping must close exactly once: {closes}, {bases}"
