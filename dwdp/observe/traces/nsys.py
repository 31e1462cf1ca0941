"""Nsight Systems SQLite export reader (`nsys export --type sqlite -o run.sqlite run.nsys-rep`).

Tables and columns used (Nsight Systems "SQLite Export Schema Reference"; timestamps in ns):
  StringIds(id, value)
  CUPTI_ACTIVITY_KIND_KERNEL(start, end, deviceId, streamId, shortName -> StringIds.id,
                             [demangledName, correlationId, globalPid])
  CUPTI_ACTIVITY_KIND_MEMCPY(start, end, deviceId, streamId, bytes, copyKind,
                             [srcDeviceId, dstDeviceId, correlationId, globalPid])
  NVTX_EVENTS(start, end, eventType, text, [textId -> StringIds.id, globalTid])
  CUPTI_ACTIVITY_KIND_RUNTIME(start, globalTid, correlationId)      optional
Columns in [] are optional. Tables are created lazily by the exporter, so a report without
copies has no MEMCPY table; a file with none of KERNEL, MEMCPY, NVTX_EVENTS is refused.

Ranks are CUDA device ids. NVTX ranges are host-side: a FORWARD range becomes an iteration on the
device whose kernels its thread launched inside it, spanning those kernels on the device
timeline (through the RUNTIME table's correlation ids); without that table the host range is used.
"""
from __future__ import annotations

import sqlite3
from bisect import bisect_left, bisect_right
from collections import defaultdict
from pathlib import Path

from dwdp.observe import phases
from dwdp.observe.traces.model import Copy, RankTrace, Span, Trace, TraceFormatError

# ENUM_CUDA_MEMCPY_OPER ids
_COPY_KINDS = {1: "H2D", 2: "D2H", 8: "D2D", 10: "P2P"}
# ENUM_NSYS_EVENT_TYPE ids of ranges (34 is NvtxMark, an instant)
_NVTX_RANGE_TYPES = (59, 60)  # NvtxPushPopRange, NvtxStartEndRange

_REQUIRED = {
    "CUPTI_ACTIVITY_KIND_KERNEL": ("start", "end", "deviceId", "streamId", "shortName"),
    "CUPTI_ACTIVITY_KIND_MEMCPY": ("start", "end", "deviceId", "streamId", "bytes", "copyKind"),
    "NVTX_EVENTS": ("start", "end", "eventType", "text"),
    "CUPTI_ACTIVITY_KIND_RUNTIME": ("start", "globalTid", "correlationId"),
    "StringIds": ("id", "value"),
}
_ACTIVITY_TABLES = ("CUPTI_ACTIVITY_KIND_KERNEL", "CUPTI_ACTIVITY_KIND_MEMCPY", "NVTX_EVENTS")


def _pid(global_id: int | None) -> int | None:
    """Process id inside a serialized GlobalId (bits 24..47)."""
    return None if global_id is None else (int(global_id) >> 24) & 0xFFFFFF


class _Schema:
    """Which tables and columns this database has; refuses ones we cannot read."""

    def __init__(self, path: Path, conn: sqlite3.Connection):
        self.path = path
        names = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")]
        self.columns = {n: {r[1] for r in conn.execute(f'PRAGMA table_info("{n}")')} for n in names}
        if not any(t in self.columns for t in _ACTIVITY_TABLES):
            raise TraceFormatError(path, f"no table {', '.join(_ACTIVITY_TABLES)}: not an Nsight Systems SQLite "
                                         f"export (tables found: {', '.join(sorted(names)) or 'none'})")
        for table, needed in _REQUIRED.items():
            if table in self.columns:
                missing = [c for c in needed if c not in self.columns[table]]
                if missing:
                    raise TraceFormatError(path, f"table {table} has no column {', '.join(missing)}: schema not recognised")
        if "CUPTI_ACTIVITY_KIND_KERNEL" in self.columns and "StringIds" not in self.columns:
            raise TraceFormatError(path, "table StringIds is missing: kernel names cannot be resolved")

    def has(self, table: str, column: str | None = None) -> bool:
        return table in self.columns and (column is None or column in self.columns[table])

    def col(self, table: str, column: str) -> str:
        """The column, or NULL where this schema version lacks it."""
        return f"t.{column}" if self.has(table, column) else "NULL"


