"""`dwdp tune-kernel`: sweep the experts kernel's tiles for one model on this GPU and write its
configuration file (dwdp.kernels.tuned_configs), which `launch_config` then reads on this device.

Legend: H = hidden, I = expert intermediate size, E = experts, k = experts per token, T = tokens,
R = rows an experts call computes (T * k, sorted by expert), Re = rows per expert = ceil(T * k / E),
N = output features, K = input features.

Per token count T, two GEMMs are tuned, as the fused experts path runs them: gate_up (kind
"<dot>_gated": N = 2I, K = H, SwiGLU epilogue) and down (kind "<dot>": N = H, K = I, routing weight
in the epilogue). Each candidate is timed on weights spread over four buffers (a local parameter and
three prefetch slots, as DWDP reads them), checked against the PyTorch reference (a candidate
whose relative error exceeds 1e-2 is dropped), and the fastest becomes the entry for (kind, N, K, Re),
pinned to the load path it ran (TMA or pointers). A kind's default becomes the candidate with the
best geometric mean over the shapes measured this run. Entries of other shapes already in the file
are kept, each with the date, versions and code it was measured with.
"""
from __future__ import annotations

import datetime
import json
import math
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from dwdp.kernels import (SWIGLU, BlockQuant, GroupedGemmConfig, device_info, epilogue_reference, expert_weight_table,
                          grouped_gemm, grouped_gemm_reference, launch_config, quantize_fp8, scale_table, tuned_configs)
from dwdp.kernels.grouped_gemm import kernel_problem

MAX_REL_ERR = 1e-2
NUM_BUFFERS = 4


@dataclass(frozen=True)
class TuneShape:
    """One GEMM to tune: its table of tiles (kind), weight shape [n, k], rows per expert and experts."""

    kind: str
    n: int
    k: int
    rows_per_expert: int
    num_experts: int
    label: str

    @property
    def gated(self) -> bool:
        return self.kind.endswith("_gated")

    @property
    def flops(self) -> float:
        return 2.0 * self.rows_per_expert * self.num_experts * self.n * self.k


