import multiprocessing as mp
import os

import pytest
import torch

from dwdp.runtime.group import init_group, launch_local
from dwdp.runtime.placement import build_placement
from dwdp.runtime.plan import CopyPlan, CopySlice, SegmentLayout, build_copy_plan, slot_layout
from dwdp.runtime.transport import HostTransport, PrefetchTimeout, Ticket
from dwdp.runtime.transport.host import SEGMENT_PREFIX, sweep_stale_segments
from dwdp.runtime.transport.reference import execute_plan_reference

TENSOR_NBYTES = (4000, 2000)
NUM_LAYERS = 3


def _segment_bytes(rank: int, nbytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1234 + rank)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)


def _transport_rank(rank: int, num_experts: int, slice_bytes: int, inflight: int) -> dict:
    group = init_group()
    placement = build_placement(num_experts, group.size)
    seg_layout = SegmentLayout(NUM_LAYERS, placement.num_local_experts, TENSOR_NBYTES)
    transport = HostTransport(rank, inflight=inflight)
    segment = transport.alloc_segment(seg_layout.total_nbytes)
    segment.copy_(_segment_bytes(rank, seg_layout.total_nbytes))
    path = transport.register()["path"]
    transport.open(group.all_gather_object(transport.register()))
    group.barrier()
    transport.seal()
    sealed = not os.path.exists(path)
    # Peers' bytes are regenerated from their seeds: an independent reference of what they hold.
    peers = [_segment_bytes(r, seg_layout.total_nbytes) for r in range(group.size)]
    slot_nbytes = slot_layout(placement, rank, TENSOR_NBYTES).total_nbytes
    mismatches = []
    for layer in range(NUM_LAYERS):
        plan = build_copy_plan(placement, rank, layer, layer % 2, seg_layout, slice_bytes)
        poison = torch.randint(0, 256, (slot_nbytes,), dtype=torch.uint8)
        got = poison.clone()
        ticket = transport.submit(plan, got)
        ticket.wait(30.0)
        assert ticket.done() and all(ticket.expert_ready(e) for e in placement.missing_experts(rank))
        want = execute_plan_reference(plan, peers, poison.clone())
        if not torch.equal(got, want):
            mismatches.append((layer, int((got != want).sum())))
    transport.close()
    return {"sealed": sealed, "mismatches": mismatches, "bytes": plan.nbytes}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "num_experts, nprocs, slice_bytes, inflight", [(8, 3, 1500, 2), (6, 2, 1 << 20, 1), (9, 4, 777, 4)]
)
def test_host_copies_match_reference_bit_exact(tmp_path, num_experts, nprocs, slice_bytes, inflight):
    results = launch_local(
        _transport_rank, nprocs, (num_experts, slice_bytes, inflight), timeout_s=100,
        env={"DWDP_SHM_DIR": str(tmp_path)},
    )
    for rank, r in enumerate(results):
        assert r["mismatches"] == [], f"rank {rank}: (layer, differing bytes) {r['mismatches']}"
        assert r["sealed"], f"rank {rank}: segment name still present after seal"
        assert r["bytes"] > 0
    assert list(tmp_path.iterdir()) == [], "shared segments leaked"


def _allocate_and_crash(shm_dir: str) -> None:
    t = HostTransport(0, shm_dir=shm_dir)
    t.alloc_segment(4096)
    os._exit(3)  # dies before sealing, without any cleanup


@pytest.mark.timeout(60)
def test_segment_of_crashed_owner_is_swept(tmp_path):
    proc = mp.get_context("spawn").Process(target=_allocate_and_crash, args=(str(tmp_path),))
    proc.start()
    try:
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
    assert proc.exitcode == 3
    leftovers = list(tmp_path.glob(f"{SEGMENT_PREFIX}*"))
    assert len(leftovers) == 1
    t = HostTransport(0, shm_dir=str(tmp_path))
    t.alloc_segment(16)  # a new owner sweeps segments of dead processes
    remaining = list(tmp_path.glob(f"{SEGMENT_PREFIX}*"))
    assert leftovers[0] not in remaining and len(remaining) == 1
    t.close()
    assert list(tmp_path.iterdir()) == []
    assert sweep_stale_segments(tmp_path) == []


def _single_rank_transport(tmp_path, nbytes=8192):
    t = HostTransport(0, inflight=2, shm_dir=str(tmp_path))
    seg = t.alloc_segment(nbytes)
    seg.copy_(_segment_bytes(0, nbytes))
    t.open([t.register()])
    t.seal()
    return t, seg


def test_copy_error_reaches_the_waiter(tmp_path):
    t, _ = _single_rank_transport(tmp_path)
    bad = CopyPlan(0, 5, 1, (CopySlice(0, 8000, 0, 1000, expert=3),))  # reads past the segment's end
    ticket = t.submit(bad, torch.empty(1000, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="layer 5 into slot 1 failed"):
        ticket.wait(10.0)
    t.close()


def test_timeout_names_layer_slot_and_peers():
    plan = CopyPlan(2, 7, 1, (CopySlice(0, 0, 0, 10, 1), CopySlice(3, 0, 10, 10, 4), CopySlice(3, 10, 20, 10, 4)))
    ticket = Ticket(plan)  # never submitted: nothing will complete it
    ticket._finish_slice(0, 1)
    assert ticket.expert_ready(1) and not ticket.expert_ready(4)
    with pytest.raises(PrefetchTimeout) as err:
        ticket.wait(0.05)
    msg = str(err.value)
    assert "rank 2" in msg and "layer 7" in msg and "slot 1" in msg and "{3: 2}" in msg, msg


def test_submit_checks_buffer_and_state(tmp_path):
    t, _ = _single_rank_transport(tmp_path)
    plan = CopyPlan(0, 0, 0, (CopySlice(0, 0, 0, 4, 0),))
    with pytest.raises(ValueError, match="uint8"):
        t.submit(plan, torch.empty(4, dtype=torch.float32))
    t.close()
    with pytest.raises(RuntimeError, match="closed"):
        t.submit(plan, torch.empty(4, dtype=torch.uint8))


def test_missing_shm_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="DWDP_SHM_DIR"):
        HostTransport(0, shm_dir=str(tmp_path / "nope")).alloc_segment(8)
