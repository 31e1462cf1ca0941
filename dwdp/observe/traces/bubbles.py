"""Prefetch bubbles: compute idle gaps explained by a prefetch wait, per iteration and per layer.

A bubble is an exposed wait (waits.py): time a rank's compute stood still for a prefetch.
Prefetch is hidden when the bubbles are ~0; the per-layer table says which layers leak.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from dwdp.observe.traces.model import Trace
from dwdp.observe.traces.waits import Wait, exposed_waits, total_exposed


@dataclass
class IterationBubbles:
    """One iteration of one rank: its bubble time and how it splits over MoE layers (us)."""

    rank: int
    iteration: int
    dur: float
    bubble_us: float
    count: int                          # waits that took measurable time (> 0)
    by_layer: dict[int | None, float]   # layer (None: unknown) -> bubble time

    @property
    def fraction(self) -> float:
        return self.bubble_us / self.dur if self.dur > 0 else 0.0


def bubbles_trace(trace: Trace, skip: int = 0) -> list[IterationBubbles]:
    """Every rank's iterations (after the first `skip` of each), in rank then time order."""
    out = []
    for rank, r in trace.ranks.items():
        for index, window in enumerate(sorted(r.iterations, key=lambda w: w.start)[skip:], start=skip):
            waits = exposed_waits(trace, rank, window)
            out.append(IterationBubbles(rank, int(window.args.get("iteration", index)), window.dur,
                                        total_exposed(waits), sum(1 for w in waits if w.dur > 0), _by_layer(waits)))
    return out


def _by_layer(waits: list[Wait]) -> dict[int | None, float]:
    totals: dict[int | None, float] = defaultdict(float)
    for w in waits:
        totals[w.layer] += w.dur
    return dict(totals)


@dataclass
class LayerBubbles:
    """One MoE layer over all (rank, iteration) rows: mean and worst bubble per iteration (us)."""

    layer: int | None
    mean_us: float
    max_us: float
    share: float  # of all bubble time


def per_layer(rows: list[IterationBubbles]) -> list[LayerBubbles]:
    layers = sorted({k for r in rows for k in r.by_layer}, key=lambda k: (k is None, k if k is not None else 0))
    grand = sum(r.bubble_us for r in rows)
    out = []
    for layer in layers:
        values = [r.by_layer.get(layer, 0.0) for r in rows]
        out.append(LayerBubbles(layer, sum(values) / len(values), max(values), sum(values) / grand if grand else 0.0))
    return out
