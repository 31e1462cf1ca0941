"""The KV directory of one `dwdp serve`: made private, held by one server at a time, cleared of what an
earlier server left.

`claim_kv_dir(path)` creates the directory with mode 0700 (its parents as the umask says), or takes an
existing one only if it is a real directory (not a symlink) of this user that nobody else may write:
another local user who could write there could swap a file under a victim's descriptor. It then
holds an exclusive lock (`flock` on `.dwdp-serve.lock` inside), so a second server on the same
directory is refused in one line, and removes the artifacts (and half-written temporaries) a server
that stopped without cleaning up left behind: no running server owns them, and nobody would expire
them. `KVDirClaim.release()` drops the lock.
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import stat
from dataclasses import dataclass

from dwdp.serve.kv_handoff import ARTIFACT_NAME

LOCK_NAME = ".dwdp-serve.lock"
_TEMPORARY = re.compile(r"\.pf-[0-9a-f]{32}\.safetensors\.tmp")  # write_kv_artifact's name before the rename


class KVDirError(ValueError):
    """A KV directory this server must not use; str() is the one line that says why."""


@dataclass
class KVDirClaim:
    """A KV directory this server holds: its path, the lock's descriptor, and what was swept at start."""

    path: str
    lock_fd: int
    swept: int

    def release(self) -> None:
        if self.lock_fd >= 0:
            os.close(self.lock_fd)  # closing the descriptor drops the flock
            self.lock_fd = -1


def _check_owner_and_kind(path: str, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise KVDirError(f"--kv-dir {path} is a symlink; give the directory itself")
    if not stat.S_ISDIR(st.st_mode):
        raise KVDirError(f"--kv-dir {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise KVDirError(f"--kv-dir {path} belongs to uid {st.st_uid}, not this user ({os.geteuid()}): another user "
                         "could replace artifacts there; give a directory of your own")


def _check_private(path: str, st: os.stat_result) -> None:
    _check_owner_and_kind(path, st)
    if st.st_mode & 0o022:
        raise KVDirError(f"--kv-dir {path} has mode {stat.S_IMODE(st.st_mode):o}: others may write there; "
                         f"chmod 700 it or give a new path")


def claim_kv_dir(path: str) -> KVDirClaim:
    """Create or check `path` (see the module docstring), lock it and sweep leftovers; KVDirError otherwise."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        os.mkdir(path, 0o700)  # a umask can only take bits away
    except FileExistsError:
        pass
    _check_owner_and_kind(path, os.lstat(path))
    dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _check_private(path, os.fstat(dir_fd))  # the directory just checked, not one swapped in meanwhile
        lock_fd = os.open(LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(lock_fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise KVDirError(f"--kv-dir {path} is held by another running dwdp serve; give each server a "
                                 "directory of its own") from None
            raise
        swept = sweep_artifacts(dir_fd)
    finally:
        os.close(dir_fd)
    return KVDirClaim(path, lock_fd, swept)


def sweep_artifacts(dir_fd: int) -> int:
    """Remove every artifact and temporary of dwdp's naming in the directory open as `dir_fd` (regular
    files only, nothing followed); returns how many."""
    removed = 0
    for name in os.listdir(dir_fd):
        if not (ARTIFACT_NAME.fullmatch(name) or _TEMPORARY.fullmatch(name)):
            continue
        try:
            if stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
                os.unlink(name, dir_fd=dir_fd)
                removed += 1
        except FileNotFoundError:
            pass
    return removed
