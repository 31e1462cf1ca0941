"""The transport interface: register local segments, open peers', submit copy plans, wait on tickets."""
from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod

import torch

from ..plan import CopyPlan


class PrefetchTimeout(TimeoutError):
    """A prefetch did not finish in time; the message names the layer, slot and outstanding peers."""


class PrefetchError(RuntimeError):
    """A prefetch failed; the message names the rank, layer, slot, source peers and the cause."""


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
        self.submitted_ns = time.perf_counter_ns()
        self.finished_ns: int | None = self.submitted_ns if not plan.slices else None

    def _finish_slice(self, peer: int, expert: int) -> None:
        with self._cond:
            if self._count_landed(peer, expert):
                self._cond.notify_all()

    def _finish_slices(self, slices) -> None:
        """Every slice of `slices` (CopySlice) has landed: one lock and one wake-up for a batch."""
        with self._cond:
            completed = False
            for s in slices:
                completed |= self._count_landed(s.peer, s.expert)
            if completed:
                self._cond.notify_all()

    def _count_landed(self, peer: int, expert: int) -> bool:
        """Count one landed slice; True when it completes its expert. Holds `_cond`."""
        self._left_total -= 1
        self._left_expert[expert] -= 1
        self._left_peer[peer] -= 1
        if self._left_total == 0:
            self.finished_ns = time.perf_counter_ns()
        # Waiters wait for whole experts: waking them for a partial one only costs them.
        return self._left_expert[expert] == 0

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self.error is None:
                self.error = error
            self._cond.notify_all()

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
            except (RuntimeError, TimeoutError):
                pass

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise RuntimeError(
                f"rank {self.plan.rank}: prefetch of layer {self.plan.layer} into slot {self.plan.slot} failed: "
                f"{self.error!r}"
            ) from self.error


class Transport(ABC):
    """Moves expert bytes from peers' segments into this rank's prefetch slots.

    Setup, in order: `alloc_segment` (fill it with local experts), `register` -> handle,
    exchange handles once through torch.distributed, `open(handles)`, barrier, `seal`.
    Per layer: `submit` a plan into a slot, the compute waits on its ticket, reads the slot, and
    calls `release_slot` once every read of the slot has been issued.
    """

    name: str

    @abstractmethod
    def alloc_segment(self, nbytes: int) -> torch.Tensor:
        """This rank's source segment: uint8 [nbytes] that peers can read."""

    @abstractmethod
    def register(self) -> dict:
        """A picklable handle peers pass to `open`."""

    @abstractmethod
    def open(self, handles: list[dict]) -> None:
        """Map every peer's segment; `handles[r]` comes from rank r of the group."""

    @abstractmethod
    def seal(self) -> None:
        """Called once all peers opened this rank's segment: drop names that could leak."""

    @abstractmethod
    def alloc_slot(self, nbytes: int) -> torch.Tensor:
        """A private uint8 [nbytes] prefetch buffer."""

    @abstractmethod
    def submit(self, plan: CopyPlan, slot_buffer: torch.Tensor) -> Ticket:
        """Start copying `plan` into `slot_buffer`; returns at once."""

    def release_slot(self, slot: int) -> None:
        """Compute has issued its last read of prefetch slot `slot`. A device backend records the
        slot's consume event here, and the next copy into the slot waits on it; the host backend
        reads synchronously, so nothing is left to order."""

    @abstractmethod
    def close(self) -> None:
        """Stop copiers and release every mapping; idempotent."""
