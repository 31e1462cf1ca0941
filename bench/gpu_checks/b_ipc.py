"""gpu_check section b  CUDA IPC: each rank maps the other's segment through the cuda transport and pulls its seeded
   pattern bit-exactly; opening one's own handle must fail; the prefetch as DWDP issues it (sliced,
   round-robin, batches cut where experts complete, a peer's contiguous slices as one copy) against
   bare batches of the same bytes, step by step, with the host's microseconds per submit and per
   layer beside each bandwidth.

The steps, per slice size (each timed on device events on its own stream, and on the host from
the first issue call to the last byte landed):
  bare slices   one cudaMemcpyBatchAsync of the plan's slices (the acceptance baseline)
  bare copies   one batch of the copies the transport issues (slices of one peer that continue
                each other merged: the same bytes in fewer copies)
  bare cut      those copies in the transport's batches, back to back on one stream, no events
  prefetch      transport.submit + ticket.wait on the compute stream, as a layer does (consume-event
                wait, batches, one event per batch, the compute stream's wait on the last one)
  memcpy path   the same prefetch with one cudaMemcpyAsync per copy
Both ranks pull at once (as a DWDP group does), then each alone while the other waits, so the two
processes' share of the one GPU is told apart from the transport's own cost.
"""
from __future__ import annotations

import statistics
import time

import torch

from .common import MiB, rank_transport, seeded_bytes

KEY = "b_ipc"


def _timed(stream: torch.cuda.Stream, issue, repeats: int = 7) -> dict:
    """Medians over `repeats` (after one untimed call) of: device seconds between events recorded on
    `stream` around `issue()`; host seconds from before `issue()` to the end event having completed;
    host seconds inside `issue()`."""
    device, wall, host = [], [], []
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            issue()
        t1 = time.perf_counter()
        end.record(stream)
        end.synchronize()
        t2 = time.perf_counter()
        if i:
            device.append(start.elapsed_time(end) / 1e3)
            wall.append(t2 - t0)
            host.append(t1 - t0)
    return {"device_s": statistics.median(device), "wall_s": statistics.median(wall),
            "issue_s": statistics.median(host)}


def _bandwidth(rank: int, group, transport, placement, layout, slot, opts: dict) -> list[dict]:
    """One row per (mode, slice size): every step's GB/s (device and wall) and host microseconds."""
    from dwdp.runtime.plan import build_copy_plan, coalesce, cut_batches
    from dwdp.runtime.transport import cuda_api

    current = torch.cuda.current_stream()
    raw = cuda_api.stream_create()
    plain_stream = torch.cuda.ExternalStream(raw)
    ptrs = transport._peer_ptrs  # the addresses the transport reads (its own mapping of the peer)

    def bare(copies):
        """One prepared batch of (peer, src_offset, dst_offset, nbytes) copies: no plan, events or waits."""
        batch = cuda_api.prepare_batch([slot.data_ptr() + d for _, _, d, _ in copies],
                                       [ptrs[p] + s for p, s, _, _ in copies], [n for *_, n in copies])
        return lambda: cuda_api.memcpy_prepared_batch(batch, raw)

    def bare_cut(plan):
        issues = [bare(coalesce(plan.slices[b.start:b.stop])) for b in cut_batches(plan, transport.copy_batches)]
        return lambda: [issue() for issue in issues]

    def layer(plan, submits: list):
        """What a layer does: submit the plan (timed alone into `submits`), then the compute stream's wait."""
        def issue():
            t0 = time.perf_counter()
            ticket = transport.submit(plan, slot)
            submits.append(time.perf_counter() - t0)
            ticket.wait(30.0)
        return issue

    rows = []
    for mode in ("together", "alone"):
        for slice_bytes in opts["prefetch_slices"]:
            plan = build_copy_plan(placement, rank, 0, 0, layout, slice_bytes)
            slices = [(s.peer, s.src_offset, s.dst_offset, s.nbytes) for s in plan.slices]
            submits = {"prefetch": [], "memcpy": []}
            steps = {"bare_slices": (plain_stream, bare(slices)),
                     "bare_copies": (plain_stream, bare(coalesce(plan.slices))),
                     "bare_cut": (plain_stream, bare_cut(plan)),
                     "prefetch": (current, layer(plan, submits["prefetch"])),
                     "memcpy": (current, layer(plan, submits["memcpy"]))}
            row = {"mode": mode, "slice_bytes": slice_bytes, "plan_bytes": plan.nbytes, "slices": len(plan.slices),
                   "copies": sum(len(coalesce(plan.slices[b.start:b.stop]))
                                 for b in cut_batches(plan, transport.copy_batches)),
                   "batches": len(cut_batches(plan, transport.copy_batches))}
            for name, (stream, issue) in steps.items():
                transport.copy = "memcpy" if name == "memcpy" else "batch"
                for turn in ((0, 1) if mode == "alone" else (None,)):
                    group.barrier()  # together: both ranks start at once; alone: the other rank waits
                    if turn is None or turn == rank:
                        t = _timed(stream, issue)
                    group.barrier()
                row[f"{name}_GBps"] = plan.nbytes / t["device_s"] / 1e9
                row[f"{name}_wall_GBps"] = plan.nbytes / t["wall_s"] / 1e9
                row[f"{name}_issue_us"] = t["issue_s"] * 1e6
            for name, times in submits.items():
                row[f"{name}_submit_us"] = statistics.median(times[1:]) * 1e6  # the first one is untimed
            transport.copy = "batch"
            rows.append(row)
    torch.cuda.synchronize()
    cuda_api.stream_destroy(raw)
    return rows


