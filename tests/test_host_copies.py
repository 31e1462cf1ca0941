"""How the host backend moves a plan: inside `submit` (small plans), by copier threads in batches,
or by a waiter that copies the batches no copier has started. Bytes are compared bit-exactly with
the plain-PyTorch reference; one process holds a 3-rank group of transports."""
import sys
import threading
import time

import pytest
import torch

from dwdp.runtime.placement import build_placement
from dwdp.runtime.plan import CopyPlan, CopySlice, SegmentLayout, arrival_order, build_copy_plan, cut_batches, slot_layout
from dwdp.runtime.transport import HostTransport, connect_in_process
from dwdp.runtime.transport.host import _HostTicket
from dwdp.runtime.transport.reference import execute_plan_reference

TENSOR_NBYTES = (3000, 1700)
NUM_EXPERTS, GROUP_SIZE, NUM_LAYERS = 9, 3, 2


def _group(tmp_path, **kwargs):
    """Transports of a 3-rank group in this process, segments filled with seeded random bytes."""
    placement = build_placement(NUM_EXPERTS, GROUP_SIZE)
    layout = SegmentLayout(NUM_LAYERS, placement.num_local_experts, TENSOR_NBYTES)
    transports, segments = [], []
    for rank in range(GROUP_SIZE):
        t = HostTransport(rank, shm_dir=str(tmp_path), **kwargs)
        segment = t.alloc_segment(layout.total_nbytes)
        gen = torch.Generator().manual_seed(50 + rank)
        segment.copy_(torch.randint(0, 256, segment.shape, dtype=torch.uint8, generator=gen))
        transports.append(t)
        segments.append(segment)
    connect_in_process(transports)
    return placement, layout, transports, segments


def _check_layer(placement, layout, transports, segments, layer, slice_bytes):
    plan = build_copy_plan(placement, 0, layer, 0, layout, slice_bytes)
    nbytes = slot_layout(placement, 0, TENSOR_NBYTES).total_nbytes
    poison = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(layer))
    got = poison.clone()
    ticket = transports[0].submit(plan, got)
    return plan, ticket, got, execute_plan_reference(plan, segments, poison.clone())


@pytest.mark.parametrize("copy_batches, slice_bytes", [(1, 1000), (3, 700), (8, 1 << 20)])
def test_copier_batches_land_bit_exact(tmp_path, copy_batches, slice_bytes):
    placement, layout, transports, segments = _group(tmp_path, copy_batches=copy_batches, min_batch_bytes=1)
    try:
        for layer in range(NUM_LAYERS):
            plan, ticket, got, want = _check_layer(placement, layout, transports, segments, layer, slice_bytes)
            # _claimed keeps one flag per batch; _batches is dropped once every byte has landed (a fast copier).
            assert isinstance(ticket, _HostTicket) and len(ticket._claimed) == len(cut_batches(plan, copy_batches))
            ticket.wait(30.0)
            assert torch.equal(got, want), f"layer {layer}: {int((got != want).sum())} bytes differ"
            missing = placement.missing_experts(0)
            assert ticket.landed_prefix(missing) == len(missing), ticket.landed_prefix(missing)
    finally:
        for t in transports:
            t.close()


@pytest.fixture
def stalled_copiers(monkeypatch):
    """Copier threads stall before claiming any batch (a loaded machine) until the event is set."""
    stall = threading.Event()
    claim = _HostTicket._claim

    def stalled_claim(self, index):
        if threading.current_thread().name.startswith("dwdp-copier"):
            stall.wait(30.0)
        return claim(self, index)

    monkeypatch.setattr(_HostTicket, "_claim", stalled_claim)
    yield stall
    stall.set()


def test_a_plan_under_min_batch_bytes_is_copied_inside_submit(tmp_path, stalled_copiers):
    placement, layout, transports, segments = _group(tmp_path)  # default min_batch_bytes: 1 MiB
    try:
        plan, ticket, got, want = _check_layer(placement, layout, transports, segments, 1, 1000)
        assert plan.nbytes < transports[0].min_batch_bytes
        assert ticket.done() and torch.equal(got, want), "a small plan had not landed when submit returned"
    finally:
        stalled_copiers.set()
        for t in transports:
            t.close()


