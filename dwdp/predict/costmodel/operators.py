"""FLOPs, HBM bytes and time of every operator of one layer, in execution order.

Legend: T = tokens per rank per forward, H = hidden size, I = expert intermediate size (routed
experts), E = experts (routed) per MoE layer, k = experts per token, Hq = query heads (`nh` in the
code), Hkv = key / value heads (`nkv`), D = head dim (`d`), Ab = bytes of one activation element
(ACT_BYTES), q = bytes of one activation element quantized for a GEMM (values + scales).
Token counts may be numpy arrays (one entry per rank or per iteration): every formula is elementwise.

Every operator belongs to one of the paper's kernel categories (Attention, GroupedGEMM, DenseGEMM,
Others) and costs max(FLOPs / (peak(dtype) * efficiency), bytes / (HBM bandwidth * memory efficiency)),
the efficiencies coming from a Calibration (IDEAL = the plain roofline). "Others" are the
memory-bound passes between GEMMs: residual add + RMSNorm, activation quantization, RoPE and K/V
assembly, SwiGLU, the permute of rows to experts and the weighted finalize.

Order inside a layer (what the DWDP timeline and the DEP barriers rely on):
    attention side: input_norm, quantize_attn_in, qkv_proj, latent_norms (MLA), attn_prep,
                    attn_core, quantize_attn_out, o_proj
    MoE side:       post_norm, router, quantize_moe_in, shared_experts, shared_act,
                    | permute, routed_experts, expert_act |, finalize
DEP dispatches before `permute` and combines after `expert_act`; DWDP needs the prefetched weights
at `routed_experts` and releases the buffer when the block ends (after `finalize`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dwdp.predict.costmodel.calibration import ATTENTION, DENSE_GEMM, GROUPED_GEMM, IDEAL, OTHERS, Calibration
from dwdp.predict.costmodel.formats import ACT_BYTES, WeightFormat
from dwdp.predict.costmodel.hardware import Hardware
from dwdp.predict.costmodel.models import ModelSpec

LOGIT_BYTES = 4  # router logits in fp32
NORM_FLOPS_PER_ELEM = 4  # square, accumulate, scale, multiply by weight
DISPATCH_BEFORE, COMBINE_AFTER, WEIGHTS_NEEDED_BY = "permute", "expert_act", "routed_experts"


@dataclass(frozen=True)
class OpCost:
    """One operator of one forward: FLOPs, HBM bytes, the dtype its FLOPs run at, its time, and
    whether its FLOP term dominates (compute-bound: slowed by clock drops, not by HBM sharing)."""

    name: str
    category: str
    flops: float | np.ndarray
    bytes: float | np.ndarray
    dtype: str
    time_s: float | np.ndarray
    compute_bound: bool | np.ndarray

    @classmethod
    def make(cls, name, category, flops, nbytes, dtype, hw: Hardware, cal: Calibration = IDEAL) -> "OpCost":
        efficiency = 1.0 if category == OTHERS else cal.compute_efficiency(category)
        compute = np.asarray(flops, float) / (hw.peak(dtype) * efficiency)
        memory = np.asarray(nbytes, float) / (hw.hbm_bytes_per_s * cal.memory)
        return cls(name, category, flops, nbytes, hw.flops_dtype(dtype), np.maximum(compute, memory), compute >= memory)


def _memory_op(name, flops, nbytes, hw, cal) -> OpCost:
    return OpCost.make(name, OTHERS, flops, nbytes, "fp32", hw, cal)


def _add_norm(name, tokens, hidden, hw, cal) -> OpCost:
    """Residual add + RMSNorm: read x and the residual, write both [T, H]; the norm weight once."""
    return _memory_op(name, NORM_FLOPS_PER_ELEM * tokens * hidden, tokens * hidden * 4 * ACT_BYTES + hidden * ACT_BYTES,
                      hw, cal)


def _quantize(name, elements, fmt: WeightFormat, hw, cal) -> list[OpCost]:
    """Read bf16, write `fmt`'s activation layout; nothing when the GEMM takes bf16 directly."""
    if not fmt.quantizes_activations:
        return []
    return [_memory_op(name, 0.0, elements * (ACT_BYTES + fmt.act_bytes), hw, cal)]


