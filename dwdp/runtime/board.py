"""The group's board: where each rank of a DWDP group publishes how to reach it, so that a rank
restarted later can rejoin, and its peers find it again, without any collective.

The board is a directory `dwdp-board-<group id>` in DWDP_SHM_DIR holding one small JSON file per
rank, `rank<r>.json`: {"pid", "segment": transport handle, "record": liveness handle,
"dense_checksum": of its dense weights, which a replacement compares with its own}. Each rank
writes its own file (atomically: a temporary file renamed over it) once it serves; a survivor
removes it once its process is gone. An entry also holds its process's start time, so a pid reused
by another process never passes for it. The handles name `/proc/<pid>/fd/<n>` paths of files the owner keeps open: they reopen
the owner's live segment and record, and stop resolving the moment it exits, so an entry of a dead
process can never map that process's memory again.

Readers never wait on the board: a missing or stale entry (its pid gone) reads as None.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from dwdp import envs
from dwdp.runtime.liveness import process_exited

BOARD_PREFIX = "dwdp-board-"


def _start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot: /proc/<pid>/stat field 22); None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _entry_alive(entry: dict) -> bool:
    """The process that wrote `entry` still runs (a zombie, or a new process with its pid, does not)."""
    pid = int(entry["pid"])
    return not process_exited(pid, None) and _start_time(pid) == entry.get("start_time")


def sweep_stale_boards(root: Path) -> None:
    """Remove entries of dead processes from every board in `root`, and boards left empty (a whole
    group killed leaves its board behind; nobody can rejoin a group with no live member)."""
    for board in root.glob(f"{BOARD_PREFIX}*"):
        for file in board.glob("rank*.json"):
            try:
                entry = json.loads(file.read_text())
                alive = _entry_alive(entry)
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being replaced right now, or not ours
            if not alive:
                try:
                    file.unlink(missing_ok=True)
                except OSError:
                    pass  # another user's board in a shared /dev/shm
        try:
            board.rmdir()
        except OSError:
            pass  # a live entry is left


class Board:
    """The board of group `group_id` (a name every rank and a replacement compute alike: see
    dwdp.runtime.group.init_group) in `shm_dir` (default DWDP_SHM_DIR)."""

    def __init__(self, group_id: str, shm_dir: str | os.PathLike | None = None):
        if not group_id or "/" in group_id:
            raise ValueError(f"group_id={group_id!r} must be a non-empty name without '/'")
        root = Path(shm_dir or envs.shm_dir())
        if not root.is_dir():
            raise FileNotFoundError(f"DWDP_SHM_DIR={str(root)!r} is not a directory")
        self.group_id = group_id
        sweep_stale_boards(root)
        self.path = root / f"{BOARD_PREFIX}{group_id}"  # made by the first `publish`: a failed setup leaves none

    def _file(self, rank: int) -> Path:
        return self.path / f"rank{rank}.json"

    def publish(self, rank: int, segment: dict, record: dict, dense_checksum: int) -> None:
        """Write this process's entry for `rank`, replacing any earlier incarnation's."""
        entry = {"pid": os.getpid(), "start_time": _start_time(os.getpid()), "segment": segment, "record": record,
                 "dense_checksum": dense_checksum}
        tmp = self.path / f".rank{rank}.{os.getpid()}.tmp"
        for attempt in range(3):
            self.path.mkdir(exist_ok=True)  # the last rank to close, or a sweep, may have removed it
            try:
                tmp.write_text(json.dumps(entry))
                os.replace(tmp, self._file(rank))  # readers see the old entry or the new one, never half
                return
            except FileNotFoundError:
                if attempt == 2:
                    raise

    def read(self, rank: int) -> dict | None:
        """`rank`'s entry, or None when it has none or its process is gone."""
        try:
            entry = json.loads(self._file(rank).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return entry if _entry_alive(entry) else None

    def sweep(self, rank: int) -> None:
        """Remove `rank`'s entry when its process is gone (a survivor cleans up after a loss)."""
        try:
            entry = json.loads(self._file(rank).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return
        if not _entry_alive(entry):
            self._file(rank).unlink(missing_ok=True)
        self._remove_if_empty()

    def withdraw(self, rank: int) -> None:
        """Remove `rank`'s entry if this process wrote it (a rank closing), and the board once empty."""
        try:
            entry = json.loads(self._file(rank).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            entry = None
        if entry is not None and int(entry["pid"]) == os.getpid():
            self._file(rank).unlink(missing_ok=True)
        self._remove_if_empty()

    def _remove_if_empty(self) -> None:
        """Remove the board once no live process has an entry on it (dead ones are swept first: an
        incarnation killed after its survivors last looked leaves its entry behind)."""
        try:
            files = list(self.path.glob("rank*.json"))
        except OSError:
            return  # already gone: another rank removed it
        for file in files:
            try:
                if not _entry_alive(json.loads(file.read_text())):
                    file.unlink(missing_ok=True)
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being replaced right now
        try:
            self.path.rmdir()
        except OSError:
            pass  # another rank's entry is still there
