"""Experts math shared by DWDP and the baselines: sort token-expert pairs by expert, run each expert on its
contiguous rows, weight and sum the k contributions of every token.

Legend: T = tokens, k = experts per token, S = T * k token-expert pairs, R = rows an experts call
computes, H = hidden, I = expert intermediate size, E = experts.

The arithmetic is the one of dwdp's experts function (the grouped GEMM reference over per-expert
weight views, the module's own gate, the weighted sum in the routing weights' dtype), so DWDP, DEP
and replicated do the same FLOPs the same way and differ only in how rows meet their experts.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .kernels.reference import grouped_gemm_reference


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """top_k_index [T, k] expert ids -> (perm [S]: pair order sorted by expert, counts [E] int64).

    Pair p = t * k + j is token t's j-th expert; `perm` is stable, so rows of one expert keep
    token order.
    """
    flat = top_k_index.reshape(-1)                          # [S]
    _, perm = torch.sort(flat, stable=True)                 # [S]
    counts = torch.bincount(flat, minlength=num_experts)    # [E]
    return perm, counts


def expert_mlp(
    module: torch.nn.Module,
    x_sorted: torch.Tensor,
    rows_per_expert: Sequence[int],
    gate_up: Sequence[torch.Tensor],
    down: Sequence[torch.Tensor],
) -> torch.Tensor:
    """down_e(gate(gate_up_e x)) for the rows of each expert.

    x_sorted [R, H]: rows grouped by expert in the order of `gate_up` / `down`;
    rows_per_expert: one count per expert (sum R); gate_up: views [2I, H]; down: views [H, I].
    Returns [R, H] in x_sorted's dtype.
    """
    if x_sorted.shape[0] == 0:
        return x_sorted.new_empty(0, down[0].shape[0])  # [0, H]
    offsets = [0]
    for n in rows_per_expert:
        offsets.append(offsets[-1] + int(n))
    h = grouped_gemm_reference(x_sorted, offsets, gate_up)   # [R, 2I]
    h = module._apply_gate(h)                                # [R, I]
    return grouped_gemm_reference(h, offsets, down)          # [R, H]


def combine(
    y_sorted: torch.Tensor, perm: torch.Tensor, top_k_weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """y_sorted [S, H] in `perm` order, top_k_weights [T, k] -> [T, H] in `dtype`.

    Routing weights keep their own dtype (often fp32), so the weighted sum is not rounded to bf16.
    """
    num_tokens, top_k = top_k_weights.shape
    hidden = y_sorted.shape[-1]
    weighted = y_sorted * top_k_weights.reshape(-1)[perm].unsqueeze(-1)   # [S, H]
    out = torch.empty_like(weighted)                                       # [S, H] in pair order
    out[perm] = weighted
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(dtype)
