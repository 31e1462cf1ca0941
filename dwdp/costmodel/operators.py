"""FLOPs, HBM bytes and roofline time of each operator of one layer.

Legend: T = tokens per rank per forward, H = hidden size, I = routed-expert intermediate size,
E = routed experts per MoE layer, k = experts per token, nh = query heads, nkv = key/value heads.
Token counts may be numpy arrays (one entry per rank or per iteration): every formula is elementwise.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .formats import ACT_BYTES, WeightFormat
from .hardware import Hardware
from .models import ModelSpec

LOGIT_BYTES = 4  # router logits in fp32
NORM_FLOPS_PER_ELEM = 4  # square, accumulate, scale, multiply by weight



@dataclass(frozen=True)
class OpCost:
    """One operator of one forward: FLOPs, HBM bytes, the dtype its FLOPs run at, and its time."""

    name: str
    flops: float | np.ndarray
    bytes: float | np.ndarray
    dtype: str
    time_s: float | np.ndarray = field(default=0.0)

    @classmethod
    def make(cls, name, flops, nbytes, dtype, hw: Hardware) -> "OpCost":
        time_s = np.maximum(np.asarray(flops, float) / hw.peak(dtype), np.asarray(nbytes, float) / hw.hbm_bytes_per_s)
        return cls(name, flops, nbytes, hw.flops_dtype(dtype), time_s)


def _linear(rows_cols: list[tuple[int, int]], tokens, fmt: WeightFormat):
    """FLOPs and bytes of T tokens through matrices [out, in]: weights once, each input and output once."""
    params = sum(r * c for r, c in rows_cols)
    weights = sum(fmt.matrix_bytes(r, c) for r, c in rows_cols)
    acts = sum(r + c for r, c in rows_cols)
    return 2 * tokens * params, weights + tokens * acts * ACT_BYTES


def attention_projections(spec: ModelSpec) -> list[tuple[int, int]]:
    """[out, in] of every attention projection of one layer."""
    h, nh = spec.hidden, spec.num_heads
    if spec.mla is None:
        d, nkv = spec.head_dim, spec.num_kv_heads
        return [(nh * d, h), (nkv * d, h), (nkv * d, h), (h, nh * d)]
    m = spec.mla
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    q = [(m.q_lora_rank, h), (nh * qk, m.q_lora_rank)] if m.q_lora_rank else [(nh * qk, h)]
    return q + [(m.kv_lora_rank + m.qk_rope_head_dim, h),
                (nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
                (h, nh * m.v_head_dim)]


def _norm_elems(spec: ModelSpec) -> int:
    """Elements normalised per token in one layer."""
    elems = 2 * spec.hidden
    if spec.mla is not None:
        elems += (spec.mla.q_lora_rank or 0) + spec.mla.kv_lora_rank
    if spec.qk_norm:
        elems += (spec.num_heads + spec.num_kv_heads) * spec.head_dim
    return elems


def attention_ops(spec: ModelSpec, hw: Hardware, tokens, pairs, keys_read, dense: WeightFormat) -> list[OpCost]:
    """Norms, projections and the attention core for `tokens` queries attending `pairs` causal pairs
    and reading `keys_read` K/V rows. MLA runs in its prefill form: K/V expanded per head."""
    norm_elems = _norm_elems(spec)
    norm = OpCost.make("norms", NORM_FLOPS_PER_ELEM * tokens * norm_elems,
                       tokens * norm_elems * 2 * ACT_BYTES + norm_elems * ACT_BYTES, "fp32", hw)
    flops, nbytes = _linear(attention_projections(spec), tokens, dense)
    if spec.attention_bias:
        nbytes = nbytes + sum(r for r, _ in attention_projections(spec)) * ACT_BYTES
    proj = OpCost.make("attn_proj", flops, nbytes, dense.compute, hw)
    nh = spec.num_heads
    if spec.mla is None:
        d_qk = d_v = spec.head_dim
        kv_heads = spec.num_kv_heads
    else:
        d_qk, d_v, kv_heads = spec.head_dim, spec.mla.v_head_dim, nh
    core_flops = 2 * pairs * nh * (d_qk + d_v)  # QK^T and PV; softmax left out
    core_bytes = (tokens * nh * (d_qk + d_v) + keys_read * kv_heads * (d_qk + d_v)) * ACT_BYTES
    core = OpCost.make("attn_core", core_flops, core_bytes, "bf16", hw)
    return [norm, proj, core]


def _mlp_cost(name, tokens, inter, hidden, fmt: WeightFormat, num_matrices_sets: float, hw: Hardware) -> OpCost:
    """Gated MLP [2I, H] + [H, I] over `tokens` rows; weights of `num_matrices_sets` copies read once."""
    flops = 2 * tokens * 3 * hidden * inter
    weights = num_matrices_sets * (fmt.matrix_bytes(2 * inter, hidden) + fmt.matrix_bytes(hidden, inter))
    acts = tokens * (2 * hidden + 3 * inter) * ACT_BYTES  # gate_up in/out, down in/out
    return OpCost.make(name, flops, weights + acts, fmt.compute, hw)


def expected_active(num_experts: float, total_experts: int, top_k: int, tokens):
    """Expected experts (out of `num_experts` considered) that get >= 1 of `tokens` uniformly routed tokens."""
    miss = (1.0 - top_k / total_experts) ** np.asarray(tokens, float)
    return num_experts * (1.0 - miss)


def moe_ops(spec: ModelSpec, hw: Hardware, tokens, fmt: WeightFormat, dense: WeightFormat,
            experts_held: int, routed_tokens=None, routing_tokens=None) -> list[OpCost]:
    """Router, shared experts and routed experts of one MoE layer.

    tokens: this rank's tokens (router, shared experts). experts_held: experts whose GEMMs this rank
    runs (DWDP: all E; DEP: its E/N). routed_tokens: token-expert rows it computes (default T*k).
    routing_tokens: tokens whose routing spreads over those experts (default T; DEP: all ranks' tokens).
    """
    h, e, k, i = spec.hidden, spec.num_experts, spec.top_k, spec.moe_intermediate
    routed_tokens = tokens * k if routed_tokens is None else routed_tokens
    routing_tokens = tokens if routing_tokens is None else routing_tokens
    ops = [OpCost.make("router", 2 * tokens * h * e,
                       h * e * ACT_BYTES + tokens * h * ACT_BYTES + tokens * e * LOGIT_BYTES, "bf16", hw)]
    if spec.shared_intermediate:
        ops.append(_mlp_cost("shared_experts", tokens, spec.shared_intermediate, h, dense, 1, hw))
    active = expected_active(experts_held, e, k, routing_tokens)
    gate_up, down = spec.expert_nbytes(fmt)
    flops = 2 * routed_tokens * 3 * h * i
    nbytes = active * (gate_up + down) + routed_tokens * (2 * h + 3 * i) * ACT_BYTES
    ops.append(OpCost.make("routed_experts", flops, nbytes, fmt.compute, hw))
    return ops


def dense_mlp_ops(spec: ModelSpec, hw: Hardware, tokens, dense: WeightFormat) -> list[OpCost]:
    return [_mlp_cost("dense_mlp", tokens, spec.dense_intermediate, spec.hidden, dense, 1, hw)]


# ---------------------------------------------------------------------------------------------
