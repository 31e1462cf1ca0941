"""Prefetch slots with two host ranks in one process (the copier threads are real)."""
import pytest
import torch

from dwdp.runtime.placement import build_placement
from dwdp.runtime.plan import PlanCache, SegmentLayout, slot_layout
from dwdp.runtime.prefetch import Prefetcher
from dwdp.runtime.transport import HostTransport, PrefetchTimeout, connect_in_process
from dwdp.runtime.transport.reference import execute_plan_reference

TENSOR_NBYTES = (3000, 1500)
NUM_LAYERS = 3


@pytest.fixture(params=[2])
def pair(tmp_path, request):
    """Rank 0's prefetcher over a 2-rank group whose segments hold seeded random bytes."""
    placement = build_placement(6, 2)
    seg_layout = SegmentLayout(NUM_LAYERS, placement.num_local_experts, TENSOR_NBYTES)
    transports, segments = [], []
    for rank in range(2):
        t = HostTransport(rank, inflight=2, shm_dir=str(tmp_path))
        seg = t.alloc_segment(seg_layout.total_nbytes)
        seg.copy_(torch.randint(0, 256, seg.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(rank)))
        transports.append(t)
        segments.append(seg)
    connect_in_process(transports)
    nbytes = slot_layout(placement, 0, TENSOR_NBYTES).total_nbytes
    buffers = [transports[0].alloc_slot(nbytes) for _ in range(request.param)]
    plans = PlanCache(placement, 0, seg_layout, slice_bytes=700)
    prefetcher = Prefetcher(transports[0], plans, buffers, NUM_LAYERS, timeout_s=10.0)

    def expected(layer):
        return execute_plan_reference(plans.get(layer, 0), segments, torch.zeros(nbytes, dtype=torch.uint8))

    yield prefetcher, buffers, expected
    for t in transports:
        t.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("pair", [2, 3, 4], indirect=True)
def test_layers_cycle_through_slots(pair):
    prefetcher, buffers, expected = pair
    for visit in range(2 * NUM_LAYERS):
        layer = visit % NUM_LAYERS
        slot = prefetcher.begin(layer)
        assert slot == visit % len(buffers)
        for ahead in range(1, len(buffers)):  # the next B - 1 layers are already on their way
            assert prefetcher.slots[(visit + ahead) % len(buffers)].layer == (layer + ahead) % NUM_LAYERS
        prefetcher.wait(layer, slot)
        assert torch.equal(buffers[slot], expected(layer)), f"layer {layer} slot {slot}"
        prefetcher.release(slot)
    assert prefetcher.stats.waits == 2 * NUM_LAYERS


class CountingTransport:
    """Passes every submit through and records (layer, slot, bytes) of what really went out; every
    other transport call goes straight to the real transport."""

    def __init__(self, inner):
        self.inner, self.submitted = inner, []

    def submit(self, plan, slot_buffer):
        self.submitted.append((plan.layer, plan.slot, sum(s.nbytes for s in plan.slices)))
        return self.inner.submit(plan, slot_buffer)

    def __getattr__(self, name):
        return getattr(self.inner, name)


# Rank 0 of build_placement(6, 2) owns experts 0-2 and pulls 3-5: 3 x (3000 + 1500) bytes per layer.
LAYER_BYTES = 3 * sum(TENSOR_NBYTES)
# Two forwards over 3 MoE layers; visit n reads slot n % B and issues the next B - 1 layers into
# the slots after it, skipping slots that already hold the layer. Worked by hand:
#   B=2: every visit must refill the other slot (layer 0 goes to slot 0 at start, then 1->1, 2->0,
#        0->1, 1->0, 2->1, 0->0); no visit finds its next layer already there.
#   B=3: slot s holds layer s for good after the first visit: 3 copies, then visits 1-5 all hit.
#   B=4: the first visit fills all four slots (0->0, 1->1, 2->2, 0->3); each later visit finds
#        the next layer in place (a hit) and refills the slot three ahead.
COPIES_BY_HAND = {
    2: ([(0, 0), (1, 1), (2, 0), (0, 1), (1, 0), (2, 1), (0, 0)], 0),
    3: ([(0, 0), (1, 1), (2, 2)], 5),
    4: ([(0, 0), (1, 1), (2, 2), (0, 3), (1, 0), (2, 1), (0, 2), (1, 3), (2, 0)], 5),
}


