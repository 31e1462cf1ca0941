"""The cuda backend's control logic on a CPU, through a recording fake of cuda_api.

What these catch: copies to the wrong place or from the wrong peer, batches not cut where experts
complete, a copy into a slot that does not wait for the slot's readers (write after read), compute
that does not wait for its copies (read after write), a host wait on the hot path, errors that do
not name their peer, a timeout that blocks without a deadline, and handles leaked or closed twice.
"""
import time

import pytest
import torch

from dwdp.runtime.placement import build_placement
from dwdp.runtime.plan import PlanCache, SegmentLayout, build_copy_plan, coalesce, cut_batches
from dwdp.runtime.prefetch import Prefetcher
from dwdp.runtime.transport import PrefetchError, PrefetchTimeout
from deadlines import assert_fired_after
from fake_cuda import TENSOR_NBYTES, FakeGroup as Group, batch_error
HOT_PATH_FORBIDDEN = {"event_wait", "event_query", "device_synchronize"}


def _poison(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("copy, has_batch, copy_batches", [("batch", True, 3), ("batch", True, 1),
                                                           ("memcpy", True, 4), ("batch", False, 2)])
@pytest.mark.parametrize("num_experts, size, slice_bytes", [(8, 3, 1000), (7, 2, 512), (9, 4, 4096)])
def test_copies_land_bit_exact_inside_their_slot(copy, has_batch, copy_batches, num_experts, size, slice_bytes):
    group = Group(num_experts, size, copy=copy, copy_batches=copy_batches, has_batch=has_batch).open()
    assert any(h["offset"] for h in group.handles), "every fake export at offset 0: the offset path is untested"
    expert_bytes = sum(TENSOR_NBYTES)
    for rank, transport in enumerate(group.transports):
        nbytes = group.slot_nbytes(rank)
        missing = [e for e in range(num_experts) if e not in group.placement.owned[rank]]
        assert nbytes == len(missing) * expert_bytes, (nbytes, missing)
        for layer in range(group.layout.num_layers):
            slot_index = layer % 2
            plan = build_copy_plan(group.placement, rank, layer, slot_index, group.layout, slice_bytes)
            poison = _poison(nbytes, 1000 * rank + layer)
            slot = poison.clone()
            start = len(group.device.calls)
            ticket = transport.submit(plan, slot)
            group.device.run()
            assert ticket.done()
            assert torch.equal(slot, group.expected(plan, nbytes, poison)), f"rank {rank} layer {layer}"
            copies = _issued_copies(group.device.calls[start:], rank)
            assert sum(n for _, _, n in copies) == nbytes, f"plan bytes {sum(n for _, _, n in copies)} != {nbytes}"
            lo, hi = slot.data_ptr(), slot.data_ptr() + nbytes
            own = group.transports[rank]._segment
            own_lo, own_hi = own.data_ptr(), own.data_ptr() + own.numel()
            spans = sorted((d, d + n) for d, _, n in copies)
            for (d0, d1), (e0, _) in zip(spans, spans[1:]):
                assert d1 <= e0, f"overlapping destinations {d0:#x}+{d1 - d0} and {e0:#x}"
            for d, s, n in copies:
                assert lo <= d and d + n <= hi, f"copy to {d:#x}+{n} outside the slot [{lo:#x}, {hi:#x})"
                assert not own_lo <= s < own_hi, f"rank {rank} copies from its own segment at {s:#x}"
            calls = [c[1] for c in group.device.calls[start:] if c[0] == rank]
            want = "memcpy_prepared_batch" if copy == "batch" and has_batch else "memcpy_async"
            assert want in calls and ({"memcpy_prepared_batch", "memcpy_async"} - {want}).isdisjoint(calls), calls
    group.close()


def _issued_copies(calls, rank):
    copies = []
    for r, name, args in calls:
        if r != rank:
            continue
        if name == "memcpy_prepared_batch":
            batch = args[0]
            copies += list(zip(batch.dsts, batch.srcs, batch.sizes))
        elif name == "memcpy_async":
            copies.append(args[:3])
    return copies


@pytest.mark.parametrize("max_batches", [1, 2, 3, 5, 64])
@pytest.mark.parametrize("num_experts, size, rank, slice_bytes", [(8, 3, 0, 700), (16, 4, 2, 1000), (5, 2, 1, 64)])
def test_batches_end_where_experts_complete(max_batches, num_experts, size, rank, slice_bytes):
    placement = build_placement(num_experts, size)
    plan = build_copy_plan(placement, rank, 1, 0, SegmentLayout(2, placement.num_local_experts, TENSOR_NBYTES),
                           slice_bytes)
    batches = cut_batches(plan, max_batches)
    assert 1 <= len(batches) <= max_batches
    assert batches[0].start == 0 and batches[-1].stop == len(plan.slices)
    assert all(a.stop == b.start for a, b in zip(batches, batches[1:])), "batches must tile the plan in order"
    last_slice = {}
    for i, s in enumerate(plan.slices):
        last_slice[s.expert] = i
    for b in batches:
        ending = {e for e, i in last_slice.items() if i == b.stop - 1}
        assert ending, f"batch {b} ends at slice {b.stop - 1}, where no expert completes"
        assert set(b.completes) == {e for e, i in last_slice.items() if b.start <= i < b.stop}
        assert set(b.peers) == {s.peer for s in plan.slices[b.start:b.stop]}


def test_transport_issues_one_batch_call_and_one_event_per_batch():
    group = Group(16, 4, copy_batches=3).open()
    plan = build_copy_plan(group.placement, 1, 0, 0, group.layout, 800)
    slot = torch.empty(group.slot_nbytes(1), dtype=torch.uint8)
    start = len(group.device.calls)
    group.transports[1].submit(plan, slot)
    calls = [(n, a) for r, n, a in group.device.calls[start:] if r == 1]
    batches = cut_batches(plan, 3)
    issued = [a[0] for n, a in calls if n == "memcpy_prepared_batch"]
    assert [b.count for b in issued] == [len(coalesce(plan.slices[b.start:b.stop])) for b in batches]
    # Each batch is followed by its event record on the copy stream, before the next batch.
    copy_stream = group.transports[1]._stream
    order = [n for n, a in calls if n in ("memcpy_prepared_batch", "event_record", "stream_wait_event")
             and copy_stream in a]
    assert order[0] == "stream_wait_event", order
    assert order[1:] == ["memcpy_prepared_batch", "event_record"] * len(batches), order
    group.close()


def _prefetcher(group, rank, num_buffers=2, timeout_s=5.0, slice_bytes=900):
    nbytes = group.slot_nbytes(rank)
    transport = group.transports[rank]
    buffers = [transport.alloc_slot(nbytes) for _ in range(num_buffers)]
    for i, b in enumerate(buffers):
        b.copy_(_poison(nbytes, 5000 + i))
    plans = PlanCache(group.placement, rank, group.layout, slice_bytes)
    return Prefetcher(transport, plans, buffers, group.layout.num_layers, timeout_s), buffers, plans


def _layer_loop(group, rank, prefetcher, buffers, plans, visits, policy, hook_on=True):
    """MoE layers as the experts function runs them, each 'kernel' checksumming its slot when it
    runs on the fake device. Returns (bad reads, hot-path calls)."""
    api = group.apis[rank]
    nbytes = group.slot_nbytes(rank)
    zero = torch.zeros(nbytes, dtype=torch.uint8)
    want = {layer: group.expected(plans.get(layer, 0), nbytes, zero) for layer in range(group.layout.num_layers)}
    bad, hot = [], []
    prefetcher.start_forward()
    for visit in range(visits):
        layer = visit % group.layout.num_layers
        start = len(group.device.calls)
        slot = prefetcher.begin(layer)
        prefetcher.wait(layer, slot)

        def kernel(slot=slot, layer=layer, visit=visit):
            if not torch.equal(buffers[slot], want[layer]):
                bad.append((visit, layer, slot, int((buffers[slot] != want[layer]).sum())))

        api.launch(kernel)
        if hook_on:
            prefetcher.release(slot)
        else:  # a prefetcher that never tells the transport its reads were issued
            prefetcher.slots[slot].readers -= 1
        hot += [n for r, n, _ in group.device.calls[start:] if r == rank]
        group.device.run(policy)
    group.device.run("copies_first" if policy == "copies_only" else policy)
    return bad, hot


@pytest.mark.parametrize("num_buffers", [2, 3])
def test_copy_into_a_slot_waits_for_its_readers(num_buffers):
    """Copies run as early as their waits allow while compute is held back until the end: without
    the consume event, a later layer's copy overwrites a slot before its kernel reads it."""
    group = Group(8, 3, num_layers=4, poll_runs=False).open()
    prefetcher, buffers, plans = _prefetcher(group, 0, num_buffers)
    bad, _ = _layer_loop(group, 0, prefetcher, buffers, plans, visits=10, policy="copies_only")
    assert bad == [], f"kernels read overwritten slots: {bad}"
    group.close()


def test_without_the_release_hook_the_schedule_overwrites_a_slot_under_its_reader():
    """The same schedule with the consume event never recorded: the fake must expose the hazard,
    or the test above proves nothing."""
    group = Group(8, 3, num_layers=4, poll_runs=False).open()
    prefetcher, buffers, plans = _prefetcher(group, 0, 2)
    bad, _ = _layer_loop(group, 0, prefetcher, buffers, plans, visits=10, policy="copies_only", hook_on=False)
    assert bad, "an unordered copy went unnoticed"
    group.close()


def test_compute_waits_for_its_copies_without_a_host_wait():
    """Compute runs as early as its waits allow: every kernel must still see its layer's bytes, and
    the host never blocks (no event query, poll or device sync between begin and release)."""
    group = Group(8, 3, num_layers=3, poll_runs=False).open()
    prefetcher, buffers, plans = _prefetcher(group, 1, 2)
    bad, hot = _layer_loop(group, 1, prefetcher, buffers, plans, visits=9, policy="compute_first")
    assert bad == [], f"kernels ran before their copies landed: {bad}"
    assert HOT_PATH_FORBIDDEN.isdisjoint(hot), f"host waits on the hot path: {sorted(HOT_PATH_FORBIDDEN & set(hot))}"
    group.close()


def test_ticket_wait_is_one_stream_wait_on_the_compute_stream():
    group = Group(8, 3, poll_runs=False).open()
    plan = build_copy_plan(group.placement, 2, 0, 0, group.layout, 600)
    slot = torch.empty(group.slot_nbytes(2), dtype=torch.uint8)
    ticket = group.transports[2].submit(plan, slot)
    start = len(group.device.calls)
    assert ticket.wait(5.0) == 0.0
    calls = [(n, a) for r, n, a in group.device.calls[start:] if r == 2]
    last_event = group.transports[2]._slot_events[0][len(cut_batches(plan, 3)) - 1]
    assert calls == [("stream_wait_event", (group.apis[2].compute, last_event))], calls
    # Per-expert waits pick the batch that completes the expert, not the last one.
    first = cut_batches(plan, 3)[0]
    start = len(group.device.calls)
    ticket.wait_experts(first.completes[:1], 5.0)
    calls = [(n, a) for r, n, a in group.device.calls[start:] if r == 2]
    assert calls == [("stream_wait_event", (group.apis[2].compute, group.transports[2]._slot_events[0][0]))], calls
    group.close()


@pytest.mark.parametrize("fail_index", [None, 2])
def test_enqueue_error_fails_the_ticket_naming_layer_slot_and_peer(fail_index):
    group = Group(8, 3, copy_batches=1).open()
    plan = build_copy_plan(group.placement, 0, 2, 1, group.layout, 1000)
    group.device.fail_next("memcpy_prepared_batch", batch_error(fail_index, len(plan.slices)))
    slot = torch.empty(group.slot_nbytes(0), dtype=torch.uint8)  # alive until the device is done with it
    ticket = group.transports[0].submit(plan, slot)
    peer = coalesce(plan.slices)[fail_index][0] if fail_index is not None else None  # one batch: its copies
    for call in (lambda: ticket.wait(1.0), ticket.done, lambda: ticket.synchronize(1.0)):
        with pytest.raises(PrefetchError) as info:
            call()
        message = str(info.value)
        assert "rank 0" in message and "layer 2" in message and "slot 1" in message, message
        assert "cudaErrorInvalidValue" in message, message
        if peer is not None:
            assert f"copy {fail_index} from peer {peer}" in message, message
        else:
            assert f"peers {list(plan.peers)}" in message, message
    group.close()


def test_failed_copy_index_names_the_peer_of_the_issued_copy_after_coalescing():
    """Three contiguous slices of peer 1 go out as one copy, so the batch's copy 1 is peer 2's slice
    (slice 1 is still peer 1's): the error must name peer 2."""
    from dwdp.runtime.plan import CopyPlan, CopySlice

    group = Group(8, 3, copy_batches=1).open()
    plan = CopyPlan(0, 0, 0, (CopySlice(1, 0, 0, 100, 3), CopySlice(1, 100, 100, 100, 3),
                              CopySlice(1, 200, 200, 50, 3), CopySlice(2, 0, 250, 100, 6)))
    group.device.fail_next("memcpy_prepared_batch", batch_error(1, 2))
    slot = torch.empty(400, dtype=torch.uint8)
    ticket = group.transports[0].submit(plan, slot)
    issued = [a[0] for r, n, a in group.device.calls if r == 0 and n == "memcpy_prepared_batch"]
    assert [b.sizes for b in issued] == [(250, 100)], issued
    with pytest.raises(PrefetchError, match="copy 1 from peer 2"):
        ticket.wait(1.0)
    group.close()


def test_sticky_error_during_a_copy_surfaces_with_the_peers():
    group = Group(8, 3, poll_runs=True).open()
    bad_peer = 2
    seg = group.transports[bad_peer]._segment
    group.device.faulty_ranges.append((seg.data_ptr(), seg.data_ptr() + seg.numel()))
    plan = build_copy_plan(group.placement, 0, 0, 0, group.layout, 1000)
    assert bad_peer in plan.peers
    slot = torch.empty(group.slot_nbytes(0), dtype=torch.uint8)  # alive until the device is done with it
    ticket = group.transports[0].submit(plan, slot)
    with pytest.raises(PrefetchError, match=r"rank 0: prefetch of layer 0 into slot 0 from peers \[1, 2\].*"
                                            r"cudaErrorIllegalAddress"):
        ticket.done()
    with pytest.raises(PrefetchError, match="cudaErrorIllegalAddress"):
        ticket.wait(1.0)
    group.device.sticky = None
    group.close()


def test_timeout_polls_with_a_deadline_and_names_outstanding_peers(monkeypatch):
    from cuda.bindings import runtime

    def forbidden(*_):
        raise AssertionError("cudaEventSynchronize has no timeout and must never be called")

    monkeypatch.setattr(runtime, "cudaEventSynchronize", forbidden)
    group = Group(8, 3, copy_batches=2).open()
    prefetcher, _, _ = _prefetcher(group, 0, 2, timeout_s=0.3)
    group.device.stalled.add(group.transports[0]._stream)
    prefetcher.start_forward()
    start = time.perf_counter()
    with pytest.raises(PrefetchTimeout) as info:
        prefetcher.slots[0].ticket.synchronize(0.3)
    elapsed = time.perf_counter() - start
    assert_fired_after(elapsed, 0.3, "the wait on a stalled copy stream")
    message = str(info.value)
    assert "layer 0 into slot 0" in message and "outstanding: [1, 2]" in message, message
    assert "event_wait" in group.device.names(0)
    group.device.stalled.clear()
    group.close()


def test_open_maps_peers_and_never_its_own_handle_and_close_unmaps_each_once():
    group = Group(9, 4).open()
    for rank, transport in enumerate(group.transports):
        opened = [a[0] for r, n, a in group.device.calls if r == rank and n == "ipc_open"]
        own = group.handles[rank]["ipc"]
        assert own not in opened and len(opened) == 3, f"rank {rank} opened {len(opened)} handles"
        assert transport._peer_ptrs[rank] == transport._segment.data_ptr()
        for r, h in enumerate(group.handles):
            if r != rank:
                assert transport._peer_ptrs[r] == group.transports[r]._segment.data_ptr()
    group.close()
    group.close()  # idempotent
    assert all(n == 0 for n in group.device.opened.values()), group.device.opened
    closes = [(r, a[0]) for r, n, a in group.device.calls if n == "ipc_close"]
    assert len(closes) == len(set(closes)) == 4 * 3, closes


def test_half_failed_open_names_the_peer_and_closes_what_it_opened():
    group = Group(9, 4)
    from dwdp.runtime.transport.cuda_api import CudaError

    original = group.apis[0].ipc_open
    count = {"n": 0}

    def flaky(raw):
        count["n"] += 1
        if count["n"] == 2:
            group.device.calls.append((0, "ipc_open", (raw,)))
            raise CudaError("cudaIpcOpenMemHandle", 2, "cudaErrorMemoryAllocation", "out of memory")
        return original(raw)

    group.apis[0].ipc_open = flaky
    with pytest.raises(PrefetchError, match=r"rank 0: cannot map the segment of peer 2 .*cudaErrorMemoryAllocation"):
        group.transports[0].open(group.handles)
    opened_by_0 = [b for b, n in group.device.opened.items() if n]
    assert opened_by_0 == [], f"handles left open after a failed open: {opened_by_0}"
    group.transports[0].close()
    attempts = [a[0] for r, n, a in group.device.calls if r == 0 and n == "ipc_close"]
    assert len(attempts) == 1 and [r for r, _ in group.device.closed].count(0) == 1, (attempts, group.device.closed)
    group.close()


def test_release_records_the_consume_event_on_the_compute_stream():
    group = Group(8, 3).open()
    t = group.transports[0]
    start = len(group.device.calls)
    t.release_slot(1)
    calls = [(n, a) for r, n, a in group.device.calls[start:] if r == 0]
    assert calls[-1] == ("event_record", (t._consume[1], group.apis[0].compute)), calls
    group.close()


def test_symmetric_memory_mapping_reads_peers_through_their_buffer_pointers(monkeypatch):
    """Multi-node mode: segments come from torch's symmetric memory and peers are read through the
    rendezvous handle's buffer pointers (no IPC handle is exported or opened)."""
    import types

    from dwdp.runtime.transport import cuda_symmetric
    from dwdp.runtime.transport.cuda import CudaTransport
    from fake_cuda import FakeCudaApi, FakeDevice

    device, size, nbytes = FakeDevice(), 3, 6000
    segments = {}

    def rendezvous(tensor, group):
        assert group == "pg", group
        return types.SimpleNamespace(buffer_ptrs=[segments[r].data_ptr() for r in range(size)])

    symm = types.SimpleNamespace(empty=lambda n, dtype, device: torch.empty(n, dtype=dtype), rendezvous=rendezvous)
    monkeypatch.setattr(cuda_symmetric, "_symmetric_memory_module", lambda: symm)
    transports = [CudaTransport(r, "cpu", mapping="symmetric_memory", process_group="pg",
                                api=FakeCudaApi(device, r)) for r in range(size)]
    for r, t in enumerate(transports):
        segments[r] = t.alloc_segment(nbytes)
        segments[r].copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                                        generator=torch.Generator().manual_seed(r)))
    handles = [t.register() for t in transports]
    assert all("ipc" not in h for h in handles)
    for t in transports:
        t.open(handles)
    from dwdp.runtime.plan import CopyPlan, CopySlice

    plan = CopyPlan(0, 0, 0, (CopySlice(1, 100, 0, 700, 5), CopySlice(2, 4000, 700, 900, 6)))
    slot = torch.zeros(1600, dtype=torch.uint8)
    transports[0].submit(plan, slot).synchronize(5.0)
    assert torch.equal(slot[:700], segments[1][100:800]) and torch.equal(slot[700:], segments[2][4000:4900])
    assert "ipc_open" not in device.names()
    for t in transports:
        t.close()


