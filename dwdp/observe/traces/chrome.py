"""Chrome trace JSON readers: our per-rank `trace_rank{r}.json` and torch.profiler's export.

Our format (written by dwdp.observe.tracing): compute lane tid 0 with phase events named from
`dwdp.observe.phases`, copier lanes tid 100+i with COPY_SLICE events whose args carry src, dst, bytes,
layer, slot, expert; `otherData` carries rank, group_size, num_moe_layers, plan_bytes_per_layer.

torch.profiler (`prof.export_chrome_trace`): "kernel" events are device kernels (tid = stream),
"gpu_memcpy" events are copies, "user_annotation" events are `record_function` ranges (our phase
names when the runtime used them, and "ProfilerStep#N"), "cpu_op" events are operators.
"""
from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path

from dwdp.observe import phases
from dwdp.observe.traces.model import Copy, RankTrace, Span, TraceFormatError

_TORCH_CATS = {"kernel", "cpu_op", "user_annotation", "gpu_memcpy", "gpu_memset", "cuda_runtime"}
_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)")
_PROFILER_STEP = re.compile(r"^ProfilerStep#\d+$")
# torch.profiler names copies "Memcpy DtoD (Device -> Device)", "Memcpy PtoP (...)", ...
_MEMCPY_KINDS = {"PtoP": "P2P", "DtoD": "D2D", "HtoD": "H2D", "DtoH": "D2H"}


