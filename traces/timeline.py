"""Timeline PNG of a run: one block per rank, a compute row coloured by category with exposed
prefetch waits in red, and its copy lanes with each copy coloured by source rank.

    python traces/timeline.py out/ -o out/timeline.png [--skip 1] [--iterations 2]

Prints the PNG path and each rank's wait share.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dwdp.observe.traces import TraceFormatError, load_trace
from dwdp.observe.traces.bubbles import bubbles_trace
from dwdp.observe.traces.report import format_table, ms, pct
from dwdp.observe.traces.timeline import plot_timeline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="trace directory, .sqlite export or torch.profiler .json")
    parser.add_argument("-o", "--output", help="PNG to write (default: timeline.png next to the run)")
    parser.add_argument("--skip", type=int, default=0, help="iterations to skip per rank (warm-up)")
    parser.add_argument("--iterations", type=int, default=None, help="iterations to plot per rank (default all)")
    parser.add_argument("--dpi", type=int, default=110)
    parser.add_argument("--json", metavar="OUT", help="write each rank's wait share here")
    args = parser.parse_args(argv)
    try:
        trace = load_trace(args.run)
        fig = plot_timeline(trace, args.skip, args.iterations)
    except (TraceFormatError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    run = Path(args.run)
    output = Path(args.output) if args.output else (run if run.is_dir() else run.parent) / "timeline.png"
    fig.savefig(output, dpi=args.dpi)
    rows = bubbles_trace(trace, args.skip)
    per_rank = {}
    for r in rows:
        per_rank.setdefault(r.rank, []).append(r)
    table = []
    for rank, rs in per_rank.items():
        rs = rs[: args.iterations]
        wait, dur = sum(r.bubble_us for r in rs), sum(r.dur for r in rs)
        table.append([str(rank), str(len(rs)), ms(dur / len(rs)), ms(wait / len(rs)), pct(wait / dur if dur else 0.0)])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": trace.source, "png": str(output),
                       "ranks": {row[0]: {"iterations": int(row[1]), "iteration_ms": float(row[2]),
                                          "wait_ms": float(row[3])} for row in table}}, f, indent=1)
    print(f"wrote {output}")
    print(format_table(["rank", "iterations", "iteration ms", "exposed wait ms/iter", "wait share"], table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
