"""The calibrated model against the DWDP paper's Table 1, the measured oracle.

Table 1: DeepSeek-R1 NVFP4 on GB200 NVL72, group 4, ISL 8K with prompt lengths uniform in
[0.8 ISL, ISL], max-num-tokens 32K, context only; per forward (the issue quotes microseconds, the
copy volume makes them milliseconds: bench/calibrate.py). DWDP4 is the paper's baseline: local and
pulled experts merged by a D2D copy, one copy per expert (no slicing).

The DEP4 column is what bench/calibrate.py fits six constants to, so matching it only shows the fit
converged; the DWDP4 column is predicted from those constants, the interference model and the hardware
data (structural choices were made with it in view: docs/performance-model.md).
"""
import dataclasses
import importlib.util
import math
from pathlib import Path

import pytest

from dwdp.predict import costmodel as cm
from dwdp.predict.simulate import SimConfig, simulate

ROOT = Path(__file__).resolve().parent.parent
TABLE1 = SimConfig(model="DeepSeek-R1", hardware="GB200-NVL72", group_size=4, weight_dtype="nvfp4", isl=8192,
                   isl_ratio=0.8, max_num_tokens=32768, iterations=200, plan="monolithic", merge_copy=True)
# Table 1 of the DWDP paper, milliseconds per forward.
MEASURED = {
    "DEP": {"Attention": 269.67, "GroupedGEMM": 342.40, "DenseGEMM": 177.50, "Others": 241.69,
            "Communication": 126.74, "D2D copy": 0.0, "P2P copy": 0.0, "Synchronization": 161.85,
            "Iteration": 1319.85},
    "DWDP": {"Attention": 320.56, "GroupedGEMM": 337.42, "DenseGEMM": 189.28, "Others": 284.32,
             "Communication": 0.0, "D2D copy": 34.00, "P2P copy": 429.00, "Synchronization": 0.0,
             "Iteration": 1165.58},
}
CATEGORY_TOL, ITERATION_TOL = 0.05, 0.03


@pytest.fixture(scope="module")
def table1():
    result = simulate(TABLE1)
    return {"DEP": {k: 1e3 * v for k, v in result.dep.items()}, "DWDP": {k: 1e3 * v for k, v in result.dwdp.items()}}


@pytest.mark.parametrize("scheme", ["DEP", "DWDP"])
def test_table1_breakdown_within_tolerance(table1, scheme):
    got, want = table1[scheme], MEASURED[scheme]
    report = "\n".join(f"{k:>16} model {got[k]:9.2f} measured {v:9.2f}" for k, v in want.items())
    for category, measured in want.items():
        tol = ITERATION_TOL if category == "Iteration" else CATEGORY_TOL
        if measured == 0.0:
            assert got[category] == 0.0, f"{scheme} {category}: model {got[category]} where Table 1 has none\n{report}"
        else:
            err = got[category] / measured - 1
            assert abs(err) <= tol, f"{scheme} {category}: {100 * err:+.1f} % (tolerance {100 * tol:.0f} %)\n{report}"
    # Table 1 has no prefetch waits: the copies hide.
    assert got["Prefetch wait"] <= 0.01 * got["Iteration"], f"{scheme} waits {got['Prefetch wait']} ms"


def test_table1_speedup_and_merge_elimination(table1):
    # The paper: DWDP4 1.13x DEP4 per iteration; removing the merge copy alone gave ~3 %.
    dep, dwdp = table1["DEP"]["Iteration"], table1["DWDP"]["Iteration"]
    want = MEASURED["DEP"]["Iteration"] / MEASURED["DWDP"]["Iteration"]
    assert abs(dep / dwdp / want - 1) <= 0.03, f"iteration ratio {dep / dwdp:.3f} vs measured {want:.3f}"
    no_merge = simulate(dataclasses.replace(TABLE1, merge_copy=False))
    gain = 1 - no_merge.dwdp["Iteration"] * 1e3 / dwdp
    assert 0.02 <= gain <= 0.04, f"merge elimination gains {100 * gain:.1f} %, the paper ~3 %"


def test_calibration_file_is_the_fit_of_table1():
    spec = importlib.util.spec_from_file_location("calibrate", ROOT / "bench" / "calibrate.py")
    calibrate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calibrate)
    fitted, stored = calibrate.fit(), cm.load_calibration()
    for name in calibrate.FITS:
        assert math.isclose(getattr(fitted, name), getattr(stored, name), rel_tol=1e-3), \
            f"{name}: refit {getattr(fitted, name)} vs dwdp/predict/data/calibration.json {getattr(stored, name)}"
    for name, source in cm.calibration_sources().items():
        assert ("fitted" in source or "chosen" in source) and len(source) > 40, f"{name}: source {source!r}"


def test_outside_host_time_is_the_fit_of_the_one_end_to_end_point():
    """bench/calibrate.py solves outside_host_s on Table 3b's point alone; refitting from zero lands on
    the stored value, and its source says where it comes from."""
    spec = importlib.util.spec_from_file_location("calibrate", ROOT / "bench" / "calibrate.py")
    calibrate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(calibrate)
    stored = cm.load_calibration()
    refit = calibrate.fit_outside_host(stored.replace(outside_host_s=0.0))
    assert math.isclose(refit.outside_host_s, stored.outside_host_s, rel_tol=1e-3), (refit.outside_host_s,
                                                                                    stored.outside_host_s)
    source = cm.calibration_sources()["outside_host_s"]
    assert "fitted" in source and "Table 3b" in source and str(calibrate.E2E_SPEEDUP) in source, source


def test_predict_uses_the_calibrated_constants():
    # bench/roofline.py and crossover_isl go through cm.predict / cm.prefetch_hidden with cal=None.
    spec, hw = cm.load_model("DeepSeek-R1"), cm.load_hardware("GB200-NVL72")
    w = cm.Workload(8192, 32768)
    default, loaded = cm.predict(spec, hw, w, TABLE1.deployment), cm.predict(spec, hw, w, TABLE1.deployment,
                                                                            cm.load_calibration())
    ideal = cm.predict(spec, hw, w, TABLE1.deployment, cm.IDEAL)
    assert default.row() == loaded.row(), "predict's default is not the calibrated model"
    assert default.t_compute > 1.5 * ideal.t_compute and default.slowdown.compute > 1.1, (default.row(), ideal.row())
