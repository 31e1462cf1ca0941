"""CUDA backend: peers' segments mapped into this process, copy-engine copies on a copy stream.

Setup: each rank's local experts live in one device buffer (its segment). The rank exports it
once (CUDA IPC on one node, or torch's symmetric memory across nodes), every peer maps it, and a
rank reads its own segment through its own pointer (opening one's own IPC handle fails).

Per layer, everything is ordered by events and the host never waits:
  compute stream:  ... kernels reading slot s ... record consume[s]        (release_slot)
  copy stream:     wait consume[s] -> batch 0 -> record ev[s][0] -> batch 1 -> record ev[s][1] ...
  compute stream:  wait ev[s][b] (Ticket.wait / wait_experts) -> kernels reading slot s
A layer's cached slice plan is cut into batches where experts complete (`plan.cut_batches`);
each batch is one cudaMemcpyBatchAsync (or one cudaMemcpyAsync per copy), and the event after
it tells compute that the experts it completes have landed. Inside a batch, a run of one peer's
slices that continue each other is issued as one copy (`plan.coalesce`): slices from different
peers still alternate copy by copy, and no copy costs the driver's per-copy work for nothing. The batches' copy arguments, the
expert -> batch map and the batch events of a (plan, slot buffer) are built on its first submit
and reused, so a later submit does no per-slice work on the host. Host waits (drain, close) poll
the events against a deadline and name the peers still outstanding.

Every device call goes through `api` (dwdp.runtime.transport.cuda_api by default), so tests drive this
control logic with a recording fake on a CPU.

VMM mappings ("vmm-posix-fd" ran on one H200, 2026-11-27; "vmm-fabric" not yet run on a GPU): the segment is a list
of cuMemCreate allocations (one per local extent of each layer and tensor in composite mode, else
one), exportable as POSIX fds or fabric handles, mapped whole and back to back into one range with one
cuMemSetAccess; `register` exports every allocation (POSIX fds: the exporter's pid, PID namespace and
fd numbers travel in the handle, beside the name of an abstract Unix socket that always serves the same
fds until seal; fabric: the 64 bytes of each handle). `open` takes each peer's fds (pidfd_getfd, or the
socket where seccomp, Yama or another PID namespace refuses it: one log line says which per peer),
imports each allocation, closes its fd, and maps the imports back to back into one range, so a plan
reads a peer's segment at the same offsets as the peer itself. `composite_views` builds the rank's
composite views (dwdp.runtime.transport.cuda_vmm) over the segment's allocations, and copy plans write
into the views' pool gaps and boundary pages. `seal` closes the exported fds (every peer holds its own
import by then); `close` waits for the copy stream and the compute stream, then unmaps and releases the
views, the peers' imports and the segment, in the reverse of setup. The driver calls go through
`driver` (cuda.bindings.driver by default, tests/fake_cuda_vmm.py in tests).
"""
from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from dwdp.runtime.transport import cuda_api
from dwdp.runtime.plan import CopyPlan, coalesce, cut_batches
from dwdp.runtime.transport.base import PeerCopyError, PeerUnreadable, PrefetchError, PrefetchTimeout, Transport
from dwdp.runtime.transport.cuda_vmm import (SCM_MAX_FD, CudaCompositeViews, FdServer, Vmm, choose_mapping,
                                              ensure_fd_room, is_power_of_two, pid_namespace, take_fds)

log = logging.getLogger("dwdp")

# Mapping -> the cuMem handle type its segments are exported as (composite views need one of these).
VMM_MAPPINGS = MappingProxyType({"vmm-posix-fd": "posix_fd", "vmm-fabric": "fabric"})
# Mappings whose export a process started later can open (a rank rejoining the group through the board).
REJOINABLE_MAPPINGS = ("ipc", "vmm-posix-fd", "vmm-fabric")


def _raw_bytes(value: bytes | str) -> bytes:
    """Handle bytes as exchanged at setup (bytes) or read from the board's JSON (hex)."""
    return bytes.fromhex(value) if isinstance(value, str) else bytes(value)


@dataclass(frozen=True)
class _VmmRange:
    """cuMem allocations `handles` (of `sizes` bytes) mapped whole, back to back, into one range of
    their own at [ptr, ptr + nbytes): a rank's segment, or a peer's as imported here."""

    handles: tuple
    sizes: tuple[int, ...]
    ptr: int

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


@dataclass(frozen=True, eq=False)
class _IssuedBatch:
    """One batch of a plan with its addresses resolved for one (slot buffer, peer mapping).

    copies: the api's prepared arguments (`prepare_batch`: dsts, srcs, sizes), built once and
    issued as they are on every submit of the plan."""

    copies: object
    peers_of_copies: tuple[int, ...]  # source peer of each copy (names the peer of a failed copy)
    peers: tuple[int, ...]
    completes: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class _PreparedPlan:
    """What every submit of one plan into one slot buffer issues and hands its ticket, built on the
    plan's first submit; later submits only enqueue it (no per-slice work on the host)."""

    plan: CopyPlan
    slot_ptr: int
    batches: tuple[_IssuedBatch, ...]
    expert_batch: Mapping[int, int]      # expert -> the batch that holds its last slice (read-only)
    batch_peers: tuple[tuple[int, ...], ...]


