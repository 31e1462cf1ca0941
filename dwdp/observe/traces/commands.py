"""The `dwdp trace` drivers: breakdown, contention, bubbles, timeline over one run's traces (or two,
for breakdown). `traces/<name>.py` runs the same driver by path.

Every driver reads a directory of trace_rank*.json, an Nsight Systems .sqlite export or a
torch.profiler JSON, prints its tables last, takes `--json OUT` for its numbers, and answers a file
it cannot read with one line `error: <file>: <what is wrong>` and exit status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from dwdp.observe.traces import TraceFormatError, load_trace
from dwdp.observe.traces.breakdown import breakdown_trace, compare, summarize
from dwdp.observe.traces.bubbles import bubbles_trace, per_layer
from dwdp.observe.traces.contention import contended_waits, measure_contention
from dwdp.observe.traces.report import format_table, ms, pct
from dwdp.observe.traces.rules import DEFAULT_RULES, load_rules

RUN_HELP = "trace directory, .sqlite export or torch.profiler .json"
# The drivers that need an extra of pyproject.toml beyond the base install (timeline plots).
EXTRAS = {"timeline": ("bench",)}


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("--json", metavar="OUT", help="write the numbers here")


def add_arguments(sub) -> None:
    """One subparser per driver on `sub` (an argparse subparsers action), each with `trace` set to its name."""
    p = sub.add_parser("breakdown", help="per-iteration time by category of one run, or two side by side "
                       "(e.g. DEP then DWDP): delta per category, %% of the first run's iteration")
    _run_args(p)
    p.add_argument("other", nargs="?", help="a second run to compare against the first")
    p.add_argument("--skip", type=int, default=0, help="iterations to skip per rank (warm-up)")
    p.add_argument("--rules", default=str(DEFAULT_RULES), help="category rules JSON")
    p = sub.add_parser("contention", help="many-to-one source contention of the prefetch copies against the "
                       "random-pull expectation, and the layers whose exposed wait coincided with it")
    _run_args(p)
    p.add_argument("--threshold-ms", type=float, default=0.05,
                   help="a layer's wait above this, while its sources served other ranks, is flagged")
    p.add_argument("--top", type=int, default=20, help="flagged layers to print, longest wait first (JSON has all)")
    p = sub.add_parser("bubbles", help="prefetch bubbles: compute idle time explained by a prefetch wait, per "
                       "iteration and per layer")
    _run_args(p)
    p.add_argument("--skip", type=int, default=0, help="iterations to skip per rank (warm-up)")
    p = sub.add_parser("timeline", help="timeline PNG of a run: per rank a compute row coloured by category, "
                       "exposed waits in red, copy lanes coloured by source rank")
    p.add_argument("run", help=RUN_HELP)
    p.add_argument("-o", "--output", help="PNG to write (default: timeline.png next to the run)")
    p.add_argument("--skip", type=int, default=0, help="iterations to skip per rank (warm-up)")
    p.add_argument("--iterations", type=int, default=None, help="iterations to plot per rank (default all)")
    p.add_argument("--dpi", type=int, default=110)
    p.add_argument("--json", metavar="OUT", help="write each rank's wait share here")


def run_trace(args: argparse.Namespace) -> int:
    """The driver `args.trace` on `args`; a trace it cannot read: one line on stderr, exit 2."""
    driver = {"breakdown": run_breakdown, "contention": run_contention, "bubbles": run_bubbles,
              "timeline": run_timeline}[args.trace]
    try:
        return driver(args)
    except TraceFormatError as exc:
        return _refuse(exc)


def _refuse(what) -> int:
    print(f"error: {what}", file=sys.stderr)
    return 2


def run_breakdown(args: argparse.Namespace) -> int:
    try:
        rules = load_rules(args.rules)
        runs = [load_trace(p) for p in filter(None, (args.run, args.other))]
        rows = [breakdown_trace(t, rules, args.skip) for t in runs]
        summaries = [summarize(r, rules) for r in rows]
    except ValueError as exc:
        return _refuse(exc)

    for trace, run_rows in zip(runs, rows):
        per_rank = {}
        for row in run_rows:
            per_rank.setdefault(row.rank, []).append(row.dur)
        print(f"{trace.source} ({trace.format}): " + ", ".join(
            f"rank {r} {ms(sum(v) / len(v))} ms x{len(v)}" for r, v in per_rank.items()))
    header = ["category"]
    for i, _ in enumerate(summaries):
        header += [f"run{i + 1} ms/iter", f"run{i + 1} share"]
    if len(summaries) == 2:
        header.append("delta (% of run1 iter)")
        delta = compare(*summaries)
    table = []
    for category in rules.order + ("Iteration",):
        line = [category]
        for s in summaries:
            value = s.iteration_us if category == "Iteration" else s.categories[category]
            line += [ms(value), pct(value / s.iteration_us)]
        if len(summaries) == 2:
            line.append(f"{100 * delta[category]:+.1f}%")
        table.append(line)
    for category in sorted({k for s in summaries for k in s.overlapped}):
        line = [f"{category} (overlapped)"]
        for s in summaries:
            value = s.overlapped.get(category, 0.0)
            line += [ms(value), pct(value / s.iteration_us)]
        table.append(line + ([""] if len(summaries) == 2 else []))
    if args.json:
        doc = {"runs": [{"source": t.source, "format": t.format, "summary": dataclasses.asdict(s),
                         "iterations": [dataclasses.asdict(r) for r in rr]} for t, s, rr in zip(runs, summaries, rows)]}
        if len(summaries) == 2:
            doc["delta_of_run1_iteration"] = delta
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    print("Categories tile each iteration (they sum to it); '(overlapped)' rows ran on copy lanes beside compute.")
    print(format_table(header, table))
    return 0


def run_contention(args: argparse.Namespace) -> int:
    trace = load_trace(args.run)
    result = measure_contention(trace)
    flagged = sorted(contended_waits(trace, args.threshold_ms * 1e3), key=lambda f: -f.episode.wait_us)

    num_copies = sum(result.copies_by_degree.values())
    degrees = sorted(set(result.copies_by_degree) | set(result.expected))
    hist = [[str(c), str(result.copies_by_degree.get(c, 0)),
             pct(result.copies_by_degree.get(c, 0) / num_copies) if num_copies else "-",
             pct(result.time_share_by_degree.get(c, 0.0)),
             pct(result.expected[c]) if c in result.expected else "-"] for c in degrees]
    sources = [[str(s), str(sum(h.values())), f"{sum(c * n for c, n in h.items()) / sum(h.values()):.2f}", str(max(h))]
               for s, h in result.per_source.items()]
    waits = [[str(f.episode.rank), str(f.episode.iteration), str(f.episode.layer), ms(f.episode.wait_us),
              "; ".join(f"src {s} also -> {sorted(d)}" for s, d in sorted(f.sources.items())), str(f.max_degree)]
             for f in flagged[: args.top]]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"source": trace.source, "format": trace.format, "threshold_ms": args.threshold_ms,
                       "contention": dataclasses.asdict(result),
                       "contended_waits": [{"rank": f.episode.rank, "iteration": f.episode.iteration,
                                            "layer": f.episode.layer, "wait_us": f.episode.wait_us,
                                            "sources": {s: sorted(d) for s, d in f.sources.items()},
                                            "max_degree": f.max_degree} for f in flagged]}, f, indent=1)
    print(f"{trace.source} ({trace.format}): {num_copies} peer copies, group size {result.group_size}")
    print(format_table(["C", "copies", "share of copies", "share of pull time", "random-pull P(C)"], hist))
    print()
    print(format_table(["source rank", "copies served", "mean C", "max C"], sources))
    print()
    print(f"layers whose wait > {args.threshold_ms} ms coincided with another rank pulling from the same source: "
          f"{len(flagged)} (longest {len(waits)} below)")
    if waits:
        print(format_table(["rank", "iteration", "layer", "wait ms", "contended sources", "max C"], waits))
    return 0


def run_bubbles(args: argparse.Namespace) -> int:
    trace = load_trace(args.run)
    rows = bubbles_trace(trace, args.skip)
    if not rows:
        return _refuse(f"{trace.source}: no iterations after skipping {args.skip}")
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


def run_timeline(args: argparse.Namespace) -> int:
    from dwdp.observe.traces.timeline import plot_timeline  # matplotlib: the bench extra

    trace = load_trace(args.run)
    try:
        fig = plot_timeline(trace, args.skip, args.iterations)
    except ValueError as exc:
        return _refuse(exc)
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
