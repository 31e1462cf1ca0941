"""gpu_check section e  the Triton kernel: against the reference (output poisoned first), TFLOP/s against F.grouped_mm
   and per-expert matmuls, multi-buffer / single-buffer, measured bf16 matmul peak."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

from .common import time_on

KEY = "e_kernel"


def _grouped_gemm_bench():
    path = Path(__file__).resolve().parent.parent / "grouped_gemm.py"
    spec = importlib.util.spec_from_file_location("dwdp_bench_grouped_gemm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def run(sections: dict, tokens: int = 4096) -> dict:
    from dwdp.kernels import grouped_gemm, grouped_gemm_reference, moe_experts, moe_experts_reference

    failures, accuracy = [], {}
    gen = torch.Generator(device="cuda").manual_seed(3)
    num_tokens, hidden, inter, experts, top_k = 777, 1024, 384, 12, 4
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
    gate_up = [(torch.randn(2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).bfloat16()
               for _ in range(experts)]
    down = [(torch.randn(hidden, inter, device="cuda", generator=gen) / inter**0.5).bfloat16() for _ in range(experts)]
    index = torch.stack([torch.randperm(experts, device="cuda", generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.softmax(torch.randn(num_tokens, top_k, device="cuda", generator=gen), -1)
    want = moe_experts_reference(x, index, weights, gate_up, down).float()
    for name, kwargs in (("moe sum", {}), ("moe atomic", {"combine": "atomic"}),
                         ("moe local-first", {"split_at": 5, "on_local_done": lambda: None})):
        got = moe_experts(x, index, weights, gate_up, down, **kwargs).float()
        accuracy[name] = ((got - want).norm() / want.norm()).item()
    counts = torch.bincount(index.reshape(-1), minlength=experts)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    x_sorted = torch.randn(int(offsets[-1]), hidden, device="cuda", generator=gen).bfloat16()
    out = torch.full((x_sorted.shape[0], 2 * inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = grouped_gemm(x_sorted, offsets, gate_up, out=out).float()
    want_gemm = grouped_gemm_reference(x_sorted, offsets, gate_up).float()
    accuracy["grouped_gemm (poisoned out)"] = ((got - want_gemm).norm() / want_gemm.norm()).item()
    if torch.isnan(got).any():
        failures.append("grouped_gemm left rows of a NaN-poisoned output unwritten")
    for name, err in accuracy.items():
        if not err < 1e-2:
            failures.append(f"kernel {name}: relative error {err:.3e} >= 1e-2 against the reference")

    n = 8192
    pair = (torch.randn(n, n, device="cuda").bfloat16(), torch.randn(n, n, device="cuda").bfloat16())
    peak = 2 * n**3 / time_on(torch.cuda.current_stream(), lambda: torch.mm(*pair), warmup=3, repeats=10) / 1e12
    pair = None  # frees the two matrices before the kernel benchmark
    bench = _grouped_gemm_bench()
    args = argparse.Namespace(buffers=4, warmup=5, repeats=20, tokens=tokens)
    has_grouped_mm = bench._grouped_mm_supported("cuda", torch.bfloat16)
    rows, notes = [], {}
    for shape in bench.SHAPES:
        if shape.name in ("qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b"):
            shape_rows, notes[shape.name] = bench.bench_model(shape, args, "cuda", torch.bfloat16, True, has_grouped_mm)
            rows += shape_rows
            torch.cuda.empty_cache()
    return {"accuracy": accuracy, "matmul_peak_tflops": peak, "tokens": tokens, "rows": rows, "notes": notes,
            "grouped_mm": has_grouped_mm, "failures": failures}


def summary(section: dict) -> list[tuple[str, str, str, str]]:
    """(check, measured, target, verdict) rows of this section for the table."""
    rows = []
    if "rows" in section:
        worst = max(section["accuracy"].values())
        rows.append(("e kernel vs reference (worst rel err)", f"{worst:.2e}", "< 1e-2", "ok" if worst < 1e-2 else "FAIL"))
        rows.append(("e measured bf16 matmul peak", f"{section['matmul_peak_tflops']:.0f} TFLOP/s", "", "info"))
        by = {(r["section"], r["model"], r["variant"]): r for r in section["rows"]}
        for (section, model, variant), r in by.items():
            if section == "moe" and variant == "fused (sum)":
                share = r["tflops"] / section["matmul_peak_tflops"]
                rows.append((f"e moe {model} T={section['tokens']}", f"{r['tflops']:.0f} TFLOP/s ({share * 100:.0f}% peak)",
                             ">= 60% peak", "ok" if share >= 0.6 else "miss"))
            if section == "gemm" and variant == "multi-buffer":
                contiguous = by[(section, model, "contiguous")]
                ratio = contiguous["median_ms"] / r["median_ms"]
                rows.append((f"e multi/single-buffer speed {model}", f"{ratio:.3f}", ">= 0.98",
                             "ok" if ratio >= 0.98 else "miss"))
    return rows
