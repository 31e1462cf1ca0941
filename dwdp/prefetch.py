"""Prefetch slots: issue, wait and release per MoE layer.

MoE layers are visited in a cycle 0, 1, ..., M-1, 0, 1, ... across forwards; visit n uses slot
n % B. At visit n the rank issues the copies of the next B - 1 layers into the other slots (those
not already there), waits for its own slot, computes, and releases it. A copy into a slot that
compute still reads is deferred until that slot is released (the host analogue of a copy stream
waiting on the consumer's event), so a slot is never overwritten under a reader. A slot that
already holds the wanted layer is reused.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from . import phases
from .plan import PlanCache
from .tracing import now_us
from .transport.base import PrefetchTimeout, Ticket, Transport


@dataclass
class PrefetchStats:
    """What one rank's prefetcher did since creation (or the last `reset`)."""

    bytes_copied: int = 0
    plans_issued: int = 0
    slot_hits: int = 0
    wait_s: float = 0.0
    waits: int = 0
    wait_s_per_layer: dict[int, float] = field(default_factory=dict)

    def reset(self) -> None:
        self.__init__()


@dataclass
class _Slot:
    buffer: torch.Tensor
    layer: int | None = None        # layer whose bytes are (or will be) in the buffer
    ticket: Ticket | None = None    # copy in flight or finished; None while deferred
    readers: int = 0                # compute currently reading the buffer
    deferred: bool = False          # a copy waits for readers to reach 0


class Prefetcher:
    def __init__(
        self,
        transport: Transport,
        plans: PlanCache,
        slot_buffers: list[torch.Tensor],
        num_layers: int,
        timeout_s: float,
    ):
        if len(slot_buffers) < 2:
            raise ValueError(f"num_buffers={len(slot_buffers)} must be >= 2")
        self.transport, self.plans, self.num_layers, self.timeout_s = transport, plans, num_layers, timeout_s
        self.slots = [_Slot(b) for b in slot_buffers]
        self.stats = PrefetchStats()
        self._visit = 0
        self._cond = threading.Condition()
        self.recorder = None  # a dwdp.tracing.TraceRecorder while tracing
        self.nvtx = None      # a dwdp.nvtx_ranges.NvtxRanges on CUDA
        self.wait_timer = None  # a dwdp.device_timing.DeviceWaitTimer while measuring device stalls

    @property
    def num_buffers(self) -> int:
        return len(self.slots)

    def slot_of_visit(self, visit: int) -> int:
        return visit % self.num_buffers

    # -- public per-layer protocol -------------------------------------------------------------
    def start_forward(self) -> None:
        """Make sure layer 0 is on its way before the forward reaches its first MoE layer."""
        with self._cond:
            if self._visit % self.num_layers != 0:
                # The previous forward stopped early: restart the cycle at the next layer 0.
                self._visit += self.num_layers - self._visit % self.num_layers
            self._issue_locked(0, self.slot_of_visit(self._visit))

    def begin(self, layer: int) -> int:
        """Enter MoE layer `layer`: make sure its copy is issued, issue the next layer's copy into
        the next slot, and hold this layer's slot for reading. Returns the slot index."""
        with self._cond:
            if self._visit % self.num_layers != layer:
                self._visit += (layer - self._visit) % self.num_layers
            slot_index = self.slot_of_visit(self._visit)
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
            self._visit += 1
            # Prefetch depth is B - 1 layers: every other slot is filled ahead of its use.
            for ahead in range(self.num_buffers - 1):
                target = self.slot_of_visit(self._visit + ahead)
                if not self._issue_locked((layer + 1 + ahead) % self.num_layers, target) and ahead == 0:
                    self.stats.slot_hits += 1
        return slot_index

    def landed(self, layer: int, slot_index: int) -> bool:
        """Whether every copy of `layer` into `slot_index` has landed; never blocks."""
        return self._ticket(layer, slot_index).done()

    def landed_prefix(self, layer: int, slot_index: int, experts) -> int:
        """How many of `experts`, in order, have landed in `slot_index` before the first that has
        not; never blocks."""
        return self._ticket(layer, slot_index).landed_prefix(experts)

    def wait(self, layer: int, slot_index: int, experts=None) -> float:
        """Block until `layer`'s experts (all, or just `experts`) have landed in `slot_index`;
        returns the seconds waited."""
        ticket = self._ticket(layer, slot_index)
        # Measured around the whole call: waking up and getting the interpreter back after the
        # copies land is part of what this rank waited, and the trace reports the same span.
        start = now_us()
        if self.nvtx is not None:
            self.nvtx.push(phases.PREFETCH_WAIT, layer, slot_index)
        mark = self.wait_timer.begin() if self.wait_timer is not None else None
        try:
            if experts is None:
                ticket.wait(self.timeout_s)
            else:
                ticket.wait_experts(experts, self.timeout_s)
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
            slot.ticket = self.transport.submit(plan, slot.buffer)
        finally:
            if self.nvtx is not None:
                self.nvtx.pop()
        if self.recorder is not None:
            self.recorder.complete(phases.PREFETCH_ISSUE, start, now_us(), layer=slot.layer, slot=slot_index,
                                   iteration=self.recorder.iteration)
        self.stats.bytes_copied += plan.nbytes
        self.stats.plans_issued += 1
        self._cond.notify_all()
