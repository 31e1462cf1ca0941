"""Many-to-one source contention of the prefetch copies, against the random-pull expectation,
and the layers whose exposed wait coincided with it.

    python traces/contention.py out/ [--threshold-ms 0.05] [--json contention.json]

C = distinct destination ranks pulling from one source at once (the pull itself included).
Random-pull expectation for group size N: C = 1 + Binomial(N-2, 1/(N-1)). Prints the tables last.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from dwdp.observe.traces import TraceFormatError, load_trace
from dwdp.observe.traces.contention import contended_waits, measure_contention
from dwdp.observe.traces.report import format_table, ms, pct


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", help="trace directory, .sqlite export or torch.profiler .json")
    parser.add_argument("--threshold-ms", type=float, default=0.05,
                        help="a layer's wait above this, while its sources served other ranks, is flagged")
    parser.add_argument("--top", type=int, default=20, help="flagged layers to print, longest wait first (JSON has all)")
    parser.add_argument("--json", metavar="OUT", help="write the numbers here")
    args = parser.parse_args(argv)
    try:
        trace = load_trace(args.run)
    except TraceFormatError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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


if __name__ == "__main__":
    sys.exit(main())