def _linear(rows_cols: list[tuple[int, int]], tokens, fmt: WeightFormat):
    """FLOPs and bytes of T tokens through matrices [out, in]: weights once, each input and output once."""
    params = sum(r * c for r, c in rows_cols)
    weights = sum(fmt.matrix_bytes(r, c) for r, c in rows_cols)
    acts = sum(r + c for r, c in rows_cols)
    return 2 * tokens * params, weights + tokens * acts * ACT_BYTES


def attention_projections(spec: ModelSpec) -> list[tuple[int, int]]:
    """[out, in] of every attention projection of one layer, the output projection last."""
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


def norm_elems(spec: ModelSpec) -> int:
    """Elements normalised per token in one layer (their norm weights are replicated parameters)."""
    elems = 2 * spec.hidden + _latent_elems(spec)
    if spec.qk_norm:
        elems += (spec.num_heads + spec.num_kv_heads) * spec.head_dim
    return elems


def _latent_elems(spec: ModelSpec) -> int:
    return 0 if spec.mla is None else (spec.mla.q_lora_rank or 0) + spec.mla.kv_lora_rank


def _prep_elems(spec: ModelSpec) -> int:
    """Elements per token read + written between the projections and the attention kernel.
    MLA (prefill form): read q, the expanded k_nope|v and k_pe; write Q, K (k_pe broadcast over
    heads, RoPE applied) and V; write the latent KV cache row. Others: read q, k, v; write q, k
    after RoPE (and QK-norm) and the K/V cache rows."""
    nh, nkv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    if spec.mla is None:
        return (nh + 2 * nkv) * d + (nh + nkv) * d + 2 * nkv * d
    m = spec.mla
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    read = nh * qk + nh * (m.qk_nope_head_dim + m.v_head_dim) + m.qk_rope_head_dim
    written = 2 * nh * qk + nh * m.v_head_dim + m.kv_lora_rank + m.qk_rope_head_dim
    return read + written


def attention_ops(spec: ModelSpec, hw: Hardware, tokens, pairs, keys_read, dense: WeightFormat,
                  cal: Calibration = IDEAL) -> list[OpCost]:
    """The attention side of one layer for `tokens` queries attending `pairs` causal pairs and reading
    `keys_read` K/V rows. MLA runs in its prefill form: K/V expanded per head."""
    h, nh = spec.hidden, spec.num_heads
    ops = [_add_norm("input_norm", tokens, h, hw, cal)]
    ops += _quantize("quantize_attn_in", tokens * h, dense, hw, cal)
    projections = attention_projections(spec)
    flops, nbytes = _linear(projections[:-1], tokens, dense)
    if spec.attention_bias:
        nbytes = nbytes + sum(r for r, _ in projections) * ACT_BYTES
    ops.append(OpCost.make("qkv_proj", DENSE_GEMM, flops, nbytes, dense.compute, hw, cal))
    latent = _latent_elems(spec)
    if latent:
        ops.append(_memory_op("latent_norms", NORM_FLOPS_PER_ELEM * tokens * latent,
                              tokens * latent * 2 * ACT_BYTES + latent * ACT_BYTES, hw, cal))
    qk_norm = (nh + spec.num_kv_heads) * spec.head_dim if spec.qk_norm else 0
    ops.append(_memory_op("attn_prep", NORM_FLOPS_PER_ELEM * tokens * qk_norm,
                          tokens * (_prep_elems(spec) + 2 * qk_norm) * ACT_BYTES, hw, cal))
    if spec.mla is None:
        d_qk = d_v = spec.head_dim
        kv_heads = spec.num_kv_heads
    else:
        d_qk, d_v, kv_heads = spec.head_dim, spec.mla.v_head_dim, nh
    core_flops = 2 * pairs * nh * (d_qk + d_v)  # QK^T and PV; softmax left out
    core_bytes = (tokens * nh * (d_qk + d_v) + keys_read * kv_heads * (d_qk + d_v)) * ACT_BYTES
    ops.append(OpCost.make("attn_core", ATTENTION, core_flops, core_bytes, "bf16", hw, cal))
    ops += _quantize("quantize_attn_out", tokens * projections[-1][1], dense, hw, cal)
    flops, nbytes = _linear(projections[-1:], tokens, dense)
    ops.append(OpCost.make("o_proj", DENSE_GEMM, flops, nbytes, dense.compute, hw, cal))
    return ops


