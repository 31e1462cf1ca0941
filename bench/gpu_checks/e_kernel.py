"""gpu_check section e  the Triton kernel: against the reference (output poisoned first), TFLOP/s against F.grouped_mm
   and per-expert matmuls, multi-buffer / single-buffer, measured bf16 matmul peak. Per shape: our TFLOP/s, torch's
   grouped_mm on the same experts merged beforehand, their ratio, the launch configuration used (tiles, TMA or
   pointers, where the tiles came from), and TMA against pointer loads on the same tiles (pointers are the
   default until TMA is at least as fast)."""
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


def run(sections: dict, tokens: int = 4096, part: str = "all") -> dict:
    """part: "correctness" (the kernel against its reference), "timing" (speeds), or "all"."""
    out = correctness() if part in ("all", "correctness") else {"failures": []}
    if part in ("all", "timing"):
        out.update(timing(tokens))
    return out


def correctness() -> dict:
    """The fused experts and the grouped GEMM against their references, the output poisoned first."""
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
    return {"accuracy": accuracy, "failures": failures}


def timing(tokens: int) -> dict:
    """bf16 matmul peak, then our kernel against grouped_mm per model shape."""
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
    return {"matmul_peak_tflops": peak, "tokens": tokens, "rows": rows, "notes": notes,
            "grouped_mm": has_grouped_mm, "per_shape": per_shape(rows, notes, peak)}


def per_shape(rows: list[dict], notes: dict, peak: float) -> dict:
    """model -> {gemm, moe}: our TFLOP/s, grouped_mm on the merged experts, ratio, configuration used."""
    by = {(r["section"], r["model"], r["variant"]): r for r in rows}
    out = {}
    for model in sorted({r["model"] for r in rows}):
        note = notes.get(model, {})
        gemm, moe = by.get(("gemm", model, "multi-buffer")), by.get(("moe", model, "fused (sum)"))
        gemm_mm, moe_mm = by.get(("gemm", model, "grouped_mm (no copy)")), by.get(
            ("moe", model, "grouped_mm (merged, no copy)"))
        entry = {}
        if gemm is not None:
            entry["gemm"] = {"ours_tflops": gemm["tflops"], "config": note.get("gemm_launch"),
                             "grouped_mm_tflops": gemm_mm["tflops"] if gemm_mm else None,
                             "ratio": gemm["tflops"] / gemm_mm["tflops"] if gemm_mm else None,
                             **load_paths(gemm, by, ("gemm", model, "multi-buffer"), note.get("gemm_launch"))}
        if moe is not None:
            launches = note.get("moe_launches") or {}
            entry["moe"] = {"ours_tflops": moe["tflops"], "config": note.get("moe_launches"),
                            "peak_share": moe["tflops"] / peak,
                            "grouped_mm_tflops": moe_mm["tflops"] if moe_mm else None,
                            "ratio": moe["tflops"] / moe_mm["tflops"] if moe_mm else None,
                            **load_paths(moe, by, ("moe", model, "fused (sum"), launches.get("gate_up"))}
        out[model] = entry
    return out


def load_paths(default: dict, by: dict, key: tuple[str, str, str], label: str | None) -> dict:
    """{"tma_tflops", "pointers_tflops"} of one GEMM on the same tiles: the default row (its launch label says
    which path it took) and the row timed on the other path (bench/grouped_gemm.py), None where not timed."""
    section, model, variant = key
    default_path = "tma" if label and "tma(" in label else "pointers"
    other_path = "pointers" if default_path == "tma" else "tma"
    sep = ", " if variant.endswith("(sum") else " ("
    other_variant = f"{variant}{sep}{'TMA' if other_path == 'tma' else 'pointers'})"
    other = by.get((section, model, other_variant))
    return {f"{default_path}_tflops": default["tflops"], f"{other_path}_tflops": other["tflops"] if other else None}


def _paths_row(check: str, entry: dict) -> tuple[str, str, str, str]:
    """TMA and pointer loads side by side; TMA becomes the default only at >= 1.0x (kernels/launch.py)."""
    tma, pointers = entry.get("tma_tflops"), entry.get("pointers_tflops")
    if tma is None or pointers is None:
        return (check, f"TMA {tma and f'{tma:.0f}'} / pointers {pointers and f'{pointers:.0f}'} TFLOP/s "
                       "(TMA cannot read these weights)", "", "info")
    return (check, f"{tma:.0f} / {pointers:.0f} TFLOP/s = {tma / pointers:.2f}x", ">= 1.0x to make TMA the default",
            "ok" if tma >= pointers else "miss")


def summary(section: dict) -> list[tuple[str, str, str, str]]:
    """(check, measured, target, verdict) rows of this section for the table."""
    rows = []
    if section.get("accuracy"):
        worst = max(section["accuracy"].values())
        rows.append(("e kernel vs reference (worst rel err)", f"{worst:.2e}", "< 1e-2", "ok" if worst < 1e-2 else "FAIL"))
    if "rows" not in section:
        return rows
    peak, tokens = section["matmul_peak_tflops"], section["tokens"]
    rows.append(("e measured bf16 matmul peak", f"{peak:.0f} TFLOP/s", "", "info"))
    for model, entry in section.get("per_shape", {}).items():
        gemm, moe = entry.get("gemm"), entry.get("moe")
        if gemm is not None:
            if gemm["ratio"] is not None:
                rows.append((f"e gemm {model} T={tokens} vs grouped_mm merged",
                             f"{gemm['ours_tflops']:.0f} / {gemm['grouped_mm_tflops']:.0f} TFLOP/s = "
                             f"{gemm['ratio']:.2f}x", ">= 1.0x", "ok" if gemm["ratio"] >= 1.0 else "miss"))
            rows.append(_paths_row(f"e gemm {model} T={tokens} TMA / pointers, same tiles", gemm))
            rows.append((f"e gemm {model} config", str(gemm["config"]), "", "info"))
        if moe is not None:
            against = (f" vs grouped_mm merged {moe['grouped_mm_tflops']:.0f} ({moe['ratio']:.2f}x)"
                       if moe["ratio"] is not None else "")
            rows.append((f"e moe {model} T={tokens}",
                         f"{moe['ours_tflops']:.0f} TFLOP/s ({moe['peak_share'] * 100:.0f}% peak){against}",
                         ">= 60% peak", "ok" if moe["peak_share"] >= 0.6 else "miss"))
            rows.append(_paths_row(f"e moe {model} T={tokens} TMA / pointers, same tiles", moe))
            if moe["config"]:
                rows.append((f"e moe {model} config", f"gate_up {moe['config']['gate_up']}; down {moe['config']['down']}",
                             "", "info"))
    by = {(r["section"], r["model"], r["variant"]): r for r in section["rows"]}
    for (kind, model, variant), r in by.items():
        if kind == "gemm" and variant == "multi-buffer" and (kind, model, "contiguous") in by:
            ratio = by[(kind, model, "contiguous")]["median_ms"] / r["median_ms"]
            rows.append((f"e multi/single-buffer speed {model}", f"{ratio:.3f}", ">= 0.98",
                         "ok" if ratio >= 0.98 else "miss"))
    return rows
