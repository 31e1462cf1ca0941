"""Predicted DWDP gains beside every measured one we can read from the DWDP paper and its authors'
TensorRT-LLM blog (an analytic prediction, computed on the CPU; the measured figures are theirs).

    PYTHONPATH=. python bench/paper_gains.py

Each point is simulated (dwdp.predict.simulate, 200 forwards per rank, seeded) with the calibrated
constants, the time outside the forward included (`speedup`) and left out (`forwards`, the iteration
ratio the tool used to report). Gains are speedup - 1. The points:
- the paper's Table 1 iteration ratio, with and without the merge copy (a forward, not end to end);
- the paper's Table 3b point, ISL 8K, ratio 0.8, max-num-tokens 32K, 1.10 TPS/GPU: the one end-to-end
  point bench/calibrate.py fits the host time to (marked "fit");
- the blog's context-only contention result: sliced copies over one copy per expert and peer, 8 %
  TPS/GPU at ISL 8K, ratio 0.5, max-num-tokens 16K (DWDP against DWDP);
- the blog's end-to-end table (TPS/GPU at matched TPS/user, disaggregated, DWDP on the context
  servers only): the tool predicts the context side; the row shows that gain diluted by the context
  servers' share of the GPUs in the DEP configuration of that TPS/user range in TensorRT-LLM's
  examples/dwdp/dwdp_reproduce.yaml (a bound if DWDP only saves context GPUs; not the tool's output).
Prints the table last; writes bench/results/paper_gains_cpu.json.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

from dwdp.predict.simulate import SimConfig, simulate

HERE = Path(__file__).resolve().parent
BLOG = ("TensorRT-LLM docs/source/blogs/tech_blog/blog19_DWDP_Distributed_Weight_Data_Parallelism_for_High_"
        "Performance_LLM_Inference_on_NVL72.md")
REPRODUCE = "TensorRT-LLM examples/dwdp/dwdp_reproduce.yaml"
# The blog's Table 4: TPS/user range -> measured TPS/GPU speedup; and the DEP configuration of the nearest
# range in the reproduction matrix: (context GPUs, generation GPUs).
E2E = [("20-30", 1.10, "e2e_20_40_dep", 5 * 4, 8), ("40-50", 1.08, "e2e_40_60_dep", 4 * 4, 8),
       ("60-70", 1.10, "e2e_60_80_dep", 7 * 4, 16), ("80-90", 1.06, "e2e_80_100_dep", 4 * 4, 16),
       ("170-180", 0.97, "e2e_160_180_dep", 2 * 4, 32)]


def _calibrate():
    spec = importlib.util.spec_from_file_location("calibrate", HERE / "calibrate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    calibrate = _calibrate()
    fit = calibrate.E2E_SETTING                             # no merge copy, one copy per expert and peer
    table1 = simulate(calibrate.TABLE1_SETTING)             # with the merge copy
    at_fit = simulate(fit)
    short = dataclasses.replace(fit, isl_ratio=0.5, max_num_tokens=16384)
    mono, sliced = simulate(short), simulate(dataclasses.replace(short, plan="tdm"))
    rows = [
        {"point": "Table 1 iteration, merge copy", "source": "DWDP paper, Table 1 (1319.85 / 1165.58 ms)",
         "measured": 1319.85 / 1165.58, "speedup": None, "forwards": table1.forward_speedup},
        {"point": "Table 1 iteration, no merge", "source": f"{BLOG}, Table 3 (1319.85 / 1131.58)",
         "measured": 1319.85 / 1131.58, "speedup": None, "forwards": at_fit.forward_speedup},
        {"point": "Table 3b: ISL 8K r0.8 MNT 32K (fit)", "source": "DWDP paper, Table 3b (issue 43)",
         "measured": calibrate.E2E_SPEEDUP, "speedup": at_fit.speedup, "forwards": at_fit.forward_speedup},
        {"point": "sliced / mono: ISL 8K r0.5 MNT 16K", "source": f"{BLOG}, contention mitigation (+8 %)",
         "measured": 1.08, "speedup": sliced.dwdp_tps_per_gpu / mono.dwdp_tps_per_gpu,
         "forwards": sliced.dwdp_forward_tps_per_gpu / mono.dwdp_forward_tps_per_gpu},
    ]
    for tps_user, measured, config, ctx, gen in E2E:
        share = ctx / (ctx + gen)
        rows.append({"point": f"end to end, {tps_user} TPS/user", "source": f"{BLOG}, Table 4; {REPRODUCE} {config}",
                     "measured": measured, "speedup": 1 / (share / at_fit.speedup + 1 - share),
                     "forwards": 1 / (share / at_fit.forward_speedup + 1 - share), "context_share": share})
    out = HERE / "results" / "paper_gains_cpu.json"
    out.write_text(json.dumps({"what": "predicted DWDP / DEP gains (analytic, computed on the CPU) beside the DWDP "
                               "paper's and blog's measured ones", "settings": {"fit": dataclasses.asdict(fit)},
                               "outside_host_s": at_fit.outside.host_s, "rows": rows}, indent=1) + "\n")
    pct = lambda v: "" if v is None else f"{100 * (v - 1):+.1f}%"  # noqa: E731
    print(f"written {out}\n\nDeepSeek-R1 NVFP4, GB200 NVL72, group 4; gains = speedup - 1; 'speedup' with the time outside "
          f"the forward ({1e3 * at_fit.outside.host_s:.0f} ms host per forward), 'forwards' without it")
    print(f"{'point':>38} {'measured':>9} {'predicted':>9} {'forwards':>9}")
    for r in rows:
        print(f"{r['point']:>38} {pct(r['measured']):>9} {pct(r['speedup']):>9} {pct(r['forwards']):>9}")


if __name__ == "__main__":
    main()
