"""Where a serving forward's time goes, DWDP against DEP, when the peer rank is idle and when it is busy.

    PYTHONPATH=. python bench/serve_profile.py            # 2 ranks, tiny preset, one 384-token prompt

Two ranks hold the serving preset in three forms each (DWDP, DEP, replicated: every expert local, no
communication, the compute reference). Per scenario, step after step behind a barrier: rank 0 runs a
forward of one prompt; rank 1 runs one too ("busy", the loaded server) or nothing ("idle", a quiet
server: DEP's rank 1 must take an idle step, whose experts compute rank 0's rows). Per mode and
rank: wall ms of the step (median), CPU ms the rank's process spent in it (all its threads: DWDP's
copiers included), and ms inside the collectives (DEP) or waiting for prefetched experts (DWDP).
Prints the table; writes bench/results/serve_profile_cpu.json with the load average.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dwdp.runtime.baselines import DEPModel, ReplicatedModel
from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.group import init_group, launch_local
from dwdp.runtime.model import DWDPModel
from dwdp.serve.presets import preset_model
from dwdp.observe.timing import load_average_1min, machine

RESULTS = Path(__file__).resolve().parent / "results"


def _rank(rank: int, tokens: int, repeats: int) -> dict:
    group = init_group()
    models = {"replicated": ReplicatedModel(preset_model("tiny", 0)), "dep": DEPModel(preset_model("tiny", 0), group),
              "dwdp": DWDPModel(preset_model("tiny", 0), DWDPConfig(backend="host"), group)}
    ids = torch.randint(3, 512, (1, tokens), generator=torch.Generator().manual_seed(rank))
    out = {}
    for scenario in ("idle", "busy"):
        for mode, model in models.items():
            runs = []
            for i in range(repeats + 2):  # two warm-up steps
                group.barrier()
                wall, cpu = time.perf_counter(), time.process_time()
                comm = model.stats.comm_s if mode == "dep" else model.stats.wait_s if mode == "dwdp" else 0.0
                with torch.inference_mode():
                    if rank == 0 or scenario == "busy":
                        model(input_ids=ids)
                    elif mode == "dep":
                        model.idle_step()
                wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                comm = (model.stats.comm_s if mode == "dep" else model.stats.wait_s if mode == "dwdp" else 0.0) - comm
                if i >= 2:
                    runs.append((wall, cpu, comm))
            out[f"{scenario}/{mode}"] = {k: 1e3 * statistics.median(r[j] for r in runs)
                                         for j, k in enumerate(("wall_ms", "cpu_ms", "comm_or_wait_ms"))}
    models["dwdp"].close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=384, help="prompt tokens per forward (default 384)")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", default=str(RESULTS / "serve_profile_cpu.json"))
    args = p.parse_args()
    before = load_average_1min()
    per_rank = launch_local(_rank, 2, (args.tokens, args.repeats), timeout_s=900)
    after = load_average_1min()
    rows = []
    for key in per_rank[0]:
        scenario, mode = key.split("/")
        r0, r1 = per_rank[0][key], per_rank[1][key]
        rows.append({"scenario": scenario, "mode": mode, "rank0": r0, "rank1": r1})
    Path(args.out).write_text(json.dumps({
        "command": f"PYTHONPATH=. python bench/serve_profile.py --tokens {args.tokens} --repeats {args.repeats}",
        "machine": machine(), "load_average_1min": {"before": before, "after": after}, "rows": rows}, indent=1) + "\n")
    print(f"2 ranks, one {args.tokens}-token prompt per busy rank, medians of {args.repeats} steps; 1-min load average "
          f"{before:.2f} before, {after:.2f} after; {args.out}")
    print(f"{'scenario':>8} {'mode':>10} {'r0 wall ms':>10} {'r0 cpu ms':>9} {'r0 comm/wait':>12} {'r1 wall ms':>10} "
          f"{'r1 cpu ms':>9} {'r1 comm/wait':>12}")
    for r in rows:
        a, b = r["rank0"], r["rank1"]
        print(f"{r['scenario']:>8} {r['mode']:>10} {a['wall_ms']:>10.1f} {a['cpu_ms']:>9.1f} "
              f"{a['comm_or_wait_ms']:>12.1f} {b['wall_ms']:>10.1f} {b['cpu_ms']:>9.1f} {b['comm_or_wait_ms']:>12.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
