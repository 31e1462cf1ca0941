"""Do the host backend's copier threads hold the interpreter lock while they copy?

    PYTHONPATH=. python bench/copier_gil.py                 # 64 MiB per plan, 1 MiB slices, 7 rounds
    PYTHONPATH=. python bench/copier_gil.py --plan-mib 16 --rounds 3

One process holds a 2-rank group of host transports; rank 0 pulls one layer's remote experts
(`--plan-mib`, cut into `--slice-bytes` slices) three ways, each on one background thread:
- transport: HostTransport's copiers (one `torch._foreach_copy_` per batch of slices);
- slice loop: one `copy_` per slice with its views made in Python, as the copier did before;
- memoryview: one `memoryview` slice assignment per slice, a copy that holds the lock (the control).
Each is timed twice, in rotated order per round: with the main thread idle (blocked in a join or a
wait) and with the main thread running pure Python (a counting loop) until the copy has landed.
Columns: copy ms with the main thread idle and busy, and `main progress`: the busy main thread's
loop iterations per second during the copy over its rate alone (1.0: the copier never took the lock
from it; near 0: the copier held it). A copier that needs the lock back after every slice also
slows down when the main thread is busy (the lock changes hands at most every 5 ms switch
interval), which the `busy / idle` column shows. Medians over rounds; writes
bench/results/copier_gil_<device>.json with the machine and its 1-min load average.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from dwdp.runtime.placement import build_placement
from dwdp.runtime.plan import SegmentLayout, build_copy_plan, slot_layout
from dwdp.observe.timing import device_tag, load_average_1min, machine
from dwdp.runtime.transport import HostTransport, connect_in_process

NUM_EXPERTS = 16


def _group(plan_bytes: int, slice_bytes: int, shm_dir: str):
    """Two host transports in this process and rank 0's plan of layer 0 (`plan_bytes` of remote experts)."""
    placement = build_placement(NUM_EXPERTS, 2)
    expert_bytes = plan_bytes // len(placement.missing_experts(0))
    tensor_nbytes = (expert_bytes * 2 // 3 // 16 * 16, expert_bytes // 3 // 16 * 16)
    layout = SegmentLayout(1, placement.num_local_experts, tensor_nbytes)
    transports, segments = [], []
    for rank in range(2):
        t = HostTransport(rank, inflight=2, shm_dir=shm_dir, min_batch_bytes=1)
        segments.append(t.alloc_segment(layout.total_nbytes))
        segments[-1].fill_(rank + 1)
        transports.append(t)
    connect_in_process(transports)
    plan = build_copy_plan(placement, 0, 0, 0, layout, slice_bytes)
    slot = transports[0].alloc_slot(slot_layout(placement, 0, tensor_nbytes).total_nbytes)
    slot.fill_(0)  # first touch outside the timed region
    return transports, segments, plan, slot


def _thread_copy(plan, segments, slot, per_slice):
    """Start a thread that copies `plan` slice by slice with `per_slice(dst, src)`; returns its done()."""
    finished = threading.Event()

    def run():
        for s in plan.slices:
            per_slice(slot, s.dst_offset, segments[s.peer], s.src_offset, s.nbytes)
        finished.set()

    threading.Thread(target=run, daemon=True).start()
    return finished.is_set, lambda: finished.wait(120.0)


def _slice_copy_(dst, dst_offset, src, src_offset, nbytes):
    dst[dst_offset : dst_offset + nbytes].copy_(src[src_offset : src_offset + nbytes])


def _memoryview_copy(dst, dst_offset, src, src_offset, nbytes):
    # numpy views share the tensors' memory; the slice assignment is one memcpy under the lock.
    memoryview(dst.numpy())[dst_offset : dst_offset + nbytes] = memoryview(src.numpy())[src_offset : src_offset + nbytes]


CHECK_EVERY = 256  # loop iterations between two done() calls: the loop, not the check, is measured


def _spin(done) -> int:
    """Pure-Python loop iterations until done() (checked every CHECK_EVERY iterations)."""
    n, x = 0, 1
    while not done():
        for _ in range(CHECK_EVERY):
            x = (x * 3 + 1) % 1000003
        n += CHECK_EVERY
    return n


def _spin_rate(seconds: float) -> float:
    """Iterations per second of the same loop on this thread, with nothing else to do."""
    end = time.perf_counter() + seconds
    return _spin(lambda: time.perf_counter() >= end) / seconds


def _run(start, busy: bool) -> tuple[float, float]:
    """(seconds until the copy landed, main-thread iterations per second meanwhile, 0 when idle)."""
    t0 = time.perf_counter()
    done, wait = start()
    n = _spin(done) if busy else (wait(), 0)[1]
    elapsed = time.perf_counter() - t0
    return elapsed, n / elapsed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan-mib", type=float, default=64.0, help="bytes of one plan (default 64 MiB)")
    p.add_argument("--slice-bytes", type=int, default=1 << 20, help="slice size (default 1 MiB)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out-dir", default="bench/results")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    load_before = load_average_1min()
    with tempfile.TemporaryDirectory() as shm_dir:
        transports, segments, plan, slot = _group(int(args.plan_mib * 2**20), args.slice_bytes, shm_dir)
        try:
            variants = {
                "transport": lambda: (lambda t: (t.done, lambda: t.wait(120.0)))(transports[0].submit(plan, slot)),
                "slice loop": lambda: _thread_copy(plan, segments, slot, _slice_copy_),
                "memoryview": lambda: _thread_copy(plan, segments, slot, _memoryview_copy),
            }
            for start in variants.values():  # warm-up: first touch of every page, thread start-up
                _run(start, busy=False)
            samples = {name: {"idle_s": [], "busy_s": [], "progress": []} for name in variants}
            names = list(variants)
            for r in range(args.rounds):
                for name in names[r % len(names):] + names[: r % len(names)]:
                    alone = _spin_rate(0.1)
                    idle, _ = _run(variants[name], busy=False)
                    busy, rate = _run(variants[name], busy=True)
                    samples[name]["idle_s"].append(idle)
                    samples[name]["busy_s"].append(busy)
                    samples[name]["progress"].append(rate / alone)
        finally:
            for t in transports:
                t.close()
    load_after = load_average_1min()
    rows = [dict(copier=name, idle_ms=1e3 * statistics.median(s["idle_s"]), busy_ms=1e3 * statistics.median(s["busy_s"]),
                 main_progress=statistics.median(s["progress"]), samples=s) for name, s in samples.items()]
    device = device_tag("cpu")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"copier_gil_{device}.json"
    path.write_text(json.dumps(dict(argv=sys.argv, machine=machine(), options=vars(args), plan_bytes=plan.nbytes,
                                    num_slices=len(plan.slices),
                                    load_average_1min=dict(before=load_before, after=load_after), rows=rows),
                               indent=2) + "\n")
    print(f"plan: {plan.nbytes / 2**20:.1f} MiB in {len(plan.slices)} slices; {args.rounds} rounds; 1-min load average "
          f"{load_before:.1f} before, {load_after:.1f} after; wrote {path}")
    header = ("copier", "idle ms", "busy ms", "busy / idle", "main progress")
    lines = [(r["copier"], f"{r['idle_ms']:.1f}", f"{r['busy_ms']:.1f}", f"{r['busy_ms'] / r['idle_ms']:.2f}",
              f"{r['main_progress']:.2f}") for r in rows]
    widths = [max(len(h), *(len(x[i]) for x in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    print("\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*x) for x in lines]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
