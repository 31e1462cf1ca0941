"""gpu_check section c  overlap: a large bf16 GEMM alone, the prefetch alone, both at once (with and without the
   PreferOverlapWithCompute hint, and an SM copy for contrast): share of the prefetch hidden,
   slowdown of each; then what moves when they share the GPU:
   - clocks: SM clock, memory clock and power draw sampled (NVML, else nvidia-smi) for a few seconds
     each while the GEMM runs alone, with the copy-engine prefetch, with an SM copy of the same
     bytes, and while each copy runs alone;
   - SMs: whether each copy path needs SMs at all, by issuing it while a kernel holds every SM's
     thread slots for a fixed time: a copy engine finishes its copy during that kernel, a copy that
     needs SMs only after it.
   One GPU: copies read and write the same HBM the GEMM uses; NVLink pulls read another GPU's HBM,
   so none of these figures is an NVLink figure."""
from __future__ import annotations

import statistics
import time

import torch

from .common import MiB, seeded_bytes, time_on

KEY = "c_overlap"
CONDITION_S = 2.5  # per clock condition: NVML's power is a ~1 s average on Hopper


def _copy_needs_sms(copies: dict, spin_ms: float = 60.0) -> dict:
    """For each copy path: ms from the start of a kernel that holds every SM for `spin_ms` to the
    copy's end (the copy issued on its own stream right after that kernel started), next to the
    copy alone. A copy done long before the kernel ends ran without SMs."""
    try:
        from .spin import hold_every_sm

        sms = torch.cuda.get_device_properties(0).multi_processor_count
        out = torch.empty(2 * sms, dtype=torch.int64, device="cuda")
        hold_every_sm(out, 1000, sms)  # compile outside the timed runs
        torch.cuda.synchronize()
    except Exception as exc:  # an older Triton without inline asm / %globaltimer: say so, skip
        return {"error": f"spin kernel unavailable: {type(exc).__name__}: {exc}"[:300]}
    busy, copy_stream = torch.cuda.Stream(), torch.cuda.Stream()
    result = {"spin_ms": spin_ms, "paths": {}}
    for name, issue in copies.items():
        alone = time_on(copy_stream, issue)
        torch.cuda.synchronize()
        started, spun, copied = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        with torch.cuda.stream(busy):
            started.record()
            hold_every_sm(out, int(spin_ms * 1e6), sms)
            spun.record()
        copy_stream.wait_event(started)
        with torch.cuda.stream(copy_stream):
            issue()
            copied.record()
        torch.cuda.synchronize()
        done_ms, spin_done_ms = started.elapsed_time(copied), started.elapsed_time(spun)
        result["paths"][name] = {"copy_alone_ms": alone * 1e3, "copy_done_ms": done_ms, "spin_done_ms": spin_done_ms,
                                 "needs_sms": done_ms >= 0.9 * spin_done_ms}
    return result


def _clock_table(gemm, copies: dict, flops_per_gemm: float, copy_bytes: int, sampler) -> dict:
    """SM clock, memory clock and power per condition, each held for CONDITION_S seconds, with the
    GEMM's TFLOP/s and the copies' GB/s over the condition when they run."""
    compute, copy_stream = torch.cuda.Stream(), torch.cuda.Stream()
    conditions = {"idle": (False, None), "gemm alone": (True, None)}
    for name in copies:
        conditions[f"gemm + {name}"] = (True, name)
        conditions[f"{name} alone"] = (False, name)
    table = {}
    sampler.start()
    try:
        for label, (with_gemm, copy) in conditions.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            iterations = 0
            while time.perf_counter() - t0 < CONDITION_S:
                if with_gemm:
                    with torch.cuda.stream(compute):
                        gemm()
                if copy is not None:
                    with torch.cuda.stream(copy_stream):
                        copies[copy]()
                if not with_gemm and copy is None:
                    time.sleep(0.05)
                iterations += 1
                if iterations % 4 == 0:
                    torch.cuda.synchronize()  # keep the queues short: the window is what ran, not what waits
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            row = sampler.window(t0, t1)
            if with_gemm:
                row["gemm_tflops"] = iterations * flops_per_gemm / (t1 - t0) / 1e12
            if copy is not None:
                row["copy_GBps"] = iterations * copy_bytes / (t1 - t0) / 1e9
            row["seconds"] = t1 - t0
            table[label] = row
    finally:
        sampler.stop()
    return {"source": sampler.source, "error": sampler.error, "conditions": table}


