"""Per-iteration time by category, for one run or two side by side (a DEP and a DWDP run).

Iteration time is an iteration span (FORWARD, profiler step, or the whole trace). Every instant of
it goes to exactly one category, so the categories sum to the iteration time:
  - phase traces (ours): the innermost-by-priority phase covering the instant, mapped through the
    rules' phase table (prefetch_wait > attention > moe_compute ... in the rules' order), so
    GroupedGEMM is MoE compute minus the waits nested in it; uncovered instants are Others;
  - kernel traces: the highest-priority category among the kernels and compute-lane copies
    running then; idle instants while a prefetch wait is open or a peer copy into the rank is in
    flight are Synchronization (see waits.py), other idle instants Others.
Copies on copy lanes (copier threads, copy streams) run beside compute and are not on the
iteration's critical path: their busy time inside the iteration is reported apart, as overlap.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from dwdp.observe.traces.intervals import clip, priority_segments, total
from dwdp.observe.traces.model import Trace
from dwdp.observe.traces.rules import OTHERS, SYNCHRONIZATION, CategoryRules, load_rules
from dwdp.observe.traces.waits import sync_sources


@dataclass
class IterationBreakdown:
    """One iteration of one rank. Times in microseconds; `categories` sums to `dur`."""

    rank: int
    iteration: int
    start: float
    dur: float
    categories: dict[str, float]
    overlapped: dict[str, float] = field(default_factory=dict)  # copy-lane busy time by category


def rank_items(trace: Trace, rank: int, rules: CategoryRules) -> list[tuple[float, float, int]]:
    """(start, end, level) of what decides a rank's categories; level len(rules.order) = waiting while idle."""
    r = trace.ranks[rank]
    if not r.kernels:
        return [(p.start, p.end, rules.level(rules.phases[p.name])) for p in r.phases if p.name in rules.phases]
    items = [(k.start, k.end, rules.level(rules.of_kernel(k.name))) for k in r.kernels]
    items += [(c.start, c.end, rules.level(rules.copies.get(c.kind, OTHERS))) for c in r.copies if c.is_critical]
    return items + [(s, e, len(rules.order)) for s, e, _ in sync_sources(trace, rank)]


def category_segments(items: list[tuple[float, float, int]], lo: float, hi: float,
                      rules: CategoryRules) -> list[tuple[float, float, str]]:
    """[lo, hi] tiled by (start, end, category) pieces, from `rank_items`."""
    wait_level = len(rules.order)
    pieces = priority_segments(items, lo, hi, wait_level + 1, rules.level(OTHERS))
    return [(s, e, SYNCHRONIZATION if level == wait_level else rules.order[level]) for s, e, level in pieces]


def breakdown_trace(trace: Trace, rules: CategoryRules | None = None, skip: int = 0) -> list[IterationBreakdown]:
    """Every rank's iterations (after the first `skip` of each), in rank then time order."""
    rules = rules or load_rules()
    out = []
    for rank, r in trace.ranks.items():
        items = rank_items(trace, rank, rules)
        side = [c for c in r.copies if not c.is_critical]
        for index, window in enumerate(sorted(r.iterations, key=lambda w: w.start)[skip:], start=skip):
            times = dict.fromkeys(rules.order, 0.0)
            for s, e, category in category_segments(items, window.start, window.end, rules):
                times[category] += e - s
            overlapped: dict[str, float] = {}
            for kind in sorted({c.kind for c in side}):
                busy = total(clip([(c.start, c.end) for c in side if c.kind == kind], window.start, window.end))
                category = rules.copies.get(kind, OTHERS)
                overlapped[category] = overlapped.get(category, 0.0) + busy
            out.append(IterationBreakdown(rank, int(window.args.get("iteration", index)), window.start,
                                          window.dur, times, overlapped))
    return out


@dataclass
class Summary:
    """Means over (rank, iteration) rows, in microseconds."""

    iterations: int
    iteration_us: float
    categories: dict[str, float]
    overlapped: dict[str, float]


def summarize(rows: list[IterationBreakdown], rules: CategoryRules | None = None) -> Summary:
    rules = rules or load_rules()
    if not rows:
        raise ValueError("no iterations to summarize (all skipped, or the trace has none)")
    n = len(rows)
    overlapped_keys = sorted({k for r in rows for k in r.overlapped})
    return Summary(
        iterations=n, iteration_us=sum(r.dur for r in rows) / n,
        categories={c: sum(r.categories[c] for r in rows) / n for c in rules.order},
        overlapped={k: sum(r.overlapped.get(k, 0.0) for r in rows) / n for k in overlapped_keys})


def compare(base: Summary, other: Summary) -> dict[str, float]:
    """Per-category change other - base as a fraction of base's iteration time (plus 'Iteration')."""
    delta = {c: (other.categories.get(c, 0.0) - base.categories.get(c, 0.0)) / base.iteration_us
             for c in base.categories}
    delta["Iteration"] = (other.iteration_us - base.iteration_us) / base.iteration_us
    return delta
