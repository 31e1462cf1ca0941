"""Multi-buffer grouped GEMM vs contiguous / merge-copy / per-expert loop, on MoE shapes.

Legend: T = tokens, k = experts per token, R = rows an experts call computes (the T * k token-expert
pairs sorted by expert), H = hidden, I = expert intermediate size, E = experts, L = local experts,
Bw = weight buffers (1 local + Bw - 1 peers).

Two sections per model:
  gemm: the gate_up GEMM (x [R, H] @ w_e.T, w_e [2I, H]) over weights in Bw buffers:
    multi-buffer          the kernel reads each expert where it lives (address table)
    contiguous            the same kernel, every expert in one [E, 2I, H] tensor
    multi-buffer (TMA) / multi-buffer (pointers)  the same tiles on the other load path than the
                          default one (pointers unless DWDP_KERNEL_TMA=1), where TMA can read the weights
    merge + grouped_mm    copy the Bw buffers into one [E, 2I, H] tensor, then F.grouped_mm
    grouped_mm (no copy)  F.grouped_mm on the contiguous tensor: the merge copy's share
    loop torch.mm         one torch.mm per expert (host offsets, computed outside the timing)
    local-first           two launches (experts [0, L) wave-aligned first, then the rest)
  moe: the whole experts path (sort, gate_up + SwiGLU, down + routing weight, back to tokens):
    fused (sum) / fused (atomic) / fused local-first   dwdp.kernels.moe_experts
    fused (sum, TMA) / fused (sum, pointers)   both GEMMs' tiles on the other load path
    merge + grouped_mm    transformers' grouped_mm path after a merge copy of both weights
    grouped_mm (merged, no copy)   the same on weights merged beforehand (the copy not timed)
On CUDA the "kernel" rows run the Triton kernel; on CPU they run the plain-PyTorch reference
(the Triton kernel only runs on CPU in the interpreter, which says nothing about speed), and
the CPU shapes are scaled down so the run takes well under a minute.

Run: python bench/grouped_gemm.py [--device cuda] [--dtype bf16] [--tokens 4096] [--buffers 4]
Writes bench/results/grouped_gemm_<tag>.json (tag from dwdp.observe.timing.device_tag) and prints a
table last. Ratios are time(variant) / time(baseline of the section): > 1 means slower.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from dwdp.kernels import device_info, expert_weight_table, grouped_gemm, grouped_gemm_reference, launch_config, local_first_split, moe_experts, moe_launch_configs, moe_experts_reference, sort_by_expert, swiglu_reference
from dwdp.kernels.grouped_gemm import kernel_problem
from dwdp.kernels.launch import tma_blocker
from dwdp.observe.timing import device_tag, load_average_1min, machine, time_fn

RESULTS = Path(__file__).resolve().parent / "results"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class MoeShape:
    name: str
    hidden: int  # H
    inter: int  # I (per expert)
    experts: int  # E
    top_k: int  # k

    def scaled(self, dim_div: int, expert_div: int) -> MoeShape:
        return MoeShape(self.name, self.hidden // dim_div, self.inter // dim_div,
                        max(8, self.experts // expert_div), self.top_k)


SHAPES = [
    MoeShape("deepseek-v3", 7168, 2048, 256, 8),
    MoeShape("qwen3-30b-a3b", 2048, 768, 128, 8),
    MoeShape("qwen3-235b-a22b", 4096, 1536, 128, 8),
    MoeShape("mixtral-8x7b", 4096, 14336, 8, 2),
]


def _split_buffers(num_experts: int, num_buffers: int, rows: int, cols: int, dtype, device, gen):
    """E expert views [rows, cols] in table order: the first ceil(E / Bw) in the local buffer, the
    rest in Bw - 1 peer buffers of consecutive experts. Returns (views, num_local)."""
    per_buffer = math.ceil(num_experts / num_buffers)
    views = []
    for start in range(0, num_experts, per_buffer):
        count = min(per_buffer, num_experts - start)
        buf = torch.randn(count, rows, cols, generator=gen, device=device, dtype=torch.float32)  # [E_b, rows, cols]
        buf = (buf / math.sqrt(cols)).to(dtype)
        views.extend(buf.unbind(0))
    return views, per_buffer


def _routing(num_tokens: int, shape: MoeShape, device, gen):
    logits = torch.randn(num_tokens, shape.experts, generator=gen, device=device)  # [T, E]
    weights, index = torch.topk(logits.softmax(-1), shape.top_k, dim=-1)  # [T, k] each
    return weights, index


def _grouped_mm(x, weights_enk, offsets):
    """F.grouped_mm over [E, N, K] weights: x [R, K] -> [R, N]; offsets are group ends (int32)."""
    return F.grouped_mm(x, weights_enk.transpose(-2, -1), offs=offsets[1:].to(torch.int32))


def _grouped_mm_supported(device, dtype) -> bool:
    if not hasattr(F, "grouped_mm"):
        return False
    try:
        x = torch.ones(4, 16, device=device, dtype=dtype)
        _grouped_mm(x, torch.ones(2, 16, 16, device=device, dtype=dtype),
                    torch.tensor([0, 2, 4], device=device, dtype=torch.int32))
        return True
    except (RuntimeError, NotImplementedError):
        return False


def _moe_grouped_mm_baseline(hidden, index, weights, gate_up_views, down_views, merged=None):
    """transformers' grouped_mm experts path, after merging the split weights (the copy DWDP avoids), or on
    `merged` = (gate_up [E, 2I, H], down [E, H, I]) merged beforehand (the copy left out of the timing)."""
    num_tokens, top_k = index.shape
    if merged is None:
        gate_up = torch.stack(gate_up_views)  # [E, 2I, H] merge copy
        down = torch.stack(down_views)  # [E, H, I] merge copy
    else:
        gate_up, down = merged
    slots, offsets = sort_by_expert(index, gate_up.shape[0])  # [S], [E + 1]
    x = hidden[slots // top_k]  # [S, H]
    h = swiglu_reference(_grouped_mm(x, gate_up, offsets))  # [S, I]
    y = _grouped_mm(h, down, offsets) * weights.reshape(-1)[slots, None].to(h.dtype)  # [S, H]
    per_slot = torch.empty_like(y)
    per_slot[slots] = y  # [S, H] slot order
    return per_slot.view(num_tokens, top_k, -1).sum(dim=1)


def _loop_mm(x, host_offsets, views, out):
    for e, w in enumerate(views):
        lo, hi = host_offsets[e], host_offsets[e + 1]
        if hi > lo:
            torch.mm(x[lo:hi], w.t(), out=out[lo:hi])
    return out


def _other_path(launch, info) -> tuple[str, object] | None:
    """("TMA" or "pointers", the launch's tiles on that path) for the load path the launch did not take, or
    None where the weights cannot go through TMA (then both paths are the pointer path)."""
    if launch.w_tma:
        return "pointers", replace(launch.tiles, tma=False)
    tma_tiles = replace(launch.tiles, tma=True)
    if launch.problem is None or tma_blocker(launch.problem, info, tma_tiles) is not None:
        return None
    return "TMA", tma_tiles


def _row(section, model, variant, timing, flops, baseline_s):
    return {
        "section": section, "model": model, "variant": variant,
        "median_ms": timing.median_s * 1e3, "p10_ms": timing.p10_s * 1e3, "p90_ms": timing.p90_s * 1e3,
        "tflops": flops / timing.median_s / 1e12,
        "ratio": timing.median_s / baseline_s if baseline_s else 1.0,
    }


@dataclass
class _Inputs:
    """Routed tokens of one model shape, built outside every timed region."""

    shape: MoeShape
    hidden: torch.Tensor  # [T, H]
    index: torch.Tensor  # [T, k]
    weights: torch.Tensor  # [T, k]
    x_sorted: torch.Tensor  # [R, H]
    offsets: torch.Tensor  # [E + 1]
    host_offsets: list[int]


def _gemm_section(inp: _Inputs, args, device, dtype, use_triton, has_grouped_mm, timer, notes) -> list[dict]:
    shape, x_sorted, offsets, host_offsets = inp.shape, inp.x_sorted, inp.offsets, inp.host_offsets
    gen = torch.Generator(device=device).manual_seed(1)
    views, num_local = _split_buffers(shape.experts, args.buffers, 2 * shape.inter, shape.hidden, dtype, device, gen)
    contig = torch.stack(views)  # [E, 2I, H]
    contig_views = list(contig.unbind(0))
    out = x_sorted.new_empty(x_sorted.shape[0], 2 * shape.inter)  # [R, 2I]
    if use_triton:
        multi_table, contig_table = expert_weight_table(views), expert_weight_table(contig_views)

        def multi():
            return grouped_gemm(x_sorted, offsets, multi_table, out=out)

        def contiguous():
            return grouped_gemm(x_sorted, offsets, contig_table, out=out)

        def local_first():
            grouped_gemm(x_sorted, offsets, multi_table, out=out, split_at=num_local, part="first")
            return grouped_gemm(x_sorted, offsets, multi_table, out=out, split_at=num_local, part="second")

        info = device_info(torch.device(device))
        launch = launch_config(kernel_problem(dtype, multi_table, num_rows=x_sorted.shape[0]), info)
        wave = launch.wave_size(info)
        n_tiles = math.ceil(2 * shape.inter / launch.tiles.block_n)
        first = local_first_split(offsets, num_local, n_tiles=[n_tiles], block_m=launch.tiles.block_m, wave_size=wave)
        notes["gemm_local_first"] = {"num_local": num_local, "first_part_experts": first, "wave_size": wave}
        notes["gemm_launch"] = launch.label
    else:
        def multi():
            return grouped_gemm_reference(x_sorted, offsets, views)

        def contiguous():
            return grouped_gemm_reference(x_sorted, offsets, contig_views)

        def local_first():
            cut = host_offsets[num_local]
            out[:cut] = grouped_gemm_reference(x_sorted[:cut], host_offsets[:num_local + 1], views[:num_local])
            out[cut:] = grouped_gemm_reference(x_sorted[cut:], [o - cut for o in host_offsets[num_local:]],
                                               views[num_local:])
            return out

    variants = [("multi-buffer", time_fn(multi, **timer)), ("contiguous", time_fn(contiguous, **timer))]
    other = _other_path(launch, info) if use_triton else None
    if other is not None:  # the same tiles on the other load path: what TMA buys or costs
        other_name, other_tiles = other
        variants.append((f"multi-buffer ({other_name})", time_fn(
            lambda: grouped_gemm(x_sorted, offsets, multi_table, out=out, config=other_tiles), **timer)))
    if has_grouped_mm:
        variants.append(("merge + grouped_mm", time_fn(lambda: _grouped_mm(x_sorted, torch.stack(views), offsets),
                                                       **timer)))
        variants.append(("grouped_mm (no copy)", time_fn(lambda: _grouped_mm(x_sorted, contig, offsets), **timer)))
    else:
        notes["grouped_mm"] = f"skipped: F.grouped_mm unavailable for {dtype} on {device}"
    variants.append(("loop torch.mm", time_fn(lambda: _loop_mm(x_sorted, host_offsets, views, out), **timer)))
    variants.append((f"local-first (L={num_local})", time_fn(local_first, **timer)))
    # Results are compared too, so a fast wrong kernel cannot pass as a win.
    expected = _loop_mm(x_sorted, host_offsets, views, torch.empty_like(out)).float()  # [R, 2I]
    notes["gemm_max_abs_diff_vs_loop"] = (multi().float() - expected).abs().max().item()
    out.fill_(float("nan"))
    notes["gemm_max_abs_diff_local_first_vs_loop"] = (local_first().float() - expected).abs().max().item()
    flops = 2.0 * x_sorted.shape[0] * (2 * shape.inter) * shape.hidden
    single = variants[0][1].median_s
    return [_row("gemm", shape.name, name, t, flops, single) for name, t in variants]


def _moe_section(inp: _Inputs, args, device, dtype, use_triton, has_grouped_mm, timer, notes) -> list[dict]:
    shape, hidden, index, weights = inp.shape, inp.hidden, inp.index, inp.weights
    gen = torch.Generator(device=device).manual_seed(2)
    gate_up, num_local = _split_buffers(shape.experts, args.buffers, 2 * shape.inter, shape.hidden, dtype, device, gen)
    down, _ = _split_buffers(shape.experts, args.buffers, shape.hidden, shape.inter, dtype, device, gen)
    if use_triton:
        gate_up_table, down_table = expert_weight_table(gate_up), expert_weight_table(down)
        launches = moe_launch_configs(dtype, gate_up_table, down_table, num_slots=index.numel(),
                                      device=device_info(torch.device(device)))
        notes["moe_launches"] = {"gate_up": launches[0].label, "down": launches[1].label}

        def fused(**kwargs):
            return moe_experts(hidden, index, weights, gate_up_table, down_table, **kwargs)

        variants = [
            ("fused (sum)", time_fn(fused, **timer)),
            ("fused (atomic)", time_fn(lambda: fused(combine="atomic"), **timer)),
            (f"fused local-first (L={num_local})", time_fn(lambda: fused(split_at=num_local), **timer)),
        ]
        info = device_info(torch.device(device))
        others = [_other_path(launch, info) for launch in launches]
        if all(o is not None for o in others):
            pair = (others[0][1], others[1][1])
            variants.append((f"fused (sum, {others[0][0]})", time_fn(lambda: fused(config=pair), **timer)))
    else:
        def fused():
            return moe_experts_reference(hidden, index, weights, gate_up, down)

        variants = [("reference (loop)", time_fn(fused, **timer))]
    if has_grouped_mm:
        def baseline():
            return _moe_grouped_mm_baseline(hidden, index, weights, gate_up, down)

        variants.append(("merge + grouped_mm", time_fn(baseline, **timer)))
        merged = (torch.stack(gate_up), torch.stack(down))  # [E, 2I, H], [E, H, I], outside the timing
        variants.append(("grouped_mm (merged, no copy)", time_fn(
            lambda: _moe_grouped_mm_baseline(hidden, index, weights, gate_up, down, merged), **timer)))
        merged = None
        notes["moe_max_abs_diff_vs_grouped_mm"] = (fused().float() - baseline().float()).abs().max().item()
    flops = 6.0 * index.numel() * shape.hidden * shape.inter
    single = variants[0][1].median_s
    return [_row("moe", shape.name, name, t, flops, single) for name, t in variants]


def bench_model(shape: MoeShape, args, device, dtype, use_triton: bool, has_grouped_mm: bool) -> tuple[list, dict]:
    """Both sections for one model shape; each section frees its weights before the next."""
    gen = torch.Generator(device=device).manual_seed(0)
    timer = dict(warmup=args.warmup, repeats=args.repeats, device=device)
    weights, index = _routing(args.tokens, shape, device, gen)
    hidden = torch.randn(args.tokens, shape.hidden, generator=gen, device=device).to(dtype)  # [T, H]
    slots, offsets = sort_by_expert(index, shape.experts)  # [R], [E + 1]
    x_sorted = hidden[slots // shape.top_k].contiguous()  # [R, H]
    inp = _Inputs(shape, hidden, index, weights, x_sorted, offsets, offsets.tolist())
    notes: dict = {}
    rows = _gemm_section(inp, args, device, dtype, use_triton, has_grouped_mm, timer, notes)
    if device == "cuda":
        torch.cuda.empty_cache()
    rows += _moe_section(inp, args, device, dtype, use_triton, has_grouped_mm, timer, notes)
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows, notes


def _table(rows: list[dict]) -> str:
    header = (f"{'section':<7} {'model':<16} {'variant':<28} {'median ms':>10} {'p10-p90 ms':>17} "
              f"{'TFLOP/s':>8} {'ratio':>6}")
    lines = [header, "-" * len(header)]
    for r in rows:
        spread = f"{r['p10_ms']:.3f}-{r['p90_ms']:.3f}"
        lines.append(f"{r['section']:<7} {r['model']:<16} {r['variant']:<28} {r['median_ms']:>10.3f} "
                     f"{spread:>17} {r['tflops']:>8.3f} {r['ratio']:>6.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default bf16 on cuda, fp32 on cpu")
    parser.add_argument("--tokens", type=int, default=None, help="T (default 4096 on cuda, 128 on cpu)")
    parser.add_argument("--buffers", type=int, default=4, help="Bw: local buffer + Bw - 1 peer buffers")
    parser.add_argument("--models", nargs="*", default=[s.name for s in SHAPES], choices=[s.name for s in SHAPES])
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads (default 1: one thread is far steadier on a shared machine)")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default bench/results/grouped_gemm_<tag>.json)")
    args = parser.parse_args()
    on_cuda = args.device == "cuda"
    dtype = DTYPES[args.dtype or ("bf16" if on_cuda else "fp32")]
    args.tokens = args.tokens or (4096 if on_cuda else 128)
    args.warmup = args.warmup if args.warmup is not None else (5 if on_cuda else 2)
    args.repeats = args.repeats or (20 if on_cuda else 7)
    # CPU: dims / 8 and experts / 4 (at least 8), so the CPU run stays well under a minute.
    shapes = [s if on_cuda else s.scaled(8, 4) for s in SHAPES if s.name in args.models]
    if not on_cuda:
        torch.set_num_threads(args.threads or 1)
    has_grouped_mm = _grouped_mm_supported(args.device, dtype)
    torch.manual_seed(0)

    load_before = load_average_1min()
    rows, notes = [], {}
    for shape in shapes:
        model_rows, model_notes = bench_model(shape, args, args.device, dtype, on_cuda, has_grouped_mm)
        rows += model_rows
        notes[shape.name] = model_notes
    tag = device_tag(args.device)
    result = {
        "bench": "grouped_gemm",
        "device": torch.cuda.get_device_name() if on_cuda else platform.processor() or platform.machine(),
        "tag": tag,
        "kernel_rows": "triton" if on_cuda else "pytorch reference",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype).removeprefix("torch."),
        "tokens": args.tokens,
        "buffers": args.buffers,
        "shapes": [vars(s) for s in shapes],
        "grouped_mm": "available" if has_grouped_mm else "skipped (unavailable for this dtype/device)",
        "notes": notes,
        "argv": sys.argv,
        "machine": machine(),
        "load_average_1min": {"before": load_before, "after": load_average_1min()},
        "rows": rows,
    }
    path = args.out or RESULTS / f"grouped_gemm_{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"device {result['device']} ({tag}), {result['dtype']}, T={args.tokens}, Bw={args.buffers}, "
          f"kernel rows: {result['kernel_rows']}, grouped_mm: {result['grouped_mm']}")
    print(f"1-min load average {load_before:.2f} before, {result['load_average_1min']['after']:.2f} after "
          f"on {os.cpu_count()} CPUs; wrote {path}")
    print(_table(rows))


if __name__ == "__main__":
    main()
