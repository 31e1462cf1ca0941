"""Contention of asynchronous expert pulls: the analytic table of contention degree C for group
sizes 3..16 next to the simulated one, then exposed prefetch wait per layer for monolithic
per-expert pulls vs TDM slices.

Writes bench/results/contention_<model>_<hw>.json and .png; prints the exposure table last. Seeded.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dwdp.predict import costmodel as cm  # noqa: E402
from dwdp.predict.contention import PullConfig, contention_table, simulate_pulls  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MAX_C = 5  # columns shown; the JSON keeps every degree


def offered_histograms(group_sizes, num_layers: int, seed: int) -> dict[int, np.ndarray]:
    """Simulated contention under the table's premise: random sources, non-serialising, always pulling."""
    out = {}
    for n in group_sizes:
        cfg = PullConfig(n, 4 * n, (1,), 1.0, mode="random", inflight=1, serialise=False, window_s=0.0,
                         num_layers=num_layers, num_samples=1500, seed=seed + n)
        out[n] = simulate_pulls(cfg).contention_hist
    return out


def plans(slice_mib: list[int]) -> list[tuple[str, dict]]:
    out = [("monolithic k=1", dict(mode="monolithic", inflight=1))]
    for mib in slice_mib:
        out.append((f"tdm {mib}MiB k=1", dict(mode="tdm", slice_bytes=mib << 20, inflight=1)))
        out.append((f"tdm {mib}MiB k=2", dict(mode="tdm", slice_bytes=mib << 20, inflight=2)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="DeepSeek-R1", choices=cm.model_names())
    p.add_argument("--hw", default="GB200-NVL72", choices=cm.hardware_names())
    p.add_argument("--dtype", default="nvfp4", choices=tuple(cm.FORMATS))
    p.add_argument("--group-sizes", type=int, nargs="+", default=[4, 8])
    p.add_argument("--ratios", type=float, nargs="+", default=[0.0, 1.0, 1.25],
                   help="compute window / uncontended prefetch time (0 = prefetch-bound)")
    p.add_argument("--slice-mib", type=int, nargs="+", default=[1, 4])
    p.add_argument("--window-cv", type=float, default=0.1)
    p.add_argument("--layers", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    table = contention_table(range(3, 17))
    offered = offered_histograms(range(3, 17), 60, args.seed)
    print("Contention degree C = 1 + Binomial(N-2, 1/(N-1)): analytic P(C=c) | simulated (random pulls)")
    print(f"{'N':>3} " + " ".join(f"{'P(C=' + str(c) + ')':>8}" for c in range(1, MAX_C + 1))
          + f" {'P(C>=3)':>8} {'E[C]':>6} | " + " ".join(f"{'sim C=' + str(c):>8}" for c in range(1, 4))
          + f" {'max|d|':>7}")
    for n, pmf in table.items():
        sim = offered[n]
        cells = [pmf[c - 1] if c - 1 < len(pmf) else 0.0 for c in range(1, MAX_C + 1)]
        print(f"{n:>3} " + " ".join(f"{v:>8.4f}" for v in cells) + f" {pmf[2:].sum():>8.4f}"
              f" {(np.arange(1, n) * pmf).sum():>6.3f} | " + " ".join(f"{v:>8.4f}" for v in sim[:3])
              + f" {np.abs(sim - pmf).max():>7.4f}")

    spec, hw = cm.load_model(args.model), cm.load_hardware(args.hw)
    fmt = cm.weight_format(args.dtype)
    rows, waits = [], {}
    for n in args.group_sizes:
        base = PullConfig(n, spec.num_experts, spec.expert_nbytes(fmt), hw.link_bytes_per_s,
                          window_cv=args.window_cv, num_layers=args.layers, num_samples=500, seed=args.seed)
        for ratio in args.ratios:
            for name, knobs in plans(args.slice_mib):
                cfg = dataclasses.replace(base, **knobs)
                unc = cm.prefetch_time(spec, hw, cm.Deployment(n, weight_dtype=args.dtype))
                result = simulate_pulls(dataclasses.replace(cfg, window_s=ratio * unc))
                exposed = result.exposed_s[:, 1:].ravel()  # layer 0 left out: peers not yet all pulling
                hist = result.contention_hist
                waits[(n, ratio, name)] = exposed
                rows.append({
                    "group_size": n, "ratio": ratio, "plan": name, "transfers_per_layer": result.transfers_per_layer,
                    "uncontended_ms": 1e3 * result.uncontended_s,
                    "prefetch_over_uncontended": float(result.prefetch_s[:, 1:].mean() / result.uncontended_s),
                    "exposed_mean_ms": 1e3 * float(exposed.mean()),
                    "exposed_p50_ms": 1e3 * float(np.percentile(exposed, 50)),
                    "exposed_p90_ms": 1e3 * float(np.percentile(exposed, 90)),
                    "exposed_max_ms": 1e3 * float(exposed.max()),
                    "mean_contention": float((np.arange(1, n) * hist).sum()),
                    "contention_hist": hist.tolist(),
                })

    fig, axes = plt.subplots(1, len(args.group_sizes), figsize=(5 * len(args.group_sizes), 3.8), squeeze=False)
    ratio = args.ratios[min(1, len(args.ratios) - 1)]
    for ax, n in zip(axes[0], args.group_sizes):
        for name, _ in plans(args.slice_mib):
            ax.hist(1e3 * waits[(n, ratio, name)], bins=30, histtype="step", label=name)
        ax.set_title(f"G={n}, window = {ratio} x uncontended prefetch", fontsize=9)
        ax.set_xlabel("exposed wait per layer (ms)")
        ax.set_ylabel("rank-layers")
        ax.legend(fontsize=7)
    fig.tight_layout()
    stem = f"contention_{args.model}_{args.hw}"
    fig.savefig(RESULTS / f"{stem}.png", dpi=120)
    plt.close(fig)
    (RESULTS / f"{stem}.json").write_text(json.dumps({
        "model": args.model, "hardware": args.hw, "weight_dtype": args.dtype, "seed": args.seed,
        "layers": args.layers, "window_cv": args.window_cv,
        "analytic": {str(n): pmf.tolist() for n, pmf in table.items()},
        "simulated_random_pulls": {str(n): h.tolist() for n, h in offered.items()},
        "exposure": rows,
    }, indent=2) + "\n")

    print(f"\nExposed prefetch wait per MoE layer: {args.model} {args.dtype} on {args.hw} "
          f"({args.layers} layers, layer 0 left out, window CV {args.window_cv})")
    head = ("G", "ratio", "plan", "xfers", "unc_ms", "pf/unc", "exp_mean", "exp_p50", "exp_p90", "exp_max", "E[C]")
    print(f"{head[0]:>3} {head[1]:>5} {head[2]:>15} " + " ".join(f"{h:>8}" for h in head[3:]))
    for r in rows:
        print(f"{r['group_size']:>3} {r['ratio']:>5.2f} {r['plan']:>15} {r['transfers_per_layer']:>8d} "
              f"{r['uncontended_ms']:>8.3f} {r['prefetch_over_uncontended']:>8.3f} {r['exposed_mean_ms']:>8.3f} "
              f"{r['exposed_p50_ms']:>8.3f} {r['exposed_p90_ms']:>8.3f} {r['exposed_max_ms']:>8.3f} "
              f"{r['mean_contention']:>8.3f}")
    print(f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
