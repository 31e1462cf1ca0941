"""How long the compute stream stalls in prefetch waits, measured on the device.

On CUDA a prefetch wait returns at once on the host (it only enqueues a stream wait), so host
clocks see nothing. This timer records a timing event just before and just after each enqueued
wait on the compute stream; the time between the two on the device is the stall. Opt-in for
benchmarks (`Prefetcher.wait_timer`), never on by default: each wait costs two event records.
"""
from __future__ import annotations

import torch


class DeviceWaitTimer:
    """begin() -> mark; end(mark, layer); totals read after the work finished (one host sync)."""

    def __init__(self):
        self._pairs: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []

    def begin(self) -> torch.cuda.Event:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def end(self, start: torch.cuda.Event, layer: int) -> None:
        stop = torch.cuda.Event(enable_timing=True)
        stop.record()
        self._pairs.append((layer, start, stop))

    def per_layer_ms(self) -> dict[int, float]:
        """Stall per MoE layer summed over every wait so far (waits for the last event first)."""
        if self._pairs:
            self._pairs[-1][2].synchronize()
        totals: dict[int, float] = {}
        for layer, start, stop in self._pairs:
            totals[layer] = totals.get(layer, 0.0) + start.elapsed_time(stop)
        return totals

    def total_ms(self) -> float:
        return sum(self.per_layer_ms().values())

    def reset(self) -> None:
        self._pairs.clear()