def _mlp_ops(name, tokens, inter, hidden, fmt: WeightFormat, hw: Hardware, cal: Calibration) -> list[OpCost]:
    """Gated MLP [2I, H] + [H, I] over `tokens` rows as one GEMM op, then its SwiGLU pass
    (read the [T, 2I] gate|up output, write the [T, I] down input in `fmt`'s activation layout)."""
    flops = 2 * tokens * 3 * hidden * inter
    weights = fmt.matrix_bytes(2 * inter, hidden) + fmt.matrix_bytes(hidden, inter)
    acts = tokens * (2 * hidden + 3 * inter) * ACT_BYTES  # gate_up in/out, down in/out
    act_pass = tokens * inter * (2 * ACT_BYTES + min(fmt.act_bytes, ACT_BYTES))
    return [OpCost.make(name, DENSE_GEMM, flops, weights + acts, fmt.compute, hw, cal),
            _memory_op(name + "_act", 0.0, act_pass, hw, cal)]


def expected_active(num_experts: float, total_experts: int, top_k: int, tokens):
    """Expected experts (out of `num_experts` considered) that get >= 1 of `tokens` uniformly routed tokens."""
    miss = (1.0 - top_k / total_experts) ** np.asarray(tokens, float)
    return num_experts * (1.0 - miss)


def moe_ops(spec: ModelSpec, hw: Hardware, tokens, fmt: WeightFormat, dense: WeightFormat,
            experts_held: int, routed_tokens=None, routing_tokens=None, cal: Calibration = IDEAL) -> list[OpCost]:
    """The MoE side of one layer: norm, router, shared experts, routed experts and their passes.

    tokens: this rank's tokens (router, shared experts). experts_held: experts whose GEMMs this rank
    runs (DWDP: all E; DEP: its E/G). routed_tokens: token-expert rows it computes (default T*k).
    routing_tokens: tokens whose routing spreads over those experts (default T; DEP: all ranks' tokens).
    """
    h, e, k, i = spec.hidden, spec.num_experts, spec.top_k, spec.moe_intermediate
    rows = tokens * k if routed_tokens is None else routed_tokens
    routing_tokens = tokens if routing_tokens is None else routing_tokens
    ops = [_add_norm("post_norm", tokens, h, hw, cal),
           OpCost.make("router", DENSE_GEMM, 2 * tokens * h * e,
                       h * e * ACT_BYTES + tokens * h * ACT_BYTES + tokens * e * LOGIT_BYTES, "bf16", hw, cal)]
    ops += _quantize("quantize_moe_in", tokens * h, fmt, hw, cal)
    if spec.shared_intermediate:
        ops += _mlp_ops("shared_experts", tokens, spec.shared_intermediate, h, dense, hw, cal)
    # Rows to experts: read and write k quantized rows per token.
    ops.append(_memory_op("permute", 0.0, rows * h * min(fmt.act_bytes, ACT_BYTES) * 2, hw, cal))
    active = expected_active(experts_held, e, k, routing_tokens)
    gate_up, down = spec.expert_nbytes(fmt)
    nbytes = active * (gate_up + down) + rows * (2 * h + 3 * i) * ACT_BYTES
    ops.append(OpCost.make("routed_experts", GROUPED_GEMM, 2 * rows * 3 * h * i, nbytes, fmt.compute, hw, cal))
    ops.append(_memory_op("expert_act", 0.0, rows * i * (2 * ACT_BYTES + min(fmt.act_bytes, ACT_BYTES)), hw, cal))
    # Weighted sum of the k rows of each token plus the shared experts' output.
    ops.append(_memory_op("finalize", 0.0, rows * h * ACT_BYTES + 2 * tokens * h * ACT_BYTES, hw, cal))
    return ops


def dense_mlp_ops(spec: ModelSpec, hw: Hardware, tokens, dense: WeightFormat, cal: Calibration = IDEAL) -> list[OpCost]:
    """The MLP side of a dense layer: norm, quantization, the MLP GEMMs and their SwiGLU pass."""
    ops = [_add_norm("post_norm", tokens, spec.hidden, hw, cal)]
    ops += _quantize("quantize_mlp_in", tokens * spec.hidden, dense, hw, cal)
    return ops + _mlp_ops("dense_mlp", tokens, spec.dense_intermediate, spec.hidden, dense, hw, cal)
