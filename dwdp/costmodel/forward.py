"""One forward on one rank: per-layer costs, prefetch, all-to-all, and DWDP vs DEP.

What DWDP and DEP pay per MoE layer (DESIGN.md 1.4):
    DWDP: the prefetch of layer j is issued when MoE j-1 starts, so it overlaps the window
          w_j = MoE_{j-1} + everything up to the MoE of layer j; exposed_j = max(0, T_prefetch - w_j).
    DEP:  T_compute + T_all2all (dispatch + combine), no prefetch; waiting under imbalance is the
          simulator's job (dwdp.simulate).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .deployment import Deployment, Workload, formats
from .formats import ACT_BYTES
from .hardware import Hardware
from .models import ModelSpec
from .operators import OpCost, _norm_elems, attention_ops, attention_projections, dense_mlp_ops, moe_ops


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
