"""CUDA backend: peers' segments mapped into this process, copy-engine copies on a copy stream.

Setup: each rank's local experts live in one device buffer (its segment). The rank exports it
once and every peer maps it; how is the job of one PeerMapping chosen at construction
(dwdp.runtime.transport.cuda_peers): "ipc" (CUDA IPC on one node, cuda_ipc), "vmm-posix-fd" and
"vmm-fabric" (cuMem allocations, what composite views need, cuda_vmm_peers), "symmetric_memory"
(torch's symmetric memory across nodes, cuda_symmetric) or "process" (every rank in this process,
cuda_process). A rank reads its own segment through its own pointer. This module is the copy side.

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

A lost peer's mapping is retired behind a fence on the copy stream and released once the copies
already enqueued from it have run. `close` waits for the copy stream and, where kernels read memory
the mapping unmaps (composite views, a cuMem segment), the compute stream, then releases every
mapping in the reverse of setup.

Every device call goes through `api` (dwdp.runtime.transport.cuda_api by default), so tests drive this
control logic with a recording fake on a CPU.
"""
from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from dwdp import envs
from dwdp.runtime.transport import cuda_api
from dwdp.runtime.plan import CopyPlan, coalesce, cut_batches
from dwdp.runtime.transport.base import PeerCopyError, PeerUnreadable, PrefetchError, PrefetchTimeout, Transport
from dwdp.runtime.transport.cuda_ipc import IpcMapping
from dwdp.runtime.transport.cuda_peers import PeerMapping
from dwdp.runtime.transport.cuda_process import ProcessMapping
from dwdp.runtime.transport.cuda_symmetric import SymmetricMapping
from dwdp.runtime.transport.cuda_vmm_peers import VMM_MAPPINGS, VmmMapping
from dwdp.runtime.transport.teardown import Steps

log = logging.getLogger("dwdp")

# Mapping name -> the PeerMapping that implements it.
PEER_MAPPINGS: Mapping[str, type[PeerMapping]] = MappingProxyType({
    "ipc": IpcMapping, "symmetric_memory": SymmetricMapping, "process": ProcessMapping,
    **{name: VmmMapping for name in VMM_MAPPINGS}})
# Mappings whose export a process started later can open (a rank rejoining the group through the board).
REJOINABLE_MAPPINGS = tuple(name for name, cls in PEER_MAPPINGS.items() if cls.rejoinable)


