"""Processes a launcher started, and everything they started in turn: found through /proc and killed
on every way out of the launcher (an exception, a KeyboardInterrupt, a timeout firing inside a wait).

Two ways to find them, for two kinds of launcher:
- a child started in a session of its own (`dwdp serve` under dwdp.serve.launch.ServerProcess, a
  test's subprocess): its process group holds it and every descendant that did not leave the group,
  orphans included (`group_members`, `kill_group`);
- children sharing the launcher's own group (ranks spawned by dwdp.runtime.group.launch_local):
  their descendants are walked by parent pid while the child still lives (`descendants`).
Linux only (/proc); elsewhere both find nothing and only the direct child is killed.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path


def _stats() -> dict[int, tuple[str, int, int]]:
    """pid -> (state, parent pid, process group) of every process this user may read."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone while we looked
        out[int(entry.name)] = (fields[0], int(fields[1]), int(fields[2]))
    return out


def is_running(pid: int) -> bool:
    """`pid` names a process that has not exited (zombies, exited and not yet reaped, do not count)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """Pids of the running processes in process group `pgid`."""
    return sorted(pid for pid, (state, _, group) in _stats().items() if group == pgid and state not in ("Z", "X"))


def descendants(pid: int) -> list[int]:
    """Pids of the running children of `pid`, their children, and so on (not `pid` itself)."""
    children: dict[int, list[int]] = {}
    for child, (state, parent, _) in _stats().items():
        if state not in ("Z", "X"):
            children.setdefault(parent, []).append(child)
    found, todo = [], list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, ()))
    return sorted(found)


def kill_group(pgid: int) -> list[int]:
    """SIGKILL every process of group `pgid`; returns the pids that were running in it."""
    members = group_members(pgid)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nobody left in it
    return members


def kill_pids(pids) -> None:
    """SIGKILL each of `pids` that still exists."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
