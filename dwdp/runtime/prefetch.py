"""Prefetch slots: issue, wait and release per MoE layer.

MoE layers are visited in a cycle 0, 1, ..., M-1, 0, 1, ... across forwards; visit n uses slot
n % B. At visit n the rank issues the copies of the next B - 1 layers into the other slots (those
not already there), waits for its own slot, computes, and releases it. A copy into a slot that
compute still reads is deferred until that slot is released (the host analogue of a copy stream
waiting on the consumer's event), so a slot is never overwritten under a reader. A slot that
already holds the wanted layer is reused.

With a Failover attached (dwdp.runtime.failover), a copy that fails names its peer: the peer is declared
lost, plans are re-pointed at surviving owners, and the slot's unfinished experts are copied again
from them while the forward waits. A copy still outstanding after `peer_timeout_s` makes the rank
read its peers' liveness records. A layer routing tokens to an expert no survivor owns fails at
once (ExpertsUnavailable); nothing ever waits on a peer's process.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from dwdp.observe import phases
from dwdp.runtime.plan import CopyPlan, PlanCache
from dwdp.observe.tracing import now_us
from dwdp.runtime.transport.base import PeerCopyError, PrefetchTimeout, Ticket, Transport


@dataclass
class PrefetchStats:
    """What one rank's prefetcher did since creation (or the last `reset`)."""

    bytes_copied: int = 0
    plans_issued: int = 0
    issue_s: float = 0.0            # host seconds spent issuing plans (transport.submit)
    slot_hits: int = 0
    wait_s: float = 0.0
    waits: int = 0
    wait_s_per_layer: dict[int, float] = field(default_factory=dict)
    bytes_from_peer: dict[int, int] = field(default_factory=dict)  # bytes of issued copies per source

    def reset(self) -> None:
        self.__init__()


@dataclass
class _Slot:
    buffer: torch.Tensor
    layer: int | None = None        # layer whose bytes are (or will be) in the buffer
    ticket: Ticket | None = None    # copy in flight or finished; None while deferred
    readers: int = 0                # compute currently reading the buffer
    deferred: bool = False          # a copy waits for readers to reach 0
    routed: torch.Tensor | None = None  # [T, k] expert ids its current reader needs (failover checks)