@pytest.mark.parametrize("pair", [2, 3, 4], indirect=True)
def test_a_slot_holding_the_wanted_layer_is_reused_not_copied_again(pair):
    prefetcher, buffers, expected = pair
    counting = CountingTransport(prefetcher.transport)
    prefetcher.transport = counting
    for _ in range(2):
        prefetcher.start_forward()  # what DWDPModel's forward pre-hook does
        for layer in range(NUM_LAYERS):
            slot = prefetcher.begin(layer)
            prefetcher.wait(layer, slot)
            assert torch.equal(buffers[slot], expected(layer)), f"layer {layer} slot {slot}"
            prefetcher.release(slot)
    copies, hits = COPIES_BY_HAND[len(buffers)]
    got = [(layer, slot) for layer, slot, _ in counting.submitted]
    assert got == copies, f"B={len(buffers)}: copies (layer, slot) {got}, expected {copies}"
    assert [n for *_, n in counting.submitted] == [LAYER_BYTES] * len(copies), counting.submitted
    stats = prefetcher.stats
    assert (stats.plans_issued, stats.bytes_copied, stats.slot_hits) == (len(copies), LAYER_BYTES * len(copies), hits), stats


def test_slot_not_overwritten_while_a_slow_consumer_reads(pair):
    prefetcher, buffers, expected = pair
    s0 = prefetcher.begin(0)
    prefetcher.wait(0, s0)
    # The consumer of layer 0 is still reading slot 0 (it has not released it) ...
    s1 = prefetcher.begin(1)  # ... while entering layer 1 asks for layer 2 to go into slot 0.
    prefetcher.wait(1, s1)
    prefetcher.drain()  # every copy that was allowed to start has finished
    assert s0 == 0 and s1 == 1
    assert torch.equal(buffers[0], expected(0)), "slot 0 was overwritten under its reader"
    prefetcher.release(s0)  # the deferred copy of layer 2 starts now
    prefetcher.release(s1)
    s2 = prefetcher.begin(2)
    assert s2 == 0
    prefetcher.wait(2, s2)
    assert torch.equal(buffers[0], expected(2))
    prefetcher.release(s2)


def test_wait_on_a_held_slot_times_out_naming_layer_and_slot(pair):
    prefetcher, _, _ = pair
    prefetcher.timeout_s = 0.2
    held = prefetcher.begin(0)
    prefetcher.wait(0, held)
    prefetcher.release(prefetcher.begin(1))
    with pytest.raises(PrefetchTimeout) as err:
        prefetcher.begin(2)  # slot 0 still held by layer 0's compute
    assert "layer 2" in str(err.value) and "slot 0" in str(err.value), str(err.value)
    prefetcher.release(held)


def test_start_forward_after_an_aborted_forward_restarts_at_layer_0(pair):
    prefetcher, buffers, expected = pair
    slot = prefetcher.begin(0)
    prefetcher.wait(0, slot)
    prefetcher.release(slot)  # the forward stops here (an exception in layer 1, say)
    prefetcher.start_forward()
    slot = prefetcher.begin(0)
    prefetcher.wait(0, slot)
    assert torch.equal(buffers[slot], expected(0))
    prefetcher.release(slot)


def test_release_without_reader_is_an_error(pair):
    prefetcher, _, _ = pair
    with pytest.raises(RuntimeError, match="slot 1"):
        prefetcher.release(1)
