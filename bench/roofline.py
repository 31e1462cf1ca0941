"""Calibrated roofline prediction of DWDP vs DEP per MoE layer, swept over ISL or max-num-tokens
(an analytic prediction computed on the CPU, no imbalance and no contention: bench/simulate.py adds both).

Every operator costs max(FLOPs / (peak x efficiency), bytes / (HBM x memory efficiency)) with the
efficiencies of dwdp/predict/data/calibration.json (--ideal: datasheet peaks); DWDP's forward walks the copy
timeline with the copies' interference (dwdp.predict.costmodel.timeline). Prints one table per hardware preset
and a crossover summary last; writes bench/results/roofline_<model>_<hw>.json and .png. Deterministic.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dwdp.predict import costmodel as cm  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
ISLS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
MNTS = (2048, 4096, 8192, 16384, 32768, 65536)
COLUMNS = ("isl", "max_num_tokens", "t_compute_ms", "t_prefetch_ms", "t_all2all_ms", "remote_gb_per_layer",
           "ratio", "compute_slowdown", "speedup", "dwdp_weight_gb", "dwdp_fits")


def default_dtype(hw: cm.Hardware) -> str:
    """nvfp4 where the GPU has FP4 tensor cores, fp8 elsewhere."""
    return "nvfp4" if hw.peak_flops.get("fp4") else "fp8"


def sweep(spec, hw, deploy, args, cal) -> list[cm.Prediction]:
    if args.sweep == "isl":
        return [cm.predict(spec, hw, cm.Workload(isl, args.max_num_tokens, args.batch), deploy, cal)
                for isl in args.values]
    return [cm.predict(spec, hw, cm.Workload(args.isl, mnt, args.batch), deploy, cal) for mnt in args.values]


def crossover_mnt(spec, hw, deploy, isl, batch, cal) -> int | None:
    """Smallest power-of-two max-num-tokens (up to 2^20) at which no prefetch is exposed."""
    for e in range(8, 21):
        if cm.prefetch_hidden(spec, hw, cm.Workload(isl, 1 << e, batch), deploy, cal):
            return 1 << e
    return None


def fmt_row(row: dict) -> str:
    cells = []
    for c in COLUMNS:
        v = row[c]
        cells.append(f"{v:>10.3f}" if isinstance(v, float) else f"{str(v):>10}")
    return " ".join(cells)


def plot(path: Path, preds, args, title: str, crossover) -> None:
    x = [p.isl if args.sweep == "isl" else p.max_num_tokens for p in preds]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(x, [1e3 * p.t_compute for p in preds], "o-", label="T_compute (DWDP, per MoE layer)")
    ax.plot(x, [1e3 * (p.t_compute_dep + p.t_all2all) for p in preds], "s-", label="DEP: T_compute + T_all2all")
    ax.plot(x, [1e3 * p.t_prefetch for p in preds], "--", label="T_prefetch (copy engine, uncontended)")
    if crossover is not None:
        ax.axvline(crossover, color="grey", lw=0.8, ls=":", label=f"crossover {args.sweep} = {crossover}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ISL (tokens)" if args.sweep == "isl" else "max_num_tokens")
    ax.set_ylabel("ms per MoE layer")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="DeepSeek-R1", choices=cm.model_names())
    p.add_argument("--hw", nargs="+", default=["H100-HGX", "GB200-NVL72"], choices=cm.hardware_names())
    p.add_argument("--dtype", default="auto", choices=("auto",) + tuple(cm.FORMATS),
                   help="expert / linear weight dtype; auto = nvfp4 with FP4 tensor cores, else fp8")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--num-local-experts", type=int, default=None)
    p.add_argument("--sweep", choices=("isl", "mnt"), default="isl")
    p.add_argument("--isl", type=int, default=8192, help="fixed ISL for --sweep mnt")
    p.add_argument("--max-num-tokens", type=int, default=8192, help="fixed budget for --sweep isl")
    p.add_argument("--batch", type=int, default=None, help="prompts per forward; default: budget always full")
    p.add_argument("--values", type=int, nargs="+", default=None)
    p.add_argument("--ideal", action="store_true", help="datasheet peaks, no interference (the plain roofline)")
    args = p.parse_args()
    cal = cm.IDEAL if args.ideal else cm.load_calibration()
    args.values = args.values or (ISLS if args.sweep == "isl" else MNTS)
    RESULTS.mkdir(parents=True, exist_ok=True)
    spec = cm.load_model(args.model)
    summary = []
    for hw_name in args.hw:
        hw = cm.load_hardware(hw_name)
        dtype = default_dtype(hw) if args.dtype == "auto" else args.dtype
        deploy = cm.Deployment(args.group_size, args.num_local_experts, dtype)
        preds = sweep(spec, hw, deploy, args, cal)
        if args.sweep == "isl":
            crossover = cm.crossover_isl(spec, hw, deploy, args.max_num_tokens, args.batch, cal=cal)
        else:
            crossover = crossover_mnt(spec, hw, deploy, args.isl, args.batch, cal)
        first = preds[0]
        title = (f"{args.model} on {hw_name}, {dtype} (experts at {first.expert_compute_dtype}), "
                 f"G={args.group_size}, L={first.num_local_experts}")
        dtype_tag = "" if args.dtype == "auto" else f"_{dtype}"  # auto keeps the stored results' names
        stem = f"roofline_{args.model}_{hw_name}{dtype_tag}" + ("" if args.sweep == "isl" else "_mnt")
        plot(RESULTS / f"{stem}.png", preds, args, title, crossover)
        (RESULTS / f"{stem}.json").write_text(json.dumps({
            "model": args.model, "model_source": cm.preset_source(args.model), "hardware": hw_name,
            "weight_dtype": dtype, "expert_compute_dtype": first.expert_compute_dtype,
            "group_size": args.group_size, "num_local_experts": first.num_local_experts,
            "sweep": args.sweep, "batch": args.batch, f"crossover_{args.sweep}": crossover,
            "calibration": "ideal" if args.ideal else {k: getattr(cal, k) for k in cm.calibration_sources()},
            "rows": [pred.row() for pred in preds],
        }, indent=2) + "\n")
        print(f"\n{title}  (per MoE layer; batch={args.batch or 'full budget'})")
        print(" ".join(f"{c:>10}" for c in COLUMNS))
        for pred in preds:
            print(fmt_row(pred.row()))
        summary.append((hw_name, dtype, first.expert_compute_dtype, first.t_prefetch, crossover))
    fixed = f"max_num_tokens={args.max_num_tokens}" if args.sweep == "isl" else f"isl={args.isl}"
    model = "plain roofline" if args.ideal else "calibrated model"
    print(f"\nCrossover ({args.model}, G={args.group_size}, {fixed}, {model}, analytic): smallest {args.sweep} "
          f"where every prefetch hides")
    print(f"{'hardware':>12} {'dtype':>6} {'gemm':>5} {'T_pf_ms':>8} {'crossover':>10}")
    for hw_name, dtype, gemm, t_pf, crossover in summary:
        print(f"{hw_name:>12} {dtype:>6} {gemm:>5} {1e3 * t_pf:>8.3f} {str(crossover):>10}")


if __name__ == "__main__":
    main()