class Prefetcher:
    def __init__(
        self,
        transport: Transport,
        plans: PlanCache,
        slot_buffers: list[torch.Tensor],
        num_layers: int,
        timeout_s: float,
        failover=None,
        slot_of_layer=None,
        buffer_of=None,
    ):
        """slot_of_layer: layer -> slot, when each layer's destination is tied to one slot (composite
        views: pool pages by layer parity); None rotates slots by visit. buffer_of: (layer, slot) ->
        the uint8 buffer a copy of that layer writes into (composite: the layer's range); None: the slot's."""
        if len(slot_buffers) < 2:
            raise ValueError(f"num_buffers={len(slot_buffers)} must be >= 2")
        self.transport, self.plans, self.num_layers, self.timeout_s = transport, plans, num_layers, timeout_s
        self.slots = [_Slot(b) for b in slot_buffers]
        self.slot_of_layer, self.buffer_of = slot_of_layer, buffer_of
        self.failover = failover  # a dwdp.runtime.failover.Failover, or None: any copy error is final
        self.stats = PrefetchStats()
        self._visit = 0
        self._in_forward = False  # between start_forward and end_forward: rejoins wait for the next
        self._cond = threading.Condition()
        self.recorder = None  # a dwdp.observe.tracing.TraceRecorder while tracing
        self.nvtx = None      # a dwdp.observe.nvtx_ranges.NvtxRanges on CUDA
        self.wait_timer = None  # a dwdp.observe.device_timing.DeviceWaitTimer while measuring device stalls
        self.closed_reason: str | None = None  # set by the model's close(): every later layer refuses with it

    @property
    def num_buffers(self) -> int:
        return len(self.slots)

    def slot_of_visit(self, visit: int, layer: int | None = None) -> int:
        """The slot of visit `visit` (of MoE layer `layer`)."""
        if self.slot_of_layer is not None and layer is not None:
            return self.slot_of_layer(layer)
        return visit % self.num_buffers

    def _buffer(self, slot_index: int) -> torch.Tensor:
        slot = self.slots[slot_index]
        return slot.buffer if self.buffer_of is None else self.buffer_of(slot.layer, slot_index)

    # -- public per-layer protocol -------------------------------------------------------------
    def start_forward(self) -> None:
        """Make sure layer 0 is on its way before the forward reaches its first MoE layer (after
        reading the peers' liveness, so a loss since the last forward is planned around)."""
        with self._cond:
            self._in_forward = True
            if self.failover is not None:
                self.failover.poll()  # a forward's start is where a rejoined peer enters the plans
                self.failover.check_device()
            if self._visit % self.num_layers != 0:
                # The previous forward stopped early: restart the cycle at the next layer 0.
                self._visit += self.num_layers - self._visit % self.num_layers
            self._issue_locked(0, self.slot_of_visit(self._visit, 0))

    def poll_peers(self):
        """Read the peers' liveness now and re-plan around any loss; returns the FailoverStatus
        (None without failover). For a thread beside the forwards, e.g. a server's health loop."""
        if self.failover is None:
            return None
        with self._cond:
            # A forward runs on one plan: a rejoin found during one is taken at the next start.
            self.failover.poll(rejoin_now=not self._in_forward)
            return self.failover.status()

    def end_forward(self) -> None:
        """The model's forward returned (one that raised is ended by the next start_forward)."""
        with self._cond:
            self._in_forward = False

    def begin(self, layer: int, routed: torch.Tensor | None = None) -> int:
        """Enter MoE layer `layer`: make sure its copy is issued, issue the next layer's copy into
        the next slot, and hold this layer's slot for reading. Returns the slot index.

        routed: [T, k] expert ids of this layer's tokens; with failover, a layer that needs an
        expert no surviving rank owns raises ExpertsUnavailable here, before holding anything."""
        if self.closed_reason is not None:
            raise RuntimeError(self.closed_reason)
        if self.failover is not None:
            self.failover.check_routed(layer, routed)
        with self._cond:
            if self._visit % self.num_layers != layer:
                self._visit += (layer - self._visit) % self.num_layers
            slot_index = self.slot_of_visit(self._visit, layer)
            slot = self.slots[slot_index]
            self._issue_locked(layer, slot_index)
            # A copy deferred behind an earlier reader of this slot starts when that reader releases.
            started = self._cond.wait_for(lambda: slot.ticket is not None, timeout=self.timeout_s)
            if not started:
                raise PrefetchTimeout(
                    f"prefetch of layer {layer} into slot {slot_index} never started within "
                    f"{self.timeout_s:.3g} s: compute still holds that slot ({slot.readers} reader(s))"
                )
            slot.readers += 1
            slot.routed = routed
            self._visit += 1
            # Prefetch depth is B - 1 layers: every other slot is filled ahead of its use.
            for ahead in range(self.num_buffers - 1):
                target_layer = (layer + 1 + ahead) % self.num_layers
                target = self.slot_of_visit(self._visit + ahead, target_layer)
                if target == slot_index:
                    # Slots tied to layers (M not a multiple of B): the next layer's pages are the
                    # ones being read; its copy is issued when that layer begins.
                    continue
                if not self._issue_locked(target_layer, target) and ahead == 0:
                    self.stats.slot_hits += 1
        return slot_index

    def landed(self, layer: int, slot_index: int) -> bool:
        """Whether every copy of `layer` into `slot_index` has landed; never blocks. A failed copy
        has not landed: the `wait` that follows re-plans and retries it, or raises."""
        try:
            return self._ticket(layer, slot_index).done()
        except PeerCopyError:
            if self.failover is None:
                raise
            return False

    def landed_prefix(self, layer: int, slot_index: int, experts) -> int:
        """How many of `experts`, in order, have landed in `slot_index` before the first that has
        not; never blocks (a failed copy: none, as in `landed`)."""
        try:
            return self._ticket(layer, slot_index).landed_prefix(experts)
        except PeerCopyError:
            if self.failover is None:
                raise
            return 0

    def wait(self, layer: int, slot_index: int, experts=None) -> float:
        """Block until `layer`'s experts (all, or just `experts`) have landed in `slot_index`;
        returns the seconds waited."""
        self._ticket(layer, slot_index)  # the slot must hold this layer
        # Measured around the whole call: waking up and getting the interpreter back after the
        # copies land is part of what this rank waited, and the trace reports the same span.
        start = now_us()
        if self.nvtx is not None:
            self.nvtx.push(phases.PREFETCH_WAIT, layer, slot_index)
        mark = self.wait_timer.begin() if self.wait_timer is not None else None
        try:
            self._wait_landed(layer, slot_index, experts)
            if mark is not None:
                self.wait_timer.end(mark, layer)
        finally:
            if self.nvtx is not None:
                self.nvtx.pop()
        end = now_us()
        waited = (end - start) / 1e6
        if self.recorder is not None:
            self.recorder.complete(phases.PREFETCH_WAIT, start, end, layer=layer, slot=slot_index,
                                   iteration=self.recorder.iteration)
        with self._cond:
            self.stats.wait_s += waited
            self.stats.waits += 1
            self.stats.wait_s_per_layer[layer] = self.stats.wait_s_per_layer.get(layer, 0.0) + waited
        return waited

    def _wait_landed(self, layer: int, slot_index: int, experts) -> None:
        """The ticket wait, in steps of peer_timeout_s under failover: a failed copy re-plans and
        retries, a copy outstanding past the bound has its peers' liveness read."""
        slot = self.slots[slot_index]
        deadline = time.monotonic() + self.timeout_s
        retries = 0
        while True:
            ticket = slot.ticket
            left = max(0.0, deadline - time.monotonic())
            step = left if self.failover is None else min(left, self.failover.peer_timeout_s)
            try:
                if experts is None:
                    ticket.wait(step)
                else:
                    ticket.wait_experts(experts, step)
                return
            except PeerCopyError as exc:
                # Each retry loses a new peer or drops a stale slice: more than G means a copy
                # fails whatever its source (a bad plan), and retrying would never end.
                failover = self.failover
                if failover is None or exc.peer == failover.rank or retries > failover.placement.group_size:
                    raise
                retries += 1
                self._retry(slot_index, failover.copy_failed(exc.peer, exc), experts)
            except PrefetchTimeout:
                if self.failover is None or time.monotonic() >= deadline:
                    raise
                gone = self.failover.exited_among(ticket.outstanding_peers())
                if gone:
                    self._retry(slot_index, gone, experts)

    def _retry(self, slot_index: int, lost: dict[int, str], experts) -> None:
        """Declare `lost` (rank -> reason), re-plan, and copy the slot's unfinished experts again
        from their new sources; raises ExpertsUnavailable when the reader needs one that is gone."""
        slot = self.slots[slot_index]
        with self._cond:
            self.failover.declare_lost(lost)
            old = slot.ticket
            old.cancel(f"sources {sorted(lost)} lost")
            old.quiesce(self.timeout_s)  # no late slice of the old copy may land over the retry
            unfinished = set(old.missing_experts())
            plan = self.plans.get(slot.layer, slot_index)
            retry = CopyPlan(plan.rank, plan.layer, plan.slot, tuple(s for s in plan.slices if s.expert in unfinished))
            slot.ticket = self.transport.submit(retry, self._buffer(slot_index))
            self._count_issued(retry)
            self.failover.retried_slices += len(retry.slices)
        needed = slot.routed if experts is None else torch.tensor(list(experts), dtype=torch.long)
        self.failover.check_routed(slot.layer, needed)

    def release(self, slot_index: int) -> None:
        """Compute no longer reads `slot_index`; a deferred copy into it may start."""
        slot = self.slots[slot_index]
        ticket = slot.ticket
        if ticket is not None and slot.readers == 1:
            # A reader that stopped early (an exception) must not let a new copy race the old one.
            ticket.fence_before_reuse(self.timeout_s)
        with self._cond:
            if slot.readers <= 0:
                raise RuntimeError(f"release of slot {slot_index} that no compute holds")
            slot.readers -= 1
            if slot.readers == 0:
                slot.routed = None
                # Every read of this slot is issued: a device copy into it must wait for them.
                self.transport.release_slot(slot_index)
            if slot.readers == 0 and slot.deferred:
                self._submit_locked(slot_index)
            self._cond.notify_all()

    def drain(self) -> None:
        """Wait for every copy in flight; deferred copies are dropped."""
        with self._cond:
            tickets = [s.ticket for s in self.slots if s.ticket is not None]
            for s in self.slots:
                if s.deferred:
                    s.deferred, s.layer = False, None
        for ticket in tickets:
            try:
                ticket.synchronize(self.timeout_s)
            except RuntimeError:
                pass  # a failed copy was already reported to the compute that waited on it

    # -- internals -----------------------------------------------------------------------------
    def _ticket(self, layer: int, slot_index: int) -> Ticket:
        slot = self.slots[slot_index]
        if slot.layer != layer or slot.ticket is None:
            raise RuntimeError(f"slot {slot_index} holds layer {slot.layer}, not layer {layer}: begin({layer}) first")
        return slot.ticket

    def _issue_locked(self, layer: int, slot_index: int) -> bool:
        """Start (or defer) the copy of `layer` into the slot; False when it is already there."""
        slot = self.slots[slot_index]
        if slot.layer == layer and (slot.deferred or (slot.ticket is not None and slot.ticket.error is None)):
            return False
        slot.layer, slot.ticket = layer, None
        if slot.readers > 0:
            slot.deferred = True
        else:
            self._submit_locked(slot_index)
        return True

    def _submit_locked(self, slot_index: int) -> None:
        slot = self.slots[slot_index]
        plan = self.plans.get(slot.layer, slot_index)
        slot.deferred = False
        start = now_us()
        if self.nvtx is not None:
            self.nvtx.push(phases.PREFETCH_ISSUE, slot.layer, slot_index)
        try:
            slot.ticket = self.transport.submit(plan, self._buffer(slot_index))
        finally:
            if self.nvtx is not None:
                self.nvtx.pop()
        end = now_us()
        self.stats.issue_s += (end - start) / 1e6
        if self.recorder is not None:
            self.recorder.complete(phases.PREFETCH_ISSUE, start, end, layer=slot.layer, slot=slot_index,
                                   iteration=self.recorder.iteration)
        self._count_issued(plan)
        self.stats.plans_issued += 1
        self._cond.notify_all()

    def _count_issued(self, plan: CopyPlan) -> None:
        self.stats.bytes_copied += plan.nbytes
        for peer, nbytes in plan.bytes_per_peer:  # per peer, not per slice: a submit's cost stays flat
            self.stats.bytes_from_peer[peer] = self.stats.bytes_from_peer.get(peer, 0) + nbytes
