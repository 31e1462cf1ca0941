"""gpu_check section c  overlap: a large bf16 GEMM alone, the prefetch alone, both at once (with and without the
   PreferOverlapWithCompute hint, and an SM copy for contrast): share of the prefetch hidden,
   slowdown of each."""
from __future__ import annotations

import statistics

import torch

from .common import MiB, seeded_bytes, time_on

KEY = "c_overlap"


def run(sections: dict) -> dict:
    """Needs the 1 MiB batch bandwidth of section a to size the prefetch (200 GB/s when a did not run)."""
    batch_rows = [r for r in sections.get("a_copy_bandwidth", {}).get("rows", [])
                  if r["slice_bytes"] == MiB and r["method"] == "cudaMemcpyBatchAsync"]
    copy_GBps = batch_rows[0]["GBps"] if batch_rows else 200.0
    from dwdp.transport import cuda_api as api

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    gemms = 8
    compute = torch.cuda.Stream()
    raw = api.stream_create()
    copy = torch.cuda.ExternalStream(raw)

    def gemm():
        for _ in range(gemms):
            torch.mm(a, b, out=out)

    t_gemm = time_on(compute, gemm)
    # A prefetch that takes about as long as the GEMMs, in 1 MiB slices and batches of 16 MiB.
    nbytes = int(min(4 << 30, max(64 * MiB, copy_GBps * 1e9 * t_gemm))) // MiB * MiB
    src, dst = seeded_bytes(5, nbytes), torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    slices = [(dst.data_ptr() + o, src.data_ptr() + o, MiB) for o in range(0, nbytes, MiB)]
    batches = [slices[i:i + 16] for i in range(0, len(slices), 16)]

    def prefetch(prefer_overlap):
        for batch in batches:
            api.memcpy_batch_async([d for d, _, _ in batch], [s for _, s, _ in batch], [m for _, _, m in batch], raw,
                                   prefer_overlap)

    def sm_copy(_prefer):
        for o in range(0, nbytes, 16 * MiB):
            dst[o:o + 16 * MiB].copy_(src[o:o + 16 * MiB])

    rows = []
    for label, prefer, issue in (("cudaMemcpyBatchAsync, hint on", True, prefetch),
                                 ("cudaMemcpyBatchAsync, hint off", False, prefetch),
                                 ("tensor.copy_ (SM)", None, sm_copy)):
        t_copy = time_on(copy, lambda: issue(prefer))
        samples = []
        for i in range(6):
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            start.record(compute)
            copy.wait_event(start)
            with torch.cuda.stream(compute):
                gemm()
            with torch.cuda.stream(copy):
                issue(prefer)
            ends = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)]
            ends[0].record(compute)
            ends[1].record(copy)
            torch.cuda.synchronize()
            if i:
                samples.append((start.elapsed_time(ends[0]) / 1e3, start.elapsed_time(ends[1]) / 1e3))
        g_with = statistics.median(s[0] for s in samples)
        c_with = statistics.median(s[1] for s in samples)
        both = statistics.median(max(s) for s in samples)
        exposed = max(0.0, both - t_gemm)
        rows.append({"copy": label, "gemm_alone_ms": t_gemm * 1e3, "copy_alone_ms": t_copy * 1e3,
                     "gemm_with_copy_ms": g_with * 1e3, "copy_with_gemm_ms": c_with * 1e3, "both_ms": both * 1e3,
                     "copy_bytes": nbytes, "hidden_fraction": max(0.0, 1 - exposed / t_copy),
                     "gemm_slowdown": g_with / t_gemm - 1, "copy_slowdown": c_with / t_copy - 1,
                     "gemm_tflops_alone": 2 * n**3 * gemms / t_gemm / 1e12})
    api.stream_destroy(raw)
    return {"rows": rows, "failures": []}


def summary(section: dict) -> list[tuple[str, str, str, str]]:
    """(check, measured, target, verdict) rows of this section for the table."""
    rows = []
    if "rows" in section:
        for r in section["rows"]:
            tag = r["copy"]
            contrast = "SM" in tag  # the SM copy is there for comparison, not a target
            rows.append((f"c GEMM slowdown with prefetch ({tag})", f"{r['gemm_slowdown'] * 100:.1f}%",
                         "" if contrast else "<= 10%",
                         "info" if contrast else "ok" if r["gemm_slowdown"] <= 0.10 else "miss"))
            rows.append((f"c prefetch hidden ({tag})", f"{r['hidden_fraction'] * 100:.1f}%",
                         "" if contrast else ">= 90%",
                         "info" if contrast else "ok" if r["hidden_fraction"] >= 0.9 else "miss"))
            rows.append((f"c prefetch slowdown with GEMM ({tag})", f"{r['copy_slowdown'] * 100:.1f}%", "", "info"))
    return rows