class CudaTicket:
    """Completion of one plan on the copy stream: one event per batch.

    `wait` / `wait_experts` make the caller's current stream wait on the right event and return
    at once; `synchronize` is the host wait (polling, with a deadline).
    """

    def __init__(self, transport: "CudaTransport", plan: CopyPlan, events: tuple[int, ...],
                 expert_batch: Mapping[int, int], batch_peers: tuple[tuple[int, ...], ...]):
        self.plan = plan
        self.error: BaseException | None = None
        self.submitted_ns = time.perf_counter_ns()
        self.finished_ns: int | None = self.submitted_ns if not plan.slices else None
        self._transport = transport
        self._events = events
        self._expert_batch = expert_batch
        self._batch_peers = batch_peers

    def _where(self) -> str:
        return f"rank {self.plan.rank}: prefetch of layer {self.plan.layer} into slot {self.plan.slot}"

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error

    def _raise_if_failed(self) -> None:
        if isinstance(self.error, PeerCopyError):
            raise PeerCopyError(f"{self._where()} failed: {self.error}", self.error.peer) from self.error
        if self.error is not None:
            raise PrefetchError(f"{self._where()} failed: {self.error}") from self.error

    def cancel(self, reason: str) -> None:
        self._fail(PrefetchError(f"cancelled: {reason}"))

    def quiesce(self, timeout: float) -> None:
        """Copies of this ticket already enqueued run before any later copy on the same stream."""

    def missing_experts(self) -> tuple[int, ...]:
        """Every expert of the plan: an enqueued batch is not known to have landed until its event
        completes, and the host must not ask (that would block), so a retry copies them all again."""
        return tuple(sorted({s.expert for s in self.plan.slices}))

    def _device_call(self, fn, *args, peers=None):
        """Run one api call for this ticket; a CUDA error (often a sticky one from an earlier copy)
        fails the ticket and names its peers."""
        try:
            return fn(*args)
        except cuda_api.CudaError as exc:
            peers = self.plan.peers if peers is None else peers
            self._fail(exc)
            raise PrefetchError(f"{self._where()} from peers {list(peers)} failed: {exc}") from exc

    # -- compute side: enqueue, never block ----------------------------------------------------
    def wait(self, timeout: float) -> float:
        """The caller's current stream waits for every slice; returns 0.0 (nothing waited here)."""
        self._raise_if_failed()
        if self._events:
            api = self._transport.api
            self._device_call(api.stream_wait_event, api.current_stream(), self._events[-1])
        return 0.0

    def wait_experts(self, experts, timeout: float) -> float:
        """The caller's current stream waits for the batch that completes the last of `experts`."""
        self._raise_if_failed()
        batches = [self._expert_batch[e] for e in experts if e in self._expert_batch]
        if batches:
            api = self._transport.api
            self._device_call(api.stream_wait_event, api.current_stream(), self._events[max(batches)])
        return 0.0

    # -- host side: queries and deadline waits -------------------------------------------------
    def done(self) -> bool:
        self._raise_if_failed()
        return not self._events or self._device_call(self._transport.api.event_query, self._events[-1])

    def expert_ready(self, expert: int) -> bool:
        self._raise_if_failed()
        batch = self._expert_batch.get(expert)
        return batch is None or self._device_call(self._transport.api.event_query, self._events[batch])

    def landed_prefix(self, experts) -> int:
        """How many of `experts`, in order, lie in batches whose events have completed (queried,
        never waited on): the experts before the first one whose batch is still on the copy stream."""
        self._raise_if_failed()
        api, done_batches, count = self._transport.api, 0, 0
        for e in experts:
            batch = self._expert_batch.get(e, -1)
            # Batches complete in stream order: query each one once, from the first onwards.
            while done_batches <= batch and self._device_call(api.event_query, self._events[done_batches]):
                done_batches += 1
            if batch >= done_batches:
                break
            count += 1
        return count

    def synchronize(self, timeout: float) -> float:
        """Block the host until every batch landed; PrefetchTimeout names the peers outstanding."""
        self._raise_if_failed()
        start = time.perf_counter()
        if self._events:
            api = self._transport.api
            try:
                self._device_call(api.event_wait, self._events[-1], timeout)
            except TimeoutError:
                outstanding = sorted({p for b, ev in enumerate(self._events)
                                      if not self._device_call(api.event_query, ev) for p in self._batch_peers[b]})
                raise PrefetchTimeout(
                    f"{self._where()} not done after {timeout:.3g} s; source peers still outstanding: {outstanding}"
                ) from None
        self.finished_ns = time.perf_counter_ns()
        return time.perf_counter() - start

    def fence_before_reuse(self, timeout: float) -> None:
        """Copies into one slot run in order on the copy stream: a later one cannot overtake this."""


