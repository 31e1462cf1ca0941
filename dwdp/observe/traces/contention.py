"""Many-to-one source contention measured from copy records (docs/design.md 1.3).

Legend: G = ranks (the group size), C = contention degree of a pull = number of distinct destination ranks
whose pulls from the same source are in flight at once (the pull's own destination included).

Measured two ways, from every peer copy with a known source:
  - per copy: C = distinct destinations with a copy from the same source overlapping this copy
    at any time during it (copies of the same destination never count twice);
  - pull time: at each instant each in-flight pull sees C = distinct destinations on its source;
    P(C = c) is the share of total pull time spent at degree c.
The random-pull expectation is contention_pmf(G): C = 1 + Binomial(G-2, 1/(G-1)).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from dwdp.observe import phases
from dwdp.observe.traces.model import Copy, Trace


@dataclass
class ContentionResult:
    """Histograms indexed by degree C (key c, 1..max)."""

    group_size: int
    copies_by_degree: dict[int, int]            # per copy: how many copies saw degree C
    time_share_by_degree: dict[int, float]      # pull time share at degree C (sums to 1)
    expected: dict[int, float]                  # random-pull P(C = c); empty when G < 2
    per_source: dict[int, dict[int, int]] = field(default_factory=dict)  # source -> copies_by_degree


def contention_pmf(group_size: int) -> np.ndarray:
    """P(C = c) for c = 1 .. G-1 (index c-1): C = 1 + Binomial(G-2, 1/(G-1)). [G-1]"""
    if group_size < 2:
        raise ValueError(f"group_size={group_size} must be >= 2: one rank has no peer to pull from")
    n, p = group_size - 2, 1.0 / (group_size - 1)
    return np.array([math.comb(n, x) * p ** x * (1 - p) ** (n - x) for x in range(n + 1)])


def peer_copies(trace: Trace) -> list[Copy]:
    """Copies between two known, different ranks."""
    return [c for c in trace.all_copies if c.kind == "P2P" and c.src >= 0 and c.dst >= 0 and c.src != c.dst]


def copy_degrees(copies: list[Copy]) -> list[int]:
    """Degree C of each copy (same order as `copies`), comparing only copies of the same source."""
    degrees = [1] * len(copies)
    by_source: dict[int, list[int]] = defaultdict(list)
    for i, c in enumerate(copies):
        by_source[c.src].append(i)
    for indices in by_source.values():
        indices.sort(key=lambda i: copies[i].start)
        for pos, i in enumerate(indices):
            c = copies[i]
            others = set()
            # Sorted by start: earlier copies may still run; later ones matter only if they start before c ends.
            for j in indices[:pos]:
                if copies[j].end > c.start and copies[j].dst != c.dst:
                    others.add(copies[j].dst)
            for j in indices[pos + 1:]:
                if copies[j].start >= c.end:
                    break
                if copies[j].dst != c.dst:
                    others.add(copies[j].dst)
            degrees[i] = 1 + len(others)
    return degrees


def time_shares(copies: list[Copy]) -> dict[int, float]:
    """Share of pull time spent at each degree (see module docstring)."""
    weight: dict[int, float] = defaultdict(float)
    by_source: dict[int, list[Copy]] = defaultdict(list)
    for c in copies:
        by_source[c.src].append(c)
    for group in by_source.values():
        events = sorted([(c.start, 1, c.dst) for c in group if c.end > c.start] +
                        [(c.end, -1, c.dst) for c in group if c.end > c.start])
        active: dict[int, int] = defaultdict(int)  # destination -> its copies in flight
        cursor = None
        for t, delta, dst in events:
            if cursor is not None and t > cursor:
                k = sum(1 for n in active.values() if n > 0)
                if k:
                    weight[k] += sum(active.values()) * (t - cursor)  # every pull in flight sees degree k
            cursor = t
            active[dst] += delta
    total_weight = sum(weight.values())
    return {k: w / total_weight for k, w in sorted(weight.items())} if total_weight else {}


def measure_contention(trace: Trace) -> ContentionResult:
    """Histograms of the run's peer copies against the random-pull expectation."""
    copies = peer_copies(trace)
    group_size = trace.group_size or len(trace.ranks)
    degrees = copy_degrees(copies)
    hist: dict[int, int] = defaultdict(int)
    per_source: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    for c, d in zip(copies, degrees):
        hist[d] += 1
        per_source[c.src][d] += 1
    expected = {c + 1: float(p) for c, p in enumerate(contention_pmf(group_size))} if group_size >= 2 else {}
    return ContentionResult(group_size, dict(sorted(hist.items())), time_shares(copies), expected,
                            {s: dict(sorted(h.items())) for s, h in sorted(per_source.items())})


@dataclass
class Episode:
    """All waits of one rank for one MoE layer in one iteration, and the copies they waited for."""

    rank: int
    iteration: int | None
    layer: int
    start: float
    end: float
    wait_us: float
    copies: list[Copy] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.copies)


def wait_episodes(trace: Trace) -> list[Episode]:
    """Group each rank's PREFETCH_WAIT phases by (iteration, layer) and give each group its copies.

    A copy of layer l into rank d belongs to the first episode of (d, l) that ends at or after the
    copy ends: a wait returns only once its copies have landed, and the next copy of that layer
    is issued only after this episode released the slot. Copies after the last episode (a
    prefetch for a forward that never ran) belong to none.
    """
    episodes = []
    for rank, r in trace.ranks.items():
        groups: dict[tuple, list] = defaultdict(list)
        for w in r.phases_named(phases.PREFETCH_WAIT):
            if w.args.get("layer") is not None:
                groups[(w.args.get("iteration"), w.args["layer"])].append(w)
        mine = []
        for (iteration, layer), ws in groups.items():
            mine.append(Episode(rank, iteration, layer, min(w.start for w in ws), max(w.end for w in ws),
                                sum(w.dur for w in ws)))
        mine.sort(key=lambda e: e.end)
        for c in r.copies:
            if c.layer is None or c.dst != rank:
                continue
            owner = next((e for e in mine if e.layer == c.layer and e.end >= c.end), None)
            if owner is not None:
                owner.copies.append(c)
        episodes += mine
    return sorted(episodes, key=lambda e: (e.rank, e.start))


@dataclass
class ContendedWait:
    """An episode whose wait exceeded the threshold while its copies shared a source with another rank's pulls."""

    episode: Episode
    sources: dict[int, set[int]]  # contended source -> other destinations pulling from it meanwhile
    max_degree: int


def contended_waits(trace: Trace, threshold_us: float) -> list[ContendedWait]:
    """Episodes with wait > threshold_us whose copies overlapped another destination's pulls from the same source."""
    by_source: dict[int, list[Copy]] = defaultdict(list)
    for c in peer_copies(trace):
        by_source[c.src].append(c)
    out = []
    for e in wait_episodes(trace):
        if e.wait_us <= threshold_us:
            continue
        sources: dict[int, set[int]] = {}
        for c in e.copies:
            others = {o.dst for o in by_source[c.src] if o.dst != c.dst and o.start < c.end and o.end > c.start}
            if others:
                sources.setdefault(c.src, set()).update(others)
        if sources:
            out.append(ContendedWait(e, sources, 1 + max(len(v) for v in sources.values())))
    return out

