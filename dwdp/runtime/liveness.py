"""Liveness of the ranks of a DWDP group, readable by peers without any collective.

Each rank owns one small record in shared memory, int64 words [pid, state, heartbeat]:
- state: STARTING, SERVING, CLOSED (the rank closed its model on purpose: on the host backend
  its segment stays readable for as long as survivors map it), FAILED (the rank reports its own
  device lost);
- heartbeat: CLOCK_MONOTONIC nanoseconds (one clock for every process of a host), written by a
  daemon thread every `period_s`.

A peer classifies a rank as `exited` when its process is gone without having closed (a pidfd
opened at setup becomes readable when the process ends, zombies included, and is immune to pid
reuse), `failed` when it reports FAILED, `stalled` when it lives but its heartbeat is older than
`stall_after_s` (SIGSTOP, a hung interpreter), `closed`, or `alive`. Nothing here runs on the hot
path unless asked: reading a record is two memory loads and one non-blocking poll.

Records are files in DWDP_SHM_DIR named dwdp-live-<pid>-<id>, mapped by every peer at setup and
then unlinked, like segments: nothing is left in /dev/shm once the last process exits, killed
ones included. A peer on another node (DWDP_NODE, default the host name) has no record here: with a
store (the world's, which outlives any rank) each rank also beats there and peers on other nodes are
watched through it (dwdp.runtime.store_liveness); without one their status is `unknown`.
"""
from __future__ import annotations

import logging
import os
import select
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from dwdp import envs
from dwdp.runtime.store_liveness import RemotePeers, StoreBeat
from dwdp.runtime.transport.host import map_file, sweep_stale_segments

log = logging.getLogger("dwdp")

LIVENESS_PREFIX = "dwdp-live-"
STARTING, SERVING, CLOSED, FAILED = 0, 1, 2, 3
_PID, _STATE, _BEAT = 0, 1, 2
_WORDS = 4  # pid, state, heartbeat, spare: one 32-byte record


def heartbeat_period(stall_after_s: float) -> float:
    """Beat four times per stall bound, so one late beat is never taken for a stall."""
    return min(1.0, max(0.01, stall_after_s / 4))


