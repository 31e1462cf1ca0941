"""Experts math shared by DWDP and the baselines: sort token-expert pairs by expert, run each expert on its
contiguous rows, weight and sum the k contributions of every token.

Legend: T = tokens, k = experts per token, S = T * k token-expert pairs, R = rows an experts call
computes, H = hidden, I = expert intermediate size, E = experts.

The arithmetic is the one of dwdp's experts function (the grouped GEMM reference over per-expert
weight views, biases, the module's own gate, its post-expert norm, the weighted sum in the routing
weights' dtype), so DWDP, DEP and replicated do the same FLOPs the same way and differ only in how
rows meet their experts.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from dwdp.models.expert_tensors import ExpertsMath
from dwdp.kernels.reference import grouped_gemm_reference


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
    math: ExpertsMath,
    x_sorted: torch.Tensor,
    rows_per_expert: Sequence[int],
    views: Mapping[str, Sequence[torch.Tensor]],
) -> torch.Tensor:
    """Each expert's MLP on its rows, from the expert's named tensors, as `math` says.

    x_sorted [R, H]: rows grouped by expert in the order of the views; rows_per_expert: one count per
    expert (sum R); views: tensor name -> one view per expert (weights [out, in], or [in, out] when
    transposed; biases [out]; a quantized weight as stored, next to its scales), each read where it
    lives; a quantized weight is dequantized one expert at a time, when that expert has rows. Returns [R, H] in x_sorted's dtype.
    """
    down = views[math.down]
    if x_sorted.shape[0] == 0:
        out_features = down[0].shape[1 if math.down in math.transposed else 0]
        return x_sorted.new_empty(0, out_features)  # [0, H]
    offsets = [0]
    for n in rows_per_expert:
        offsets.append(offsets[-1] + int(n))

    def linear(x: torch.Tensor, weight: str, bias: str | None) -> torch.Tensor:
        ws = views[weight]
        b = None if bias is None else views[bias]
        quantized = math.quantization(weight)
        if quantized is not None:  # dequantized one expert at a time, on use
            return grouped_gemm_reference(x, offsets, ws, b, weight_scales=views[quantized.scale],
                                          quant=quantized.quant)
        if weight in math.transposed:
            ws = [w.t() for w in ws]  # [in, out] storage read as an [out, in] view, never copied
        return grouped_gemm_reference(x, offsets, ws, b)

    parts = [linear(x_sorted, w, b) for w, b in zip(math.first, math.first_bias)]  # [R, N1_j] each
    h = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)                   # [R, N1]
    y = linear(math.gate(h), math.down, math.down_bias)                             # [R, H]
    return y if math.post_norm is None else math.post_norm(y)


def plain_routing_layers(layers: list, who: str) -> list:
    """`layers` (dwdp.models.adapters.ExpertsLayer) when every one routes plainly: ids in [0, E), weights on
    the output. The baselines sort pairs by expert id and weight outputs; ValueError otherwise."""
    for layer in layers:
        math = layer.spec.math
        if math.num_identity_experts or math.weights_on_input:
            what = "identity experts" if math.num_identity_experts else "routing weights on the input"
            raise ValueError(f"{who} does not handle {layer.name} ({type(layer.module).__name__}): it has {what}")
    return layers


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
