"""Host work per submit on the cuda backend, through the recording fake of cuda_api.

A plan's copy arguments are built on its first submit into a slot buffer and reused: later submits
issue exactly what the first one issued (same copies, same batch events, same consume-event wait),
and the function calls they make and the Python memory they allocate do not grow with the number of
slices (counted, not timed: bench/submit_cost.py times them).
The real bindings still convert each batch's arguments on every call (bench/submit_cost.py
measures that part); these tests hold our side of the submit to a flat cost.
"""
import gc
import sys
import tracemalloc

import pytest
import torch

from dwdp.runtime.plan import PlanCache, build_copy_plan, cut_batches
from dwdp.runtime.prefetch import Prefetcher
from dwdp.runtime.transport import cuda_api
from fake_cuda import FakeGroup as Group

SMALL_SLICE, LARGE_SLICE_COUNT_SLICE = 600, 70  # 64 and 544 slices for rank 0 of 16 experts over 2 ranks


class KeepingApi:
    """The fake for setup; on the hot path, calls that only keep what they are handed (no per-copy
    work of their own), so what a submit costs is the transport's own work."""

    def __init__(self, fake):
        self.fake = fake
        self.kept = []
        self.prepared = 0

    def __getattr__(self, name):
        return getattr(self.fake, name)

    def prepare_batch(self, dsts, srcs, sizes, prefer_overlap=True):
        self.prepared += 1
        return cuda_api.prepare_batch(dsts, srcs, sizes, prefer_overlap)

    def memcpy_prepared_batch(self, batch, stream):
        self.kept.append(batch)

    def event_record(self, event, stream):
        pass

    def stream_wait_event(self, stream, event):
        pass


def _keeping_group(copy_batches=4, num_layers=1):
    group = Group(16, 2, num_layers=num_layers, copy_batches=copy_batches).open()
    transport = group.transports[0]
    transport.api = KeepingApi(transport.api)
    return group, transport


def _allocated_per_call(fn, calls: int = 5) -> int:
    """Fewest bytes of Python memory one call of `fn` allocates (peak, transient or kept)."""
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        grown = []
        for _ in range(calls):
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            fn()
            grown.append(tracemalloc.get_traced_memory()[1] - before)
    finally:
        tracemalloc.stop()
        gc.enable()
    return min(grown)


def _calls_per_call(fn, calls: int = 3) -> int:
    """Fewest function calls (Python and C, as sys.setprofile sees them) one call of `fn` makes: the
    host work it does, counted rather than timed, so a loaded machine cannot change it. A loop over
    slices in Python shows up here; one hidden inside a C call shows up in its allocations instead."""
    counts = []
    for _ in range(calls):
        made = [0]

        def count(frame, event, arg):
            if event in ("call", "c_call"):
                made[0] += 1

        sys.setprofile(count)
        try:
            fn()
        finally:
            sys.setprofile(None)
        counts.append(made[0])
    return min(counts)


def test_submit_cost_does_not_grow_with_the_slice_count():
    group, transport = _keeping_group()
    slot = torch.empty(group.slot_nbytes(0), dtype=torch.uint8)
    plans = {b: build_copy_plan(group.placement, 0, 0, 0, group.layout, b) for b in (SMALL_SLICE, LARGE_SLICE_COUNT_SLICE)}
    small, large = plans[SMALL_SLICE], plans[LARGE_SLICE_COUNT_SLICE]
    assert len(large.slices) >= 8 * len(small.slices), (len(small.slices), len(large.slices))
    assert len(cut_batches(small, 4)) == len(cut_batches(large, 4)), "the two plans must issue as many batches"
    submits, allocated = {}, {}
    for name, plan in (("small", small), ("large", large)):
        transport.submit(plan, slot)  # the first submit builds the plan's copy arguments
        prepared = transport.api.prepared
        submits[name] = lambda plan=plan: transport.submit(plan, slot)  # noqa: E731
        allocated[name] = _allocated_per_call(submits[name])
        assert transport.api.prepared == prepared, f"{name}: later submits prepared copy arguments again"
    made = {name: _calls_per_call(fn) for name, fn in submits.items()}
    (small_bytes, small_calls), (large_bytes, large_calls) = ((allocated[n], made[n]) for n in ("small", "large"))
    assert large_bytes <= 1.5 * small_bytes, (
        f"a submit of {len(large.slices)} slices allocates {large_bytes} B of Python memory, one of "
        f"{len(small.slices)} slices {small_bytes} B: the host builds something per slice on every submit")
    assert large_calls == small_calls, (
        f"a submit of {len(large.slices)} slices makes {large_calls} function calls, one of {len(small.slices)} slices "
        f"{small_calls}: host work per submit grows with the slice count")
    group.close()


