"""Prefetch bubbles: compute idle time explained by a prefetch wait, per iteration and per layer.

    python traces/bubbles.py out/ [--skip 1] [--json bubbles.json]

Prefetch is hidden when the bubble share is ~0. Prints the tables last.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from dwdp.observe.traces import TraceFormatError, load_trace
from dwdp.observe.traces.bubbles import bubbles_trace, per_layer
from dwdp.observe.traces.report import format_table, ms, pct


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="trace directory, .sqlite export or torch.profiler .json")
    parser.add_argument("--skip", type=int, default=0, help="iterations to skip per rank (warm-up)")
    parser.add_argument("--json", metavar="OUT", help="write the numbers here")
    args = parser.parse_args(argv)
    try:
        trace = load_trace(args.run)
    except TraceFormatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = bubbles_trace(trace, args.skip)
    if not rows:
        print(f"error: {trace.source}: no iterations after skipping {args.skip}", file=sys.stderr)
        return 2
    layers = per_layer(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": trace.source, "format": trace.format,
                       "iterations": [{**dataclasses.asdict(r), "by_layer": {str(k): v for k, v in r.by_layer.items()}}
                                      for r in rows],
                       "layers": [dataclasses.asdict(x) for x in layers]}, f, indent=1)
    total_bubble = sum(r.bubble_us for r in rows)
    total_iter = sum(r.dur for r in rows)
    print(f"{trace.source} ({trace.format}): bubbles {ms(total_bubble / len(rows))} ms per iteration, "
          f"{pct(total_bubble / total_iter if total_iter else 0.0)} of iteration time")
    print(format_table(["rank", "iteration", "iteration ms", "bubble ms", "share", "waits"],
                       [[str(r.rank), str(r.iteration), ms(r.dur), ms(r.bubble_us), pct(r.fraction), str(r.count)]
                        for r in rows]))
    print()
    print(format_table(["MoE layer", "mean bubble ms/iter", "worst ms", "share of bubbles"],
                       [["?" if x.layer is None else str(x.layer), ms(x.mean_us), ms(x.max_us), pct(x.share)]
                        for x in layers]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
