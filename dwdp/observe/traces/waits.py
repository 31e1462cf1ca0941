"""Exposed prefetch waits: the time a rank's compute stood still because a prefetch was not done.

Two sources, one answer:
  - phase traces (ours: no kernels): each PREFETCH_WAIT phase is compute standing still;
  - kernel traces (Nsight, torch.profiler): instants inside an iteration with no kernel and no
    compute-lane copy running, while a PREFETCH_WAIT range is open or a peer copy into this rank
    is in flight. On a GPU the compute stream idles inside a forward only when it waits on an
    event, and the prefetch copy is what it waits on.
"""
from __future__ import annotations

from dataclasses import dataclass

from dwdp.observe import phases
from dwdp.observe.traces.intervals import clip, complement, intersect, overlap, union
from dwdp.observe.traces.model import Span, Trace


@dataclass(frozen=True)
class Wait:
    """One exposed wait interval; layer is the MoE layer waited on, None when the trace cannot say."""

    rank: int
    start: float
    end: float
    layer: int | None

    @property
    def dur(self) -> float:
        return self.end - self.start


def sync_sources(trace: Trace, rank: int) -> list[tuple[float, float, int | None]]:
    """(start, end, layer) of what a rank may be waiting on: its wait phases and inbound peer copies."""
    r = trace.ranks[rank]
    out = [(p.start, p.end, p.args.get("layer")) for p in r.phases_named(phases.PREFETCH_WAIT)]
    out += [(c.start, c.end, c.layer) for rt in trace.ranks.values() for c in rt.copies
            if c.dst == rank and c.kind == "P2P" and not c.is_critical]
    return out


def busy_intervals(trace: Trace, rank: int) -> list[tuple[float, float]]:
    """When the rank's compute lanes run something (kernels and compute-lane copies)."""
    r = trace.ranks[rank]
    return [(k.start, k.end) for k in r.kernels] + [(c.start, c.end) for c in r.copies if c.is_critical]


def exposed_waits(trace: Trace, rank: int, window: Span) -> list[Wait]:
    """The exposed wait intervals of `rank` inside `window`, in time order."""
    r = trace.ranks[rank]
    if not r.kernels:
        waits = r.phases_named(phases.PREFETCH_WAIT)
        return [Wait(rank, s, e, w.args.get("layer")) for w in waits for s, e in clip([(w.start, w.end)], window.start, window.end)]
    sources = sync_sources(trace, rank)
    idle = complement(busy_intervals(trace, rank), window.start, window.end)
    out = []
    for s, e in intersect(idle, [(a, b) for a, b, _ in sources]):
        # Name the layer of the source that covers most of this interval.
        best = max(sources, key=lambda src: overlap((s, e), (src[0], src[1])))
        out.append(Wait(rank, s, e, best[2]))
    return out


def total_exposed(waits: list[Wait]) -> float:
    return sum(e - s for s, e in union((w.start, w.end) for w in waits))