def on_rank_device(method):
    """Run a transport method with the rank's device current on the calling thread. The runtime keeps the
    current device per host thread: a call from a thread that never set one (the health thread's
    failover, a finaliser, a rejoin) would make a context on device 0, record events there and fail
    against the rank's streams ("event and stream must be on the same device")."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        self.make_device_current()
        return method(self, *args, **kwargs)

    return run


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
        self._transport.make_device_current()
        self._raise_if_failed()
        if self._events:
            api = self._transport.api
            stream = api.current_stream()
            self._transport.reader_streams.add(stream)
            self._device_call(api.stream_wait_event, stream, self._events[-1])
        return 0.0

    def wait_experts(self, experts, timeout: float) -> float:
        """The caller's current stream waits for the batch that completes the last of `experts`."""
        self._transport.make_device_current()
        self._raise_if_failed()
        batches = [self._expert_batch[e] for e in experts if e in self._expert_batch]
        if batches:
            api = self._transport.api
            stream = api.current_stream()
            self._transport.reader_streams.add(stream)
            self._device_call(api.stream_wait_event, stream, self._events[max(batches)])
        return 0.0

    # -- host side: queries and deadline waits -------------------------------------------------
    def done(self) -> bool:
        self._transport.make_device_current()
        self._raise_if_failed()
        return not self._events or self._device_call(self._transport.api.event_query, self._events[-1])

    def expert_ready(self, expert: int) -> bool:
        self._transport.make_device_current()
        self._raise_if_failed()
        batch = self._expert_batch.get(expert)
        return batch is None or self._device_call(self._transport.api.event_query, self._events[batch])

    def landed_prefix(self, experts) -> int:
        """How many of `experts`, in order, lie in batches whose events have completed (queried,
        never waited on): the experts before the first one whose batch is still on the copy stream."""
        self._transport.make_device_current()
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
        self._transport.make_device_current()
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
    mapping: a name of PEER_MAPPINGS: "ipc", "symmetric_memory", "vmm-posix-fd" or "vmm-fabric" (cuMem
    allocations, needed by composite views); process_group: needed by "symmetric_memory"; "process":
    every rank of the group lives in this process (`dwdp tune`, tests), a peer's segment is read
    through its own pointer (with peer access enabled between devices).
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
        if mapping not in PEER_MAPPINGS:
            raise ValueError(f"mapping={mapping!r} must be one of {tuple(PEER_MAPPINGS)}")
        self.api = api
        api.require()
        self.rank = rank
        self.device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
        # The device every call runs on, made current on whichever thread calls (on_rank_device); None for a
        # "cpu" device (tests whose fake device is host memory).
        self._device_index = (self.device.index or 0) if self.device.type == "cuda" else None
        self.make_device_current()
        self.mapping = mapping
        self.copy_batches, self.prefer_overlap, self.close_timeout_s = copy_batches, prefer_overlap, close_timeout_s
        self.copy = copy
        if copy == "batch" and not api.has_memcpy_batch():
            log.warning("rank %d: cudaMemcpyBatchAsync is not available (CUDA < 12.8); one cudaMemcpyAsync per slice",
                        rank)
            self.copy = "memcpy"
        # How this rank's segment and its peers' are mapped: one object, chosen here once.
        self.mapper = PEER_MAPPINGS[mapping](mapping, rank, self.device, api, driver=driver,
                                             process_group=process_group)
        self._segment: torch.Tensor | None = None
        self._peer_ptrs: list[int] = []
        self._peer_nbytes: list[int] = []
        self._stream: int | None = None
        self._consume: dict[int, int] = {}      # slot -> consume event
        self._slot_events: dict[int, tuple[int, ...]] = {}  # slot -> one event per batch
        self._prepared_plans: dict[tuple[int, int, int], _PreparedPlan] = {}  # (layer, slot, slot ptr)
        self._forgotten: set[int] = set()        # lost peers no copy may read any more
        # (a lost peer's mapping as the mapper retired it, fence event on the copy stream): released once
        # the fence has run
        self._unmap_after: list[tuple[object, int]] = []
        self._handle: dict | None = None              # what register() exported
        self._keep_export = False                     # board_handle() given: the export outlives seal
        self._closed = False
        self.reader_streams: set[int] = set()  # streams that waited on a ticket or released a slot
        self.recorder = None  # copy slices have no host lane on this backend: see NVTX / Nsight instead

    def make_device_current(self) -> None:
        """The rank's device current on the calling thread (set only when another one is: a set device's
        context is made, and the thread keeps it afterwards)."""
        if self._device_index is not None and self.api.get_device() != self._device_index:
            self.api.set_device(self._device_index)

    @property
    def fd_paths(self) -> dict[int, str]:
        """peer -> how its POSIX fds came (pidfd_getfd, or the socket and why); VMM POSIX-fd mapping only."""
        return self.mapper.fd_paths

    @property
    def views(self):
        """This rank's composite views (CudaCompositeViews) once built; None otherwise."""
        return self.mapper.views

    # -- setup ---------------------------------------------------------------------------------
    @on_rank_device
    def alloc_segment(self, nbytes: int, allocations: tuple[int, ...] | None = None) -> torch.Tensor:
        """uint8 [nbytes]: this rank's segment. allocations (VMM mappings only): the sizes of the
        cuMem allocations that make it up, back to back (CompositeLayout.segment_allocations), each a
        multiple of the granularity; None: one allocation of nbytes rounded up to the granularity."""
        if self._segment is not None:
            raise RuntimeError(f"rank {self.rank}: segment already allocated")
        self._segment = self.mapper.alloc_segment(nbytes, allocations)
        return self._segment

    def composite_unavailable(self) -> str | None:
        return self.mapper.composite_unavailable()

    def describe_mapping(self) -> str:
        return self.mapper.describe()

    @on_rank_device
    def granularity(self) -> int:
        """The cuMem allocation granularity of this device for the segment's handle type (VMM only)."""
        return self.mapper.granularity()

    @on_rank_device
    def composite_views(self, layout):
        """This rank's composite views over its segment (see dwdp.runtime.transport.cuda_vmm); closed
        with the transport. Ran on one H200 with POSIX fds."""
        return self.mapper.composite_views(layout)

    @on_rank_device
    def register(self) -> dict:
        if self._segment is None:
            raise RuntimeError(f"rank {self.rank}: register() before alloc_segment()")
        # Peers read the segment from their own streams: its fill must be complete first.
        self.api.device_synchronize()
        handle = {"backend": self.name, "rank": self.rank, "mapping": self.mapping,
                  "nbytes": self._segment.numel(), "host": envs.node_name(), "device": self.device.index or 0}
        self.mapper.export(handle)
        self._handle = handle
        return handle

    @on_rank_device
    def open(self, handles: list[dict | None]) -> None:
        if self._peer_ptrs:
            raise RuntimeError(f"rank {self.rank}: open() called twice")
        missing = [r for r, handle in enumerate(handles) if handle is None and r != self.rank]
        if missing and not self.mapper.rejoinable:
            raise ValueError(f"rank {self.rank}: peers {missing} have no segment handle; only mappings "
                             f"{REJOINABLE_MAPPINGS} open a group that lacks some of its ranks")
        for r, handle in enumerate(handles):
            if handle is not None:
                self._check_handle(r, handle)
        try:
            ptrs = self.mapper.open(handles)
            self._stream = self.api.stream_create()
        except BaseException:
            self.mapper.close_peers()
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

    @property
    def can_rejoin(self) -> bool:
        return self.mapper.rejoinable

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
        if self.mapper.keep_export_for_board():
            self._keep_export = True
        return {k: v.hex() if isinstance(v, bytes) else [x.hex() for x in v] if k == "fabric" else v
                for k, v in self._handle.items()}

    @on_rank_device
    def peer_segment(self, peer: int) -> torch.Tensor:
        """`peer`'s mapped segment, uint8 [nbytes] on this device (a rejoining rank copies its experts from it)."""
        if peer == self.rank or not 0 <= peer < len(self._peer_ptrs) or peer in self._forgotten:
            raise ValueError(f"rank {self.rank}: peer {peer} has no mapped segment")
        return self.api.tensor_at(self._peer_ptrs[peer], self._peer_nbytes[peer], self.device)

    @on_rank_device
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
        self._peer_ptrs[peer] = self.mapper.open_peer(peer, handle)
        self._prepared_plans = {key: prepared for key, prepared in self._prepared_plans.items()
                                if peer not in prepared.plan.peers}
        self._forgotten.discard(peer)
        self.faulty_peers = MappingProxyType({p: why for p, why in self.faulty_peers.items() if p != peer})

    @on_rank_device
    def fill_landed(self) -> None:
        """The segment's fill (torch copies on whatever stream, peers' segments read by a rejoin) has
        landed: the device is synchronised (setup only)."""
        self.api.device_synchronize()

    @on_rank_device
    def seal(self) -> None:
        """Stop serving and close the exported POSIX fds (every peer imported its own before the setup
        barrier) unless the board hands them to ranks that join later; nothing else to unlink: an IPC
        export is not a name in a file system."""
        if self._keep_export and not self._closed:
            return
        self.mapper.seal()

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

    @on_rank_device
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

    @on_rank_device
    def forget_peer(self, peer: int) -> None:
        """Refuse copies from `peer` from now on and release its mapping once the copies already
        enqueued from it have run (a fence on the copy stream, checked without blocking)."""
        if peer == self.rank or not 0 <= peer < len(self._peer_ptrs):
            raise ValueError(f"rank {self.rank}: cannot forget peer {peer}; expected another rank of "
                             f"[0, {len(self._peer_ptrs)})")
        if peer in self._forgotten:
            return
        self._forgotten.add(peer)
        self._prepared_plans = {key: prepared for key, prepared in self._prepared_plans.items()
                                if peer not in prepared.plan.peers}
        retired = self.mapper.retire_peer(peer)
        if retired is not None:
            if self._stream is not None:
                fence = self.api.event_create()
                self.api.event_record(fence, self._stream)
                self._unmap_after.append((retired, fence))
            else:
                self.mapper.release(retired)  # nothing was ever enqueued from it
        self._unmap_landed()

    def _unmap_landed(self) -> None:
        """Release the mappings of forgotten peers whose fence has completed."""
        waiting = []
        for retired, fence in self._unmap_after:
            try:
                landed = self.api.event_query(fence)
            except cuda_api.CudaError:
                landed = False  # a sticky error: leave the mapping to close()
            if not landed:
                waiting.append((retired, fence))
                continue
            self.api.event_destroy(fence)
            try:
                self.mapper.release(retired)
            except cuda_api.CudaError as exc:  # the mapping stays retired: close finishes its release
                log.error("rank %d: releasing a lost peer's mapping failed (%s); close tries again", self.rank, exc)
        self._unmap_after = waiting

    @on_rank_device
    def release_slot(self, slot: int) -> None:
        """Record the slot's consume event on the compute stream, after the reads just issued."""
        if self._closed:
            return
        event = self._consume.get(slot)
        if event is None:
            event = self._consume[slot] = self.api.event_create()
        stream = self.api.current_stream()
        self.reader_streams.add(stream)
        self.api.event_record(event, stream)

    # -- teardown ------------------------------------------------------------------------------
    @on_rank_device
    def close(self) -> None:
        """Drain, then release everything in the reverse of setup; every step runs whatever failed before
        it (one failing unmap must not leave exports, events or the fd server behind), and the first
        error is raised at the end. A drain that does not finish in time leaves every mapping in place
        (one log line): unmapping under running work would fault this process's context."""
        if self._closed:
            return
        self._closed = True
        steps = Steps(f"rank {self.rank}: closing the cuda transport")
        drained = self._drain_before_unmap()
        steps.run("releasing the mappings", self.mapper.close, drained)
        fences = [fence for _, fence in self._unmap_after]
        self._unmap_after = []
        # Events and the stream only cost a handle until the process exits: a sticky error fails them all,
        # and one line (the drain's) has said so.
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
        self._peer_ptrs, self._segment = [], None
        if self.mapper.holds_exports():  # a failed setup, a failed close, or kept for the board
            self._keep_export = False
            steps.run("closing the exports", self.seal)
        steps.raise_first()

    def _drain_before_unmap(self) -> bool:
        """Wait, within the close deadline, for every stream that may still read mapped memory: a fence on
        the copy stream and on every stream that waited on a ticket or released a slot, then the whole
        device synchronised (as PyTorch's symmetric memory does before it unmaps: a forward on a side
        stream, a CUDA-graph replay, a close from a finaliser thread). cudaDeviceSynchronize has no
        deadline: it runs on a helper thread waited for with the remaining time. False on a timeout or
        a sticky error: the mappings are then left to process exit."""
        deadline = time.monotonic() + self.close_timeout_s
        streams = [s for s in (self._stream, *sorted(self.reader_streams)) if s is not None]
        try:
            for stream in streams:
                fence = self.api.event_create()
                self.api.event_record(fence, stream)
                self.api.event_wait(fence, max(deadline - time.monotonic(), 0.0))
                self.api.event_destroy(fence)
            self._synchronize_device(max(deadline - time.monotonic(), 0.0))
        except (cuda_api.CudaError, TimeoutError) as exc:
            log.error("rank %d: work still in flight at close (%s); every mapping is left in place until the "
                      "process exits", self.rank, exc)
            return False
        return True

    def _synchronize_device(self, timeout_s: float) -> None:
        """cudaDeviceSynchronize on a helper thread (the rank's device made current there), waited for at
        most `timeout_s`; TimeoutError after that (the thread finishes whenever the device does)."""
        done, failed = threading.Event(), []

        def synchronize():
            try:
                self.make_device_current()
                self.api.device_synchronize()
            except BaseException as exc:
                failed.append(exc)
            finally:
                done.set()

        threading.Thread(target=synchronize, name=f"dwdp-close-sync-{self.rank}", daemon=True).start()
        if not done.wait(timeout_s):
            raise TimeoutError(f"the device did not finish its queued work within {self.close_timeout_s:.3g} s")
        if failed:
            raise failed[0]
