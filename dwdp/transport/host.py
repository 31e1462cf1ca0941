"""Host backend: segments in shared memory files, a pool of copier threads.

Each rank's source segment is a file in DWDP_SHM_DIR (default /dev/shm) mapped with
`torch.from_file(shared=True)`. Peers map it once at setup; then its owner unlinks the name, so
the memory disappears with the last process that maps it, even if the owner crashes later.
Files left by an owner that died during setup are swept by the next allocation.
"""
from __future__ import annotations

import os
import queue
import threading
import uuid
from pathlib import Path

import torch

from .. import envs
from ..plan import CopyPlan
from ..tracing import now_us
from .base import PeerUnreadable, Ticket, Transport

SEGMENT_PREFIX = "dwdp-seg-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_segments(directory: Path, prefix: str = SEGMENT_PREFIX) -> list[Path]:
    """Unlink `prefix`<pid>-... files whose owning process no longer exists; returns what was removed."""
    removed = []
    for path in directory.glob(f"{prefix}*"):
        try:
            pid = int(path.name[len(prefix):].split("-", 1)[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def map_file(path: str, nbytes: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


class HostTransport(Transport):
    name = "host"

    def __init__(self, rank: int, inflight: int = 2, shm_dir: str | None = None):
        self.rank = rank
        self.inflight = inflight
        self.shm_dir = Path(shm_dir or envs.shm_dir())
        self._path: Path | None = None
        self._segment: torch.Tensor | None = None
        self._peers: list[torch.Tensor | None] = []  # None once a lost peer is forgotten
        self.peer_paths: list[str] = []  # segment file of every rank (unlinked after seal; names for /proc/self/maps)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.recorder = None  # a dwdp.tracing.TraceRecorder while tracing

    # -- setup ---------------------------------------------------------------------------------
    def alloc_segment(self, nbytes: int) -> torch.Tensor:
        if self._segment is not None:
            raise RuntimeError(f"rank {self.rank}: segment already allocated")
        if not self.shm_dir.is_dir():
            raise FileNotFoundError(f"DWDP_SHM_DIR={str(self.shm_dir)!r} is not a directory")
        sweep_stale_segments(self.shm_dir)
        path = self.shm_dir / f"{SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        with open(path, "wb") as f:
            f.truncate(max(nbytes, 1))
        self._path = path
        self._segment = map_file(str(path), max(nbytes, 1))[:nbytes]
        return self._segment

    def register(self) -> dict:
        if self._path is None:
            raise RuntimeError(f"rank {self.rank}: register() before alloc_segment()")
        return {"backend": self.name, "rank": self.rank, "path": str(self._path), "nbytes": self._segment.numel()}

    def open(self, handles: list[dict]) -> None:
        peers = []
        for r, handle in enumerate(handles):
            if handle.get("backend") != self.name:
                raise ValueError(f"rank {self.rank}: peer {r} uses backend {handle.get('backend')!r}, expected 'host'")
            if r == self.rank:
                peers.append(self._segment)
                continue
            path = handle["path"]
            if not os.path.exists(path):
                raise FileNotFoundError(f"rank {self.rank}: segment {path} of peer {r} does not exist")
            peers.append(map_file(path, max(handle["nbytes"], 1))[: handle["nbytes"]])
        self._peers = peers
        self.peer_paths = [str(h["path"]) for h in handles]
        self._start_copiers()

    def seal(self) -> None:
        if self._path is not None:
            self._path.unlink(missing_ok=True)
            self._path = None

    def alloc_slot(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    # -- copies --------------------------------------------------------------------------------
    def _start_copiers(self) -> None:
        for i in range(self.inflight):
            t = threading.Thread(target=self._copier, args=(i,), name=f"dwdp-copier-{self.rank}-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def _copier(self, worker: int) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            ticket, dst, s = item
            if not ticket._start_slice():
                continue  # the ticket failed or was cancelled: its other slices are retried elsewhere
            recorder = self.recorder
            start = now_us() if recorder is not None else 0.0
            try:
                self._copy_slice(dst, s)
            except BaseException as exc:  # surfaced to the waiter, never lost in a thread
                ticket._fail(exc, peer=s.peer, started=True)
                continue
            if recorder is not None:
                recorder.copy_slice(worker, start, now_us(), s.peer, s.nbytes, ticket.plan.layer, ticket.plan.slot,
                                    s.expert)
            ticket._finish_slice(s.peer, s.expert)

    def _copy_slice(self, dst: torch.Tensor, s) -> None:
        # A function of its own: the view of a peer's segment dies on return, so a forgotten
        # peer's mapping is not kept alive by an idle copier.
        self._check_readable(s.peer)
        source = self._peers[s.peer]
        if source is None:
            raise PeerUnreadable(f"rank {self.rank}: peer {s.peer} was lost and its segment released")
        # torch releases the GIL inside copy_, so copiers and compute run in parallel.
        dst[s.dst_offset : s.dst_offset + s.nbytes].copy_(source[s.src_offset : s.src_offset + s.nbytes])

    def submit(self, plan: CopyPlan, slot_buffer: torch.Tensor) -> Ticket:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: submit() on a closed transport")
        if not self._peers:
            raise RuntimeError(f"rank {self.rank}: submit() before open()")
        if slot_buffer.dtype != torch.uint8 or not slot_buffer.is_contiguous():
            raise ValueError(f"slot_buffer must be a contiguous uint8 tensor, got {slot_buffer.dtype}")
        ticket = Ticket(plan)
        for s in plan.slices:
            self._queue.put((ticket, slot_buffer, s))
        return ticket

    def forget_peer(self, peer: int) -> None:
        """Unmap `peer`'s segment (the caller made sure no ticket still reads it): with its name
        unlinked at seal, the memory goes once the last rank that mapped it lets go."""
        if peer == self.rank or not 0 <= peer < len(self._peers):
            raise ValueError(f"rank {self.rank}: cannot forget peer {peer}; expected another rank of "
                             f"[0, {len(self._peers)})")
        self._peers[peer] = None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=10)
        self._threads.clear()
        self.seal()
        self._peers = []
        self._segment = None
