"""Predicted DWDP-vs-DEP throughput per GPU from the calibrated cost model (an analytic prediction,
computed on the CPU; nothing is measured here).

For every combination of --group-size, --isl, --isl-ratio (or --isl-std), --mnts and --cvs, each rank
packs drawn prompts into forwards of at most max-num-tokens (dwdp.predict.packing) and both schemes run the
same forwards (dwdp.predict.simulate): DEP waits at every MoE layer for the slowest rank, DWDP runs each
rank alone with its copies' interference. --cvs overrides the per-rank spread packing gives.
--breakdown prints, per setting, the per-forward breakdown in the DWDP paper's categories for DEP
and three DWDP variants: the paper's baseline (merge copy, one copy per expert), without the merge
copy, and without it on dwdp's sliced copy plan; beside the forward's categories, the time every mode
pays per forward outside it (host, KV hand-off, other: dwdp.predict.costmodel.outside), then the
speedup, the gain (speedup - 1) and the speedup of the forwards alone.

Prints the constants and their sources first and the speedup table last; writes
bench/results/simulate_<model>_<hw>_<dtype>_cpu.json and .png (or --out). Seeded.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dwdp.predict import costmodel as cm  # noqa: E402
from dwdp.predict.packing import RequestMix  # noqa: E402
from dwdp.predict.serve_sim import analytic_service, fitted_service, simulate_rates  # noqa: E402
from dwdp.predict.costmodel import OUTSIDE_PARTS  # noqa: E402
from dwdp.predict.simulate import ROWS, SimConfig, simulate  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = (("DWDP merge+mono", "monolithic", True), ("DWDP mono", "monolithic", False), ("DWDP sliced", "tdm", False))
INTERFERENCE_FIELDS = ("power_limit_w", "idle_power_fraction", "compute_power_fraction", "copy_power_fraction",
                       "copy_power_traffic_tb_s", "copy_power_w_per_tb_s", "copy_engine_efficiency", "hbm_tb_s",
                       "nvlink_gb_s")


def print_constants(hw_name: str) -> dict:
    """Every constant the prediction uses beyond model shapes and peaks, with its source."""
    cal, sources = cm.load_calibration(), cm.calibration_sources()
    hw_sources = cm.hardware_sources(hw_name)
    print("Calibration constants (dwdp/predict/data/calibration.json):")
    for name, source in sources.items():
        print(f"  {name:>22} = {getattr(cal, name):<8.4g} {source}")
    print(f"Hardware figures for {hw_name} (dwdp/predict/data/hardware.json):")
    data = cm.data.load_json("hardware.json")[hw_name]
    out = {"calibration": {k: {"value": getattr(cal, k), "source": s} for k, s in sources.items()}, "hardware": {}}
    for name in INTERFERENCE_FIELDS:
        if name in data:
            print(f"  {name:>22} = {data[name]['value']:<8} {hw_sources[name]}")
            out["hardware"][name] = data[name]
    return out


def print_breakdown(cfg: SimConfig, dep: dict, variants: dict) -> None:
    mix = f"std {cfg.isl_std:g}" if cfg.isl_std is not None else f"ratio {cfg.isl_ratio:g}"
    cv = "from packing" if cfg.cv is None else f"{cfg.cv:g}"
    print(f"\nBreakdown per forward, ms (analytic): G={cfg.group_size} ISL={cfg.isl} {mix} MNT={cfg.max_num_tokens} "
          f"CV={cv}; P2P copy overlaps and is not in Iteration (the forward); Host, KV hand-off and Other are paid "
          f"outside the forward by every mode")
    names = ["DEP"] + list(variants)
    print(f"{'category':>19} " + " ".join(f"{n:>16}" for n in names))
    for row in ROWS:
        if row == OUTSIDE_PARTS[0]:
            print(f"{'-- outside --':>19}")
        cells = [dep[row]] + [v.dwdp[row] for v in variants.values()]
        print(f"{row:>19} " + " ".join(f"{1e3 * c:>16.2f}" for c in cells))
    for name, value in (("speedup", "speedup"), ("gain", "gain"), ("forwards' speedup", "forward_speedup")):
        print(f"{name:>19} {'':>16} " + " ".join(f"{getattr(v, value):>16.3f}" for v in variants.values()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="DeepSeek-R1", choices=cm.model_names())
    p.add_argument("--hw", default="GB200-NVL72", choices=cm.hardware_names())
    p.add_argument("--dtype", default="nvfp4", choices=tuple(cm.FORMATS))
    p.add_argument("--group-size", type=int, nargs="+", default=[4])
    p.add_argument("--num-local-experts", type=int, default=None)
    p.add_argument("--isl", type=int, nargs="+", default=[8192], help="longest prompt (uniform) or mean (--isl-std)")
    p.add_argument("--isl-ratio", type=float, nargs="+", default=[0.8],
                   help="prompt lengths uniform in [ratio * isl, isl]")
    p.add_argument("--isl-std", type=float, nargs="+", default=None,
                   help="prompt lengths normal around isl with this standard deviation (replaces --isl-ratio)")
    p.add_argument("--mnts", type=int, nargs="+", default=[16384, 32768], help="max-num-tokens per forward")
    p.add_argument("--cvs", type=float, nargs="+", default=None,
                   help="override the per-rank token CV (default: the spread packing gives)")
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--plan", choices=("tdm", "monolithic", "none"), default="tdm",
                   help="DWDP copy plan in the speedup table (contention stretch simulated)")
    p.add_argument("--merge-copy", action="store_true", help="DWDP merges local and pulled experts (paper baseline)")
    p.add_argument("--slice-mib", type=int, default=1)
    p.add_argument("--inflight", type=int, default=2)
    p.add_argument("--breakdown", action="store_true", help="print the per-category breakdown of every setting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", metavar="JSON", help="where the table goes (a .png beside it); default "
                   "bench/results/simulate_<model>_<hw>_<dtype>_cpu.json, the stored sweep")
    p.add_argument("--context-share", type=float, nargs="+", default=None, metavar="F",
                   help="also print each setting's gain diluted end to end in disaggregated serving, where the "
                        "context servers are this share F of the GPUs and the generation side is unchanged: "
                        "1 / (F / speedup + 1 - F) (a bound: fewer context GPUs for the same load, nothing else)")
    p.add_argument("--ttft-rates", type=float, nargs="+", default=None,
                   help="also predict TTFT p50/p90/p99 of both modes under Poisson arrivals at these requests/s "
                        "(whole group), for the first setting (dwdp.predict.serve_sim)")
    p.add_argument("--ttft-duration", type=float, default=120.0, help="seconds of arrivals per TTFT rate")
    p.add_argument("--ttft-forwards", choices=("packed", "padded"), default="packed",
                   help="forwards of the simulated server: packed (real tokens, long prompts chunked, as `dwdp serve` "
                        "runs them) or padded (B x Tmax)")
    p.add_argument("--ttft-from", metavar="JSON",
                   help="predict TTFT from a `dwdp bench serve` run instead: its rates, mixes, ranks and "
                        "max-num-tokens, forward times fitted to its measured forwards; prints the prediction "
                        "beside the measurement and writes bench/results/simulate_ttft_cpu.json")
    args = p.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if args.ttft_from:
        ttft_from_measurement(Path(args.ttft_from), args.seed)
        return
    constants = print_constants(args.hw)

    mixes = [("std", s) for s in args.isl_std] if args.isl_std else [("ratio", r) for r in args.isl_ratio]
    rows, breakdowns = [], []
    for g, isl, (kind, spread), mnt, cv in itertools.product(args.group_size, args.isl, mixes, args.mnts,
                                                             args.cvs or [None]):
        cfg = SimConfig(args.model, args.hw, g, args.dtype, isl, spread if kind == "ratio" else 1.0,
                        spread if kind == "std" else None, mnt, cv, args.iterations, args.num_local_experts,
                        plan=args.plan, slice_bytes=args.slice_mib << 20, inflight=args.inflight,
                        merge_copy=args.merge_copy, seed=args.seed)
        result = simulate(cfg)
        rows.append(result.row())
        if args.breakdown:
            variants = {name: simulate(dataclasses.replace(cfg, plan=plan, merge_copy=merge))
                        for name, plan, merge in VARIANTS}
            print_breakdown(cfg, result.dep, variants)
            breakdowns.append({"setting": result.row(), "DEP": result.dep,
                               **{name: v.dwdp for name, v in variants.items()}})

    out = Path(args.out) if args.out else RESULTS / f"simulate_{args.model}_{args.hw}_{args.dtype}_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    stem = out.stem
    fig, ax = plt.subplots(figsize=(6.5, 4))
    labels = [f"G{r['group_size']} isl{r['isl']} {r['isl_std'] if r['isl_std'] is not None else r['isl_ratio']} "
              f"mnt{r['max_num_tokens']}" + ("" if r["cv"] is None else f" cv{r['cv']}") for r in rows]
    ax.barh(range(len(rows)), [r["speedup"] for r in rows])
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_yticks(range(len(rows)), labels, fontsize=6)
    ax.set_xlabel("predicted DWDP / DEP tokens per second per GPU")
    ax.set_title(f"{args.model} {args.dtype} on {args.hw}, plan={args.plan} (analytic prediction)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    plt.close(fig)
    out.write_text(json.dumps({
        "what": "analytic prediction from the calibrated cost model, computed on the CPU (nothing measured)",
        "model": args.model, "model_source": cm.preset_source(args.model), "hardware": args.hw,
        "weight_dtype": args.dtype, "iterations": args.iterations, "seed": args.seed, "plan": args.plan,
        "merge_copy": args.merge_copy, "constants": constants, "rows": rows, "breakdowns": breakdowns,
    }, indent=2) + "\n")

    print(f"\nPredicted DWDP/DEP tokens/s per GPU (analytic, not measured): {args.model} {args.dtype} on {args.hw}, "
          f"plan={args.plan}{', merge copy' if args.merge_copy else ''}, {args.iterations} forwards per rank")
    print("speedup and gain (speedup - 1) include the time outside the forward; fwd_spd: the forwards alone")
    print(f"{'G':>3} {'isl':>6} {'mix':>11} {'mnt':>6} {'cv':>5} {'tok/fwd':>8} {'tok_cv':>6} {'speedup':>8} "
          f"{'gain':>7} {'fwd_spd':>7} {'outside':>7} "
          f"{'dep_sync':>8} {'dep_a2a':>8} {'dwdp_wait':>9} {'interf':>7} {'stretch':>7} {'fits':>5}")
    for r in rows:
        mix = f"std {r['isl_std']:g}" if r["isl_std"] is not None else f"ratio {r['isl_ratio']:g}"
        cv = "-" if r["cv"] is None else f"{r['cv']:.2f}"
        print(f"{r['group_size']:>3} {r['isl']:>6} {mix:>11} {r['max_num_tokens']:>6} {cv:>5} "
              f"{r['tokens_per_forward']:>8.0f} {r['token_cv']:>6.3f} {r['speedup']:>8.3f} {r['gain']:>+7.3f} "
              f"{r['forward_speedup']:>7.3f} {r['dep_outside_frac']:>7.3f} {r['dep_sync_frac']:>8.3f} "
              f"{r['dep_a2a_frac']:>8.3f} {r['dwdp_wait_frac']:>9.3f} {r['dwdp_interference_frac']:>7.3f} "
              f"{r['stretch']:>7.3f} {str(r['dwdp_fits']):>5}")
    if args.context_share:
        print("\nGain end to end if the context servers are a share F of the GPUs, the generation side unchanged, "
              "and DWDP saves context GPUs in proportion: 1 / (F / speedup + 1 - F) - 1")
        print(f"{'G':>3} {'isl':>6} {'mnt':>6} {'context gain':>12} " + " ".join(f"{'F=' + format(f, 'g'):>9}"
                                                                           for f in args.context_share))
        for r in rows:
            diluted = [1 / (f / r["speedup"] + 1 - f) - 1 for f in args.context_share]
            print(f"{r['group_size']:>3} {r['isl']:>6} {r['max_num_tokens']:>6} {r['gain']:>+12.3f} "
                  + " ".join(f"{g:>+9.3f}" for g in diluted))
    if args.ttft_rates:
        first = next(iter(itertools.product(args.group_size, args.isl, mixes, args.mnts)))
        g, isl, (kind, spread), mnt = first
        cfg = SimConfig(args.model, args.hw, g, args.dtype, isl, spread if kind == "ratio" else 1.0,
                        spread if kind == "std" else None, mnt, None, 20, args.num_local_experts, plan=args.plan,
                        slice_bytes=args.slice_mib << 20, inflight=args.inflight, seed=args.seed)
        service = analytic_service(cfg, packed=args.ttft_forwards == "packed")
        mix = RequestMix(isl, cfg.isl_ratio, cfg.isl_std)
        predicted = simulate_rates(mix, args.ttft_rates, args.ttft_duration, g, mnt, service, args.seed)
        print(f"\nPredicted TTFT (analytic, not measured): {service.source}; {mix.describe()}, max-num-tokens {mnt}, "
              f"Poisson arrivals for {args.ttft_duration:g} s per rate, router and batching as `dwdp serve`")
        print(ttft_table(predicted))
        path = out.with_name(f"{stem}_ttft.json")
        path.write_text(json.dumps({"what": "analytic prediction (dwdp.predict.serve_sim over the cost model), nothing "
                                    "measured", "service": service.source, "mix": mix.describe(), "group_size": g,
                                    "max_num_tokens": mnt, "rates": args.ttft_rates, "predicted": predicted},
                                   indent=1) + "\n")
    print(f"({time.perf_counter() - start:.1f} s)")


def ttft_table(predicted: dict, measured: dict | None = None) -> str:
    """One line per mode and rate: predicted TTFT p50/p99 (and the measured ones beside them)."""
    lines = [f"{'mode':>14} {'req/s':>6} {'tok/s/rank':>10} {'p50 ms':>8} {'p99 ms':>8}"
             + (f" {'meas p50':>9} {'meas p99':>9}" if measured else "")]
    for mode, rows in predicted.items():
        for i, r in enumerate(rows):
            line = (f"{mode:>14} {r['offered_rps']:>6g} {r['tokens_per_s_per_rank']:>10.0f} "
                    f"{1e3 * r['ttft_p50_s']:>8.0f} {1e3 * r['ttft_p99_s']:>8.0f}")
            if measured:
                m = measured[mode][i]
                line += f" {1e3 * m['ttft_p50_s']:>9.0f} {1e3 * m['ttft_p99_s']:>9.0f}"
            lines.append(line)
    return "\n".join(lines)


def ttft_from_measurement(path: Path, seed: int) -> None:
    """TTFT of both modes predicted from a measured `dwdp bench serve` run's own forwards, beside it."""
    data = json.loads(path.read_text())
    meta, out = data["meta"], {}
    for mix_name, by_variant in data["results"].items():
        if "dwdp" not in by_variant or "dep" not in by_variant:
            continue
        service = fitted_service(data["results"], mix_name, packed=by_variant["dwdp"].get("forwards") == "packed")
        mix = RequestMix.from_description(mix_name)
        rates = meta.get("rates_by_mix", {}).get(mix_name, meta["rates"])
        predicted = simulate_rates(mix, rates, meta["duration_s"], meta["ranks"], meta["max_num_tokens"], service, seed)
        measured = {mode: by_variant[mode]["rows"] for mode in ("dwdp", "dep")}
        print(f"\n{mix_name}: TTFT predicted by dwdp.predict.serve_sim ({service.source}; overheads "
              f"{ {k: round(v, 4) for k, v in service.overhead_s.items()} } s) beside the measurement of {path}")
        print(ttft_table(predicted, measured))
        out[mix_name] = {"service": service.source, "overhead_s": service.overhead_s, "predicted": predicted,
                         "measured": {mode: [{k: r[k] for k in ("offered_rps", "ttft_p50_s", "ttft_p90_s",
                                                                  "ttft_p99_s", "tokens_per_s_per_rank")}
                                             for r in rows] for mode, rows in measured.items()}}
    target = RESULTS / "simulate_ttft_cpu.json"
    target.write_text(json.dumps({"what": "TTFT predicted by a queueing simulation (dwdp.predict.serve_sim) with forward "
                                  "times fitted to the measured run, beside that run's measurement",
                                  "measured_run": str(path), "command": meta["command"], "results": out},
                                 indent=1) + "\n")
    print(f"written {target}")



if __name__ == "__main__":
    main()