def test_symmetric_memory_without_torch_support_is_a_clear_error(monkeypatch):
    import sys

    from dwdp.runtime.transport.cuda_symmetric import _symmetric_memory_module

    monkeypatch.setitem(sys.modules, "torch.distributed._symmetric_memory", None)  # import -> ImportError
    monkeypatch.delattr(torch.distributed, "_symmetric_memory", raising=False)  # an earlier import's attribute
    with pytest.raises(RuntimeError, match="cuda_mapping='symmetric_memory' .* needs torch.distributed._symmetric_memory"):
        _symmetric_memory_module()


def test_process_mapping_reads_peers_through_their_own_pointers():
    """Every rank in one process (dwdp tune): no IPC handle is exported or opened, each peer's segment
    is read at its own address, bit-exact; a handle from another process is refused by name."""
    import os

    from dwdp.runtime.transport.cuda import CudaTransport
    from fake_cuda import FakeCudaApi, FakeDevice

    device, size, nbytes = FakeDevice(), 3, 6000
    transports = [CudaTransport(r, "cpu", mapping="process", api=FakeCudaApi(device, r)) for r in range(size)]
    for r, t in enumerate(transports):
        t.alloc_segment(nbytes).copy_(_poison(nbytes, 40 + r))
    handles = [t.register() for t in transports]
    transports[0].open(handles)
    assert transports[0]._peer_ptrs == [t._segment.data_ptr() for t in transports]
    from dwdp.runtime.plan import CopyPlan, CopySlice

    plan = CopyPlan(0, 0, 0, (CopySlice(1, 100, 0, 700, 5), CopySlice(2, 4000, 700, 900, 6)))
    slot = torch.zeros(1600, dtype=torch.uint8)
    transports[0].submit(plan, slot).synchronize(5.0)
    assert torch.equal(slot[:700], transports[1]._segment[100:800])
    assert torch.equal(slot[700:], transports[2]._segment[4000:4900])
    assert not {"ipc_export", "ipc_open"} & set(device.names()), device.names()
    stranger = dict(handles[2], pid=os.getpid() + 1)
    with pytest.raises(ValueError, match=r"rank 1: peer 2's segment belongs to process \d+, not this one"):
        transports[1].open([handles[0], handles[1], stranger])
    for t in transports:
        t.close()
