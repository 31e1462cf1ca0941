"""gpu_check section b  CUDA IPC: each rank maps the other's segment through the cuda transport and pulls its seeded
   pattern bit-exactly; opening one's own handle must fail; the prefetch as DWDP issues it (sliced,
   round-robin, batches cut where experts complete) against one bare batch of the same slices and
   against per-slice cudaMemcpyAsync."""
from __future__ import annotations

import torch

from .common import MiB, rank_transport, seeded_bytes, time_on

KEY = "b_ipc"


def _ipc_rank(rank: int, opts: dict) -> dict:
    from dwdp.plan import build_copy_plan, slot_layout
    from dwdp.transport import cuda_api
    from dwdp.transport.reference import execute_plan_reference

    group, placement, layout, transport, handles = rank_transport(rank, opts, 100)
    tensor_nbytes = layout.tensor_nbytes
    try:
        cuda_api.ipc_open(handles[rank]["ipc"])
        own_handle = "opened (unexpected: CUDA refuses a process its own IPC handle)"
    except cuda_api.CudaError as exc:
        own_handle = str(exc)
    peers = [seeded_bytes(100 + r, layout.total_nbytes) for r in range(group.size)]
    nbytes = slot_layout(placement, rank, tensor_nbytes).total_nbytes
    slot = transport.alloc_slot(nbytes)
    mismatched = []
    for layer in range(layout.num_layers):
        plan = build_copy_plan(placement, rank, layer, 0, layout, opts["slice_bytes"])
        poison = seeded_bytes(900 + layer, nbytes)
        slot.copy_(poison)
        transport.release_slot(0)  # compute wrote the slot: the copy must come after that write
        transport.submit(plan, slot).synchronize(30.0)
        expected = execute_plan_reference(plan, peers, poison.clone())
        if not torch.equal(slot, expected):
            mismatched.append((layer, int((slot != expected).sum())))

    current = torch.cuda.current_stream()
    raw = cuda_api.stream_create()
    plain_stream = torch.cuda.ExternalStream(raw)
    ptrs = transport._peer_ptrs

    def plain_batch(slices):
        """The same copies through the bare API: one batch, no plan, no events, no waits."""
        dsts = [slot.data_ptr() + c.dst_offset for c in slices]
        srcs = [ptrs[c.peer] + c.src_offset for c in slices]
        sizes = [c.nbytes for c in slices]
        return lambda: cuda_api.memcpy_batch_async(dsts, srcs, sizes, raw)

    bandwidth = []
    whole = build_copy_plan(placement, rank, 0, 0, layout, 1 << 40)  # one copy per expert tensor
    group.barrier()
    unsliced = time_on(plain_stream, plain_batch(whole.slices), repeats=7)
    for slice_bytes in opts["prefetch_slices"]:
        plan = build_copy_plan(placement, rank, 0, 0, layout, slice_bytes)
        row = {"slice_bytes": slice_bytes, "plan_bytes": plan.nbytes, "slices": len(plan.slices)}
        for method in ("batch", "memcpy"):
            transport.copy = method
            group.barrier()  # both ranks pull at once, as a DWDP group does
            seconds = time_on(current, lambda: transport.submit(plan, slot).wait(30.0), repeats=7)
            row[f"prefetch_{method}_GBps"] = plan.nbytes / seconds / 1e9
        group.barrier()
        row["plain_batch_same_slices_GBps"] = plan.nbytes / time_on(plain_stream, plain_batch(plan.slices),
                                                                     repeats=7) / 1e9
        row["plain_batch_unsliced_GBps"] = plan.nbytes / unsliced / 1e9
        bandwidth.append(row)
    torch.cuda.synchronize()
    cuda_api.stream_destroy(raw)
    transport.close()
    return {"rank": rank, "own_handle_open": own_handle, "mismatched_layers": mismatched, "bandwidth": bandwidth}


def run(sections: dict) -> dict:
    from dwdp.group import launch_local

    opts = {"experts": 16, "layers": 3, "tensor_nbytes": [8 * MiB, 4 * MiB], "slice_bytes": 1 * MiB,
            "copy_batches": 4, "prefetch_slices": [1 * MiB, 4 * MiB, 8 * MiB]}
    ranks = launch_local(_ipc_rank, 2, (opts,), timeout_s=240)
    failures = []
    for r in ranks:
        if r["mismatched_layers"]:
            failures.append(f"IPC rank {r['rank']}: pulled bytes differ in (layer, bytes) {r['mismatched_layers']}")
        if "failed" not in r["own_handle_open"]:
            failures.append(f"IPC rank {r['rank']}: own handle {r['own_handle_open']}")
    return {"options": opts, "ranks": ranks, "failures": failures}


def summary(section: dict) -> list[tuple[str, str, str, str]]:
    """(check, measured, target, verdict) rows of this section for the table."""
    rows = []
    if "ranks" in section:
        for r in section["ranks"]:
            rows.append((f"b IPC pull bit-exact, rank {r['rank']}", "yes" if not r["mismatched_layers"] else "NO",
                         "yes", "ok" if not r["mismatched_layers"] else "FAIL"))
            for bw in r["bandwidth"]:
                kib = bw["slice_bytes"] // 1024
                ratio = bw["prefetch_batch_GBps"] / bw["plain_batch_same_slices_GBps"]
                rows.append((f"b prefetch / bare batch of its slices, {kib} KiB, rank {r['rank']}",
                             f"{ratio:.2f} ({bw['prefetch_batch_GBps']:.0f} / "
                             f"{bw['plain_batch_same_slices_GBps']:.0f} GB/s)", ">= 0.90",
                             "ok" if ratio >= 0.9 else "miss"))
                rows.append((f"b prefetch / unsliced batch, {kib} KiB, rank {r['rank']}",
                             f"{bw['prefetch_batch_GBps'] / bw['plain_batch_unsliced_GBps']:.2f} "
                             f"(memcpy path {bw['prefetch_memcpy_GBps']:.0f} GB/s)", "", "info"))
    return rows
