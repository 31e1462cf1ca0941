"""Timeline figure of one run: per rank a compute row coloured by breakdown category, with the
exposed prefetch waits in red, and one row per copy lane with each copy coloured by its source.

Hidden prefetch reads as: red marks absent or hair-thin, copy rows busy under the compute row.
"""
from __future__ import annotations

import matplotlib
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from dwdp.observe.traces.breakdown import category_segments, rank_items
from dwdp.observe.traces.model import Trace
from dwdp.observe.traces.rules import SYNCHRONIZATION, CategoryRules, load_rules
from dwdp.observe.traces.waits import exposed_waits, total_exposed

CATEGORY_COLORS = {
    "Attention": "#4c72b0", "GroupedGEMM": "#55a868", "DenseGEMM": "#8172b2", "Communication": "#ccb974",
    "D2D copy": "#64b5cd", "P2P copy": "#937860", "Others": "#d0d0d0", SYNCHRONIZATION: "#d62728",
}
SOURCE_COLORS = matplotlib.colormaps["Set2"].colors
COMPUTE_HEIGHT, COPY_HEIGHT, GAP = 0.8, 0.45, 0.5


def plot_timeline(trace: Trace, skip: int = 0, max_iterations: int | None = None,
                  rules: CategoryRules | None = None, title: str | None = None, mark_us: float = 50.0):
    """The figure for iterations skip .. skip+max_iterations of every rank (time in ms).

    Waits of at least `mark_us` also get a triangle above the row, so that ones too thin to see
    at the figure's scale are not lost.
    """
    rules = rules or load_rules()
    windows = {rank: sorted(r.iterations, key=lambda w: w.start)[skip:][:max_iterations] for rank, r in trace.ranks.items()}
    spans = [w for ws in windows.values() for w in ws]
    if not spans:
        raise ValueError(f"no iterations to plot after skipping {skip}")
    t0, t1 = min(w.start for w in spans), max(w.end for w in spans)
    lanes = {rank: sorted({c.lane for c in r.copies if not c.is_critical}) for rank, r in trace.ranks.items()}
    rows = sum(1 + len(v) for v in lanes.values())
    # A bare Figure (no pyplot): drawing to a PNG needs no GUI backend and leaves the caller's alone.
    fig = Figure(figsize=(13, 1.0 + 0.55 * rows + 0.3 * len(lanes)))
    ax = fig.subplots()
    y, ticks, labels, sources, used = 0.0, [], [], set(), set()
    for rank, r in trace.ranks.items():
        items = rank_items(trace, rank, rules)
        by_category: dict[str, list] = {}
        waits, iter_us = [], 0.0
        for w in windows[rank]:
            for s, e, category in category_segments(items, w.start, w.end, rules):
                by_category.setdefault(category, []).append(((s - t0) / 1e3, (e - s) / 1e3))
            waits += exposed_waits(trace, rank, w)
            iter_us += w.dur
        for category, bars in by_category.items():
            used.add(category)
            ax.broken_barh(bars, (y - COMPUTE_HEIGHT / 2, COMPUTE_HEIGHT), color=CATEGORY_COLORS.get(category, "#999999"),
                           linewidth=0)
        marks = [(w.start - t0) / 1e3 for w in waits if w.dur >= mark_us]
        ax.plot(marks, [y - COMPUTE_HEIGHT / 2 - 0.1] * len(marks), marker="v", color=CATEGORY_COLORS[SYNCHRONIZATION],
                markersize=4, linestyle="none")
        share = total_exposed(waits) / iter_us if iter_us else 0.0
        ticks.append(y)
        labels.append(f"rank {rank} compute\nwaits {100 * share:.1f}%")
        top = y - COMPUTE_HEIGHT / 2 - 0.2
        for lane in lanes[rank]:
            y += COMPUTE_HEIGHT / 2 + COPY_HEIGHT / 2 + 0.1
            for c in r.copies:
                if c.lane == lane and c.end > t0 and c.start < t1:
                    sources.add(c.src)
                    ax.broken_barh([((c.start - t0) / 1e3, (c.end - c.start) / 1e3)], (y - COPY_HEIGHT / 2, COPY_HEIGHT),
                                   color=SOURCE_COLORS[c.src % len(SOURCE_COLORS)], linewidth=0)
            ticks.append(y)
            labels.append(lane)
        ax.vlines([(w.start - t0) / 1e3 for w in windows[rank]], top, y + COPY_HEIGHT / 2, color="black",
                  linewidth=0.7, linestyle=":")
        y += COMPUTE_HEIGHT + GAP
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_ylim(y - GAP, -COMPUTE_HEIGHT)
    ax.set_xlim(0, (t1 - t0) / 1e3)
    ax.set_xlabel(f"time since the first plotted iteration (ms); dotted: iteration starts; "
                  f"triangles: waits >= {mark_us / 1e3:g} ms")
    handles = [Patch(color=CATEGORY_COLORS.get(c, "#999999"), label=c) for c in rules.order if c in used]
    handles += [Patch(color=SOURCE_COLORS[s % len(SOURCE_COLORS)], label=f"copy from rank {s}") for s in sorted(sources)]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=min(len(handles), 7), fontsize=8, frameon=False)
    ax.set_title(title or f"{trace.source} ({trace.format})", fontsize=10)
    fig.tight_layout()
    return fig