def read_json(path: Path) -> dict:
    """The parsed document; a bare event list becomes {"traceEvents": list}."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise TraceFormatError(path, f"cannot read the file ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise TraceFormatError(path, "not a text file, so not Chrome trace JSON") from None
    if not text.strip():
        raise TraceFormatError(path, "empty file")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(path, f"not valid JSON (truncated?): {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    if isinstance(doc, list):
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise TraceFormatError(path, "no 'traceEvents' list: not a Chrome trace")
    return doc


def complete_events(path: Path, doc: dict) -> list[dict]:
    """The "X" (complete) events, each checked for a name, a finite ts and a dur >= 0."""
    out = []
    for i, event in enumerate(doc["traceEvents"]):
        if not isinstance(event, dict):
            raise TraceFormatError(path, f"traceEvents[{i}] is {type(event).__name__}, not an object")
        if event.get("ph") != "X":
            continue
        for key, kind in (("name", str), ("ts", (int, float)), ("dur", (int, float))):
            value = event.get(key)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise TraceFormatError(path, f"traceEvents[{i}] ({event.get('name', '?')}) has no valid '{key}': {value!r}")
        if not (math.isfinite(event["ts"]) and math.isfinite(event["dur"])) or event["dur"] < 0:
            raise TraceFormatError(path, f"traceEvents[{i}] ({event['name']}) has ts={event['ts']!r} dur={event['dur']!r}")
        out.append(event)
    return out


def is_torch_profiler(events: list[dict]) -> bool:
    return any(e.get("cat") in _TORCH_CATS for e in events)


def _span(event: dict, lane: str) -> Span:
    args = event.get("args") if isinstance(event.get("args"), dict) else {}
    return Span(event["name"], float(event["ts"]), float(event["ts"]) + float(event["dur"]), lane, args)


def _int_arg(path: Path, index_name: str, args: dict, key: str, required: bool) -> int | None:
    value = args.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise TraceFormatError(path, f"{index_name} has no integer args.{key}: {value!r}")
    return value


def read_dwdp_chrome(path: Path, doc: dict | None = None) -> tuple[RankTrace, dict]:
    """One `trace_rank{r}.json` -> (its RankTrace, its otherData)."""
    path = Path(path)
    doc = read_json(path) if doc is None else doc
    events = complete_events(path, doc)
    other = doc.get("otherData") if isinstance(doc.get("otherData"), dict) else {}
    rank = other.get("rank")
    if rank is None:
        pids = {e.get("pid") for e in events}
        if len(pids) != 1 or not isinstance(next(iter(pids)), int):
            raise TraceFormatError(path, "no otherData.rank and not exactly one integer pid to take the rank from")
        rank = next(iter(pids))
    if not isinstance(rank, int):
        raise TraceFormatError(path, f"otherData.rank is {rank!r}, not an integer")
    trace = RankTrace(rank)
    thread_names = {e.get("tid"): e["args"]["name"] for e in doc["traceEvents"]
                    if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "thread_name"
                    and isinstance(e.get("args"), dict) and isinstance(e["args"].get("name"), str)}
    for i, event in enumerate(events):
        name = event["name"]
        if name == phases.COPY_SLICE:
            args = event.get("args") if isinstance(event.get("args"), dict) else {}
            where = f"traceEvents[{i}] ({name})"
            trace.copies.append(Copy(
                src=_int_arg(path, where, args, "src", True), dst=_int_arg(path, where, args, "dst", True),
                nbytes=_int_arg(path, where, args, "bytes", True), start=float(event["ts"]),
                end=float(event["ts"]) + float(event["dur"]), kind="P2P",
                lane=thread_names.get(event.get("tid"), f"copy lane {event.get('tid')}"),
                is_critical=False, layer=_int_arg(path, where, args, "layer", False),
                slot=_int_arg(path, where, args, "slot", False), expert=_int_arg(path, where, args, "expert", False)))
        elif name in phases.ALL:
            trace.phases.append(_span(event, "compute"))
    trace.phases.sort(key=lambda s: (s.start, -s.end))
    trace.copies.sort(key=lambda c: c.start)
    trace.iterations = [p for p in trace.phases if p.name == phases.FORWARD]
    if not trace.phases and not trace.copies:
        raise TraceFormatError(path, f"no dwdp phase or copy events (names from dwdp.observe.phases) in {len(events)} complete events")
    return trace, other


def _memcpy_kind(name: str) -> str:
    for token, kind in _MEMCPY_KINDS.items():
        if token in name:
            return kind
    return "other"


def read_torch_profiler(path: Path, doc: dict | None = None) -> RankTrace:
    """A torch.profiler Chrome export -> one RankTrace.

    The rank comes from distributedInfo.rank, else from "rank<N>" in the file name, else 0.
    Without device kernels, the operators of the forward thread (the thread that carries the
    FORWARD / ProfilerStep annotations, else the one with most operator time) stand in for them.
    """
    path = Path(path)
    doc = read_json(path) if doc is None else doc
    events = complete_events(path, doc)
    info = doc.get("distributedInfo") if isinstance(doc.get("distributedInfo"), dict) else {}
    match = _RANK_IN_NAME.search(path.name)
    rank = info.get("rank") if isinstance(info.get("rank"), int) else int(match.group(1)) if match else 0
    trace = RankTrace(rank)
    kernel_lanes = {e.get("tid") for e in events if e.get("cat") == "kernel"}
    cpu_ops: dict = defaultdict(list)
    steps = []
    for event in events:
        cat = event.get("cat")
        if cat == "kernel":
            trace.kernels.append(_span(event, f"stream {event.get('tid')}"))
        elif cat == "gpu_memcpy":
            kind = _memcpy_kind(event["name"])
            # torch does not record the peer of a peer copy: src -1 marks it unknown.
            trace.copies.append(Copy(
                src=rank if kind == "D2D" else -1, dst=rank, nbytes=int((event.get("args") or {}).get("bytes", 0)),
                start=float(event["ts"]), end=float(event["ts"]) + float(event["dur"]), kind=kind,
                lane=f"stream {event.get('tid')}", is_critical=event.get("tid") in kernel_lanes))
        elif cat == "user_annotation":
            span = _span(event, f"thread {event.get('tid')}")
            (steps if _PROFILER_STEP.match(span.name) else trace.phases).append(span)
        elif cat == "cpu_op":
            cpu_ops[event.get("tid")].append(_span(event, f"thread {event.get('tid')}"))
    trace.phases.sort(key=lambda s: (s.start, -s.end))
    trace.iterations = [p for p in trace.phases if p.name == phases.FORWARD] or sorted(steps, key=lambda s: s.start)
    if not trace.kernels and cpu_ops:
        marked = {s.lane for s in trace.iterations}
        busiest = max(cpu_ops, key=lambda tid: sum(s.dur for s in cpu_ops[tid]))
        tid = next((t for t in cpu_ops if f"thread {t}" in marked), busiest)
        trace.kernels = cpu_ops[tid]
    trace.kernels.sort(key=lambda s: s.start)
    everything = trace.kernels + trace.phases
    if not everything:
        raise TraceFormatError(path, "torch.profiler trace without kernels, operators or annotations")
    if not trace.iterations:
        trace.iterations = [Span("whole trace", min(s.start for s in everything), max(s.end for s in everything))]
    return trace
