"""Trace analysis: readers for our per-rank Chrome traces, torch.profiler exports and Nsight
Systems SQLite exports into one in-memory form, and the analyses the `traces/` scripts print
(time breakdown, many-to-one contention, prefetch bubbles, timeline plot)."""
from dwdp.observe.traces.load import load_trace
from dwdp.observe.traces.model import Copy, RankTrace, Span, Trace, TraceFormatError

__all__ = ["Copy", "RankTrace", "Span", "Trace", "TraceFormatError", "load_trace"]