def model_gemms(hidden: int, inter: int, num_experts: int, top_k: int, tokens: Sequence[int], dot: str = "bf16"
                ) -> list[TuneShape]:
    """The gate_up and down GEMMs of an MoE layer at each token count."""
    if dot not in ("bf16", "fp8"):
        raise ValueError(f"dot={dot!r} must be 'bf16' or 'fp8'")
    shapes = []
    for t in tokens:
        if t < 1:
            raise ValueError(f"tokens={t} must be >= 1")
        rows = -(-t * top_k // num_experts)
        shapes.append(TuneShape(f"{dot}_gated", 2 * inter, hidden, rows, num_experts, f"gate_up T={t}"))
        shapes.append(TuneShape(dot, hidden, inter, rows, num_experts, f"down T={t}"))
    return shapes


def candidate_tiles(kind: str, full: bool = False, pointer_variants: bool = False):
    """Tile configurations to try for a kind (before the shared-memory check): a short list around what
    the H100 sweep found, or with `full` the product of the usual tile sizes, warps and stages, each with
    and without a grouped tile order, and with `pointer_variants` each also forced onto pointer loads
    (where TMA would be taken)."""
    fp8 = kind.startswith("fp8") and not kind.startswith("fp8w")
    if full:
        base = [GroupedGemmConfig(bm, bn, bk, num_warps=w, num_stages=s)
                for bm in (64, 128) for bn in (64, 128, 256) for bk in ((128,) if fp8 else (64, 128))
                for w in (4, 8) for s in (2, 3, 4, 5)]
    elif fp8:
        base = [GroupedGemmConfig(64, 256, 128, num_warps=8, num_stages=3),
                GroupedGemmConfig(128, 128, 128, num_warps=8, num_stages=3),
                GroupedGemmConfig(128, 128, 128, num_warps=8, num_stages=4),
                GroupedGemmConfig(128, 256, 128, num_warps=8, num_stages=2),
                GroupedGemmConfig(64, 128, 128, num_warps=4, num_stages=4),
                GroupedGemmConfig(128, 64, 128, num_warps=4, num_stages=4)]
    else:
        base = [GroupedGemmConfig(128, 256, 64, num_warps=8, num_stages=3),
                GroupedGemmConfig(128, 256, 64, num_warps=8, num_stages=4),
                GroupedGemmConfig(128, 128, 64, num_warps=8, num_stages=4),
                GroupedGemmConfig(128, 128, 128, num_warps=8, num_stages=3),
                GroupedGemmConfig(64, 256, 64, num_warps=8, num_stages=4),
                GroupedGemmConfig(64, 128, 64, num_warps=4, num_stages=4),
                GroupedGemmConfig(128, 64, 64, num_warps=4, num_stages=4)]
    configs = [replace(c, group_m=g) for c in base for g in (0, 8)]
    return configs + [replace(c, tma=False) for c in configs] if pointer_variants else configs


def _spread(views: torch.Tensor) -> list[torch.Tensor]:
    """E views of [E, ...] weights copied into NUM_BUFFERS separate buffers (consecutive experts each)."""
    per = -(-views.shape[0] // NUM_BUFFERS)
    out = []
    for start in range(0, views.shape[0], per):
        out.extend(views[start:start + per].clone().unbind(0))
    return out


def measure_gemm(shape: TuneShape, config, device: torch.device, *, warmup: int = 3, repeats: int = 10,
                 seed: int = 0) -> dict:
    """Time one candidate on `shape` (bf16 weights, or fp8 with 128 x 128 block scales and fp8 x fp8 dots).
    Returns {"tflops", "rel_err", "path", "median_ms"}, or {"error": text} when it cannot run or is wrong."""
    from dwdp.observe.timing import time_fn

    gen = torch.Generator(device=device).manual_seed(seed)
    fp8 = shape.kind.startswith("fp8")
    rows = shape.rows_per_expert * shape.num_experts
    dense = torch.randn(shape.num_experts, shape.n, shape.k, device=device, generator=gen) / shape.k ** 0.5
    x = torch.randn(rows, shape.k, device=device, generator=gen).bfloat16()  # [R, K], R = Re * E
    offsets = torch.arange(shape.num_experts + 1, device=device) * shape.rows_per_expert  # [E + 1]
    epilogue = SWIGLU if shape.gated else None
    row_scale = None if shape.gated else torch.rand(rows, device=device, generator=gen)  # [R]
    quantized = {}
    if fp8:
        quant = BlockQuant("fp8", (128, 128), halves=2 if shape.gated else 1)
        q, s = quantize_fp8(dense, quant)
        weights = _spread(q)
        quantized = dict(weight_scales=_spread(s), quant=quant)
    else:
        weights = _spread(dense.bfloat16())
    table = expert_weight_table(weights)
    scales = scale_table(quantized["weight_scales"], quantized["quant"], table, "weight_scales") if fp8 else None
    kwargs = dict(activation=epilogue, row_scale=row_scale, fp8_activations=fp8, config=config,
                  weight_scales=scales)
    try:
        got = grouped_gemm(x, offsets, table, **kwargs)
        want = grouped_gemm_reference(x if fp8 else x.float(), offsets, weights if fp8 else [w.float() for w in weights],
                                      fp8_activations=fp8, **quantized).float()
        want = epilogue_reference(want, epilogue) if epilogue is not None else want * row_scale[:, None]
        rel_err = ((got.float() - want).norm() / want.norm()).item()
        timing = time_fn(lambda: grouped_gemm(x, offsets, table, out=got, **kwargs), warmup=warmup, repeats=repeats,
                         device=device)
    except Exception as exc:  # out of resources, compile errors: the candidate is dropped with the reason
        text = str(exc).splitlines()[0] if str(exc) else ""
        return {"error": f"{type(exc).__name__}: {text}"[:300]}
    if rel_err > MAX_REL_ERR:
        return {"error": f"relative error {rel_err:.3e} > {MAX_REL_ERR}", "rel_err": rel_err}
    launch = launch_config(kernel_problem(torch.float8_e4m3fn if fp8 else x.dtype, table, num_rows=rows,
                                          epilogue=epilogue, scales=scales, has_row_scale=row_scale is not None),
                           device_info(device), config)
    return {"tflops": shape.flops / timing.median_s / 1e12, "rel_err": rel_err,
            "path": "tma" if launch.w_tma else "pointers", "median_ms": timing.median_s * 1e3}


Measure = Callable[[TuneShape, object], dict]


def sweep(shapes: Sequence[TuneShape], candidates: Callable[[str], list], measure: Measure,
          log: Callable[[str], None] = print) -> list[dict]:
    """Measure every candidate on every shape: [{shape, results: [(config, result)], best}]."""
    out = []
    for shape in shapes:
        results = []
        for config in candidates(shape.kind):
            result = measure(shape, config)
            results.append((config, result))
            what = f"{result['tflops']:.1f} TFLOP/s" if "tflops" in result else result["error"]
            log(f"{shape.label:>16} {shape.kind:<10} n={shape.n} k={shape.k} rows={shape.rows_per_expert} "
                f"{config.block_m}x{config.block_n}x{config.block_k} w{config.num_warps} s{config.num_stages} "
                f"g{config.group_m}{' pointers' if config.tma is False else ''}: {what}")
        ok = [(c, r) for c, r in results if "tflops" in r]
        best = max(ok, key=lambda cr: cr[1]["tflops"]) if ok else None
        out.append({"shape": shape, "results": results, "best": best})
    return out


def _config_dict(config, result: dict) -> dict:
    fields = asdict(config)
    fields["tma"] = result.get("path") == "tma" if result.get("path") else None
    return fields


def build_file(device: str, swept: list[dict], measured: dict, existing: dict | None = None) -> dict:
    """The configuration file's content: this run's best entries over `existing`'s, defaults per kind."""
    entries = {}
    if existing is not None:
        for entry in existing.get("entries", []):
            entry = dict(entry)
            entry.setdefault("measured", existing.get("measured"))
            entries[(entry["kind"], entry["n"], entry["k"], entry["rows_per_expert"])] = entry
    defaults = dict(existing.get("defaults", {})) if existing is not None else {}
    by_kind: dict[str, list[dict]] = {}
    for item in swept:
        shape, best = item["shape"], item["best"]
        if best is None:
            continue
        config, result = best
        entries[(shape.kind, shape.n, shape.k, shape.rows_per_expert)] = {
            "kind": shape.kind, "n": shape.n, "k": shape.k, "rows_per_expert": shape.rows_per_expert,
            "config": _config_dict(config, result), "tflops": round(result["tflops"], 1),
            "rel_err": float(f"{result['rel_err']:.3g}"), "shape": shape.label, "measured": measured,
            "candidates": len(item["results"]),
        }
        by_kind.setdefault(shape.kind, []).append(item)
    for kind, items in by_kind.items():
        scores = {}
        for item in items:
            for config, result in item["results"]:
                if "tflops" in result:
                    scores.setdefault(config, []).append(result["tflops"])
        complete = {c: v for c, v in scores.items() if len(v) == len(items)}
        if not complete:
            continue
        config = max(complete, key=lambda c: math.prod(complete[c]))
        mean = math.prod(complete[config]) ** (1 / len(items))
        defaults[kind] = {"config": {**asdict(config), "tma": None},
                          "why": f"best geometric mean ({mean:.0f} TFLOP/s) over the {len(items)} shapes of this kind "
                                 f"measured on {measured['date']}"}
    ordered = sorted(entries.values(), key=lambda e: (e["kind"], e["n"], e["k"], e["rows_per_expert"]))
    return {"format": tuned_configs.FORMAT, "device": device, "measured": measured, "defaults": defaults,
            "entries": ordered}


def measured_meta(device: torch.device, how: str) -> dict:
    import triton

    root = Path(__file__).resolve().parents[1]
    try:
        code = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip() or "unknown"
    except (OSError, subprocess.CalledProcessError):
        code = "unknown"
    info = device_info(device)
    return {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "triton": triton.__version__,
            "code": code, "gpu": f"{info.name} ({info.num_sms} SMs)", "how": how}


def output_path(device_name: str, out_dir: str | None) -> Path:
    from dwdp.envs import kernel_configs_dir

    directory = Path(out_dir or kernel_configs_dir() or tuned_configs.PACKAGE_DIR)
    return directory / tuned_configs.file_name(device_name)


def run_tune_kernel(shapes: list[TuneShape], device: torch.device, *, full: bool = False, warmup: int = 3,
                    repeats: int = 10, out_dir: str | None = None, how: str = "",
                    candidates: Callable[[str], list] | None = None, log: Callable[[str], None] = print) -> Path:
    """Sweep (`candidates(kind)`, default `candidate_tiles`), then write (merge into) this device's
    configuration file. Returns its path."""
    info = device_info(device)
    path = output_path(info.name, out_dir)
    existing = None
    if path.exists():
        tuned_configs.load(path)  # a malformed file is an error here too, naming it, before anything is measured
        existing = json.loads(path.read_text())
    tma = info.capability is not None and info.capability >= (9, 0)
    candidates = candidates or (lambda kind: candidate_tiles(kind, full, pointer_variants=tma))
    swept = sweep(shapes, candidates,
                  lambda shape, config: measure_gemm(shape, config, device, warmup=warmup, repeats=repeats), log)
    content = build_file(info.name, swept, measured_meta(device, how), existing)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=1) + "\n")
    tuned_configs.load(path)
    for item in swept:
        shape, best = item["shape"], item["best"]
        what = "no candidate ran" if best is None else (
            f"{best[0].block_m}x{best[0].block_n}x{best[0].block_k} w{best[0].num_warps} s{best[0].num_stages} "
            f"g{best[0].group_m} {best[1]['path']}: {best[1]['tflops']:.1f} TFLOP/s")
        log(f"best {shape.label:>16} {shape.kind:<10} n={shape.n} k={shape.k} rows={shape.rows_per_expert}: {what}")
    log(f"wrote {path}")
    return path