def _ipc_rank(rank: int, opts: dict) -> dict:
    from dwdp.runtime.plan import build_copy_plan, slot_layout
    from dwdp.runtime.transport import cuda_api
    from dwdp.runtime.transport.reference import execute_plan_reference

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
    for copy in ("batch", "memcpy"):
        transport.copy = copy
        for layer in range(layout.num_layers):
            for slice_bytes in (opts["slice_bytes"], max(opts["prefetch_slices"])):
                plan = build_copy_plan(placement, rank, layer, 0, layout, slice_bytes)
                poison = seeded_bytes(900 + layer, nbytes)
                slot.copy_(poison)
                transport.release_slot(0)  # compute wrote the slot: the copy must come after that write
                transport.submit(plan, slot).synchronize(30.0)
                expected = execute_plan_reference(plan, peers, poison.clone())
                if not torch.equal(slot, expected):
                    mismatched.append((copy, layer, slice_bytes, int((slot != expected).sum())))
    transport.copy = "batch"
    transport.release_slot(0)
    group.barrier()
    bandwidth = _bandwidth(rank, group, transport, placement, layout, slot, opts)
    transport.close()
    return {"rank": rank, "own_handle_open": own_handle, "mismatched_layers": mismatched, "bandwidth": bandwidth}


def run(sections: dict) -> dict:
    from dwdp.runtime.group import launch_local

    opts = {"experts": 16, "layers": 3, "tensor_nbytes": [8 * MiB, 4 * MiB], "slice_bytes": 1 * MiB,
            "copy_batches": 4, "prefetch_slices": [1 * MiB, 4 * MiB, 8 * MiB]}
    ranks = launch_local(_ipc_rank, 2, (opts,), timeout_s=400)
    failures = []
    for r in ranks:
        if r["mismatched_layers"]:
            failures.append(f"IPC rank {r['rank']}: pulled bytes differ in (copy, layer, slice, bytes) "
                            f"{r['mismatched_layers']}")
        if "failed" not in r["own_handle_open"]:
            failures.append(f"IPC rank {r['rank']}: own handle {r['own_handle_open']}")
    return {"options": opts, "ranks": ranks, "failures": failures,
            "note": "one GPU: both ranks' segments are in the same device memory; NVLink is not measured"}


def summary(section: dict) -> list[tuple[str, str, str, str]]:
    """(check, measured, target, verdict) rows of this section for the table."""
    rows = []
    for r in section.get("ranks", []):
        rows.append((f"b IPC pull bit-exact, rank {r['rank']}", "yes" if not r["mismatched_layers"] else "NO",
                     "yes", "ok" if not r["mismatched_layers"] else "FAIL"))
        for bw in r["bandwidth"]:
            kib, mode = bw["slice_bytes"] // 1024, bw["mode"]
            ratio = bw["prefetch_GBps"] / bw["bare_slices_GBps"]
            tag = f"{kib} KiB, {mode}, rank {r['rank']}"
            if mode == "together":
                rows.append((f"b prefetch / bare batch of its slices, {tag}",
                             f"{ratio:.2f} ({bw['prefetch_GBps']:.0f} / {bw['bare_slices_GBps']:.0f} GB/s)",
                             ">= 0.90", "ok" if ratio >= 0.9 else "miss"))
            else:
                rows.append((f"b prefetch / bare batch of its slices, {tag}",
                             f"{ratio:.2f} ({bw['prefetch_GBps']:.0f} / {bw['bare_slices_GBps']:.0f} GB/s)", "", "info"))
            rows.append((f"b GB/s bare slices | copies | cut | prefetch, {tag}",
                         " | ".join(f"{bw[k + '_GBps']:.0f}" for k in ("bare_slices", "bare_copies", "bare_cut",
                                                                       "prefetch"))
                         + f" (host to landed {bw['prefetch_wall_GBps']:.0f})", "", "info"))
            rows.append((f"b host us per submit / per layer ({bw['copies']} copies, {bw['batches']} batches), {tag}",
                         f"{bw['prefetch_submit_us']:.0f} / {bw['prefetch_issue_us']:.0f} (memcpy path "
                         f"{bw['memcpy_submit_us']:.0f}, {bw['memcpy_GBps']:.0f} GB/s)", "", "info"))
    return rows
