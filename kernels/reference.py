"""Plain-PyTorch references of every kernel; the CPU runtime uses them and tests compare against them.

Legend: R = rows an experts call computes (token-expert pairs, sorted by expert), K = input
features, N = output features, N1 = output features of the first projection, I = expert intermediate
size, E = experts in the weight table, T = tokens, k = experts per token, H = hidden.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from dwdp.kernels.block_scales import BlockQuant, dequantize, dequantize_rows, quantize_rows_fp8
from dwdp.kernels.grouped_gemm import SWIGLU, Epilogue


def grouped_gemm_reference(
    x_sorted: torch.Tensor,
    expert_offsets: torch.Tensor | Sequence[int],
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor] | None = None,
    *,
    weight_scales: Sequence[torch.Tensor] | None = None,
    quant: BlockQuant | None = None,
    fp8_activations: bool = False,
) -> torch.Tensor:
    """out[rows of e] = x_sorted[rows of e] @ weights[e].T (+ biases[e]) for each expert e.

    x_sorted: [R, K], rows grouped by expert in table order.
    expert_offsets: [E + 1] row offsets (offsets[0] = 0, offsets[E] = R), tensor or ints.
    weights: E views [N, K], each wherever its expert lives (local parameter or a prefetch
        buffer); they are read in place, never concatenated. A transposed view ([K, N] storage) is fine.
        Quantized (with `weight_scales` and `quant`): each view as stored (fp8 [N, K], MXFP4 blocks
        [N, K / 32, 16]); an expert's weight is dequantized to x's dtype only when it has rows, one
        expert at a time, and dropped before the next.
    biases: optional E views [N], one per expert.
    weight_scales: E views of block scales (kernels.block_scales), with `quant`.
    fp8_activations: fp8 weights times activations quantized to fp8 per row and block of K columns
        (quantize_rows_fp8, group = the weights' block columns), as the kernel's fp8 dots see them;
        products and sums in fp32.
    Returns [R, N] in x_sorted's dtype.
    """
    offsets = expert_offsets.tolist() if isinstance(expert_offsets, torch.Tensor) else list(expert_offsets)
    if len(offsets) != len(weights) + 1:
        raise ValueError(f"expert_offsets has {len(offsets)} entries, expected len(weights) + 1 = {len(weights) + 1}")
    if offsets[0] != 0 or offsets[-1] != x_sorted.shape[0]:
        raise ValueError(f"expert_offsets must run from 0 to R={x_sorted.shape[0]}, got {offsets[0]}..{offsets[-1]}")
    if not weights:
        raise ValueError("weights is empty: expected one [N, K] view per expert")
    if biases is not None and len(biases) != len(weights):
        raise ValueError(f"biases has {len(biases)} entries, expected one per expert ({len(weights)})")
    if (weight_scales is None) != (quant is None):
        raise ValueError("weight_scales and quant go together: both for quantized weights, neither for dense ones")
    if weight_scales is not None and len(weight_scales) != len(weights):
        raise ValueError(f"weight_scales has {len(weight_scales)} entries, expected one per expert ({len(weights)})")
    n = weights[0].shape[0]
    out = x_sorted.new_empty(x_sorted.shape[0], n)  # [R, N]
    x, compute = x_sorted, x_sorted.dtype
    if fp8_activations:
        if quant is None or quant.format != "fp8":
            raise ValueError(f"fp8_activations needs fp8 weights with block scales, got quant={quant}")
        group = quant.block[1]
        x, compute = dequantize_rows(*quantize_rows_fp8(x_sorted, group), group), torch.float32  # [R, K]
    for e in range(len(weights)):
        lo, hi = offsets[e], offsets[e + 1]
        if hi < lo:
            raise ValueError(f"expert_offsets decreases at expert {e}: {lo} > {hi}")
        if hi > lo:
            w = weights[e]
            if quant is not None:
                w = dequantize(w, weight_scales[e], quant, compute)  # [N, K], this expert only
            b = None if biases is None else biases[e].to(compute)
            out[lo:hi] = F.linear(x[lo:hi], w, b)
    return out


def swiglu_reference(gate_up_out: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for a [R, 2I] tensor in transformers' [gate; up] layout; returns [R, I]."""
    gate, up = gate_up_out.chunk(2, dim=-1)  # [R, I] each
    return F.silu(gate) * up


def _activation(x: torch.Tensor, name: str, alpha: float) -> torch.Tensor:
    if name == "silu":
        return x * torch.sigmoid(alpha * x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "relu2":
        return torch.relu(x).square()
    return x


def epilogue_reference(h: torch.Tensor, epilogue: Epilogue) -> torch.Tensor:
    """What the kernel's epilogue does to the first GEMM's output h [R, N1]: [R, N1 / 2] gated, else [R, N1]."""
    if not epilogue.gated:
        return _activation(h, epilogue.activation, epilogue.alpha)
    gate, up = (h[..., 0::2], h[..., 1::2]) if epilogue.interleaved else h.chunk(2, dim=-1)  # [R, I] each
    if epilogue.limit != float("inf"):
        gate = gate.clamp(max=epilogue.limit)
        up = up.clamp(min=-epilogue.limit, max=epilogue.limit)
    return _activation(gate, epilogue.activation, epilogue.alpha) * (up + epilogue.up_offset)


def moe_experts_reference(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: Sequence[torch.Tensor],
    down: Sequence[torch.Tensor],
    *,
    first_bias: Sequence[torch.Tensor] | None = None,
    down_bias: Sequence[torch.Tensor] | None = None,
    epilogue: Epilogue = SWIGLU,
    first_scales: Sequence[torch.Tensor] | None = None,
    down_scales: Sequence[torch.Tensor] | None = None,
    first_quant: BlockQuant | None = None,
    down_quant: BlockQuant | None = None,
    fp8_activations: bool = False,
) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * down_e(gate(gate_up_e x_t + b1_e)) + b2_e) with e = top_k_index[t, j].

    Same semantics as transformers' experts functions: every expert's math in hidden's dtype,
    the routing weight applied to the expert output, the k contributions of a token summed
    over a [T, k, H] buffer (fp32 accumulation inside the sum, one rounding).
    hidden: [T, H]; top_k_index: [T, k] integer expert ids in [0, E); top_k_weights: [T, k].
    gate_up: E views [2I, H] (gate and up halves, or interleaved rows; [I, H] when the epilogue is
    not gated); down: E views [H, I]; either may be a transposed view. first_bias: E views [2I];
    down_bias: E views [H]. epilogue: the gate (default silu(gate) * up).
    first_scales / down_scales with first_quant / down_quant: quantized weights (as stored) and their
    block scales, each expert dequantized to hidden's dtype when it has tokens. fp8_activations: both
    GEMMs as fp8 x fp8 dots (grouped_gemm_reference), h rounded to hidden's dtype in between, as the
    kernel stores it.
    Returns [T, H] in hidden's dtype.
    """
    if len(gate_up) != len(down):
        raise ValueError(f"gate_up has {len(gate_up)} experts but down has {len(down)}")
    num_tokens, hidden_dim = hidden.shape
    top_k = top_k_index.shape[1]
    per_slot = hidden.new_zeros(num_tokens, top_k, hidden_dim)  # [T, k, H]
    for e in range(len(gate_up)):
        token_idx, pos = torch.where(top_k_index == e)  # [n_e] each
        if token_idx.numel() == 0:
            continue
        b1 = None if first_bias is None else first_bias[e]
        b2 = None if down_bias is None else down_bias[e]
        if fp8_activations:
            rows = [0, token_idx.numel()]
            # fp32 in and out: the kernel's epilogue and routing weight act on its fp32 accumulators.
            h = grouped_gemm_reference(hidden[token_idx].float(), rows, [gate_up[e]], None if b1 is None else [b1],
                                       weight_scales=[first_scales[e]], quant=first_quant, fp8_activations=True)
            h = epilogue_reference(h, epilogue).to(hidden.dtype)  # [n_e, I] as the kernel stores it
            y = grouped_gemm_reference(h.float(), rows, [down[e]], None if b2 is None else [b2],
                                       weight_scales=[down_scales[e]], quant=down_quant, fp8_activations=True)
        else:
            w1, w2 = gate_up[e], down[e]
            if first_scales is not None:
                w1 = dequantize(w1, first_scales[e], first_quant, hidden.dtype)  # [2I, H], this expert only
            if down_scales is not None:
                w2 = dequantize(w2, down_scales[e], down_quant, hidden.dtype)    # [H, I]
            h = epilogue_reference(F.linear(hidden[token_idx], w1, b1), epilogue)  # [n_e, I]
            y = F.linear(h, w2, b2)  # [n_e, H]
        per_slot[token_idx, pos] = (y * top_k_weights[token_idx, pos, None].to(y.dtype)).to(per_slot.dtype)
    return per_slot.sum(dim=1)
