"""Per-iteration time by category for one run, or two runs side by side (e.g. DEP then DWDP).

    python traces/breakdown.py out/                       # one run
    python traces/breakdown.py dep_run/ dwdp_run/         # delta per category, % of the first run's iteration
    python traces/breakdown.py run.sqlite --json breakdown.json

Inputs: a directory of trace_rank*.json, an Nsight Systems .sqlite export, or a torch.profiler
JSON. Category rules: dwdp/observe/traces/categories.json (or --rules FILE). Prints the table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from dwdp.observe.traces import TraceFormatError, load_trace
from dwdp.observe.traces.breakdown import breakdown_trace, compare, summarize
from dwdp.observe.traces.report import format_table, ms, pct
from dwdp.observe.traces.rules import DEFAULT_RULES, load_rules


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="trace directory, .sqlite export or torch.profiler .json")
    parser.add_argument("other", nargs="?", help="a second run to compare against the first")
    parser.add_argument("--skip", type=int, default=0, help="iterations to skip per rank (warm-up)")
    parser.add_argument("--rules", default=str(DEFAULT_RULES), help="category rules JSON")
    parser.add_argument("--json", metavar="OUT", help="write the numbers here")
    args = parser.parse_args(argv)
    try:
        rules = load_rules(args.rules)
        runs = [load_trace(p) for p in filter(None, (args.run, args.other))]
        rows = [breakdown_trace(t, rules, args.skip) for t in runs]
        summaries = [summarize(r, rules) for r in rows]
    except (TraceFormatError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

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


if __name__ == "__main__":
    sys.exit(main())