def test_layer_visit_cost_does_not_grow_with_the_slice_count():
    """The prefetcher's per-layer host work (begin: issue the next layer; wait; release) is as flat
    as the transport's: its statistics count bytes per source peer, not per slice."""
    visits, allocated, counts, groups = {}, {}, {}, []
    for slice_bytes in (SMALL_SLICE, LARGE_SLICE_COUNT_SLICE):
        group, transport = _keeping_group(num_layers=4)
        groups.append(group)
        nbytes = group.slot_nbytes(0)
        buffers = [transport.alloc_slot(nbytes) for _ in range(2)]
        plans = PlanCache(group.placement, 0, group.layout, slice_bytes)
        prefetcher = Prefetcher(transport, plans, buffers, group.layout.num_layers, timeout_s=5.0)
        prefetcher.start_forward()
        state = {"visit": 0}

        def visit(prefetcher=prefetcher, state=state):
            layer = state["visit"] % 4
            state["visit"] += 1
            slot = prefetcher.begin(layer)
            prefetcher.wait(layer, slot)
            prefetcher.release(slot)

        for _ in range(8):
            visit()  # every (layer, slot) plan submitted once: built
        counts[slice_bytes] = len(plans.get(0, 0).slices)
        visits[slice_bytes] = visit
        allocated[slice_bytes] = _allocated_per_call(visit, calls=8)
    made = {s: _calls_per_call(visit) for s, visit in visits.items()}
    for group in groups:
        group.close()
    cost = {s: (allocated[s], made[s]) for s in visits}
    (small_bytes, small_calls), (large_bytes, large_calls) = cost[SMALL_SLICE], cost[LARGE_SLICE_COUNT_SLICE]
    assert counts[LARGE_SLICE_COUNT_SLICE] >= 8 * counts[SMALL_SLICE], counts
    assert large_bytes <= 1.5 * small_bytes, (counts, small_bytes, large_bytes)
    assert large_calls == small_calls, (
        f"a layer visit with {counts[LARGE_SLICE_COUNT_SLICE]} slices per plan makes {large_calls} function calls, "
        f"with {counts[SMALL_SLICE]} slices {small_calls}")


def _issued(calls, rank):
    """A rank's device calls in a comparable form: copies as (dst, src, bytes) tuples per batch."""
    out = []
    for r, name, args in calls:
        if r != rank:
            continue
        if name == "memcpy_prepared_batch":
            batch, stream = args
            out.append(("batch", tuple(zip(batch.dsts, batch.srcs, batch.sizes)), stream))
        elif name in ("event_record", "stream_wait_event", "memcpy_async"):
            out.append((name, *args))
    return out


def _expected(transport, plan, slot, copy_batches):
    """What one submit must issue, worked out from the plan alone: the copy stream waits on the
    slot's consume event, then each batch of copies (a slice, or a run of one peer's slices that
    continue each other in both memories) is followed by its own event."""
    stream, consume, events = transport._stream, transport._consume[plan.slot], transport._slot_events[plan.slot]
    calls = [("stream_wait_event", stream, consume)]
    for b, batch in enumerate(cut_batches(plan, copy_batches)):
        copies = []
        for s in plan.slices[batch.start:batch.stop]:
            dst, src = slot.data_ptr() + s.dst_offset, transport._peer_ptrs[s.peer] + s.src_offset
            if copies and copies[-1][0] + copies[-1][2] == dst and copies[-1][1] + copies[-1][2] == src:
                copies[-1] = (copies[-1][0], copies[-1][1], copies[-1][2] + s.nbytes)
            else:
                copies.append((dst, src, s.nbytes))
        calls += [("batch", tuple(copies), stream), ("event_record", events[b], stream)]
    return calls


@pytest.mark.parametrize("num_experts, size", [(9, 3), (7, 2)])
def test_repeated_submits_issue_exactly_what_the_first_one_issued(num_experts, size):
    """Same copies, same batch events, and the write-after-read wait on the slot's latest consume
    record, on every submit; a new plan or another buffer is built afresh."""
    group = Group(num_experts, size, copy_batches=3).open()
    rank, transport, device = 1, group.transports[1], group.device
    plans = [build_copy_plan(group.placement, rank, 0, s, group.layout, 700) for s in (0, 1)]
    slots = [torch.empty(group.slot_nbytes(rank), dtype=torch.uint8) for _ in range(2)]

    def submit(plan, slot):
        start = len(device.calls)
        transport.submit(plan, slot)
        calls = device.calls[start:]
        return _issued(calls, rank), sum(1 for r, n, _ in calls if r == rank and n == "prepare_batch")

    for s in (0, 1):
        transport.release_slot(s)  # the slots' consume events exist, as after a first reader
    first, prepared = submit(plans[0], slots[0])
    assert first == _expected(transport, plans[0], slots[0], 3) and prepared == len(cut_batches(plans[0], 3))
    for _ in range(3):
        transport.release_slot(0)  # a reader released the slot: the next copy must wait for that record
        consume = transport._consume[0]
        again, prepared = submit(plans[0], slots[0])
        assert again == first and prepared == 0, (again, first, prepared)
        copy_queue = device.streams[transport._stream]
        wait = next(op for op in reversed(copy_queue) if op.kind == "wait")
        assert wait.args == (consume, device.events[consume].recorded), "the copy waits on a stale consume record"
        other, _ = submit(plans[1], slots[1])
        assert other == _expected(transport, plans[1], slots[1], 3)
    # The same plan into another buffer: new destinations.
    moved, prepared = submit(plans[0], slots[1])
    assert moved == _expected(transport, plans[0], slots[1], 3) and prepared > 0
    # Sources re-planned: a new plan object for the same layer and slot issues its own copies.
    replanned = build_copy_plan(group.placement, rank, 0, 0, group.layout, 300)
    fresh, prepared = submit(replanned, slots[0])
    assert fresh == _expected(transport, replanned, slots[0], 3) and prepared == len(cut_batches(replanned, 3))
    device.run()
    group.close()