class LivenessRecord:
    """This rank's own record: create, publish the handle, beat, mark closed or failed."""

    def __init__(self, shm_dir: str | os.PathLike, period_s: float, beat: StoreBeat | None = None):
        directory = Path(shm_dir)
        if not directory.is_dir():
            raise FileNotFoundError(f"DWDP_SHM_DIR={str(directory)!r} is not a directory")
        sweep_stale_segments(directory, LIVENESS_PREFIX)
        self.path: Path | None = directory / f"{LIVENESS_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        with open(self.path, "wb") as f:
            f.truncate(8 * _WORDS)
        self._fd: int | None = os.open(self.path, os.O_RDWR)  # /proc/<pid>/fd/<fd>: the board's handle
        self.words = map_file(str(self.path), 8 * _WORDS).view(torch.int64)  # [4]
        self.words[_PID] = os.getpid()
        self.words[_STATE] = STARTING
        self.words[_BEAT] = time.monotonic_ns()
        self.period_s = period_s
        self.beat = beat  # the same beats in the world's store, for peers on other nodes
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _node_fields(self) -> dict:
        return {"host": envs.node_name(), **({"beat": self.beat.handle()} if self.beat is not None else {})}

    def handle(self) -> dict:
        return {"path": str(self.path), "pid": os.getpid(), **self._node_fields()}

    def board_handle(self) -> dict:
        """A handle valid for as long as this process lives (dwdp.runtime.board)."""
        return {"path": f"/proc/{os.getpid()}/fd/{self._fd}", "pid": os.getpid(), **self._node_fields()}

    @property
    def is_serving(self) -> bool:
        return int(self.words[_STATE]) == SERVING

    def start(self) -> None:
        """Mark SERVING and beat until `close`."""
        self.words[_STATE] = SERVING
        if self.beat is not None:
            self.beat.set_state(SERVING)
            self.beat.start(self.period_s)  # its own thread: a hanging store never delays the record's beat
        self._thread = threading.Thread(target=self._beat, name="dwdp-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.period_s):
            self.words[_BEAT] = time.monotonic_ns()

    def seal(self) -> None:
        """Every peer has mapped the record: drop its name."""
        if self.path is not None:
            self.path.unlink(missing_ok=True)
            self.path = None

    def mark_failed(self) -> None:
        self.words[_STATE] = FAILED
        if self.beat is not None:
            self.beat.set_state(FAILED)

    def close(self) -> None:
        """Stop beating and say so, so that peers do not take the silence for a crash."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self.beat is not None:
            self.beat.stop()
        if int(self.words[_STATE]) != FAILED:
            self.words[_STATE] = CLOSED
            if self.beat is not None:
                self.beat.set_state(CLOSED)
        self.seal()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass(frozen=True)
class PeerStatus:
    state: str   # "alive", "stalled", "exited", "failed", "closed" or "unknown"
    pid: int
    beat_age_s: float | None  # seconds since its last heartbeat (None: no record)
    remote: bool = False      # on another node: read from its beats in the store

    @property
    def is_lost(self) -> bool:
        return self.state in ("exited", "failed")

    def describe(self, peer: int) -> str:
        if self.state == "exited" and self.remote:
            return (f"rank {peer} (pid {self.pid}, another node) has not beaten for {self.beat_age_s:.2f} s, or a new "
                    "process took its place")
        if self.state == "exited":
            return f"rank {peer} (pid {self.pid}) exited without closing"
        if self.state == "failed":
            return f"rank {peer} (pid {self.pid}) reports its device lost"
        if self.state == "stalled":
            return f"rank {peer} (pid {self.pid}) is alive but silent for {self.beat_age_s:.2f} s"
        return f"rank {peer} (pid {self.pid}) is {self.state}"


def _pidfd(pid: int) -> int | None:
    """A pidfd of `pid`, or None where the kernel or Python has none (or the pid is gone)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def process_exited(pid: int, pidfd: int | None) -> bool:
    """True once `pid` has ended (a zombie counts as ended)."""
    if pidfd is not None:
        return bool(select.select([pidfd], [], [], 0)[0])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


class PeerLiveness:
    """The records of every peer of `rank` on this node, mapped once at setup, and the beats of those on
    other nodes (`remote`, read through the world's store; None: their status is unknown)."""

    def __init__(self, rank: int, handles: list[dict | None], stall_after_s: float,
                 remote: RemotePeers | None = None):
        """handles[r]: rank r's record handle; None for a peer already lost (not watched)."""
        self.rank, self.stall_after_s, self.remote = rank, stall_after_s, remote
        self._words: dict[int, torch.Tensor] = {}
        self._pids: dict[int, int] = {}
        self._pidfds: dict[int, int | None] = {}
        self._incarnations: dict[int, str | None] = {}
        self._nodes: dict[int, str | None] = {}  # kept after `forget`: where a lost peer ran
        for peer, handle in enumerate(handles):
            if peer != rank and handle is not None:
                self.watch(peer, handle)

    def watch(self, peer: int, handle: dict) -> None:
        """Map `peer`'s record (at setup, or a new incarnation's once the old one was forgotten)."""
        if peer in self._words or (self.remote is not None and peer in self.remote):
            raise RuntimeError(f"rank {self.rank}: already watching peer {peer}; forget({peer}) first")
        self._nodes[peer] = handle.get("host")
        beat = handle.get("beat")
        self._incarnations[peer] = beat.get("incarnation") if isinstance(beat, dict) else None
        if handle.get("host") != envs.node_name():
            if self.remote is not None and isinstance(beat, dict):
                self.remote.watch(peer, int(handle["pid"]), beat)
            return  # on another node: no record to read here (without a store its status stays unknown)
        if not os.path.exists(handle["path"]):
            raise FileNotFoundError(f"rank {self.rank}: liveness record {handle['path']} of peer {peer} does not exist")
        pidfd = _pidfd(int(handle["pid"]))  # first: a record of a process that has gone reads as exited
        self._words[peer] = map_file(handle["path"], 8 * _WORDS).view(torch.int64)
        self._pids[peer] = int(handle["pid"])
        self._pidfds[peer] = pidfd

    @property
    def peers(self) -> tuple[int, ...]:
        remote = self.remote.peers if self.remote is not None else ()
        return tuple(sorted((*self._words, *remote)))

    def node_of(self, peer: int) -> str | None:
        """The node `peer` runs (or last ran) on, as its handle named it."""
        return self._nodes.get(peer)

    def identity(self, peer: int) -> tuple:
        """(pid, beat incarnation): which process `peer` is (a pid alone may be reused on another node)."""
        return self.pid(peer), self._incarnations.get(peer)

    def pid(self, peer: int) -> int:
        if peer not in self._pids and self.remote is not None:
            return self.remote.pid(peer)
        return self._pids[peer]

    def status(self, peer: int) -> PeerStatus:
        words = self._words.get(peer)
        if words is None:
            if self.remote is not None and peer in self.remote:
                seen = self.remote.status(peer)
                return PeerStatus(seen.state, self.remote.pid(peer), seen.beat_age_s, remote=True)
            return PeerStatus("unknown", -1, None)
        pid = self._pids[peer]
        state, beat = int(words[_STATE]), int(words[_BEAT])
        age = (time.monotonic_ns() - beat) / 1e9
        if state == FAILED:
            return PeerStatus("failed", pid, age)
        if state == CLOSED:
            return PeerStatus("closed", pid, age)
        if process_exited(pid, self._pidfds[peer]):
            return PeerStatus("exited", pid, age)
        if state == SERVING and age > self.stall_after_s:
            return PeerStatus("stalled", pid, age)
        return PeerStatus("alive", pid, age)

    def forget(self, peer: int) -> None:
        """Stop watching a lost peer: unmap its record and close its pidfd."""
        self._words.pop(peer, None)
        self._pids.pop(peer, None)
        self._incarnations.pop(peer, None)
        fd = self._pidfds.pop(peer, None)
        if fd is not None:
            os.close(fd)
        if self.remote is not None:
            self.remote.forget(peer)

    def close(self) -> None:
        for peer in list(self._words):
            self.forget(peer)
        if self.remote is not None:
            self.remote.close()


def entry_identity(entry: dict) -> tuple:
    """(pid, beat incarnation) of a board entry, as PeerLiveness.identity names a watched peer."""
    beat = entry["record"].get("beat")
    return int(entry["pid"]), beat.get("incarnation") if isinstance(beat, dict) else None


def remote_watch(group, stall_after_s: float, lost_after_s: float, spans_nodes: bool):
    """(this rank's StoreBeat, its RemotePeers) when its group spans nodes, each over its own connection to
    the world's store (dwdp.runtime.group.connect_store); (None, None) otherwise. Raises when the group
    spans nodes and no store can be reached: without one, no peer on another node could be declared lost
    but by a failing copy, and no replacement could find the group."""
    if not spans_nodes:
        return None, None
    from dwdp.runtime.group import connect_store

    period = heartbeat_period(stall_after_s)
    beat = StoreBeat(connect_store(), group.group_id or "world", group.rank)
    remote = RemotePeers(connect_store(), stall_after_s, lost_after_s, period)
    return beat, remote


def exchange_records(group, shm_dir: str, stall_after_s: float,
                     lost_after_s: float | None = None) -> tuple[LivenessRecord | None, PeerLiveness | None]:
    """This rank's record and its view of every peer's (two all_gathers, at setup: the nodes, then the
    handles). Call `seal` on the record after the group barrier and `start` it once serving; (None, None)
    for one rank. lost_after_s: when a silent peer on another node is lost (default 5 x stall_after_s)."""
    if group.size == 1:
        return None, None
    nodes = group.all_gather_object(envs.node_name())
    beat, remote = remote_watch(group, stall_after_s, lost_after_s or 5 * stall_after_s, len(set(nodes)) > 1)
    record = LivenessRecord(shm_dir, heartbeat_period(stall_after_s), beat)
    try:
        liveness = PeerLiveness(group.rank, group.all_gather_object(record.handle()), stall_after_s, remote)
        if remote is not None:
            remote.start()
        return record, liveness
    except BaseException:
        record.close()
        if remote is not None:
            remote.close()
        raise


def close_records(record: LivenessRecord | None, liveness: PeerLiveness | None) -> None:
    if record is not None:
        record.close()
    if liveness is not None:
        liveness.close()