def read_nsys_sqlite(path: str | Path) -> Trace:
    """An Nsight Systems SQLite export -> Trace with one RankTrace per CUDA device."""
    path = Path(path)
    if not path.is_file():
        raise TraceFormatError(path, "no such file")
    try:
        conn = sqlite3.connect(path.resolve().as_uri() + "?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise TraceFormatError(path, f"cannot open as SQLite: {exc}") from None
    try:
        return _read(path, conn)
    except sqlite3.DatabaseError as exc:
        raise TraceFormatError(path, f"not a readable SQLite database ({exc})") from None
    finally:
        conn.close()


def _read(path: Path, conn: sqlite3.Connection) -> Trace:
    schema = _Schema(path, conn)
    strings = dict(conn.execute("SELECT id, value FROM StringIds")) if schema.has("StringIds") else {}
    ranks: dict[int, RankTrace] = {}

    def rank(device: int) -> RankTrace:
        return ranks.setdefault(int(device), RankTrace(int(device)))

    launches = {}  # (pid, correlationId) -> (launching thread, launch time)
    if schema.has("CUPTI_ACTIVITY_KIND_RUNTIME"):
        for start, tid, corr in conn.execute("SELECT start, globalTid, correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME"):
            launches[(_pid(tid), corr)] = (tid, start)

    device_work = []  # kernels and copies: (device, launch thread, launch time ns, start ns, end ns)
    pid_devices: dict = defaultdict(set)
    kernel_streams = set()
    if schema.has("CUPTI_ACTIVITY_KIND_KERNEL"):
        k = "CUPTI_ACTIVITY_KIND_KERNEL"
        rows = conn.execute(f"SELECT t.start, t.end, t.deviceId, t.streamId, t.shortName, {schema.col(k, 'demangledName')}, "
                            f"{schema.col(k, 'correlationId')}, {schema.col(k, 'globalPid')} FROM {k} AS t")
        for start, end, device, stream, short, demangled, corr, gpid in rows:
            name = strings.get(short) or strings.get(demangled) or f"kernel {short}"
            rank(device).kernels.append(Span(name, start / 1e3, end / 1e3, f"stream {stream}",
                                             {"demangled": strings.get(demangled, name)}))
            kernel_streams.add((device, stream))
            if gpid is not None:
                pid_devices[_pid(gpid)].add(device)
            launch = launches.get((_pid(gpid), corr))
            if launch is not None:
                device_work.append((device, launch[0], launch[1], start, end))

    if schema.has("CUPTI_ACTIVITY_KIND_MEMCPY"):
        m = "CUPTI_ACTIVITY_KIND_MEMCPY"
        rows = conn.execute(f"SELECT t.start, t.end, t.deviceId, t.streamId, t.bytes, t.copyKind, "
                            f"{schema.col(m, 'srcDeviceId')}, {schema.col(m, 'dstDeviceId')}, "
                            f"{schema.col(m, 'correlationId')}, {schema.col(m, 'globalPid')} FROM {m} AS t")
        for start, end, device, stream, nbytes, copy_kind, src, dst, corr, gpid in rows:
            launch = launches.get((_pid(gpid), corr))
            # Copy-stream copies overlap the forward (a prefetch may outlive it): they do not bound iterations.
            if launch is not None and (device, stream) in kernel_streams:
                device_work.append((device, launch[0], launch[1], start, end))
            src = device if src is None else src
            dst = (device if copy_kind != 10 else -1) if dst is None else dst
            kind = "P2P" if copy_kind == 10 or src != dst else _COPY_KINDS.get(copy_kind, "other")
            rank(device).copies.append(Copy(int(src), int(dst), int(nbytes), start / 1e3, end / 1e3, kind,
                                            f"stream {stream}", (device, stream) in kernel_streams))

    if schema.has("NVTX_EVENTS"):
        _read_nvtx(conn, schema, strings, ranks, rank, pid_devices, device_work)

    for r in ranks.values():
        r.kernels.sort(key=lambda s: s.start)
        r.copies.sort(key=lambda c: c.start)
        r.phases.sort(key=lambda s: (s.start, -s.end))
        r.iterations.sort(key=lambda s: s.start)
        if not r.iterations:
            spans = [(s.start, s.end) for s in r.kernels] + [(c.start, c.end) for c in r.copies]
            if spans:
                r.iterations = [Span("whole trace", min(s for s, _ in spans), max(e for _, e in spans), "device")]
    if not ranks:
        raise TraceFormatError(path, "no kernels, copies or device-attributable NVTX ranges")
    return Trace(str(path), "nsys-sqlite", dict(sorted(ranks.items())), group_size=len(ranks))


def _read_nvtx(conn, schema: _Schema, strings: dict, ranks: dict, rank, pid_devices: dict, device_work: list) -> None:
    """Adds our phase ranges to the device whose process (or launched kernels) they belong to."""
    n = "NVTX_EVENTS"
    types = ", ".join(str(t) for t in _NVTX_RANGE_TYPES)
    rows = conn.execute(f"SELECT t.start, t.end, t.text, {schema.col(n, 'textId')}, {schema.col(n, 'globalTid')} "
                        f"FROM {n} AS t WHERE t.eventType IN ({types}) AND t.end IS NOT NULL")
    all_devices = set(ranks)
    by_thread: dict = defaultdict(list)  # launching thread -> work sorted by launch time
    for w in sorted(device_work, key=lambda w: w[2]):
        by_thread[w[1]].append(w)
    launch_times = {t: [w[2] for w in ws] for t, ws in by_thread.items()}
    for start, end, text, text_id, tid in rows:
        name = text if text is not None else strings.get(text_id)
        if name not in phases.ALL:
            continue
        times = launch_times.get(tid, [])
        launched = by_thread[tid][bisect_left(times, start):bisect_right(times, end)] if times else []
        devices = {w[0] for w in launched} or pid_devices.get(_pid(tid)) or all_devices
        if len(devices) != 1:
            continue  # a range we cannot pin to one device says nothing about any one rank
        device = next(iter(devices))
        host = Span(name, start / 1e3, end / 1e3, "host", {})
        rank(device).phases.append(host)
        if name == phases.FORWARD:
            on_device = [w for w in launched if w[0] == device]
            if on_device:
                rank(device).iterations.append(Span(name, min(w[3] for w in on_device) / 1e3,
                                                    max(w[4] for w in on_device) / 1e3, "device", {}))
            else:
                rank(device).iterations.append(host)
