"""Fit the cost model's six calibration constants to the DEP4 column of the DWDP paper's Table 1, and
the host time every mode pays per forward outside it to one end-to-end point, and write them, each
with its source, to dwdp/predict/data/calibration.json.

Table 1: DeepSeek-R1 NVFP4 on GB200 NVL72, group 4, ISL 8K with prompt lengths uniform in
[0.8 ISL, ISL], max-num-tokens 32K, context only; per iteration (one forward of every layer).
The figures are milliseconds per forward (a copy of these figures labelled microseconds cannot be right):
each DWDP forward pulls 58 layers x 4.76 GB, which takes 307 ms at the full 900 GB/s, so a 429 us
copy (or 429 us per layer) is impossible, while 429 ms is 72 % of the link.

Each constant is solved by bisection so that the simulated DEP category matches the measured one;
the loop runs twice because a constant can shift another category a little (memory efficiency
enters the GEMMs' weight reads). The DWDP column is not used: it is what the fitted model predicts
(tests/test_calibration.py).

Then the time outside the forward (dwdp.predict.costmodel.outside): its KV hand-off is derived (KV
bytes per token over the link), its host part is solved (secant) so that the simulated DWDP4 / DEP4
tokens per second per GPU at the paper's Table 3b point (ISL 8K, ratio 0.8, max-num-tokens 32K:
measured 1.10) comes out; DWDP as the paper ran it there (no merge copy, one copy per expert and
peer). That is the only end-to-end figure used: the paper's other end-to-end points judge the fit.

Prints a table last; writes bench/results/calibrate_cpu.json too (analytic model evaluated on the
CPU, nothing measured here).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from dwdp.predict import costmodel as cm
from dwdp.predict.simulate import SimConfig, simulate, simulate_dep, workload

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
DATA = ROOT / "dwdp" / "predict" / "data" / "calibration.json"
TABLE1_SETTING = SimConfig(model="DeepSeek-R1", hardware="GB200-NVL72", group_size=4, weight_dtype="nvfp4", isl=8192,
                           isl_ratio=0.8, max_num_tokens=32768, iterations=200, plan="monolithic", merge_copy=True)
# Table 1, DEP4 column, milliseconds per forward: the fit targets.
TABLE1_DEP_MS = {"Attention": 269.67, "GroupedGEMM": 342.40, "DenseGEMM": 177.50, "Others": 241.69,
                 "Communication": 126.74, "Synchronization": 161.85}
# The one end-to-end point: the paper's Table 3b, DWDP4 / DEP4 tokens/s per GPU at ISL 8K, ratio 0.8, MNT 32K.
E2E_SETTING = dataclasses.replace(TABLE1_SETTING, merge_copy=False)
E2E_SPEEDUP = 1.10
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


def fit_outside_host(cal: cm.Calibration, tol: float = 1e-6, rounds: int = 20) -> cm.Calibration:
    """outside_host_s solved by the secant method so that the simulated speedup at E2E_SETTING is
    E2E_SPEEDUP (the speedup falls smoothly as the host time grows: it dilutes both modes' forwards)."""
    def miss(host_s: float) -> float:
        return simulate(E2E_SETTING, cal.replace(outside_host_s=host_s)).speedup - E2E_SPEEDUP

    x0, x1 = 0.0, 0.5
    f0, f1 = miss(x0), miss(x1)
    if f0 < 0:
        raise ValueError(f"the forwards alone give {f0 + E2E_SPEEDUP:.4f} <= {E2E_SPEEDUP}: no host time can explain it")
    for _ in range(rounds):
        if abs(f1) <= tol:
            return cal.replace(outside_host_s=x1)
        x0, x1, f0 = x1, max(0.0, x1 - f1 * (x1 - x0) / (f1 - f0)), f1
        f1 = miss(x1)
    raise ValueError(f"outside_host_s did not converge: {x1} s leaves the speedup {f1:+.2e} off {E2E_SPEEDUP}")


def main() -> None:
    cal = fit_outside_host(fit())
    data = {"_doc": ("Constants fitted to the DEP4 column of the DWDP paper's Table 1 (DeepSeek-R1 NVFP4, GB200 NVL72, "
                     "group 4, ISL 8K, lengths in [0.8 ISL, ISL], max-num-tokens 32K, context only), and the host "
                     "time outside the forward fitted to one end-to-end point (the paper's Table 3b at that setting), "
                     "by bench/calibrate.py, which rewrites this file. Those figures are therefore not independent "
                     "checks of these values; the DWDP column and the other end-to-end points are predicted from them.")}
    for name, (category, _) in FITS.items():
        data[name] = {"value": round(getattr(cal, name), 4),
                      "source": f"fitted: {WHAT[name]}; solved so that the simulated DEP4 {category} matches Table 1's "
                                f"{TABLE1_DEP_MS[category]} ms per forward"}
    data["clock_power_exponent"] = {
        "value": 1.0,
        "source": ("chosen, not fitted: dynamic power of a compute-bound kernel taken proportional to clock (fixed "
                   "voltage), the smallest physical exponent; Table 1's DWDP attention slowdown (1.19x) was in view "
                   "when choosing it, so that figure is not a fully independent check")}
    data["outside_host_s"] = {
        "value": round(cal.outside_host_s, 4),
        "source": (f"fitted: seconds per forward every mode pays outside it for host work (scheduling, sampling, "
                   f"host work, iteration gaps); solved so that the simulated DWDP4 / DEP4 tokens per second per GPU "
                   f"at the paper's Table 3b point (ISL {E2E_SETTING.isl}, ratio {E2E_SETTING.isl_ratio}, "
                   f"max-num-tokens {E2E_SETTING.max_num_tokens}, no merge copy, one copy per expert) is its "
                   f"measured {E2E_SPEEDUP}, with the KV hand-off derived (KV bytes per token over the copy engines' "
                   f"NVLink rate); the only end-to-end figure fitted")}
    data["outside_other_s"] = {
        "value": 0.0,
        "source": ("chosen, not fitted: seconds per forward outside it for anything but host work and the KV hand-off; "
                   "one end-to-end point cannot tell it from the host part, which holds it all; kept apart so "
                   "that a second measured point can split them")}
    DATA.write_text(json.dumps(data, indent=2) + "\n")
    cm.load_calibration.cache_clear()
    got = dep_row(cm.load_calibration())
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "calibrate_cpu.json").write_text(json.dumps(
        {"note": "analytic model evaluated on the CPU; targets from the DWDP paper's Table 1 (DEP4, ms per forward)",
         "calibration": {k: v["value"] for k, v in data.items() if not k.startswith("_")},
         "target_ms": TABLE1_DEP_MS, "fitted_ms": got,
         "e2e_target_speedup": E2E_SPEEDUP, "e2e_fitted_speedup": simulate(E2E_SETTING).speedup}, indent=2) + "\n")
    print(f"wrote {DATA.relative_to(ROOT)}")
    print(f"{'constant':>16} {'value':>8}  fitted on")
    for name, (category, _) in FITS.items():
        print(f"{name:>16} {data[name]['value']:>8.4f}  DEP4 {category}")
    print(f"{'outside_host_s':>16} {data['outside_host_s']['value']:>8.4f}  Table 3b DWDP4 / DEP4 = {E2E_SPEEDUP}")
    print(f"\n{'category':>16} {'Table 1 ms':>11} {'model ms':>9}")
    for category, target in TABLE1_DEP_MS.items():
        print(f"{category:>16} {target:>11.2f} {got[category]:>9.2f}")
    e2e = simulate(E2E_SETTING)
    print(f"{'Table 3b speedup':>16} {E2E_SPEEDUP:>11.3f} {e2e.speedup:>9.3f}  (forwards alone {e2e.forward_speedup:.3f})")


if __name__ == "__main__":
    main()
