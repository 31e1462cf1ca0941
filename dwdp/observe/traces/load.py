"""One entry point for every trace input: `load_trace(path) -> Trace`.

path may be
  - a directory of our `trace_rank{r}.json` files (one run, one file per rank), or of
    torch.profiler exports (`*.json`, one per rank), or holding one Nsight `*.sqlite` export;
  - a single `.sqlite` Nsight Systems export;
  - a single `.json` file: ours (one rank) or a torch.profiler export.
"""
from __future__ import annotations

from pathlib import Path

from dwdp.observe.traces.chrome import (
    complete_events,
    is_torch_profiler,
    read_dwdp_chrome,
    read_json,
    read_torch_profiler,
)
from dwdp.observe.traces.model import RankTrace, Trace, TraceFormatError
from dwdp.observe.traces.nsys import read_nsys_sqlite

SQLITE_SUFFIXES = (".sqlite", ".sqlite3", ".db")


def load_trace(path: str | Path) -> Trace:
    """Read a run's traces; raises TraceFormatError naming the file and the problem."""
    path = Path(path)
    if path.is_dir():
        ours = sorted(path.glob("trace_rank*.json"))
        if ours:
            return _load_json_files(path, ours)
        dbs = sorted(p for p in path.iterdir() if p.suffix in SQLITE_SUFFIXES)
        if len(dbs) == 1:
            return read_nsys_sqlite(dbs[0])
        others = sorted(path.glob("*.json"))
        if others and not dbs:
            return _load_json_files(path, others)
        raise TraceFormatError(path, f"expected trace_rank*.json files, *.json exports or one .sqlite export; "
                                     f"found {len(dbs)} .sqlite and {len(others)} .json")
    if not path.exists():
        raise TraceFormatError(path, "no such file or directory")
    if path.suffix in SQLITE_SUFFIXES:
        return read_nsys_sqlite(path)
    return _load_json_files(path, [path])


def _load_json_files(source: Path, files: list[Path]) -> Trace:
    ranks: dict[int, RankTrace] = {}
    meta: dict = {}
    formats = set()
    for f in files:
        doc = read_json(f)
        if is_torch_profiler(complete_events(f, doc)):
            formats.add("torch-profiler")
            rank_trace, other = read_torch_profiler(f, doc), {}
        else:
            formats.add("dwdp-chrome")
            rank_trace, other = read_dwdp_chrome(f, doc)
        if rank_trace.rank in ranks:
            raise TraceFormatError(f, f"rank {rank_trace.rank} appears in two files of {source}")
        ranks[rank_trace.rank] = rank_trace
        for key in ("group_size", "num_moe_layers"):
            if key in other:
                if key in meta and meta[key] != other[key]:
                    raise TraceFormatError(f, f"otherData.{key}={other[key]!r} but another rank says {meta[key]!r}")
                meta[key] = other[key]
        if "plan_bytes_per_layer" in other:
            meta.setdefault("plan", {})[rank_trace.rank] = _plan_bytes(f, other["plan_bytes_per_layer"])
    if len(formats) > 1:
        raise TraceFormatError(source, "mixes our trace_rank files with torch.profiler exports")
    return Trace(str(source), formats.pop(), dict(sorted(ranks.items())), group_size=meta.get("group_size"),
                 num_moe_layers=meta.get("num_moe_layers"), plan_bytes=meta.get("plan", {}))


def _plan_bytes(path: Path, raw) -> dict[int, int]:
    if not isinstance(raw, dict):
        raise TraceFormatError(path, f"otherData.plan_bytes_per_layer is {type(raw).__name__}, not an object")
    try:
        return {int(k): int(v) for k, v in raw.items()}
    except (TypeError, ValueError):
        raise TraceFormatError(path, f"otherData.plan_bytes_per_layer has a non-integer layer or byte count: {raw!r}") from None
