"""Host backend: segments in shared memory files, a pool of copier threads.

Each rank's source segment is a file in DWDP_SHM_DIR (default /dev/shm) mapped with
`torch.from_file(shared=True)`. Peers map it once at setup; then its owner unlinks the name, so
the memory disappears with the last process that maps it, even if the owner crashes later.
Files left by an owner that died during setup are swept by the next allocation.

A layer's plan is cut where experts complete (`plan.cut_batches`, as on the cuda backend) into at
most `copy_batches` batches and no more than one per `min_batch_bytes`; a copier thread takes one
batch at a time and copies all its slices in one `torch._foreach_copy_` call, the host analogue of
cudaMemcpyBatchAsync: the interpreter lock is released for the whole batch, and the views of every
slice are resolved once per (plan, slot buffer). While a trace is recorded, slices are copied one
by one so each gets its own event.

Handing work to a copier is not free on a CPU: waking it costs the compute thread a context switch
and interpreter-lock hand-offs, hundreds of microseconds on a loaded machine (the woken copier
preempts the compute thread that still holds the lock). A plan smaller than `min_batch_bytes`
costs less to copy than that, so `submit` copies it at once on the calling thread.

Each batch is claimed once, by a copier or by a compute thread that waits for it: a waiter first
copies, itself, the batches of its plan no copier has started, in plan order, and sleeps only on
batches already being copied. On a CPU the waiting thread has nothing else to do, and on a loaded
machine a woken copier can wait milliseconds for a core.
"""
from __future__ import annotations

import os
import queue
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from dwdp import envs
from dwdp.runtime.plan import CopyPlan, CopySlice, cut_batches
from dwdp.observe.tracing import now_us
from dwdp.runtime.transport.host_composite import HostCompositeViews, composite_unsupported_reason, page_size
from dwdp.runtime.transport.base import PeerUnreadable, Ticket, Transport

SEGMENT_PREFIX = "dwdp-seg-"
MIN_BATCH_BYTES = 1 << 20  # about 50-100 us of copying on one core: more than a copier's wake-up costs


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


def connect_in_process(transports: list["HostTransport"]) -> None:
    """Open every transport on all of their segments, then seal them: the exchange of handles that
    a process group does across processes, for ranks held by one process (tune, tests, benches).
    Each transport must have allocated its segment."""
    handles = [t.register() for t in transports]
    for t in transports:
        t.open(handles)
    for t in transports:
        t.seal()


def map_file(path: str, nbytes: int) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


@dataclass(frozen=True)
class _HostBatch:
    """A run of a plan's slices with their uint8 views resolved for one slot buffer: one copier task."""

    slices: tuple[CopySlice, ...]
    dsts: list[torch.Tensor]  # [nbytes] views of the slot buffer, one per slice
    srcs: list[torch.Tensor]  # [nbytes] views of the peers' segments, one per slice
    peers: tuple[int, ...]    # the sources it reads


class _HostTicket(Ticket):
    """A Ticket whose batches are each copied once, by whichever of a copier and a waiter claims it
    first (see the module docstring)."""

    def __init__(self, plan: CopyPlan, batches: list[_HostBatch], copy_batch):
        super().__init__(plan)
        self._batches = batches
        self._claimed = [False] * len(batches)
        self._unclaimed = len(batches)
        self._copy_batch = copy_batch  # (ticket, batch, copier or None) -> None; reports landing or failure

    def _claim(self, index: int) -> bool:
        """Take batch `index` to copy (counted as running until it lands or fails); False when
        another thread took it or the ticket failed or was cancelled."""
        with self._cond:
            if self._claimed[index] or self.error is not None:
                return False
            self._claimed[index] = True
            self._unclaimed -= 1
            self._running += 1
            return True

    def copy_unclaimed(self, ready=lambda: False) -> None:
        """Copy on this thread, in plan order, the batches no copier has claimed, until `ready()`
        (checked under the ticket's lock); a failure fails the ticket, as in a copier."""
        for index, batch in enumerate(self._batches):
            with self._cond:
                if not self._unclaimed or self.error is not None or ready():
                    return
            if self._claim(index):
                self._copy_batch(self, batch, None)

    def _wait_until(self, ready, timeout: float, what: str) -> float:
        self.copy_unclaimed(ready)
        return super()._wait_until(ready, timeout, what)

    def _finish_slices(self, slices) -> None:
        super()._finish_slices(slices)
        with self._cond:
            if self._left_total == 0:
                # Every byte landed: the views of peers' segments are no longer needed. A ticket can
                # outlive its copy for many forwards (a slot that keeps its layer), and its views would
                # keep a lost peer's segment mapped.
                self._batches = []


