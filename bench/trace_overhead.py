"""What trace recording costs: forward time with recording off vs on, on the demo model.

Each rank of a local group holds two identical DWDP models, one recording and one not, and times
them in alternating rounds so both see the same machine state. Prints a table last; writes
bench/results/trace_overhead_<device>.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from dwdp import DWDPConfig, DWDPModel, init_group
from dwdp.demo import rank_prompts
from dwdp.models.demo_model import DEMO_MODEL
from dwdp.runtime.group import launch_local
from dwdp.models.tiny import build_tiny_model
from dwdp.observe.timing import device_tag, load_average_1min, machine

RESULTS = Path(__file__).resolve().parent / "results"


def _rank(rank: int, rounds: int, max_len: int) -> dict:
    group = init_group()
    ids, mask, tokens = rank_prompts(rank, 0, 2, max_len, DEMO_MODEL["vocab"])
    with tempfile.TemporaryDirectory() as trace_dir:
        off = DWDPModel(build_tiny_model("deepseek_v3", **DEMO_MODEL), DWDPConfig(backend="host"), group)
        on = DWDPModel(build_tiny_model("deepseek_v3", **DEMO_MODEL), DWDPConfig(backend="host"), group,
                       trace=trace_dir)
        times = {"off": [], "on": []}
        with torch.no_grad():
            for model in (off, on):  # warm-up outside the timed rounds
                model(input_ids=ids, attention_mask=mask)
            for _ in range(rounds):
                for name, model in (("off", off), ("on", on)):
                    start = time.perf_counter()
                    model(input_ids=ids, attention_mask=mask)
                    times[name].append(time.perf_counter() - start)
        events = len(on.recorder._events)
        off.close()
        on.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"rank": rank, "tokens": tokens, "off_ms": 1e3 * med["off"], "on_ms": 1e3 * med["on"],
            "ratio_on_off": med["on"] / med["off"], "events_recorded": events,
            "off_spread_ms": 1e3 * (max(times["off"]) - min(times["off"]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--max-len", type=int, default=64)
    args = parser.parse_args()
    load_before = load_average_1min()
    rows = launch_local(_rank, args.ranks, (args.rounds, args.max_len), timeout_s=600)
    load = {"before": load_before, "after": load_average_1min()}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"trace_overhead_{device_tag()}.json"
    out.write_text(json.dumps({"argv": sys.argv, "ranks": args.ranks, "rounds": args.rounds, "max_len": args.max_len,
                               "model": DEMO_MODEL, "machine": machine(), "load_average_1min": load,
                               "rows": rows}, indent=2) + "\n")
    print(f"{machine()['cpu_count']} CPUs, 1-min load average {load['before']:.2f} before, {load['after']:.2f} after")
    print(f"{'rank':>4}  {'tokens':>6}  {'off ms':>8}  {'on ms':>8}  {'on/off':>7}  {'off spread ms':>13}  "
          f"{'events':>7}")
    for r in rows:
        print(f"{r['rank']:>4}  {r['tokens']:>6}  {r['off_ms']:>8.2f}  {r['on_ms']:>8.2f}  {r['ratio_on_off']:>7.3f}  "
              f"{r['off_spread_ms']:>13.2f}  {r['events_recorded']:>7}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
