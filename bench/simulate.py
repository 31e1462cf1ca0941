"""Predicted DWDP-vs-DEP throughput over many forwards, against per-rank imbalance (CV of per-rank
tokens) and max-num-tokens, with prefetch exposure taken from the contention simulation.

Writes bench/results/simulate_<model>_<hw>_g<G>.json and .png; prints the speedup table last. Seeded.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from dwdp import costmodel as cm  # noqa: E402
from dwdp.contention import PullConfig  # noqa: E402
from dwdp.simulate import SimConfig, measure_exposure, simulate  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="DeepSeek-R1", choices=cm.model_names())
    p.add_argument("--hw", default="GB200-NVL72", choices=cm.hardware_names())
    p.add_argument("--dtype", default="nvfp4", choices=tuple(cm.FORMATS))
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--num-local-experts", type=int, default=None)
    p.add_argument("--isl", type=int, default=8192)
    p.add_argument("--cvs", type=float, nargs="+", default=[0.0, 0.1, 0.2, 0.3, 0.4])
    p.add_argument("--mnts", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--plan", choices=("tdm", "monolithic", "none"), default="tdm",
                   help="prefetch plan simulated for the exposure curve; none = uncontended")
    p.add_argument("--slice-mib", type=int, default=1)
    p.add_argument("--inflight", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    spec, hw = cm.load_model(args.model), cm.load_hardware(args.hw)
    curve = None
    if args.plan != "none":
        base = PullConfig(args.group_size, spec.num_experts, spec.expert_nbytes(cm.weight_format(args.dtype)),
                          hw.link_bytes_per_s, mode=args.plan, slice_bytes=args.slice_mib << 20,
                          inflight=1 if args.plan == "monolithic" else args.inflight,
                          num_local_experts=args.num_local_experts, num_layers=5, seed=args.seed)
        curve = measure_exposure(base)
        print("Exposure curve from the contention simulation (mean exposed / T_prefetch per MoE layer):")
        print("  window/T_prefetch " + " ".join(f"{r:>6.2f}" for r in curve.ratios))
        print("  exposed/T_prefetch" + " ".join(f"{e:>7.3f}" for e in curve.exposed))

    rows = []
    for mnt in args.mnts:
        for cv in args.cvs:
            cfg = SimConfig(args.model, args.hw, args.group_size, args.dtype, args.isl, mnt, cv,
                            args.iterations, args.num_local_experts, args.seed)
            rows.append(simulate(cfg, curve).row())

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mnt in args.mnts:
        sel = [r for r in rows if r["max_num_tokens"] == mnt]
        ax.plot([r["cv"] for r in sel], [r["speedup"] for r in sel], "o-", label=f"max_num_tokens={mnt}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("CV of per-rank tokens")
    ax.set_ylabel("DWDP / DEP throughput")
    ax.set_title(f"{args.model} {args.dtype} on {args.hw}, G={args.group_size}, ISL={args.isl}, plan={args.plan}",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    stem = f"simulate_{args.model}_{args.hw}_g{args.group_size}"
    fig.savefig(RESULTS / f"{stem}.png", dpi=120)
    plt.close(fig)
    (RESULTS / f"{stem}.json").write_text(json.dumps({
        "model": args.model, "hardware": args.hw, "weight_dtype": args.dtype, "group_size": args.group_size,
        "isl": args.isl, "iterations": args.iterations, "seed": args.seed, "plan": args.plan,
        "slice_mib": args.slice_mib, "inflight": args.inflight,
        "exposure_curve": None if curve is None else {"ratios": curve.ratios, "exposed": curve.exposed},
        "rows": rows,
    }, indent=2) + "\n")

    print(f"\nDetail at each max_num_tokens (CV = {args.cvs[len(args.cvs) // 2]}):")
    print(f"{'mnt':>7} {'speedup':>8} {'dep_wait':>9} {'dep_a2a':>8} {'dwdp_exp':>9}")
    for r in rows:
        if r["cv"] == args.cvs[len(args.cvs) // 2]:
            print(f"{r['max_num_tokens']:>7} {r['speedup']:>8.3f} {r['dep_wait_frac']:>9.3f} "
                  f"{r['dep_a2a_frac']:>8.3f} {r['dwdp_exposed_frac']:>9.3f}")
    print(f"\nPredicted DWDP/DEP throughput: {args.model} {args.dtype} on {args.hw}, G={args.group_size}, "
          f"ISL={args.isl}, {args.iterations} forwards, plan={args.plan}")
    print(f"{'CV':>5} " + " ".join(f"{'mnt=' + str(m):>10}" for m in args.mnts))
    for cv in args.cvs:
        speed = {r["max_num_tokens"]: r["speedup"] for r in rows if r["cv"] == cv}
        print(f"{cv:>5.2f} " + " ".join(f"{speed[m]:>10.3f}" for m in args.mnts))
    print(f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