def test_a_waiter_copies_the_batches_no_copier_has_started(tmp_path, stalled_copiers):
    placement, layout, transports, segments = _group(tmp_path, copy_batches=4, min_batch_bytes=1)
    try:
        plan, ticket, got, want = _check_layer(placement, layout, transports, segments, 0, 700)
        assert not ticket.done(), "nothing should land while the copiers stall"
        first = cut_batches(plan, 4)[0].completes
        ticket.wait_experts(first, 10.0)  # copies the first batch only, on this thread
        assert ticket.landed_prefix(first) == len(first) and not ticket.done()
        rest = [e for e in arrival_order(plan) if e not in first]
        # A prefix: counting stops at the first expert still missing, whatever has landed after it.
        assert ticket.landed_prefix(list(first) + rest) == len(first), ticket.landed_prefix(list(first) + rest)
        assert ticket.landed_prefix(rest[:1] + list(first)) == 0, ticket.landed_prefix(rest[:1] + list(first))
        ticket.wait(10.0)
        assert torch.equal(got, want), f"{int((got != want).sum())} bytes differ"
        assert ticket._unclaimed == 0
    finally:
        stalled_copiers.set()
        for t in transports:
            t.close()


def test_a_failed_copier_batch_reaches_the_waiter(tmp_path):
    placement, layout, transports, segments = _group(tmp_path, min_batch_bytes=1)
    try:
        end = segments[1].numel()
        bad = CopyPlan(0, 1, 0, (CopySlice(1, end - 10, 0, 1000, expert=4),))  # reads past peer 1's segment
        ticket = transports[0].submit(bad, torch.empty(1000, dtype=torch.uint8))
        with pytest.raises(RuntimeError, match="layer 1 into slot 0 failed"):
            ticket.wait(10.0)
    finally:
        for t in transports:
            t.close()


def test_copiers_leave_the_interpreter_lock_to_compute_while_they_copy(tmp_path, monkeypatch):
    """This thread holds the interpreter lock without a break (no switch interval can take it: it is set to
    100 s) and watches a copier's batch land slice after slice meanwhile: the copier copies without the
    lock. A copier that held it for the whole copy would let this thread run only after the batch was
    written; one that took it back between slices could not go on while this thread holds it. Neither
    depends on the machine's load. How much compute keeps of its speed is bench/copier_gil.py's figure."""
    expert_bytes = 8 << 20
    placement = build_placement(16, 2)
    tensor_nbytes = (expert_bytes * 2 // 3 // 16 * 16, expert_bytes // 3 // 16 * 16)
    layout = SegmentLayout(1, placement.num_local_experts, tensor_nbytes)
    # One copier, and one batch for the whole 64 MiB plan: the copy this thread watches lasts as long as it can.
    transports = [HostTransport(rank, inflight=1, shm_dir=str(tmp_path), copy_batches=1, min_batch_bytes=1)
                  for rank in range(2)]
    real_copy = torch._foreach_copy_
    started, watched = threading.Event(), []

    def copy_announced(dsts, srcs):
        watched[:] = [d.numpy() for d in dsts]  # numpy views: reading one never lets the lock go
        started.set()
        return real_copy(dsts, srcs)

    def landed() -> int:
        return sum(1 for d in watched if d[-1] != 0)  # slices of the batch whose last byte is written

    try:
        for rank, t in enumerate(transports):
            t.alloc_segment(layout.total_nbytes).fill_(rank + 1)
        handles = [t.register() for t in transports]
        for t in transports:
            t.open(handles)
        plan = build_copy_plan(placement, 0, 0, 0, layout, 1 << 20)
        slot = transports[0].alloc_slot(slot_layout(placement, 0, tensor_nbytes).total_nbytes)
        assert plan.nbytes > 60 << 20 and len(plan.slices) >= 64, (plan.nbytes, len(plan.slices))
        transports[0].submit(plan, slot).wait(60.0)  # first touch of every page, copier start-up
        monkeypatch.setattr(torch, "_foreach_copy_", copy_announced)
        watches = []
        for _ in range(30):  # a busy machine may keep this thread off the cores for a whole copy: try again
            slot.zero_()
            started.clear()
            ticket = transports[0].submit(plan, slot)
            while not started.is_set():  # runnable, not asleep: it takes the lock the moment the copier lets it go
                time.sleep(0)
            switch = sys.getswitchinterval()
            sys.setswitchinterval(100.0)
            try:  # from here until the lock is let go, nothing but this loop runs Python
                first = now = landed()
                for _ in range(200_000):
                    now = landed()
                    if now > first or now == len(watched):
                        break
            finally:
                sys.setswitchinterval(switch)
            ticket.wait(60.0)
            watches.append((first, now, len(watched)))
            assert landed() == len(watched), "the batch did not land"
            if now > first:
                break
        assert any(now > first for first, now, _ in watches), (
            f"(slices landed when this thread woke, when it stopped watching, in the batch): {watches}: no slice "
            "landed while this thread held the interpreter lock; the copier needs it to copy")
    finally:
        for t in transports:
            t.close()