def run(sections: dict) -> dict:
    """Needs the 1 MiB batch bandwidth of section a to size the prefetch (200 GB/s when a did not run)."""
    batch_rows = [r for r in sections.get("a_copy_bandwidth", {}).get("rows", [])
                  if r["slice_bytes"] == MiB and r["method"] == "cudaMemcpyBatchAsync"]
    copy_GBps = batch_rows[0]["GBps"] if batch_rows else 200.0
    from dwdp.runtime.transport import cuda_api as api

    from .telemetry import Sampler

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

    def batches(prefer_overlap):
        """The prefetch's copy arguments, built once as the transport builds a plan's."""
        out = []
        for start in range(0, nbytes, 16 * MiB):
            offsets = range(start, min(start + 16 * MiB, nbytes), MiB)
            out.append(api.prepare_batch([dst.data_ptr() + o for o in offsets], [src.data_ptr() + o for o in offsets],
                                         [MiB] * len(offsets), prefer_overlap))
        return out

    prepared = {prefer: batches(prefer) for prefer in (True, False)}

    def prefetch(prefer_overlap):
        """On torch's current stream, like the SM copy (every caller sets it to the stream it times)."""
        stream = torch.cuda.current_stream().cuda_stream
        for batch in prepared[prefer_overlap]:
            api.memcpy_prepared_batch(batch, stream)

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

    # What moves: clocks and power, and whether each copy path needs SMs (same bytes each).
    paths = {"copy-engine batch, hint on": lambda: prefetch(True), "copy-engine batch, hint off": lambda: prefetch(False),
             "SM copy": lambda: sm_copy(None)}
    props = torch.cuda.get_device_properties(0)
    uuid = getattr(props, "uuid", None)
    sampler = Sampler(uuid=f"GPU-{uuid}" if uuid is not None else None)
    clocks = _clock_table(gemm, {"copy-engine prefetch": lambda: prefetch(True), "SM copy": lambda: sm_copy(None)},
                          2 * n**3 * gemms, nbytes, sampler) if sampler.source else {"error": sampler.error}
    if "conditions" in clocks:
        alone = clocks["conditions"].get("copy-engine prefetch alone", {})
        idle = clocks["conditions"].get("idle", {})
        if alone.get("power_w") is not None and idle.get("power_w") is not None and alone.get("copy_GBps"):
            # Watts per TB/s of copy traffic inside one GPU: each byte is read and written, 2x the rate.
            clocks["copy_w_per_tb_s_one_gpu"] = (alone["power_w"] - idle["power_w"]) / (2 * alone["copy_GBps"] / 1e3)
    engines = _copy_needs_sms(paths)
    api.stream_destroy(raw)
    return {"rows": rows, "clocks": clocks, "copy_needs_sms": engines, "failures": []}


def _moves(clocks: dict) -> str:
    """One line: what changes from the GEMM alone to the GEMM with the copy-engine prefetch."""
    c = clocks.get("conditions", {})
    base, both = c.get("gemm alone", {}), c.get("gemm + copy-engine prefetch", {})
    parts = []
    for key, unit in (("sm_mhz", "MHz SM"), ("mem_mhz", "MHz mem"), ("power_w", "W")):
        if base.get(key) is not None and both.get(key) is not None:
            parts.append(f"{base[key]:.0f}->{both[key]:.0f} {unit}")
    if base.get("gemm_tflops") and both.get("gemm_tflops"):
        parts.append(f"GEMM {base['gemm_tflops']:.0f}->{both['gemm_tflops']:.0f} TFLOP/s")
    if both.get("reasons"):
        parts.append("reasons " + "+".join(both["reasons"]))
    return ", ".join(parts) or "no samples"


def summary(section: dict) -> list[tuple[str, str, str, str]]:
    """(check, measured, target, verdict) rows of this section for the table."""
    rows = []
    for r in section.get("rows", []):
        tag = r["copy"]
        contrast = "SM" in tag  # the SM copy is there for comparison, not a target
        rows.append((f"c GEMM slowdown with prefetch ({tag})", f"{r['gemm_slowdown'] * 100:.1f}%",
                     "" if contrast else "<= 10%",
                     "info" if contrast else "ok" if r["gemm_slowdown"] <= 0.10 else "miss"))
        rows.append((f"c prefetch hidden ({tag})", f"{r['hidden_fraction'] * 100:.1f}%",
                     "" if contrast else ">= 90%",
                     "info" if contrast else "ok" if r["hidden_fraction"] >= 0.9 else "miss"))
        rows.append((f"c prefetch slowdown with GEMM ({tag})", f"{r['copy_slowdown'] * 100:.1f}%", "", "info"))
    clocks = section.get("clocks", {})
    if "conditions" in clocks:
        rows.append((f"c gemm alone -> with CE prefetch ({clocks['source']})", _moves(clocks), "", "info"))
        for label, c in clocks["conditions"].items():
            rows.append((f"c clocks: {label}", f"SM {c['sm_mhz']} MHz, mem {c['mem_mhz']} MHz, {c['power_w']} W"
                         + (f", GEMM {c['gemm_tflops']:.0f} TFLOP/s" if "gemm_tflops" in c else ""), "", "info"))
    elif clocks:
        rows.append(("c clocks", f"not sampled: {str(clocks.get('error'))[:60]}", "", "info"))
    for name, p in section.get("copy_needs_sms", {}).get("paths", {}).items():
        rows.append((f"c needs SMs: {name}", f"{'yes' if p['needs_sms'] else 'no'} (done at {p['copy_done_ms']:.1f} of "
                     f"{p['spin_done_ms']:.1f} ms spin; alone {p['copy_alone_ms']:.2f} ms)", "", "info"))
    return rows
