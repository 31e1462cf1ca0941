"""Plain-PyTorch references of every kernel; the CPU runtime uses them and tests compare against them.

Legend: T = rows (token-expert pairs) sorted by expert, K = input features, N = output features,
E = experts in the weight table.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F


def grouped_gemm_reference(
    x_sorted: torch.Tensor,
    expert_offsets: torch.Tensor | Sequence[int],
    weights: Sequence[torch.Tensor],
) -> torch.Tensor:
    """out[rows of e] = x_sorted[rows of e] @ weights[e].T for each expert e.

    x_sorted: [T, K], rows grouped by expert in table order.
    expert_offsets: [E + 1] row offsets (offsets[0] = 0, offsets[E] = T), tensor or ints.
    weights: E views [N, K], each wherever its expert lives (local parameter or a prefetch
        buffer); they are read in place, never concatenated.
    Returns [T, N] in x_sorted's dtype.
    """
    offsets = expert_offsets.tolist() if isinstance(expert_offsets, torch.Tensor) else list(expert_offsets)
    if len(offsets) != len(weights) + 1:
        raise ValueError(f"expert_offsets has {len(offsets)} entries, expected len(weights) + 1 = {len(weights) + 1}")
    if offsets[0] != 0 or offsets[-1] != x_sorted.shape[0]:
        raise ValueError(f"expert_offsets must run from 0 to T={x_sorted.shape[0]}, got {offsets[0]}..{offsets[-1]}")
    if not weights:
        raise ValueError("weights is empty: expected one [N, K] view per expert")
    n = weights[0].shape[0]
    out = x_sorted.new_empty(x_sorted.shape[0], n)  # [T, N]
    for e, w in enumerate(weights):
        lo, hi = offsets[e], offsets[e + 1]
        if hi < lo:
            raise ValueError(f"expert_offsets decreases at expert {e}: {lo} > {hi}")
        if hi > lo:
            out[lo:hi] = F.linear(x_sorted[lo:hi], w)
    return out