class HostTransport(Transport):
    """The `host` backend (see the module docstring). inflight: copier threads; copy_batches: most
    batches (copier tasks) one plan is cut into; min_batch_bytes: fewest bytes worth a copier task
    (smaller plans are copied inside `submit`)."""

    name = "host"
    device_types = auto_for = ("cpu",)
    default_slice_bytes = 1 << 20  # the design's default; the CPU sweeps in bench/README.md ran with it

    @classmethod
    def from_config(cls, rank: int, config, *, device=None, mapping=None, process_group=None) -> "HostTransport":
        """inflight and copy_batches from the DWDPConfig; device, mapping and process_group are not used."""
        return cls(rank, inflight=config.inflight, copy_batches=config.copy_batches)

    def __init__(self, rank: int, inflight: int = 2, shm_dir: str | None = None, copy_batches: int = 4,
                 min_batch_bytes: int = MIN_BATCH_BYTES):
        if copy_batches < 1:
            raise ValueError(f"copy_batches={copy_batches} must be >= 1")
        if min_batch_bytes < 1:
            raise ValueError(f"min_batch_bytes={min_batch_bytes} must be >= 1")
        self.rank = rank
        self.inflight = inflight
        self.copy_batches = copy_batches
        self.min_batch_bytes = min_batch_bytes
        self._batches: dict[tuple[int, int], tuple[CopyPlan, list[_HostBatch]]] = {}
        self.shm_dir = Path(shm_dir or envs.fabric_dir())  # segments: reachable from every node of the group
        self._path: Path | None = None
        self._fd: int | None = None  # kept open: /proc/<pid>/fd/<fd> reopens the segment (a rejoining peer)
        self._segment: torch.Tensor | None = None
        self._peers: list[torch.Tensor | None] = []  # None once a lost peer is forgotten
        self.peer_paths: list[str] = []  # segment file of every rank (unlinked after seal; names for /proc/self/maps)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.recorder = None  # a dwdp.observe.tracing.TraceRecorder while tracing (Transport.recorder)

    # -- setup ---------------------------------------------------------------------------------
    def alloc_segment(self, nbytes: int, allocations: tuple[int, ...] | None = None) -> torch.Tensor:
        """One /dev/shm file of `nbytes` (allocations: ignored, mmap maps a file at any page offset)."""
        if self._segment is not None:
            raise RuntimeError(f"rank {self.rank}: segment already allocated")
        if not self.shm_dir.is_dir():
            raise FileNotFoundError(f"DWDP_SHM_DIR={str(self.shm_dir)!r} is not a directory")
        sweep_stale_segments(self.shm_dir)
        path = self.shm_dir / f"{SEGMENT_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        with open(path, "wb") as f:
            f.truncate(max(nbytes, 1))
        self._path = path
        self._fd = os.open(path, os.O_RDWR)
        self._segment = map_file(str(path), max(nbytes, 1))[:nbytes]
        return self._segment

    def segment_fd(self) -> int:
        """A new read-write descriptor of this rank's segment file (the caller closes it), for
        mapping its pages elsewhere (composite views). Only before seal: the name goes then."""
        if self._path is None:
            raise RuntimeError(f"rank {self.rank}: segment_fd() needs an allocated, unsealed segment")
        return os.open(self._path, os.O_RDWR)

    def composite_unavailable(self) -> str | None:
        return composite_unsupported_reason()

    def granularity(self) -> int:
        return page_size()

    def composite_views(self, layout) -> HostCompositeViews:
        """The segment file and a memfd pool mapped MAP_SHARED | MAP_FIXED into one range (only before
        seal: the file's name goes then). The views live as long as tensors over them."""
        fd = self.segment_fd()
        try:
            return HostCompositeViews(layout, fd)
        finally:
            os.close(fd)

    def describe_mapping(self) -> str:
        return f"/dev/shm segment + memfd pool, mmap MAP_FIXED, {page_size()} B pages"

    def register(self) -> dict:
        if self._path is None:
            raise RuntimeError(f"rank {self.rank}: register() before alloc_segment()")
        return {"backend": self.name, "rank": self.rank, "path": str(self._path), "nbytes": self._segment.numel()}

    @property
    def can_rejoin(self) -> bool:
        return True

    def board_handle(self) -> dict:
        """A handle that stays valid for as long as this process lives, names unlinked or not."""
        if self._fd is None:
            raise RuntimeError(f"rank {self.rank}: board_handle() before alloc_segment()")
        return {"backend": self.name, "rank": self.rank, "path": f"/proc/{os.getpid()}/fd/{self._fd}",
                "nbytes": self._segment.numel()}

    def open(self, handles: list[dict | None]) -> None:
        """Map every peer's segment; a None handle is a peer already lost (a rank rejoining a group
        that lacks it): nothing is mapped for it until `open_peer`."""
        peers = []
        for r, handle in enumerate(handles):
            if handle is None and r != self.rank:
                peers.append(None)
                continue
            if handle is not None and handle.get("backend") != self.name:
                raise ValueError(f"rank {self.rank}: peer {r} uses backend {handle.get('backend')!r}, expected 'host'")
            if r == self.rank:
                peers.append(self._segment)
                continue
            path = handle["path"]
            if not os.path.exists(path):
                raise FileNotFoundError(f"rank {self.rank}: segment {path} of peer {r} does not exist")
            peers.append(map_file(path, max(handle["nbytes"], 1))[: handle["nbytes"]])
        self._peers = peers
        self.peer_paths = [str(h["path"]) if h is not None else "" for h in handles]
        self._start_copiers()

    def peer_segment(self, peer: int) -> torch.Tensor:
        """`peer`'s mapped segment, uint8 [nbytes] (a rejoining rank copies its experts from it)."""
        segment = self._peers[peer] if 0 <= peer < len(self._peers) else None
        if segment is None:
            raise ValueError(f"rank {self.rank}: peer {peer} has no mapped segment")
        return segment

    def open_peer(self, peer: int, handle: dict) -> None:
        """Map the segment of a new incarnation of `peer` (it was lost and forgotten, then rejoined);
        copies from it are allowed again, whatever the fault hook said of the old one."""
        if peer == self.rank or not 0 <= peer < len(self._peers):
            raise ValueError(f"rank {self.rank}: cannot open peer {peer}; expected another rank of "
                             f"[0, {len(self._peers)})")
        if self._peers[peer] is not None:
            raise RuntimeError(f"rank {self.rank}: peer {peer} is still mapped; forget_peer({peer}) first, so the "
                               "segment of its dead process is never read again")
        if handle.get("backend") != self.name or handle.get("nbytes") != self._segment.numel():
            raise ValueError(f"rank {self.rank}: rejoining peer {peer} offers {handle!r}; expected a host segment "
                             f"of {self._segment.numel()} bytes")
        self._peers[peer] = map_file(handle["path"], max(handle["nbytes"], 1))[: handle["nbytes"]]
        self.peer_paths[peer] = str(handle["path"])
        self.faulty_peers = MappingProxyType({p: why for p, why in self.faulty_peers.items() if p != peer})

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
            ticket, index = item
            if ticket._claim(index):
                self._copy_batch(ticket, ticket._batches[index], worker)

    def _copy_batch(self, ticket: _HostTicket, batch: _HostBatch, worker: int | None) -> None:
        """Copy one claimed batch and report it to the ticket; a failure reaches the waiter. `worker`:
        the copier, or None for a waiting compute thread (traced on the lane after the copiers')."""
        recorder = self.recorder
        try:
            for peer in batch.peers:
                self._check_source(peer)
            if recorder is None:
                torch._foreach_copy_(batch.dsts, batch.srcs)  # the lock is released for the whole batch
            else:
                self._copy_recorded(self.inflight if worker is None else worker, ticket, batch, recorder)
        except BaseException as exc:  # surfaced to the waiter, never lost in a thread
            ticket._fail(exc, peer=self._failing_peer(batch, exc), started=True)
            return
        ticket._finish_slices(batch.slices)

    def _source_view(self, s: CopySlice) -> torch.Tensor:
        """[nbytes] view of slice `s`'s source; empty for a forgotten peer (`_check_source` refuses
        the batch before any copy)."""
        source = self._peers[s.peer]
        if source is None:
            return torch.empty(0, dtype=torch.uint8)
        return source[s.src_offset : s.src_offset + s.nbytes]

    def _check_source(self, peer: int) -> None:
        """Raise PeerUnreadable, naming `peer`, when the fault hook marks it or it was forgotten."""
        self._check_readable(peer)
        if self._peers[peer] is None:
            raise PeerUnreadable(f"rank {self.rank}: peer {peer} was lost and its segment released", peer)

    @staticmethod
    def _failing_peer(batch: _HostBatch, exc: BaseException) -> int | None:
        """The source a failed batch copy is blamed on: the peer PeerUnreadable names, else the
        first slice whose copy fails again on its own (None when every slice copies)."""
        if isinstance(exc, PeerUnreadable):
            return exc.peer
        for s, dst, src in zip(batch.slices, batch.dsts, batch.srcs):
            try:
                dst.copy_(src)
            except Exception:
                return s.peer
        return None

    @staticmethod
    def _copy_recorded(lane: int, ticket: Ticket, batch: _HostBatch, recorder) -> None:
        """Slice by slice, one trace event each (tracing only)."""
        for s, dst, src in zip(batch.slices, batch.dsts, batch.srcs):
            start = now_us()
            dst.copy_(src)
            recorder.copy_slice(lane, start, now_us(), s.peer, s.nbytes, ticket.plan.layer, ticket.plan.slot,
                                s.expert)

    def _resolve(self, plan: CopyPlan, slot_buffer: torch.Tensor) -> list[_HostBatch]:
        """The plan's batches with their views into `slot_buffer`, built once and reused. A slice
        outside its segment or slot gives a view of the wrong length: the copy fails and the waiter
        hears of it."""
        key = (id(plan), slot_buffer.data_ptr())
        cached = self._batches.get(key)
        if cached is not None and cached[0] is plan:
            return cached[1]
        batches = []
        max_batches = max(1, min(self.copy_batches, plan.nbytes // self.min_batch_bytes))
        for batch in cut_batches(plan, max_batches):
            chunk = plan.slices[batch.start : batch.stop]
            batches.append(_HostBatch(
                slices=chunk,
                dsts=[slot_buffer[s.dst_offset : s.dst_offset + s.nbytes] for s in chunk],
                srcs=[self._source_view(s) for s in chunk],
                peers=tuple(sorted({s.peer for s in chunk})),
            ))
        self._batches[key] = (plan, batches)
        return batches

    def submit(self, plan: CopyPlan, slot_buffer: torch.Tensor) -> Ticket:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: submit() on a closed transport")
        if not self._peers:
            raise RuntimeError(f"rank {self.rank}: submit() before open()")
        if slot_buffer.dtype != torch.uint8 or not slot_buffer.is_contiguous():
            raise ValueError(f"slot_buffer must be a contiguous uint8 tensor, got {slot_buffer.dtype}")
        ticket = _HostTicket(plan, self._resolve(plan, slot_buffer), self._copy_batch)
        if plan.nbytes < self.min_batch_bytes:
            ticket.copy_unclaimed()  # here, on this thread (see the module docstring)
            return ticket
        for index in range(len(ticket._batches)):
            self._queue.put((ticket, index))
        return ticket

    def forget_peer(self, peer: int) -> None:
        """Unmap `peer`'s segment (the caller made sure no ticket still reads it): with its name
        unlinked at seal, the memory goes once the last rank that mapped it lets go."""
        if peer == self.rank or not 0 <= peer < len(self._peers):
            raise ValueError(f"rank {self.rank}: cannot forget peer {peer}; expected another rank of "
                             f"[0, {len(self._peers)})")
        self._peers[peer] = None
        # Cached batches hold views of its segment: drop them so the mapping really goes.
        self._batches = {key: entry for key, entry in self._batches.items()
                         if all(peer not in batch.peers for batch in entry[1])}

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
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._peers = []
        self._batches = {}
        self._segment = None
