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
ones included. Peers on another host (multi-node) have no record here: their status is `unknown`.
"""
from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

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

    def __init__(self, shm_dir: str | os.PathLike, period_s: float):
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
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def handle(self) -> dict:
        return {"path": str(self.path), "pid": os.getpid(), "host": socket.gethostname()}

    def board_handle(self) -> dict:
        """A handle valid for as long as this process lives (dwdp.runtime.board)."""
        return {"path": f"/proc/{os.getpid()}/fd/{self._fd}", "pid": os.getpid(), "host": socket.gethostname()}

    @property
    def is_serving(self) -> bool:
        return int(self.words[_STATE]) == SERVING

    def start(self) -> None:
        """Mark SERVING and beat until `close`."""
        self.words[_STATE] = SERVING
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

    def close(self) -> None:
        """Stop beating and say so, so that peers do not take the silence for a crash."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if int(self.words[_STATE]) != FAILED:
            self.words[_STATE] = CLOSED
        self.seal()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass(frozen=True)
class PeerStatus:
    state: str   # "alive", "stalled", "exited", "failed", "closed" or "unknown"
    pid: int
    beat_age_s: float | None  # seconds since its last heartbeat (None: no record)

    @property
    def is_lost(self) -> bool:
        return self.state in ("exited", "failed")

    def describe(self, peer: int) -> str:
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
    """The records of every peer of `rank` on this host, mapped once at setup."""

    def __init__(self, rank: int, handles: list[dict | None], stall_after_s: float):
        """handles[r]: rank r's record handle; None for a peer already lost (not watched)."""
        self.rank, self.stall_after_s = rank, stall_after_s
        self._words: dict[int, torch.Tensor] = {}
        self._pids: dict[int, int] = {}
        self._pidfds: dict[int, int | None] = {}
        for peer, handle in enumerate(handles):
            if peer != rank and handle is not None:
                self.watch(peer, handle)

    def watch(self, peer: int, handle: dict) -> None:
        """Map `peer`'s record (at setup, or a new incarnation's once the old one was forgotten)."""
        if peer in self._words:
            raise RuntimeError(f"rank {self.rank}: already watching peer {peer}; forget({peer}) first")
        if handle.get("host") != socket.gethostname():
            return  # on another host: no record to read here, its status stays unknown
        if not os.path.exists(handle["path"]):
            raise FileNotFoundError(f"rank {self.rank}: liveness record {handle['path']} of peer {peer} does not exist")
        pidfd = _pidfd(int(handle["pid"]))  # first: a record of a process that has gone reads as exited
        self._words[peer] = map_file(handle["path"], 8 * _WORDS).view(torch.int64)
        self._pids[peer] = int(handle["pid"])
        self._pidfds[peer] = pidfd

    @property
    def peers(self) -> tuple[int, ...]:
        return tuple(sorted(self._words))

    def pid(self, peer: int) -> int:
        return self._pids[peer]

    def status(self, peer: int) -> PeerStatus:
        words = self._words.get(peer)
        if words is None:
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
        fd = self._pidfds.pop(peer, None)
        if fd is not None:
            os.close(fd)

    def close(self) -> None:
        for peer in list(self._words):
            self.forget(peer)


def exchange_records(group, shm_dir: str, stall_after_s: float) -> tuple[LivenessRecord | None, PeerLiveness | None]:
    """This rank's record and its view of every peer's (one all_gather, at setup). Call `seal` on
    the record after the group barrier and `start` it once serving; (None, None) for one rank."""
    if group.size == 1:
        return None, None
    record = LivenessRecord(shm_dir, heartbeat_period(stall_after_s))
    try:
        return record, PeerLiveness(group.rank, group.all_gather_object(record.handle()), stall_after_s)
    except BaseException:
        record.close()
        raise


def close_records(record: LivenessRecord | None, liveness: PeerLiveness | None) -> None:
    if record is not None:
        record.close()
    if liveness is not None:
        liveness.close()
