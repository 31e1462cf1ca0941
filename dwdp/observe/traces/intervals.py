"""Interval arithmetic on (start, end) pairs: unions, clipping, complements, a priority tiling."""
from __future__ import annotations

from collections.abc import Iterable, Sequence


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering exactly the input; empty intervals are dropped."""
    merged: list[list[float]] = []
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def clip(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """Each interval cut to [lo, hi]; those left empty are dropped."""
    return [(max(s, lo), min(e, hi)) for s, e in intervals if min(e, hi) > max(s, lo)]


def total(intervals: Iterable[tuple[float, float]]) -> float:
    """Length covered by the intervals, overlaps counted once."""
    return sum(e - s for s, e in union(intervals))


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Length of the intersection of two intervals (0 when disjoint or touching)."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def priority_segments(items: Sequence[tuple[float, float, int]], lo: float, hi: float,
                      num_levels: int, fallback: int) -> list[tuple[float, float, int]]:
    """[lo, hi] cut into (start, end, level) pieces: each instant goes to the lowest level active then.

    items: (start, end, level) with 0 <= level < num_levels; instants with no item go to
    `fallback`. Adjacent pieces of the same level are merged; the pieces tile [lo, hi] exactly.
    """
    events: list[tuple[float, int, int]] = []
    for start, end, level in items:
        s, e = max(start, lo), min(end, hi)
        if e > s:
            events.append((s, 1, level))
            events.append((e, -1, level))
    events.sort()
    active = [0] * num_levels
    pieces: list[list] = []
    cursor = lo

    def emit(until: float) -> None:
        owner = next((i for i, n in enumerate(active) if n > 0), fallback)
        if pieces and pieces[-1][2] == owner and pieces[-1][1] == cursor:
            pieces[-1][1] = until
        else:
            pieces.append([cursor, until, owner])

    for t, delta, level in events:
        if t > cursor:
            emit(t)
            cursor = t
        active[level] += delta
    if hi > cursor:
        emit(hi)
    return [(s, e, level) for s, e, level in pieces]


def complement(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    """The parts of [lo, hi] that no interval covers."""
    gaps, cursor = [], lo
    for s, e in clip(union(intervals), lo, hi):
        if s > cursor:
            gaps.append((cursor, s))
        cursor = max(cursor, e)
    if hi > cursor:
        gaps.append((cursor, hi))
    return gaps


def intersect(a: Iterable[tuple[float, float]], b: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Where both interval sets cover (each taken as its union)."""
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if e > s:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out
