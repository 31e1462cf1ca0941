"""Fit the cost model's six calibration constants to the DEP4 column of the DWDP paper's Table 1 and
write them, each with its source, to dwdp/predict/data/calibration.json.

Table 1: DeepSeek-R1 NVFP4 on GB200 NVL72, group 4, ISL 8K with prompt lengths uniform in
[0.8 ISL, ISL], max-num-tokens 32K, context only; per iteration (one forward of every layer).
The figures are milliseconds per forward (a copy of these figures labelled microseconds cannot be right):
each DWDP forward pulls 58 layers x 4.76 GB, which takes 307 ms at the full 900 GB/s, so a 429 us
copy (or 429 us per layer) is impossible, while 429 ms is 72 % of the link.

Each constant is solved by bisection so that the simulated DEP category matches the measured one;
the loop runs twice because a constant can shift another category a little (memory efficiency
enters the GEMMs' weight reads). The DWDP column is not used: it is what the fitted model predicts
(tests/test_calibration.py). Prints a table last; writes bench/results/calibrate_cpu.json too
(analytic model evaluated on the CPU, nothing measured here).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dwdp.predict import costmodel as cm
from dwdp.predict.simulate import SimConfig, simulate_dep, workload

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DATA = ROOT / "dwdp" / "data" / "calibration.json"
TABLE1_SETTING = SimConfig(model="DeepSeek-R1", hardware="GB200-NVL72", group_size=4, weight_dtype="nvfp4", isl=8192,
                           isl_ratio=0.8, max_num_tokens=32768, iterations=200, plan="monolithic", merge_copy=True)
# Table 1, DEP4 column, milliseconds per forward: the fit targets.
TABLE1_DEP_MS = {"Attention": 269.67, "GroupedGEMM": 342.40, "DenseGEMM": 177.50, "Others": 241.69,
                 "Communication": 126.74, "Synchronization": 161.85}
# constant -> (category it is solved from, whether the category grows with the constant)
FITS = {"memory": ("Others", False), "attention": ("Attention", False), "dense_gemm": ("DenseGEMM", False),
        "grouped_gemm": ("GroupedGEMM", False), "all_to_all": ("Communication", False),
        "expert_load_cv": ("Synchronization", True)}
BOUNDS = {"expert_load_cv": (0.0, 2.0)}
WHAT = {
    "attention": "share of the bf16 tensor-core peak the attention kernel reaches",
    "grouped_gemm": "share of the tensor-core peak the routed experts' grouped GEMMs reach",
    "dense_gemm": "share of the tensor-core peak the dense GEMMs (attention projections, router, shared experts) reach",
    "memory": "share of the HBM peak memory-bound kernels (and the merge copy) reach",
    "all_to_all": "share of the NVLink per-direction rate DEP's dispatch + combine reach",
    "expert_load_cv": "per-layer CV of routed rows across DEP ranks (expert skew and other per-step jitter)",
}


def dep_row(cal: cm.Calibration, cfg: SimConfig = TABLE1_SETTING) -> dict:
    """The DEP breakdown of the Table 1 setting in ms per forward (same draws every call)."""
    spec, hw = cm.load_model(cfg.model), cm.load_hardware(cfg.hardware)
    rng = np.random.default_rng(cfg.seed)
    shape = workload(cfg, rng)
    row, _ = simulate_dep(spec, hw, cfg.deployment, cal, shape, rng)
    return {k: 1e3 * v for k, v in row.items()}


def solve(cal: cm.Calibration, name: str, rounds: int = 20) -> cm.Calibration:
    """Bisect constant `name` until its category matches Table 1."""
    category, rising = FITS[name]
    low, high = BOUNDS.get(name, (1e-3, 1.0))
    for _ in range(rounds):
        mid = (low + high) / 2
        above = dep_row(cal.replace(**{name: mid}))[category] > TABLE1_DEP_MS[category]
        if above == rising:
            high = mid
        else:
            low = mid
    value = (low + high) / 2
    if name != "expert_load_cv" and high >= 1.0 - 1e-6:
        raise ValueError(f"{name} would exceed 1: the model cannot reach Table 1's {category} at any efficiency")
    return cal.replace(**{name: value})


def fit() -> cm.Calibration:
    cal = cm.IDEAL
    for _ in range(2):
        for name in FITS:
            cal = solve(cal, name)
    return cal


def main() -> None:
    cal = fit()
    data = {"_doc": ("Constants fitted to the DEP4 column of the DWDP paper's Table 1 (DeepSeek-R1 NVFP4, GB200 NVL72, "
                     "group 4, ISL 8K, lengths in [0.8 ISL, ISL], max-num-tokens 32K, context only) by "
                     "bench/calibrate.py, which rewrites this file. That column is therefore not an independent "
                     "check of these values; the DWDP column is predicted from them.")}
    for name, (category, _) in FITS.items():
        data[name] = {"value": round(getattr(cal, name), 4),
                      "source": f"fitted: {WHAT[name]}; solved so that the simulated DEP4 {category} matches Table 1's "
                                f"{TABLE1_DEP_MS[category]} ms per forward"}
    data["clock_power_exponent"] = {
        "value": 1.0,
        "source": ("chosen, not fitted: dynamic power of a compute-bound kernel taken proportional to clock (fixed "
                   "voltage), the smallest physical exponent; Table 1's DWDP attention slowdown (1.19x) was in view "
                   "when choosing it, so that figure is not a fully independent check")}
    DATA.write_text(json.dumps(data, indent=2) + "\n")
    cm.load_calibration.cache_clear()
    got = dep_row(cm.load_calibration())
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "calibrate_cpu.json").write_text(json.dumps(
        {"note": "analytic model evaluated on the CPU; targets from the DWDP paper's Table 1 (DEP4, ms per forward)",
         "calibration": {k: v["value"] for k, v in data.items() if not k.startswith("_")},
         "target_ms": TABLE1_DEP_MS, "fitted_ms": got}, indent=2) + "\n")
    print(f"wrote {DATA.relative_to(ROOT)}")
    print(f"{'constant':>16} {'value':>8}  fitted on")
    for name, (category, _) in FITS.items():
        print(f"{name:>16} {data[name]['value']:>8.4f}  DEP4 {category}")
    print(f"\n{'category':>16} {'Table 1 ms':>11} {'model ms':>9}")
    for category, target in TABLE1_DEP_MS.items():
        print(f"{category:>16} {target:>11.2f} {got[category]:>9.2f}")


if __name__ == "__main__":
    main()
