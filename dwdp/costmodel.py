"""Roofline cost model of one forward of an MoE model on one rank, and what DWDP and DEP pay for it.

Legend: T = tokens per rank per forward, H = hidden size, I = routed-expert intermediate size,
E = routed experts per MoE layer, k = experts per token, N = group size, L = local experts per rank,
nh = query heads, nkv = key/value heads, P = causal (query, key) pairs attended in one forward.
Units: FLOPs, bytes, seconds.

Every operator costs max(FLOPs / peak_flops(dtype), bytes / HBM bandwidth). Token counts may be
numpy arrays (one entry per rank or per iteration): every formula is elementwise.

What DWDP and DEP pay per MoE layer (DESIGN.md 1.4):
    DWDP: the prefetch of layer j is issued when MoE j-1 starts, so it overlaps the window
          w_j = MoE_{j-1} + everything up to the MoE of layer j; exposed_j = max(0, T_prefetch - w_j).
    DEP:  T_compute + T_all2all (dispatch + combine), no prefetch; waiting under imbalance is the
          simulator's job (dwdp.simulate).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

import numpy as np

ACT_BYTES = 2  # activations, KV and router weights in bf16
LOGIT_BYTES = 4  # router logits in fp32
NORM_FLOPS_PER_ELEM = 4  # square, accumulate, scale, multiply by weight


# ---------------------------------------------------------------------------------------------
# Hardware
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    """Per-GPU peaks. peak_flops[dtype] in FLOP/s (None = no tensor-core support), bandwidths in B/s."""

    name: str
    peak_flops: dict
    hbm_bytes_per_s: float
    hbm_bytes: float
    link_bytes_per_s: float  # NVLink, per direction per GPU
    domain_size: int

    def flops_dtype(self, dtype: str) -> str:
        """The dtype a GEMM of `dtype` weights runs at: the narrowest supported one at least as wide."""
        chain = ("fp4", "fp8", "bf16")
        if dtype == "fp32":
            return dtype
        for candidate in chain[chain.index(dtype):]:
            if self.peak_flops.get(candidate) is not None:
                return candidate
        raise ValueError(f"{self.name} has no tensor-core peak for {dtype} or any wider dtype")

    def peak(self, dtype: str) -> float:
        return self.peak_flops[self.flops_dtype(dtype)]


def _data(name: str) -> dict:
    return json.loads(resources.files("dwdp").joinpath("data", name).read_text())


def hardware_names() -> tuple[str, ...]:
    return tuple(k for k in _data("hardware.json") if not k.startswith("_"))


@lru_cache(maxsize=None)
def load_hardware(name: str) -> Hardware:
    """A hardware preset from dwdp/data/hardware.json (values there carry their sources)."""
    data = _data("hardware.json")
    if name not in data or name.startswith("_"):
        raise ValueError(f"unknown hardware {name!r}; presets: {hardware_names()}")
    entry = data[name]
    peaks = {k: (None if v["value"] is None else v["value"] * 1e12) for k, v in entry["peak_tflops"].items()}
    return Hardware(
        name=name,
        peak_flops=peaks,
        hbm_bytes_per_s=entry["hbm_tb_s"]["value"] * 1e12,
        hbm_bytes=entry["hbm_gb"]["value"] * 1e9,
        link_bytes_per_s=entry["nvlink_gb_s"]["value"] * 1e9,
        domain_size=entry["gpus_per_nvlink_domain"]["value"],
    )


# ---------------------------------------------------------------------------------------------
# Weight formats
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WeightFormat:
    """How one weight matrix [rows, cols] (cols = reduction dim) is stored.

    bits: bits per value; block: (rows, cols) covered by one scale (None = unscaled);
    scale_bytes: bytes per block scale; tensor_scale_bytes: per-matrix global scale;
    compute: tensor-core dtype its GEMMs run at.
    """

    name: str
    bits: int
    block: tuple[int, int] | None
    scale_bytes: int
    tensor_scale_bytes: int
    compute: str

    def matrix_bytes(self, rows: int, cols: int) -> int:
        nbytes = rows * cols * self.bits // 8
        if self.block is not None:
            nbytes += math.ceil(rows / self.block[0]) * math.ceil(cols / self.block[1]) * self.scale_bytes
        return nbytes + self.tensor_scale_bytes


FORMATS = {
    "bf16": WeightFormat("bf16", 16, None, 0, 0, "bf16"),
    # DeepSeek-V3/R1 checkpoint layout: one fp32 scale per 128x128 block.
    "fp8": WeightFormat("fp8", 8, (128, 128), 4, 0, "fp8"),
    # NVFP4: e2m1 values, one fp8 (e4m3) scale per 16 values along K, one fp32 scale per tensor.
    "nvfp4": WeightFormat("nvfp4", 4, (1, 16), 1, 4, "fp4"),
}


def weight_format(name: str) -> WeightFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown weight dtype {name!r}; expected one of {tuple(FORMATS)}")
    return FORMATS[name]


# ---------------------------------------------------------------------------------------------
# Model description
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention sizes (DeepSeek); q_lora_rank None = plain q projection."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class ModelSpec:
    """The fields of a model the cost model needs. is_moe[l] / window[l] per layer (window None = full)."""

    name: str
    hidden: int
    vocab: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    is_moe: tuple[bool, ...]
    window: tuple[int | None, ...]
    num_experts: int
    top_k: int
    moe_intermediate: int
    shared_intermediate: int  # total over shared experts; 0 = none
    dense_intermediate: int
    mla: MLA | None = None
    attention_bias: bool = False
    qk_norm: bool = False
    expert_bias: bool = False

    @property
    def num_layers(self) -> int:
        return len(self.is_moe)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe)

    def expert_nbytes(self, fmt: WeightFormat) -> tuple[int, int]:
        """Bytes of one routed expert's (gate_up [2I, H], down [H, I]), biases included."""
        h, i = self.hidden, self.moe_intermediate
        gate_up, down = fmt.matrix_bytes(2 * i, h), fmt.matrix_bytes(h, i)
        if self.expert_bias:
            gate_up, down = gate_up + 2 * i * ACT_BYTES, down + h * ACT_BYTES
        return gate_up, down

    @classmethod
    def from_config(cls, config, name: str | None = None) -> "ModelSpec":
        """Read a transformers config (DeepSeek-V3, Qwen3-MoE, gpt-oss, Mixtral families and alike)."""
        get = lambda *keys, default=None: next(  # noqa: E731
            (getattr(config, k) for k in keys if getattr(config, k, None) is not None), default)
        num_layers = config.num_hidden_layers
        hidden, heads = config.hidden_size, config.num_attention_heads
        num_experts = get("n_routed_experts", "num_local_experts", "num_experts")
        if num_experts is None:
            raise ValueError(f"{type(config).__name__} has no routed-expert count: not an MoE config")
        moe_inter = get("moe_intermediate_size", "intermediate_size")
        dense_inter = get("intermediate_size", default=moe_inter)
        first_dense = get("first_k_dense_replace", default=0)
        sparse_step = get("decoder_sparse_step", "moe_layer_freq", default=1)
        mlp_only = set(get("mlp_only_layers", default=[]) or [])
        is_moe = tuple(
            l >= first_dense and l not in mlp_only and (l + 1) % sparse_step == 0 for l in range(num_layers)
        )
        shared = get("n_shared_experts", default=0) * moe_inter + get("shared_expert_intermediate_size", default=0)
        sliding = get("sliding_window")
        layer_types = get("layer_types")
        if layer_types is not None:
            window = tuple(sliding if t == "sliding_attention" else None for t in layer_types)
        elif sliding is not None and get("use_sliding_window", default=True):
            window = (sliding,) * num_layers
        else:
            window = (None,) * num_layers
        mla = None
        if get("kv_lora_rank") is not None:
            mla = MLA(get("q_lora_rank"), config.kv_lora_rank, config.qk_nope_head_dim,
                      config.qk_rope_head_dim, config.v_head_dim)
        model_type = getattr(config, "model_type", "")
        return cls(
            name=name or model_type,
            hidden=hidden,
            vocab=config.vocab_size,
            num_heads=heads,
            num_kv_heads=get("num_key_value_heads", default=heads),
            head_dim=get("head_dim", default=hidden // heads) if mla is None else mla.qk_nope_head_dim + mla.qk_rope_head_dim,
            is_moe=is_moe,
            window=window,
            num_experts=num_experts,
            top_k=config.num_experts_per_tok,
            moe_intermediate=moe_inter,
            shared_intermediate=shared,
            dense_intermediate=dense_inter,
            mla=mla,
            attention_bias=bool(get("attention_bias", default=False)),
            # Qwen3 normalises q and k per head; the config carries no flag for it.
            qk_norm=model_type.startswith("qwen3"),
            expert_bias=model_type == "gpt_oss",
        )


def model_names() -> tuple[str, ...]:
    return tuple(k for k in _data("models.json") if not k.startswith("_"))


def preset_config(name: str):
    """A transformers config object for a preset, built offline from dwdp/data/models.json."""
    from transformers import AutoConfig

    data = _data("models.json")
    if name not in data or name.startswith("_"):
        raise ValueError(f"unknown model preset {name!r}; presets: {model_names()}")
    return AutoConfig.for_model(data[name]["model_type"], **data[name]["config"])


def preset_source(name: str) -> str:
    return _data("models.json")[name]["source"]


@lru_cache(maxsize=None)
def load_model(name: str) -> ModelSpec:
    return ModelSpec.from_config(preset_config(name), name=name)


# ---------------------------------------------------------------------------------------------
# Workload and deployment
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """What one rank's forward carries.

    isl: prompt length. max_num_tokens: token budget per forward.
    batch: prompts per rank; None = a saturated context server whose every forward is filled to
        max_num_tokens with prefill chunks of isl-token prompts. With a batch, its batch * isl tokens
        run in ceil(batch * isl / max_num_tokens) chunked forwards and the outputs are per-forward means.
    """

    isl: int
    max_num_tokens: int = 8192
    batch: int | None = None

    def __post_init__(self):
        for name in ("isl", "max_num_tokens") + (("batch",) if self.batch is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")

    @property
    def chunks_per_prompt(self) -> int:
        return math.ceil(self.isl / self.max_num_tokens)

    @property
    def tokens(self) -> float:
        """T: tokens per forward."""
        if self.batch is None:
            return float(self.max_num_tokens)
        total = self.batch * self.isl
        return total / math.ceil(total / self.max_num_tokens)

    def pairs_per_token(self, window: int | None) -> float:
        """Mean keys each query attends to (causal, optionally sliding)."""
        return causal_pairs(self.isl, window) / self.isl

    def keys_read_per_token(self, window: int | None) -> float:
        """Mean K/V rows read per new token: every chunk reads its visible context once."""
        chunk = min(self.isl, self.max_num_tokens)
        total = 0
        for start in range(0, self.isl, chunk):
            end = min(self.isl, start + chunk)
            total += end if window is None else min(end, (end - start) + window)
        return total / self.isl


def causal_pairs(seq_len, window: int | None = None):
    """(query, key) pairs of causal attention over seq_len tokens; a sliding window caps keys per query."""
    s = np.asarray(seq_len, dtype=np.float64)
    full = s * (s + 1) / 2
    if window is None:
        return full
    w = float(window)
    return np.where(s <= w, full, w * (w + 1) / 2 + (s - w) * w)


@dataclass(frozen=True)
class Deployment:
    """How the model is spread. weight_dtype applies to every linear layer but the router;
    dense_dtype overrides it for attention, dense MLP and shared experts (None = same)."""

    group_size: int
    num_local_experts: int | None = None
    weight_dtype: str = "nvfp4"
    dense_dtype: str | None = None
    a2a_bytes_per_elem: int = ACT_BYTES  # DEP dispatch / combine payload
    num_buffers: int = 2

    def local_experts(self, num_experts: int) -> int:
        low = math.ceil(num_experts / self.group_size)
        n = low if self.num_local_experts is None else self.num_local_experts
        if not low <= n <= num_experts:
            raise ValueError(f"num_local_experts={n} must be in [{low}, {num_experts}] for group_size={self.group_size}")
        return n

    def __post_init__(self):
        if self.group_size < 1:
            raise ValueError(f"group_size={self.group_size} must be >= 1")
        weight_format(self.weight_dtype)
        if self.dense_dtype is not None:
            weight_format(self.dense_dtype)


# ---------------------------------------------------------------------------------------------
# Operators
# ---------------------------------------------------------------------------------------------
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
# One forward: per-layer costs, prefetch, all-to-all, DWDP vs DEP
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerCost:
    """Operator costs of layer `index` on one rank. mlp: DWDP rank (all E experts' weights read);
    mlp_dep: DEP rank (its E/N experts, fed with T*k rows gathered from all ranks)."""

    index: int
    is_moe: bool
    attn: tuple[OpCost, ...]
    mlp: tuple[OpCost, ...]
    mlp_dep: tuple[OpCost, ...]

    @property
    def attn_s(self):
        return sum(op.time_s for op in self.attn)

    @property
    def mlp_s(self):
        return sum(op.time_s for op in self.mlp)

    @property
    def mlp_dep_s(self):
        return sum(op.time_s for op in self.mlp_dep)

    def ops(self) -> tuple[OpCost, ...]:
        return self.attn + self.mlp


def formats(deploy: Deployment) -> tuple[WeightFormat, WeightFormat]:
    """(expert format, dense format) of a deployment."""
    fmt = weight_format(deploy.weight_dtype)
    return fmt, weight_format(deploy.dense_dtype or deploy.weight_dtype)


def layer_costs(spec: ModelSpec, hw: Hardware, workload: Workload, deploy: Deployment, tokens=None) -> list[LayerCost]:
    """Costs of every layer for one forward. tokens overrides the workload's T (an array gives one
    cost per entry; prompts keep the workload's isl, so attention per token is unchanged)."""
    fmt, dense = formats(deploy)
    t = workload.tokens if tokens is None else np.asarray(tokens, float)
    n = deploy.group_size
    dep_held = math.ceil(spec.num_experts / n)
    cache: dict = {}
    out = []
    for index, (moe, window) in enumerate(zip(spec.is_moe, spec.window)):
        key = (moe, window)
        if key not in cache:
            attn = attention_ops(spec, hw, t, t * workload.pairs_per_token(window),
                                 t * workload.keys_read_per_token(window), dense)
            if moe:
                mlp = moe_ops(spec, hw, t, fmt, dense, spec.num_experts)
                # Balanced routing: every DEP rank computes T*k rows drawn from all N ranks' tokens.
                mlp_dep = moe_ops(spec, hw, t, fmt, dense, dep_held, routing_tokens=t * n)
            else:
                mlp = mlp_dep = dense_mlp_ops(spec, hw, t, dense)
            cache[key] = (tuple(attn), tuple(mlp), tuple(mlp_dep))
        attn, mlp, mlp_dep = cache[key]
        out.append(LayerCost(index, moe, attn, mlp, mlp_dep))
    return out


def remote_bytes_per_layer(spec: ModelSpec, deploy: Deployment) -> int:
    """Bytes one DWDP rank pulls per MoE layer: its E - L missing experts."""
    fmt, _ = formats(deploy)
    missing = spec.num_experts - deploy.local_experts(spec.num_experts)
    return missing * sum(spec.expert_nbytes(fmt))


def prefetch_time(spec: ModelSpec, hw: Hardware, deploy: Deployment) -> float:
    """Uncontended T_prefetch: remote bytes over the rank's inbound link."""
    return remote_bytes_per_layer(spec, deploy) / hw.link_bytes_per_s


def remote_ranks_per_token(num_experts: int, group_size: int, top_k: int) -> float:
    """Expected number of other DEP ranks one token is sent to (DeepEP sends a token once per rank),
    experts split into contiguous near-equal ranges, top-k drawn uniformly without replacement."""
    if group_size == 1:
        return 0.0
    sizes = [(r + 1) * num_experts // group_size - r * num_experts // group_size for r in range(group_size)]
    total = math.comb(num_experts, top_k)
    p_hit = [1.0 - math.comb(num_experts - m, top_k) / total for m in sizes]
    return (group_size - 1) / group_size * sum(p_hit)


def all2all_bytes(spec: ModelSpec, deploy: Deployment, tokens):
    """Bytes one DEP rank sends (= receives, balanced) per MoE layer: dispatch + combine."""
    per_direction = tokens * remote_ranks_per_token(spec.num_experts, deploy.group_size, spec.top_k) \
        * spec.hidden * deploy.a2a_bytes_per_elem
    return 2 * per_direction


def prefetch_windows(attn_s, mlp_s, is_moe) -> list:
    """Compute window hiding each MoE layer's prefetch: from the start of the previous MoE layer's
    experts to the start of this one's (wrapping to the previous forward for the first MoE layer)."""
    moe_layers = [l for l, m in enumerate(is_moe) if m]
    windows = []
    for j, layer in enumerate(moe_layers):
        prev = moe_layers[j - 1]
        span = list(range(prev, layer)) if prev < layer else list(range(prev, len(is_moe))) + list(range(0, layer))
        w = mlp_s[prev] + attn_s[layer]
        for l in span[1:]:
            w = w + attn_s[l] + mlp_s[l]
        windows.append(w)
    return windows


def dwdp_forward_time(attn_s, mlp_s, is_moe, t_prefetch):
    """One DWDP forward: all compute plus, per MoE layer, the prefetch its window does not hide."""
    compute = sum(a + m for a, m in zip(attn_s, mlp_s))
    exposed = sum(np.maximum(0.0, t_prefetch - w) for w in prefetch_windows(attn_s, mlp_s, is_moe))
    return compute + exposed


@dataclass(frozen=True)
class Prediction:
    """One rank, one forward, no imbalance, no contention. Per-layer figures are means over MoE layers."""

    model: str
    hardware: str
    weight_dtype: str
    expert_compute_dtype: str
    group_size: int
    num_local_experts: int
    isl: int
    max_num_tokens: int
    tokens: float
    layers: tuple[LayerCost, ...]
    remote_bytes_per_layer: int
    t_compute: float  # s, attention + MoE of one MoE layer on a DWDP rank
    t_compute_dep: float
    t_prefetch: float
    t_all2all: float
    a2a_bytes_per_layer: float
    dwdp_forward_s: float
    dep_forward_s: float
    dwdp_weight_bytes: float
    dep_weight_bytes: float
    hbm_bytes: float

    @property
    def ratio(self) -> float:
        """Compute / prefetch: >= 1 means the prefetch hides behind compute."""
        return self.t_compute / self.t_prefetch if self.t_prefetch > 0 else math.inf

    @property
    def speedup(self) -> float:
        return self.dep_forward_s / self.dwdp_forward_s

    @property
    def dwdp_fits(self) -> bool:
        return self.dwdp_weight_bytes <= self.hbm_bytes

    def row(self) -> dict:
        return {
            "isl": self.isl, "max_num_tokens": self.max_num_tokens, "tokens": self.tokens,
            "t_compute_ms": 1e3 * self.t_compute, "t_compute_dep_ms": 1e3 * self.t_compute_dep,
            "t_prefetch_ms": 1e3 * self.t_prefetch, "t_all2all_ms": 1e3 * self.t_all2all,
            "remote_gb_per_layer": self.remote_bytes_per_layer / 1e9, "ratio": self.ratio,
            "dwdp_forward_ms": 1e3 * self.dwdp_forward_s, "dep_forward_ms": 1e3 * self.dep_forward_s,
            "speedup": self.speedup, "dwdp_weight_gb": self.dwdp_weight_bytes / 1e9,
            "dep_weight_gb": self.dep_weight_bytes / 1e9, "dwdp_fits": self.dwdp_fits,
        }


def replicated_weight_bytes(spec: ModelSpec, deploy: Deployment) -> int:
    """Weights every rank keeps in both DWDP and DEP: embeddings, attention, norms, router, shared
    experts, dense MLPs."""
    _, dense = formats(deploy)
    h = spec.hidden
    total = 2 * spec.vocab * h * ACT_BYTES  # embedding + LM head
    attn = sum(dense.matrix_bytes(r, c) for r, c in attention_projections(spec)) + _norm_elems(spec) * ACT_BYTES
    for moe in spec.is_moe:
        total += attn
        if moe:
            total += h * spec.num_experts * ACT_BYTES
            if spec.shared_intermediate:
                s = spec.shared_intermediate
                total += dense.matrix_bytes(2 * s, h) + dense.matrix_bytes(h, s)
        else:
            d = spec.dense_intermediate
            total += dense.matrix_bytes(2 * d, h) + dense.matrix_bytes(h, d)
    return total


def predict(spec: ModelSpec, hw: Hardware, workload: Workload, deploy: Deployment) -> Prediction:
    """Roofline prediction of one forward on one rank for DWDP and DEP at the same group size."""
    fmt, _ = formats(deploy)
    layers = layer_costs(spec, hw, workload, deploy)
    attn = [float(l.attn_s) for l in layers]
    mlp = [float(l.mlp_s) for l in layers]
    mlp_dep = [float(l.mlp_dep_s) for l in layers]
    moe = [l.is_moe for l in layers]
    num_moe = max(1, sum(moe))
    t_prefetch = prefetch_time(spec, hw, deploy)
    a2a_bytes = float(all2all_bytes(spec, deploy, workload.tokens))
    t_a2a = a2a_bytes / hw.link_bytes_per_s
    local = deploy.local_experts(spec.num_experts)
    per_expert = sum(spec.expert_nbytes(fmt))
    replicated = replicated_weight_bytes(spec, deploy)
    return Prediction(
        model=spec.name, hardware=hw.name, weight_dtype=fmt.name, expert_compute_dtype=hw.flops_dtype(fmt.compute),
        group_size=deploy.group_size, num_local_experts=local, isl=workload.isl,
        max_num_tokens=workload.max_num_tokens, tokens=workload.tokens, layers=tuple(layers),
        remote_bytes_per_layer=remote_bytes_per_layer(spec, deploy),
        t_compute=sum(a + m for a, m, x in zip(attn, mlp, moe) if x) / num_moe,
        t_compute_dep=sum(a + m for a, m, x in zip(attn, mlp_dep, moe) if x) / num_moe,
        t_prefetch=t_prefetch, t_all2all=t_a2a, a2a_bytes_per_layer=a2a_bytes,
        dwdp_forward_s=float(dwdp_forward_time(attn, mlp, moe, t_prefetch)),
        dep_forward_s=sum(attn) + sum(mlp_dep) + t_a2a * sum(moe),
        dwdp_weight_bytes=replicated + spec.num_moe_layers * local * per_expert
        + deploy.num_buffers * remote_bytes_per_layer(spec, deploy),
        dep_weight_bytes=replicated + spec.num_moe_layers * math.ceil(spec.num_experts / deploy.group_size) * per_expert,
        hbm_bytes=hw.hbm_bytes,
    )


def crossover_isl(spec: ModelSpec, hw: Hardware, deploy: Deployment, max_num_tokens: int = 8192,
                  batch: int | None = None, low: int = 1, high: int = 1 << 20) -> int | None:
    """Smallest ISL at which every MoE layer's prefetch hides behind its window (bisection; the
    exposed time falls monotonically with ISL). None if not hidden even at `high`."""
    def hidden(isl: int) -> bool:
        w = Workload(isl, max_num_tokens, batch)
        layers = layer_costs(spec, hw, w, deploy)
        windows = prefetch_windows([float(l.attn_s) for l in layers], [float(l.mlp_s) for l in layers],
                                   [l.is_moe for l in layers])
        return min(windows) >= prefetch_time(spec, hw, deploy)

    if not hidden(high):
        return None
    if hidden(low):
        return low
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if hidden(mid) else (mid, high)
    return high