class CudaTransport(Transport):
    """The `cuda` backend of the Transport interface (see the module docstring).

    rank: this rank's index in the DWDP group. device: the CUDA device of the model.
    copy: "batch" or "memcpy" (DWDPConfig.cuda_copy); copy_batches: most batches per plan.
    mapping: "ipc", "symmetric_memory", "vmm-posix-fd" or "vmm-fabric" (cuMem allocations, needed by
    composite views); process_group: needed by "symmetric_memory"; "process": every
    rank of the group lives in this process (`dwdp tune`, tests), a peer's segment is read through
    its own pointer (with peer access enabled between devices).
    prefer_overlap: the PreferOverlapWithCompute hint on batches. api: the cuda_api module or a fake;
    driver: cuda.bindings.driver or a fake of it (VMM mappings only).
    """

    name = "cuda"
    device_types = auto_for = ("cuda",)
    # One cuda.bindings batch call costs the host about 5.6 us per copy on the H100 measured
    # (bench/results/h100_submit_cost_ed3ed31.json), whatever the copy's size and link, so a rank cannot
    # issue 1 MiB slices faster than ~190 GB/s, under the ~370-397 GB/s a copy engine moves one way over
    # NVLink 4 (nvbandwidth, NCCL issue #1264); 4 MiB slices issue at ~750 GB/s. Slices of one peer that
    # follow each other go out as one copy anyway (dwdp.runtime.plan.coalesce): this only matters where
    # several peers alternate. `dwdp tune` on the node measures it.
    default_slice_bytes = 4 << 20
    settles_cuda_mapping = True
    nvtx_ranges = True

    @classmethod
    def from_config(cls, rank: int, config, *, device=None, mapping: str | None = None,
                    process_group=None) -> "CudaTransport":
        """cuda_copy, copy_batches and wait_timeout_s (the close deadline) from the DWDPConfig; mapping:
        the one the group settled on (dwdp.runtime.cuda_mapping), "ipc" when None."""
        return cls(rank, device, copy=config.cuda_copy, copy_batches=config.copy_batches,
                   mapping=mapping if mapping is not None else "ipc", process_group=process_group,
                   close_timeout_s=config.wait_timeout_s)

    def __init__(self, rank: int, device: torch.device | str | int = "cuda", *, copy: str = "batch",
                 copy_batches: int = 4, mapping: str = "ipc", process_group=None, prefer_overlap: bool = True,
                 close_timeout_s: float = 60.0, api=cuda_api, driver=None):
        if copy not in ("batch", "memcpy"):
            raise ValueError(f"copy={copy!r} must be 'batch' or 'memcpy'")
        if mapping not in ("ipc", "symmetric_memory", "process", *VMM_MAPPINGS):
            raise ValueError(f"mapping={mapping!r} must be 'ipc', 'symmetric_memory', 'process', "
                             f"'vmm-posix-fd' or 'vmm-fabric'")
        self.api = api
        api.require()
        self.rank = rank
        self.device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        if self.device.type == "cuda":
            api.set_device(self.device.index or 0)
        self.mapping, self.process_group = mapping, process_group
        self.copy_batches, self.prefer_overlap, self.close_timeout_s = copy_batches, prefer_overlap, close_timeout_s
        self.copy = copy
        if copy == "batch" and not api.has_memcpy_batch():
            log.warning("rank %d: cudaMemcpyBatchAsync is not available (CUDA < 12.8); one cudaMemcpyAsync per slice",
                        rank)
            self.copy = "memcpy"
        self._segment: torch.Tensor | None = None
        self._symmetric = None
        self._peer_ptrs: list[int] = []
        self._peer_nbytes: list[int] = []
        self._opened: list[int] = []           # IPC bases this rank opened, closed exactly once
        self._peer_bases: dict[int, int] = {}  # peer -> the IPC base opened for it
        self._stream: int | None = None
        self._consume: dict[int, int] = {}      # slot -> consume event
        self._slot_events: dict[int, tuple[int, ...]] = {}  # slot -> one event per batch
        self._prepared_plans: dict[tuple[int, int, int], _PreparedPlan] = {}  # (layer, slot, slot ptr)
        self._forgotten: set[int] = set()        # lost peers no copy may read any more
        # (IPC base or retired VMM import, fence event on the copy stream): released once the fence has run
        self._unmap_after: list[tuple[int | _VmmRange, int]] = []
        self._handle_type = VMM_MAPPINGS.get(mapping)
        self._vmm = Vmm(self.device.index or 0, driver) if self._handle_type is not None else None
        self._own_range: _VmmRange | None = None     # the segment's allocations, mapped for this rank
        self._peer_ranges: dict[int, _VmmRange] = {}  # peer -> its imported allocations, mapped
        self._exported_fds: list[int] = []            # the segment's POSIX fds, open until seal
        self._fd_server: FdServer | None = None       # serves them over SCM_RIGHTS where pidfd_getfd is refused
        self.fd_paths: dict[int, str] = {}            # peer -> how its fds came (pidfd_getfd or the socket, why)
        self._handle: dict | None = None              # what register() exported
        self._keep_export = False                     # board_handle() given: the export outlives seal
        self.views: CudaCompositeViews | None = None
        self._granularity: int | None = None
        self._closed = False
        self.recorder = None  # copy slices have no host lane on this backend: see NVTX / Nsight instead

    # -- setup ---------------------------------------------------------------------------------
    def alloc_segment(self, nbytes: int, allocations: tuple[int, ...] | None = None) -> torch.Tensor:
        """uint8 [nbytes]: this rank's segment. allocations (VMM mappings only): the sizes of the
        cuMem allocations that make it up, back to back (CompositeLayout.segment_allocations), each a
        multiple of the granularity; None: one allocation of nbytes rounded up to the granularity."""
        if self._segment is not None:
            raise RuntimeError(f"rank {self.rank}: segment already allocated")
        if self._vmm is not None:
            self._segment = self._alloc_vmm_segment(nbytes, allocations)
        elif allocations is not None:
            raise ValueError(f"rank {self.rank}: mapping={self.mapping!r} makes one allocation per segment; "
                             "allocations= needs 'vmm-posix-fd' or 'vmm-fabric'")
        elif self.mapping == "symmetric_memory":
            symm = _symmetric_memory_module()
            self._segment = symm.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)[:nbytes]
        else:
            self._segment = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)[:nbytes]
        return self._segment

    def composite_unavailable(self) -> str | None:
        if self._vmm is not None:
            return None
        return (f"the cuda backend maps peers with {self.mapping!r}; composite views need cuMem allocations "
                "(VMM export refused on some rank, or cuda_mapping set to another mapping)")

    def describe_mapping(self) -> str:
        if self._vmm is None:
            return f"peers through {self.mapping}"
        return f"cuMemCreate segment + pool, peers through {self.mapping}, {self.granularity()} B granules"

    def granularity(self) -> int:
        """The cuMem allocation granularity of this device for the segment's handle type (VMM only)."""
        if self._vmm is None:
            raise ValueError(f"rank {self.rank}: mapping={self.mapping!r} has no cuMem granularity; composite views "
                             "need mapping 'vmm-posix-fd' or 'vmm-fabric'")
        if self._granularity is None:
            self._granularity = self._vmm.granularity(self._handle_type)
        return self._granularity

    def _alignment(self) -> int:
        """Reservation alignment: the granularity where it is a power of two (the driver's rule), else
        the driver's default."""
        g = self.granularity()
        return g if is_power_of_two(g) else 0

    def _release_range(self, mapped: _VmmRange) -> None:
        self._vmm.unmap_back_to_back(mapped.ptr, mapped.sizes)
        for handle in reversed(mapped.handles):
            self._vmm.release(handle)

    def _alloc_vmm_segment(self, nbytes: int, allocations: tuple[int, ...] | None) -> torch.Tensor:
        g = self.granularity()
        sizes = (-(-max(nbytes, 1) // g) * g,) if allocations is None else tuple(int(n) for n in allocations)
        if not sizes or any(n < 1 or n % g for n in sizes) or sum(sizes) < nbytes:
            raise ValueError(f"rank {self.rank}: segment allocations {sizes} must be positive multiples of the "
                             f"granularity {g} covering {nbytes} bytes")
        handles = []
        try:
            for size in sizes:
                handles.append(self._vmm.create(size, self._handle_type))
            ptr = self._vmm.map_back_to_back(handles, sizes, self._alignment())
        except BaseException:
            for handle in reversed(handles):
                self._vmm.release(handle)
            raise
        self._own_range = _VmmRange(tuple(handles), sizes, ptr)
        return self.api.tensor_at(ptr, sum(sizes), self.device)[:nbytes]

    def composite_views(self, layout) -> CudaCompositeViews:
        """This rank's composite views over its segment (see dwdp.runtime.transport.cuda_vmm); closed
        with the transport. Ran on one H200 with POSIX fds."""
        if self._own_range is None:
            raise RuntimeError(f"rank {self.rank}: composite_views() needs a VMM segment (mapping "
                               f"{self.mapping!r}; alloc_segment first)")
        if self.views is not None:
            raise RuntimeError(f"rank {self.rank}: composite views already built")
        want = tuple(a.nbytes for a in layout.segment_allocations)
        if self._own_range.sizes != want:
            raise ValueError(f"rank {self.rank}: the segment's allocations {self._own_range.sizes} are not the "
                             f"layout's {want}: alloc_segment(layout.segment_nbytes, allocations=...) first")
        self.views = CudaCompositeViews(layout, self._own_range.handles, self._vmm, self._handle_type,
                                        tensor_at=lambda ptr, n: self.api.tensor_at(ptr, n, self.device))
        return self.views

    def register(self) -> dict:
        if self._segment is None:
            raise RuntimeError(f"rank {self.rank}: register() before alloc_segment()")
        # Peers read the segment from their own streams: its fill must be complete first.
        self.api.device_synchronize()
        handle = {"backend": self.name, "rank": self.rank, "mapping": self.mapping,
                  "nbytes": self._segment.numel(), "host": socket.gethostname(), "device": self.device.index or 0}
        if self.mapping == "ipc":
            handle["ipc"], handle["offset"] = self.api.ipc_export(self._segment.data_ptr())
        elif self.mapping == "process":
            handle["ptr"], handle["pid"] = self._segment.data_ptr(), os.getpid()
        elif self._vmm is not None:
            handle["allocations"], handle["granularity"] = list(self._own_range.sizes), self.granularity()
            self._export_vmm(handle)
        self._handle = handle
        return handle

    def _export_vmm(self, handle: dict) -> None:
        """Export every segment allocation into `handle`: fabric bytes, or POSIX fds (open until seal,
        served beside the export over a socket, for peers that pidfd_getfd cannot reach)."""
        if self._handle_type == "fabric":
            handle["fabric"] = [self._vmm.export(h, "fabric") for h in self._own_range.handles]
            return
        # Room for our exports, and for one socket message of a peer's while we import it.
        ensure_fd_room(len(self._own_range.handles) + SCM_MAX_FD)
        try:
            for h in self._own_range.handles:
                self._exported_fds.append(self._vmm.export(h, "posix_fd"))
            name = f"dwdp-vmm-{os.getpid()}-{self.rank}-{self._exported_fds[0]}"
            self._fd_server = FdServer(self._exported_fds, name)
        except BaseException:
            self.seal()
            raise
        handle.update(pid=os.getpid(), pid_ns=pid_namespace(), fds=list(self._exported_fds), socket=name)

    def open(self, handles: list[dict]) -> None:
        if self._peer_ptrs:
            raise RuntimeError(f"rank {self.rank}: open() called twice")
        missing = [r for r, handle in enumerate(handles) if handle is None and r != self.rank]
        if missing and self.mapping not in REJOINABLE_MAPPINGS:
            raise ValueError(f"rank {self.rank}: peers {missing} have no segment handle; only mappings "
                             f"{REJOINABLE_MAPPINGS} open a group that lacks some of its ranks")
        for r, handle in enumerate(handles):
            if handle is not None:
                self._check_handle(r, handle)
        try:
            if self.mapping == "ipc":
                ptrs = self._open_ipc(handles)
            elif self.mapping == "process":
                ptrs = self._open_process(handles)
            elif self._vmm is not None:
                ptrs = self._open_vmm(handles)
            else:
                ptrs = self._open_symmetric(handles)
            self._stream = self.api.stream_create()
        except BaseException:
            self._close_mappings()
            raise
        self._peer_ptrs = ptrs
        self._peer_nbytes = [int(h["nbytes"]) if h is not None else self._segment.numel() for h in handles]
        self._forgotten.update(missing)  # lost before this rank joined: nothing is mapped for them
        paths = "; ".join(f"peer {p}: {how}" for p, how in sorted(self.fd_paths.items()))
        log.info("rank %d: cuda transport on %s, peers mapped through %s%s (%s copies, up to %d batches per layer)",
                 self.rank, self.device, self.mapping, f" ({paths})" if paths else "", self.copy, self.copy_batches)

    def _check_handle(self, peer: int, handle: dict) -> None:
        if handle.get("backend") != self.name or handle.get("mapping") != self.mapping:
            raise ValueError(f"rank {self.rank}: peer {peer} uses backend {handle.get('backend')!r} with mapping "
                             f"{handle.get('mapping')!r}, expected 'cuda' with {self.mapping!r}")

    def _open_ipc(self, handles: list[dict | None]) -> list[int]:
        ptrs = []
        for r, handle in enumerate(handles):
            if r == self.rank:
                ptrs.append(self._segment.data_ptr())  # one's own IPC handle cannot be opened
            else:
                ptrs.append(0 if handle is None else self._open_ipc_peer(r, handle))
        return ptrs

    def _open_ipc_peer(self, r: int, handle: dict) -> int:
        try:
            base = self.api.ipc_open(_raw_bytes(handle["ipc"]))
        except (cuda_api.CudaError, ValueError) as exc:
            raise PrefetchError(
                f"rank {self.rank}: cannot map the segment of peer {r} (host {handle.get('host')}, device "
                f"{handle.get('device')}): {exc}"
            ) from exc
        self._opened.append(base)
        self._peer_bases[r] = base
        return base + int(handle["offset"])

    def _open_vmm(self, handles: list[dict | None]) -> list[int]:
        ptrs = []
        for r, handle in enumerate(handles):
            if r == self.rank:
                ptrs.append(self._own_range.ptr)  # this rank's own mapping: nothing to import
            else:
                ptrs.append(0 if handle is None else self._open_vmm_peer(r, handle))
        return ptrs

    def _open_vmm_peer(self, r: int, handle: dict) -> int:
        sizes = tuple(int(n) for n in handle["allocations"])
        if int(handle["granularity"]) != self.granularity():
            # Every rank computed every layout with its own granularity: they must agree.
            raise ValueError(f"rank {self.rank}: peer {r}'s cuMem granularity is {handle['granularity']}, this "
                             f"rank's {self.granularity()}; composite layouts need one granularity")
        imported = []
        try:
            if self._handle_type == "posix_fd":
                ensure_fd_room(min(len(sizes), SCM_MAX_FD))
                fds, self.fd_paths[r] = take_fds(handle)
                try:
                    for i, fd in enumerate(fds):
                        imported.append(self._vmm.import_(fd, "posix_fd"))
                        os.close(fd)  # the imported handle keeps the allocation
                        fds[i] = -1
                finally:
                    for fd in fds:
                        if fd >= 0:
                            os.close(fd)
            else:
                for raw in handle["fabric"]:
                    imported.append(self._vmm.import_(_raw_bytes(raw), "fabric"))
                self.fd_paths[r] = "fabric handles"
            if len(imported) != len(sizes):
                raise ValueError(f"{len(imported)} handles for {len(sizes)} allocations")
            ptr = self._vmm.map_back_to_back(imported, sizes, self._alignment())
        except (cuda_api.CudaError, OSError, ValueError) as exc:
            for h in reversed(imported):
                self._vmm.release(h)
            raise PrefetchError(
                f"rank {self.rank}: cannot import the segment of peer {r} (host {handle.get('host')}, device "
                f"{handle.get('device')}, {self.mapping}): {exc}"
            ) from exc
        except BaseException:
            for h in reversed(imported):
                self._vmm.release(h)
            raise
        self._peer_ranges[r] = _VmmRange(tuple(imported), sizes, ptr)
        return ptr

    def _open_process(self, handles: list[dict]) -> list[int]:
        own = self.device.index or 0
        for r, handle in enumerate(handles):
            if handle.get("pid") != os.getpid():
                raise ValueError(f"rank {self.rank}: peer {r}'s segment belongs to process {handle.get('pid')}, "
                                 f"not this one ({os.getpid()}); mapping='process' holds every rank in one process")
            device = int(handle["device"])
            if self.device.type == "cuda" and device != own and self.api.can_access_peer(own, device):
                self.api.enable_peer_access(device)  # copies between the devices go over their link
        return [int(h["ptr"]) for h in handles]

    def _open_symmetric(self, handles: list[dict]) -> list[int]:
        symm = _symmetric_memory_module()
        if self.process_group is None:
            raise ValueError(f"rank {self.rank}: mapping='symmetric_memory' needs the DWDP group's process group")
        self._symmetric = symm.rendezvous(self._segment, self.process_group)
        return [int(p) for p in self._symmetric.buffer_ptrs]

    @property
    def can_rejoin(self) -> bool:
        return self.mapping in REJOINABLE_MAPPINGS

    def board_handle(self) -> dict:
        """register()'s handle in JSON (bytes as hex), for the group's board: an IPC or fabric handle is
        valid for as long as this process holds its segment; a POSIX fd export is kept open (and served
        where Yama refuses pidfd_getfd) until close, so a rank started later can still take it. Call
        before seal. A rejoin on CUDA has not yet run on a GPU."""
        if not self.can_rejoin:
            raise ValueError(f"rank {self.rank}: mapping {self.mapping!r} cannot be rejoined; expected one of "
                             f"{REJOINABLE_MAPPINGS}")
        if self._handle is None:
            raise RuntimeError(f"rank {self.rank}: board_handle() before register()")
        if self._handle_type == "posix_fd":
            if not self._exported_fds:
                raise RuntimeError(f"rank {self.rank}: board_handle() after seal closed the exported fds")
            self._keep_export = True
        return {k: v.hex() if isinstance(v, bytes) else [x.hex() for x in v] if k == "fabric" else v
                for k, v in self._handle.items()}

    def peer_segment(self, peer: int) -> torch.Tensor:
        """`peer`'s mapped segment, uint8 [nbytes] on this device (a rejoining rank copies its experts from it)."""
        if peer == self.rank or not 0 <= peer < len(self._peer_ptrs) or peer in self._forgotten:
            raise ValueError(f"rank {self.rank}: peer {peer} has no mapped segment")
        return self.api.tensor_at(self._peer_ptrs[peer], self._peer_nbytes[peer], self.device)

    def open_peer(self, peer: int, handle: dict) -> None:
        """Map the segment of a new incarnation of `peer` (lost, forgotten, then rejoined: `handle` is its
        board_handle). Plans prepared while the old incarnation was mapped are dropped, so no copy ever
        reads the dead process's mapping again. Not yet run on a GPU (tested through the fakes)."""
        if self._closed or not self._peer_ptrs:
            raise RuntimeError(f"rank {self.rank}: open_peer() needs an open transport")
        if peer == self.rank or not 0 <= peer < len(self._peer_ptrs):
            raise ValueError(f"rank {self.rank}: cannot open peer {peer}; expected another rank of "
                             f"[0, {len(self._peer_ptrs)})")
        if peer not in self._forgotten:
            raise RuntimeError(f"rank {self.rank}: peer {peer} is still mapped; forget_peer({peer}) first, so the "
                               "segment of its dead process is never read again")
        if not self.can_rejoin:
            raise ValueError(f"rank {self.rank}: mapping {self.mapping!r} cannot be rejoined; expected one of "
                             f"{REJOINABLE_MAPPINGS}")
        self._check_handle(peer, handle)
        if int(handle.get("nbytes", -1)) != self._peer_nbytes[peer]:
            raise ValueError(f"rank {self.rank}: rejoining peer {peer} offers a segment of {handle.get('nbytes')} "
                             f"bytes; expected {self._peer_nbytes[peer]}")
        self._peer_ptrs[peer] = (self._open_ipc_peer(peer, handle) if self.mapping == "ipc"
                                 else self._open_vmm_peer(peer, handle))
        self._prepared_plans = {key: prepared for key, prepared in self._prepared_plans.items()
                                if peer not in prepared.plan.peers}
        self._forgotten.discard(peer)
        self.faulty_peers = MappingProxyType({p: why for p, why in self.faulty_peers.items() if p != peer})

    def seal(self) -> None:
        """Stop serving and close the exported POSIX fds (every peer imported its own before the setup
        barrier) unless the board hands them to ranks that join later; nothing else to unlink: an IPC
        export is not a name in a file system."""
        if self._keep_export and not self._closed:
            return
        if self._fd_server is not None:
            self._fd_server.close()
            self._fd_server = None
        while self._exported_fds:
            os.close(self._exported_fds.pop())

    def alloc_slot(self, nbytes: int) -> torch.Tensor:
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)[:nbytes]

    # -- copies --------------------------------------------------------------------------------
    def _consume_event(self, slot: int) -> int:
        event = self._consume.get(slot)
        if event is None:
            event = self._consume[slot] = self.api.event_create()
            # Until a reader releases the slot, its first copy is ordered after everything the
            # compute stream has issued so far (e.g. whatever allocated the slot).
            self.api.event_record(event, self.api.current_stream())
        return event

    def _batch_events(self, slot: int, count: int) -> tuple[int, ...]:
        """The first `count` batch events of `slot` (created on first need, then reused: a later
        record of an event supersedes the earlier one, as the copies into a slot run in order)."""
        events = self._slot_events.get(slot)
        if events is None or len(events) < count:
            events = list(events or ())
            while len(events) < count:
                events.append(self.api.event_create())
            self._slot_events[slot] = events = tuple(events)
        return events if len(events) == count else events[:count]

    def _prepared(self, plan: CopyPlan, slot_buffer: torch.Tensor) -> _PreparedPlan:
        """The issue-ready form of `plan` into `slot_buffer`, built on its first submit and reused.

        One entry per (layer, slot, slot buffer): a new plan for the same layer and slot (sources
        re-planned after a loss, a retry of the unfinished experts) replaces it, so the cache stays
        as small as the set of plans in use."""
        slot_ptr = slot_buffer.data_ptr()
        key = (plan.layer, plan.slot, slot_ptr)
        prepared = self._prepared_plans.get(key)
        if prepared is not None and prepared.plan is plan:
            return prepared
        prepared = self._prepare(plan, slot_buffer)
        self._prepared_plans[key] = prepared
        return prepared

    def _prepare(self, plan: CopyPlan, slot_buffer: torch.Tensor) -> _PreparedPlan:
        """Check every slice's addresses once and build each batch's copy arguments."""
        dst_base, dst_nbytes = slot_buffer.data_ptr(), slot_buffer.numel()
        for s in plan.slices:
            if s.peer == self.rank or not 0 <= s.peer < len(self._peer_ptrs):
                raise ValueError(f"rank {self.rank}: plan of layer {plan.layer} copies from peer {s.peer}, expected "
                                 f"another rank of the group [0, {len(self._peer_ptrs)})")
            if s.nbytes < 1 or s.dst_offset < 0 or s.dst_offset + s.nbytes > dst_nbytes:
                raise ValueError(f"rank {self.rank}: slice {s} of layer {plan.layer} does not fit the slot "
                                 f"({dst_nbytes} bytes)")
            if s.src_offset < 0 or s.src_offset + s.nbytes > self._peer_nbytes[s.peer]:
                raise ValueError(f"rank {self.rank}: slice {s} of layer {plan.layer} reads past the segment of "
                                 f"peer {s.peer} ({self._peer_nbytes[s.peer]} bytes)")
        batches = []
        for batch in cut_batches(plan, self.copy_batches):
            # One copy per run of a peer's contiguous slices: fewer copies, the same bytes, and the
            # round-robin interleaving of peers untouched (plan.coalesce).
            chunk = coalesce(plan.slices[batch.start : batch.stop])
            copies = self.api.prepare_batch([dst_base + dst for _, _, dst, _ in chunk],
                                            [self._peer_ptrs[peer] + src for peer, src, _, _ in chunk],
                                            [n for *_, n in chunk], self.prefer_overlap)
            batches.append(_IssuedBatch(copies, tuple(c[0] for c in chunk), batch.peers, batch.completes))
        expert_batch = MappingProxyType({e: b for b, batch in enumerate(batches) for e in batch.completes})
        return _PreparedPlan(plan, dst_base, tuple(batches), expert_batch, tuple(b.peers for b in batches))

    def submit(self, plan: CopyPlan, slot_buffer: torch.Tensor) -> CudaTicket:
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: submit() on a closed transport")
        if not self._peer_ptrs:
            raise RuntimeError(f"rank {self.rank}: submit() before open()")
        if slot_buffer.dtype != torch.uint8 or not slot_buffer.is_contiguous():
            raise ValueError(f"slot_buffer must be a contiguous uint8 tensor, got {slot_buffer.dtype}")
        if self._unmap_after:
            self._unmap_landed()
        prepared = self._prepared(plan, slot_buffer)
        batches = prepared.batches
        api, stream = self.api, self._stream
        events = self._batch_events(plan.slot, len(batches))
        ticket = CudaTicket(self, plan, events, prepared.expert_batch, prepared.batch_peers)
        if not batches:
            return ticket
        try:
            # Write after read: the slot's previous readers must be done before the first copy.
            api.stream_wait_event(stream, self._consume_event(plan.slot))
            for batch, event in zip(batches, events):
                self._issue(batch, stream)
                api.event_record(event, stream)
        except (cuda_api.CudaError, PrefetchError) as exc:
            error = exc if isinstance(exc, PrefetchError) else PrefetchError(
                f"rank {self.rank}: prefetch of layer {plan.layer} into slot {plan.slot} from peers "
                f"{list(plan.peers)}: {exc}")
            log.error("%s", error)
            ticket._fail(error)
        return ticket

    def _issue(self, batch: _IssuedBatch, stream: int) -> None:
        for peer in batch.peers:  # the fault hook and lost peers: refused before anything is enqueued
            if peer in self._forgotten:
                raise PeerCopyError(f"rank {self.rank}: peer {peer} was lost and its mapping released", peer)
            try:
                self._check_readable(peer)
            except PeerUnreadable as exc:
                raise PeerCopyError(str(exc), peer) from exc
        try:
            if self.copy == "batch":
                self.api.memcpy_prepared_batch(batch.copies, stream)
            else:
                copies = batch.copies
                for dst, src, n in zip(copies.dsts, copies.srcs, copies.sizes):
                    self.api.memcpy_async(dst, src, n, stream)
        except cuda_api.CudaError as exc:
            index = getattr(exc, "fail_index", None)
            if index is None:
                raise PrefetchError(f"rank {self.rank}: a copy from peers {list(batch.peers)} failed to enqueue: "
                                    f"{exc}") from exc
            peer = batch.peers_of_copies[index]
            raise PeerCopyError(f"rank {self.rank}: copy {index} from peer {peer} failed to enqueue: {exc}",
                                peer) from exc

    def forget_peer(self, peer: int) -> None:
        """Refuse copies from `peer` from now on and close its IPC mapping once the copies already
        enqueued from it have run (a fence on the copy stream, checked without blocking)."""
        if peer == self.rank or not 0 <= peer < len(self._peer_ptrs):
            raise ValueError(f"rank {self.rank}: cannot forget peer {peer}; expected another rank of "
                             f"[0, {len(self._peer_ptrs)})")
        if peer in self._forgotten:
            return
        self._forgotten.add(peer)
        self._prepared_plans = {key: prepared for key, prepared in self._prepared_plans.items()
                                if peer not in prepared.plan.peers}
        mapping = self._peer_bases.get(peer)  # an IPC base (kept: it names what was opened for the peer)
        if mapping is None:
            mapping = self._peer_ranges.pop(peer, None)  # a VMM import, retired until its fence has run
        if mapping is not None:
            if self._stream is not None:
                fence = self.api.event_create()
                self.api.event_record(fence, self._stream)
                self._unmap_after.append((mapping, fence))
            elif isinstance(mapping, _VmmRange):
                self._release_range(mapping)  # nothing was ever enqueued from it
        self._unmap_landed()

    def _unmap_landed(self) -> None:
        """Close the mappings of forgotten peers whose fence has completed."""
        waiting = []
        for base, fence in self._unmap_after:
            try:
                landed = self.api.event_query(fence)
            except cuda_api.CudaError:
                landed = False  # a sticky error: leave the mapping to close()
            if not landed:
                waiting.append((base, fence))
                continue
            self.api.event_destroy(fence)
            if isinstance(base, _VmmRange):  # a peer's imported allocation: it goes with the last importer's release
                self._release_range(base)
                continue
            self._opened.remove(base)
            self.api.ipc_close(base)
        self._unmap_after = waiting

    def release_slot(self, slot: int) -> None:
        """Record the slot's consume event on the compute stream, after the reads just issued."""
        if self._closed:
            return
        event = self._consume.get(slot)
        if event is None:
            event = self._consume[slot] = self.api.event_create()
        self.api.event_record(event, self.api.current_stream())

    # -- teardown ------------------------------------------------------------------------------
    def _close_mappings(self) -> None:
        """Release the peers' mappings (IPC and VMM imports), in the reverse of their opening."""
        imported, self._peer_ranges = self._peer_ranges, {}
        for peer in reversed(list(imported)):
            try:
                self._release_range(imported[peer])
            except cuda_api.CudaError as exc:
                log.error("rank %d: releasing the import of peer %d failed: %s", self.rank, peer, exc)
        opened, self._opened = self._opened, []
        for base in opened:
            try:
                self.api.ipc_close(base)
            except cuda_api.CudaError as exc:
                log.error("rank %d: closing a peer mapping at %#x failed: %s", self.rank, base, exc)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        drained = self._drain_before_unmap()
        retired = [mapping for mapping, _ in self._unmap_after if isinstance(mapping, _VmmRange)]
        if drained:
            # Unmapping a peer's segment under a running copy would fault it: only once drained.
            for mapping in retired:
                self._release_range(mapping)
            self._close_mappings()
            self._close_own_vmm()
        else:
            self._opened, self._peer_ranges = [], {}
        fences = [fence for _, fence in self._unmap_after]
        self._unmap_after = []
        for event in [*self._consume.values(), *(e for evs in self._slot_events.values() for e in evs), *fences]:
            try:
                self.api.event_destroy(event)
            except cuda_api.CudaError:
                pass
        self._consume, self._slot_events, self._prepared_plans = {}, {}, {}
        if self._stream is not None and drained:
            try:
                self.api.stream_destroy(self._stream)
            except cuda_api.CudaError:
                pass
        self._stream = None
        self._peer_ptrs, self._segment, self._symmetric = [], None, None
        if self._exported_fds or self._fd_server is not None:  # a failed setup, or kept for the board
            self.seal()

    def _drain_before_unmap(self) -> bool:
        """Wait (with the close deadline) for the copy stream and, where this rank maps memory that
        kernels read (its segment, composite views), the compute stream: cuMemUnmap waits for nothing,
        and unmapping a range under a running kernel or copy faults the context. False on a timeout or
        a sticky error: the mappings are then left to process exit."""
        streams = []
        if self._stream is not None:
            streams.append(("copy", self._stream))
        try:
            if self._own_range is not None or self.views is not None:
                streams.append(("compute", self.api.current_stream()))
            for what, stream in streams:
                fence = self.api.event_create()
                self.api.event_record(fence, stream)
                self.api.event_wait(fence, self.close_timeout_s)
                self.api.event_destroy(fence)
        except (cuda_api.CudaError, TimeoutError) as exc:
            log.error("rank %d: work still in flight at close (%s); mappings are left to process exit", self.rank, exc)
            return False
        return True

    def _close_own_vmm(self) -> None:
        """The views, then the segment's own mapping and allocation (the reverse of setup)."""
        try:
            if self.views is not None:
                self.views.close()
            self.views = None
            if self._own_range is not None:
                self._release_range(self._own_range)
            self._own_range = None
            if self._vmm is not None:
                self._vmm.close()
        except cuda_api.CudaError as exc:
            log.error("rank %d: releasing the composite views or the segment failed: %s", self.rank, exc)


def local_vmm_mapping(rank: int, device, driver=None) -> str:
    """What this rank's device can export: "vmm-fabric", "vmm-posix-fd" or "ipc" (one log line,
    dwdp.runtime.transport.cuda_vmm.choose_mapping). driver: cuda.bindings.driver or a fake of it.
    Ran on one H200 (it answered "vmm-posix-fd": fabric create refused with no IMEX channel)."""
    vmm = Vmm(torch.device(device).index or 0, driver)
    try:
        # POSIX fds reach peers either way: pidfd_getfd, or the SCM_RIGHTS socket where it is refused.
        return choose_mapping(vmm, rank)
    finally:
        vmm.close()


def fabric_import_refusals(rank: int, device, all_gather, driver=None) -> list[str]:
    """Whether fabric handles really cross between the ranks of a group that all export them: each rank
    exports one granule, every rank imports every peer's (an import can be refused with NOT_PERMITTED
    after the export succeeded, e.g. ranks in different IMEX channels). all_gather: the group's
    all_gather_object (two rounds, every rank calls this). Returns every rank's refusals, "rank r: why";
    empty when every import worked. Not yet run on a GPU (a single GPU has no IMEX channel)."""
    vmm = Vmm(torch.device(device).index or 0, driver)
    handle, raw, refusals = None, None, []
    try:
        try:
            handle = vmm.create(vmm.granularity("fabric"), "fabric")
            raw = vmm.export(handle, "fabric")
        except cuda_api.CudaError as exc:
            refusals.append(f"rank {rank}: export: {exc}")
        raws = all_gather(raw)
        for peer, peer_raw in enumerate(raws):
            if peer == rank or peer_raw is None:
                continue
            try:
                vmm.release(vmm.import_(peer_raw, "fabric"))
            except cuda_api.CudaError as exc:
                refusals.append(f"rank {rank}: import from rank {peer}: {exc}")
        return [why for answer in all_gather(refusals) for why in answer]
    finally:
        if handle is not None:
            vmm.release(handle)
        vmm.close()


def _symmetric_memory_module():
    try:
        from torch.distributed import _symmetric_memory as symm
    except ImportError as exc:
        raise RuntimeError(
            f"cuda_mapping='symmetric_memory' (multi-node NVLink) needs torch.distributed._symmetric_memory, "
            f"which torch {torch.__version__} does not have; run the group on one node (cuda_mapping='ipc')"
        ) from exc
    if not hasattr(symm, "rendezvous") or not hasattr(symm, "empty"):
        raise RuntimeError(f"torch {torch.__version__}'s _symmetric_memory lacks empty/rendezvous; "
                           "use cuda_mapping='ipc' on one node")
    return symm
