"""One DWDP rank's forward in time: compute stream and copy engine side by side.

Legend: M = MoE layers, B = prefetch slots (buffers), X = shape of the token arrays (scalar, [F] or [F, G]).
Times in seconds; every quantity is elementwise over X.

Schedule (what the reference implementation and dwdp.runtime.prefetch both do): MoE layer j reads buffer
j % B; the copy of layer j into that buffer is issued when MoE layer j - B releases it (at the end
of its MoE block) and runs once the copy engine has finished the copies queued before it; MoE layer
j waits for it before its grouped GEMM. The first B layers of a forward are copied during the
previous forward: the walk runs the forward twice (identical token counts) and reports the second.

While the copy engine is busy, every operator runs slower by the factor of its class
(dwdp.predict.costmodel.interference): compute-bound ones by `slowdown.compute`, memory-bound ones by
`slowdown.memory`. An operator during which the copies end runs slow for the overlapped part only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dwdp.predict.costmodel.calibration import GROUPED_GEMM, KERNEL_CATEGORIES
from dwdp.predict.costmodel.interference import NONE, CopySlowdown
from dwdp.predict.costmodel.operators import WEIGHTS_NEEDED_BY, OpCost


@dataclass(frozen=True)
class RankTimeline:
    """One forward of one DWDP rank. category_s[c]: compute-stream time of kernel category c;
    merge_s: D2D merge copies; wait_s: exposed prefetch waits; copy_s: copy-engine busy time;
    overlapped_s[c]: part of category c's time that ran beside copies. All [X]."""

    category_s: dict
    merge_s: np.ndarray
    wait_s: np.ndarray
    copy_s: np.ndarray
    overlapped_s: dict

    @property
    def total_s(self) -> np.ndarray:
        return sum(self.category_s.values()) + self.merge_s + self.wait_s


def _run(base, compute_bound, busy_left, slowdown: CopySlowdown):
    """Duration of an operator of `base` seconds starting with the copy engine busy for `busy_left`
    more seconds, and the part of it that overlapped the copies."""
    factor = np.where(compute_bound, slowdown.compute, slowdown.memory)
    slow = base * factor
    within = slow <= busy_left
    duration = np.where(within, slow, busy_left + base - busy_left / factor)
    return duration, np.where(within, slow, busy_left)


def dwdp_timeline(layers: list[list[OpCost]], is_moe: list[bool], copy_s, slowdown: CopySlowdown,
                  merge: OpCost | None = None, num_buffers: int = 2) -> RankTimeline:
    """Walk one rank's forward. layers[l]: operators of layer l in execution order; copy_s: duration
    of one MoE layer's prefetch (scalar or [X]); merge: the D2D copy run before each grouped GEMM
    (None = the experts are read where they lie)."""
    num_moe = sum(is_moe)
    if num_buffers < 2:
        raise ValueError(f"num_buffers={num_buffers} must be >= 2")
    buffers = min(num_buffers, max(num_moe, 1))
    shape = np.asarray(copy_s).shape
    for ops in layers:
        for op in ops:
            shape = np.broadcast_shapes(shape, np.shape(op.time_s))
    zero = np.zeros(shape)
    now, busy_end = zero.copy(), zero.copy()
    ready: dict[int, np.ndarray] = {}

    def issue(j):
        nonlocal busy_end
        busy_end = np.maximum(now, busy_end) + copy_s
        ready[j] = busy_end

    for j in range(min(buffers, num_moe)):
        issue(j)
    for _ in range(2):  # accumulators restart each pass: what is left describes the second
        spent = {c: zero.copy() for c in KERNEL_CATEGORIES}
        overlapped = {c: zero.copy() for c in KERNEL_CATEGORIES}
        merge_s, wait_s = zero.copy(), zero.copy()
        j = 0
        for ops, moe in zip(layers, is_moe):
            for op in ops:
                if moe and op.name == WEIGHTS_NEEDED_BY:
                    wait = np.maximum(0.0, ready[j] - now)
                    now, wait_s = now + wait, wait_s + wait
                    if merge is not None:
                        duration, _ = _run(merge.time_s, merge.compute_bound, np.maximum(0.0, busy_end - now), slowdown)
                        now, merge_s = now + duration, merge_s + duration
                duration, during = _run(op.time_s, op.compute_bound, np.maximum(0.0, busy_end - now), slowdown)
                now = now + duration
                spent[op.category] = spent[op.category] + duration
                overlapped[op.category] = overlapped[op.category] + during
            if moe:
                # The block is over: its buffer takes the copy of MoE layer j + B (next forward's if past the end).
                issue((j + buffers) % num_moe)
                j += 1
    copy_total = zero + num_moe * np.asarray(copy_s, float)
    return RankTimeline(spent, merge_s, wait_s, copy_total, overlapped)


def uniform_layers_wait(layer_s: float, copy_s: float, num_moe_layers: int, num_buffers: int = 2,
                        slowdown: CopySlowdown | None = None) -> float:
    """Mean prefetch wait per MoE layer when every layer is one MoE layer of `layer_s` seconds of
    compute (all of it counted before the grouped GEMM: the narrowest window) and each prefetch lasts
    `copy_s`: what `dwdp tune` asks of a measured layer and a measured copy rate."""
    if num_moe_layers < 1:
        raise ValueError(f"num_moe_layers={num_moe_layers} must be >= 1")
    layer = [OpCost(WEIGHTS_NEEDED_BY, GROUPED_GEMM, 0.0, 0.0, "fp32", float(layer_s), True)]
    timeline = dwdp_timeline([layer] * num_moe_layers, [True] * num_moe_layers, float(copy_s), slowdown or NONE,
                             None, num_buffers)
    return float(timeline.wait_s) / num_moe_layers
