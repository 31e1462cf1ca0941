"""The transport interface: register local segments, open peers', submit copy plans, wait on tickets."""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType

import torch

from dwdp.runtime.plan import CopyPlan


class PrefetchTimeout(TimeoutError):
    """A prefetch did not finish in time; the message names the layer, slot and outstanding peers."""


class PrefetchError(RuntimeError):
    """A prefetch failed; the message names the rank, layer, slot, source peers and the cause."""


class PeerCopyError(PrefetchError):
    """A copy from one peer failed: `peer` names it, so the caller can treat that source as lost."""

    def __init__(self, message: str, peer: int):
        super().__init__(message)
        self.peer = peer


class PeerUnreadable(RuntimeError):
    """The fault hook's error: `peer`'s memory is treated as unreadable (a lost device)."""

    def __init__(self, message: str, peer: int):
        super().__init__(message)
        self.peer = peer


class Ticket:
    """Completion of one submitted plan, with per-expert readiness.

    A copier calls `_finish_slice` once per slice or `_finish_slices` once per batch (from any
    thread); compute calls `wait` or `wait_experts`, which block at most `timeout` seconds, or asks
    `landed_prefix` what it can compute now without blocking.
    """

    def __init__(self, plan: CopyPlan):
        self.plan = plan
        self._cond = threading.Condition()
        self._left_total = len(plan.slices)
        self._left_expert = plan.slices_per_expert()
        self._left_peer = plan.slices_per_peer()
        self.error: BaseException | None = None
        self.failed_peer: int | None = None  # the source whose copy failed, when one did
        self._running = 0                    # slices (or batches) a copier is copying right now
        self.submitted_ns = time.perf_counter_ns()
        self.finished_ns: int | None = self.submitted_ns if not plan.slices else None

    def _start_slice(self) -> bool:
        """A copier is about to copy a slice or a batch of them; False once the ticket failed (skip
        it). Each True is matched by one `_finish_slice`, `_finish_slices` or `_fail(started=True)`."""
        with self._cond:
            if self.error is not None:
                return False
            self._running += 1
            return True

    def _finish_slice(self, peer: int, expert: int) -> None:
        """One started slice has landed."""
        with self._cond:
            self._running -= 1
            if self._count_landed(peer, expert) or (self._running == 0 and self.error is not None):
                self._cond.notify_all()

    def _finish_slices(self, slices) -> None:
        """Every slice of one started batch (CopySlice each) has landed: one lock and one wake-up."""
        with self._cond:
            self._running -= 1
            completed = False
            for s in slices:
                completed |= self._count_landed(s.peer, s.expert)
            if completed or (self._running == 0 and self.error is not None):
                self._cond.notify_all()  # waiters for experts, or `quiesce` after a failure

    def _count_landed(self, peer: int, expert: int) -> bool:
        """Count one landed slice; True when it completes its expert. Holds `_cond`."""
        self._left_total -= 1
        self._left_expert[expert] -= 1
        self._left_peer[peer] -= 1
        if self._left_total == 0:
            self.finished_ns = time.perf_counter_ns()
        # Waiters wait for whole experts: waking them for a partial one only costs them.
        return self._left_expert[expert] == 0

    def _fail(self, error: BaseException, peer: int | None = None, started: bool = False) -> None:
        """Record the first failure (`peer`: the source of the failed copy; `started`: it came from
        a slice or batch that `_start_slice` let run)."""
        with self._cond:
            if started:
                self._running -= 1
            if self.error is None:
                self.error, self.failed_peer = error, peer
            self._cond.notify_all()

    def cancel(self, reason: str) -> None:
        """Copy nothing more for this ticket (its sources were re-planned)."""
        self._fail(RuntimeError(f"cancelled: {reason}"))

    def quiesce(self, timeout: float) -> None:
        """Once failed or cancelled: block until no copier still writes for this ticket, so a retry
        into the same slot is not overwritten by a late slice."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._running == 0, timeout=timeout):
                raise PrefetchTimeout(f"rank {self.plan.rank}: {self._running} slice(s) of layer {self.plan.layer} "
                                      f"into slot {self.plan.slot} still copying after {timeout:.3g} s")

    def outstanding_peers(self) -> dict[int, int]:
        """Slices not landed yet, per source peer."""
        with self._cond:
            return {p: n for p, n in sorted(self._left_peer.items()) if n}

    def missing_experts(self) -> tuple[int, ...]:
        """Experts of the plan whose slices have not all landed."""
        with self._cond:
            return tuple(sorted(e for e, n in self._left_expert.items() if n))

    def done(self) -> bool:
        with self._cond:
            self._raise_if_failed()
            return self._left_total == 0

    def expert_ready(self, expert: int) -> bool:
        with self._cond:
            self._raise_if_failed()
            return self._left_expert.get(expert, 0) == 0

    def landed_prefix(self, experts) -> int:
        """How many of `experts`, taken in order, have landed before the first one that has not;
        never blocks."""
        with self._cond:
            self._raise_if_failed()
            count = 0
            for e in experts:
                if self._left_expert.get(e, 0):
                    break
                count += 1
            return count

    def wait(self, timeout: float) -> float:
        """Block until every slice has landed; returns the seconds spent waiting."""
        return self._wait_until(lambda: self._left_total == 0, timeout, "all experts")

    def wait_experts(self, experts, timeout: float) -> float:
        experts = tuple(experts)
        return self._wait_until(
            lambda: all(self._left_expert.get(e, 0) == 0 for e in experts), timeout, f"experts {list(experts)}"
        )

    def _wait_until(self, ready, timeout: float, what: str) -> float:
        start = time.perf_counter()
        with self._cond:
            if self.error is None and ready():
                return 0.0  # the common case on the hot path: nothing to wait for
            finished = self._cond.wait_for(lambda: self.error is not None or ready(), timeout=timeout)
            self._raise_if_failed()
            if not finished:
                outstanding = {p: n for p, n in sorted(self._left_peer.items()) if n}
                raise PrefetchTimeout(
                    f"rank {self.plan.rank}: prefetch of layer {self.plan.layer} into slot {self.plan.slot} "
                    f"({what}) not done after {timeout:.3g} s; slices still outstanding per source peer: "
                    f"{outstanding}"
                )
        return time.perf_counter() - start

    def synchronize(self, timeout: float) -> float:
        """Block the host until every slice has landed (setup, drain and close; never the hot path)."""
        return self.wait(timeout)

    def fence_before_reuse(self, timeout: float) -> None:
        """Make sure a later copy into the same slot cannot overtake this one (a reader stopped
        early): host copier threads could, so wait; errors were already reported to a waiter."""
        if self.finished_ns is None:
            try:
                self.wait(timeout)
            except RuntimeError:
                self.quiesce(timeout)  # failed: slices already running may still land
            except TimeoutError:
                pass

    def _raise_if_failed(self) -> None:
        if self.error is None:
            return
        where = f"rank {self.plan.rank}: prefetch of layer {self.plan.layer} into slot {self.plan.slot} failed"
        if self.failed_peer is not None:
            raise PeerCopyError(f"{where}: copy from peer {self.failed_peer}: {self.error!r}",
                                self.failed_peer) from self.error
        raise RuntimeError(f"{where}: {self.error!r}") from self.error


class Transport(ABC):
    """Moves expert bytes from peers' segments into this rank's prefetch slots.

    Setup, in order: `alloc_segment` (fill it with local experts), `register` -> handle,
    exchange handles once through torch.distributed, `open(handles)`, barrier, `seal`.
    Per layer: `submit` a plan into a slot, the compute waits on its ticket, reads the slot, and
    calls `release_slot` once every read of the slot has been issued.

    Everything the runtime, serve, tune and the benchmarks use of a transport is declared here
    (tests/test_layout.py checks it). Implemented by: host (HostTransport, dwdp.runtime.transport.host)
    and cuda (CudaTransport, dwdp.runtime.transport.cuda); "both" below means both of them, "default"
    that the method here is the answer of a backend that does not override it. Sizes are in bytes,
    peers and ranks are indices in the DWDP group.

    The class attributes under "registry" say what dwdp.runtime.transport.registry needs to list a
    backend; `from_config` builds one.
    """

    # -- registry (dwdp.runtime.transport.registry) -------------------------------------------------
    name: str                           # the backend's name: DWDPConfig.backend, `dwdp tune --backend`, handles
    device_types: tuple[str, ...] = ()  # torch device types of the models it serves ("cpu", "cuda")
    auto_for: tuple[str, ...] = ()      # device types backend="auto" picks it for (one backend per type)
    default_slice_bytes: int            # DWDPConfig.slice_bytes when the config names none
    settles_cuda_mapping = False        # True: the group settles a CUDA peer mapping first (runtime.cuda_mapping)
    nvtx_ranges = False                 # True: DWDPModel marks layers with NVTX ranges (copies show in Nsight)

    # -- state every backend has ---------------------------------------------------------------------
    rank: int                                                # this rank's index in the DWDP group
    faulty_peers: Mapping[int, str] = MappingProxyType({})  # peer -> why copies from it fail (fault hook)
    # A dwdp.observe.tracing.TraceRecorder that DWDPModel sets while tracing: host traces each copy slice
    # on it, cuda leaves copies to NVTX / Nsight.
    recorder = None

    @classmethod
    @abstractmethod
    def from_config(cls, rank: int, config, *, device=None, mapping: str | None = None,
                    process_group=None) -> "Transport":
        """This backend's transport for `rank`, set up from a DWDPConfig `config`. device: the model's
        torch device; mapping: the peer mapping the group settled on (cuda: dwdp.runtime.cuda_mapping;
        None where `settles_cuda_mapping` is False); process_group: the DWDP group's (cuda's
        symmetric memory rendezvous). Both."""

    # -- setup, in the order DWDPModel runs it -------------------------------------------------------
    @abstractmethod
    def alloc_segment(self, nbytes: int, allocations: tuple[int, ...] | None = None) -> torch.Tensor:
        """This rank's source segment: uint8 [nbytes] that peers can read. allocations: the sizes of the
        pieces it is made of (CompositeLayout.segment_allocations); a backend that maps allocations only
        whole (cuMem) makes one allocation per piece, one that maps files at offsets may ignore it. Both."""

    @abstractmethod
    def register(self) -> dict:
        """A picklable handle peers pass to `open` ({"backend": name, "rank", "nbytes", ...}); the
        segment's fill must be complete. Both."""

    @abstractmethod
    def open(self, handles: list[dict | None]) -> None:
        """Map every peer's segment; `handles[r]` comes from rank r of the group (None: a peer lost
        before this rank joined, where `can_rejoin`). Both."""

    def fill_landed(self) -> None:
        """Block until everything written into this rank's segment so far has landed (a fill on a device
        runs asynchronously): before its board entry is published, peers may read it. Host: copies are
        synchronous, nothing to wait for."""

    @abstractmethod
    def seal(self) -> None:
        """Called once all peers opened this rank's segment: drop names that could leak. Both."""

    @property
    def can_rejoin(self) -> bool:
        """Whether a process started later can open this rank's segment (board_handle / open_peer).
        host: always; cuda: with mappings "ipc", "vmm-posix-fd", "vmm-fabric"; default: never."""
        return False

    def board_handle(self) -> dict:
        """A JSON-able handle a process started later can open (a rank rejoining the group: see
        dwdp.runtime.board); before seal. host, cuda (rejoinable mappings); default refuses."""
        raise ValueError(f"the {self.name} backend cannot be rejoined: a lost rank stays lost")

    def describe_mapping(self) -> str:
        """How this rank's segment and its peers' are mapped, for the setup's log line. host, cuda;
        default: the backend's name."""
        return self.name

    # -- composite views (dwdp.runtime.composite): backends that can map pages build them ----------
    def composite_unavailable(self) -> str | None:
        """Why this transport cannot build composite views (None when it can). host (Linux), cuda (VMM
        mappings); default: never can."""
        return f"the {self.name} backend builds no composite views"

    def granularity(self) -> int:
        """Bytes of one page of the composite views (the host's page, cuMem's granularity)."""
        raise ValueError(self.composite_unavailable() or f"the {self.name} backend has no page granularity")

    def composite_views(self, layout):
        """This rank's composite views of `layout` over its segment (alloc_segment first, with the
        layout's allocations): an object with `layer_range(layer)` (uint8 [layer_nbytes], the
        destination of the layer's composite copy plan) and `view(layer, tensor, dtype, shape)` (the
        [E, ...] tensor). Closed with the transport. host, cuda (VMM mappings)."""
        raise ValueError(self.composite_unavailable() or f"the {self.name} backend builds no composite views")

    # -- per layer -----------------------------------------------------------------------------------
    @abstractmethod
    def alloc_slot(self, nbytes: int) -> torch.Tensor:
        """A private uint8 [nbytes] prefetch buffer on this rank's device. Both."""

    @abstractmethod
    def submit(self, plan: CopyPlan, slot_buffer: torch.Tensor) -> Ticket:
        """Start copying `plan` into `slot_buffer` (contiguous uint8); returns at once with a ticket
        (host: Ticket; cuda: CudaTicket, which makes the compute stream wait instead of the host).
        Both."""

    def release_slot(self, slot: int) -> None:
        """Compute has issued its last read of prefetch slot `slot`. cuda records the slot's consume
        event here, and the next copy into the slot waits on it; host (default) reads synchronously,
        so nothing is left to order."""

    # -- lost and rejoining peers (dwdp.runtime.failover) ------------------------------------------
    def fail_copies_from(self, peer: int, reason: str = "injected fault") -> None:
        """Fault hook: from now on every copy from `peer` fails, naming it, as if its memory had
        become unreadable (a device lost). Chaos tests and `dwdp serve --fault-injection` use it. Both
        (this default: `faulty_peers`, read by the backends' copies through `_check_readable`)."""
        self.faulty_peers = MappingProxyType({**self.faulty_peers, peer: reason})

    def _check_readable(self, peer: int) -> None:
        reason = self.faulty_peers.get(peer)
        if reason is not None:
            raise PeerUnreadable(f"rank {self.rank}: memory of peer {peer} is unreadable ({reason})", peer)

    @abstractmethod
    def forget_peer(self, peer: int) -> None:
        """`peer` was lost and no plan reads it any more: drop its mapping once no copy in flight
        reads it, so its memory goes with the last survivor that read it. Both."""

    def open_peer(self, peer: int, handle: dict) -> None:
        """Map the segment of a new incarnation of the forgotten peer `peer` (it rejoined; `handle`: its
        board_handle). host, cuda (rejoinable mappings); default refuses."""
        raise ValueError(f"the {self.name} backend cannot be rejoined: a lost rank stays lost")

    def peer_segment(self, peer: int) -> torch.Tensor:
        """`peer`'s mapped segment, uint8 [nbytes] on this rank's device, never a copy (a rejoining rank
        copies its experts out of it). host, cuda; default refuses."""
        raise ValueError(f"the {self.name} backend does not expose peers' segments")

    # -- teardown ------------------------------------------------------------------------------------
    @abstractmethod
    def close(self) -> None:
        """Stop copiers and release every mapping; idempotent. Both."""
