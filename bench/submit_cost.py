"""Host cost of issuing one layer's copies on the cuda backend, and which layer of software it goes to.

    PYTHONPATH=. python bench/submit_cost.py                     # 8 .. 512 copies per batch
    PYTHONPATH=. python bench/submit_cost.py --copies 8,128 --repeats 9

Rows, per number of copies:
  transport submit    CudaTransport.submit of a plan with that many slices (4 batches) after its first
                      submit, every device call a no-op: the transport's own Python work per layer
  prepare             cuda_api.prepare_batch of one batch: building its arguments (once per plan)
  bindings call       cuda_api.memcpy_prepared_batch of a prepared batch. Without a GPU (or with
                      CUDA_VISIBLE_DEVICES='') the real cuda.bindings convert the tuples to C arrays and
                      the runtime returns error 35 (100): the conversion alone. With a GPU: conversion,
                      runtime and driver, copies of --slice-bytes inside the device
  prepare + call      cuda_api.memcpy_batch_async: both on every call
With a GPU the script also runs itself with CUDA_VISIBLE_DEVICES='' and reports that conversion on
the same CPU, so the driver's share is the difference. Without a driver each bindings call also
raises (and names) error 35, a few microseconds whatever the copy count: the slope per extra copy
between the first and last rows is the conversion's own cost. Times are the fewest microseconds per call
over --repeats runs of --calls calls (the least disturbed run on a shared machine), with the median
beside it. Writes bench/results/submit_cost_<device>.json with the machine and its 1-min load.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from dwdp.benchmarks.submit_cost import bindings_calls, bindings_version, device_usable, no_device_submit
from dwdp.observe.timing import device_tag, load_average_1min, machine

RESULTS = Path(__file__).resolve().parent / "results"


def _per_call_us(fn, calls: int, repeats: int, after=None) -> tuple[float, float]:
    """(fewest, median) microseconds per call of fn over `repeats` runs of `calls` calls; `after()`
    runs untimed after each run (on a GPU: drain the copies those calls queued)."""
    fn()
    if after is not None:
        after()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter_ns() - t0) / calls / 1e3)
        if after is not None:
            after()
    return min(runs), statistics.median(runs)


def measure(copies_list: list[int], slice_bytes: int, calls: int, repeats: int, device: bool) -> list[dict]:
    rows = []
    for copies in copies_list:
        submit, slices = no_device_submit(copies)
        bindings, close = bindings_calls(copies, slice_bytes, device)
        drain = torch.cuda.synchronize if device else None
        timed = {"transport_submit": submit, **bindings}
        row = {"copies": copies, "transport_slices": slices}
        for name, fn in timed.items():
            best, median = _per_call_us(fn, calls, repeats, drain if name.endswith("call") else None)
            row[f"{name}_us"], row[f"{name}_median_us"] = best, median
        close()
        rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copies", default="8,32,128,512", help="copies per batch, comma-separated")
    parser.add_argument("--slice-bytes", type=int, default=64 << 10, help="bytes per copy on a GPU (default 64 KiB)")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--conversion-only", action="store_true",
                        help="no device: time the bindings' argument conversion (used with CUDA_VISIBLE_DEVICES='')")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    copies = [int(c) for c in args.copies.split(",")]
    device = not args.conversion_only and device_usable()
    load_before = load_average_1min()
    rows = measure(copies, args.slice_bytes, args.calls, args.repeats, device)
    result = {"bench": "submit_cost", "date": time.strftime("%Y-%m-%d"), "device": device_tag("cuda" if device else "cpu"),
              "bindings": bindings_version(), "machine": machine(), "load_1min_before": load_before,
              "load_1min_after": load_average_1min(), "slice_bytes": args.slice_bytes if device else None,
              "calls": args.calls, "repeats": args.repeats, "rows": rows}
    if args.conversion_only:
        print(json.dumps(result))
        return 0
    if device:
        env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
        out = subprocess.run([sys.executable, __file__, "--conversion-only", "--copies", args.copies, "--calls",
                              str(args.calls), "--repeats", str(args.repeats)], env=env, capture_output=True, text=True)
        result["conversion_only_rows"] = json.loads(out.stdout.splitlines()[-1])["rows"] if out.returncode == 0 \
            else {"error": out.stderr[-2000:]}
    _print(result, device)
    path = args.out or RESULTS / f"submit_cost_{result['device']}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return 0


def _print(result: dict, device: bool) -> None:
    where = "conversion + runtime + driver" if device else "conversion only (no driver)"
    print(f"host microseconds per call, fewest of {result['repeats']} runs (median); bindings call: {where}")
    head = f"{'copies':>6}  {'transport submit':>17}  {'prepare':>15}  {'bindings call':>15}  {'prepare + call':>15}"
    print(head)
    for r in result["rows"]:
        cells = [f"{r[k + '_us']:7.1f} ({r[k + '_median_us']:6.1f})" for k in
                 ("transport_submit", "prepare", "bindings_call", "prepare_and_call")]
        print(f"{r['copies']:>6}  {cells[0]:>17}  {cells[1]:>15}  {cells[2]:>15}  {cells[3]:>15}")
    first, last = result["rows"][0], result["rows"][-1]
    span = last["copies"] - first["copies"]
    if span > 0:
        slope = {k: (last[k + "_us"] - first[k + "_us"]) / span for k in ("transport_submit", "prepare", "bindings_call")}
        result["us_per_copy"] = slope
        print("per extra copy (slope between the first and last rows): " +
              ", ".join(f"{k.replace('_', ' ')} {v:.3f} us" for k, v in slope.items()))
    conversion = result.get("conversion_only_rows")
    if isinstance(conversion, list):
        for r, c in zip(result["rows"], conversion):
            print(f"{r['copies']:>6} copies: bindings conversion alone {c['bindings_call_us']:.1f} us of "
                  f"{r['bindings_call_us']:.1f} us per call ({c['bindings_call_us'] / r['bindings_call_us']:.0%})")


if __name__ == "__main__":
    sys.exit(main())
