"""One forward on one rank: per-layer operators, prefetch, all-to-all, and DWDP vs DEP.

Legend: T = tokens per rank per forward, E = experts (routed) per MoE layer, L = local experts per
rank, G = ranks (the group size), M = MoE layers, k = experts per token. Times in seconds, bytes in
bytes.

DWDP: the timeline of dwdp.predict.costmodel.timeline (copies issued when a buffer is released, compute
slowed by the copies' interference, exposed waits where a copy is late).
DEP:  compute on its E/G experts fed with T*k rows gathered from all ranks, plus dispatch and combine;
waiting under imbalance is the simulator's job (dwdp.predict.simulate).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from dwdp.predict.costmodel.calibration import IDEAL, OTHERS, Calibration, load_calibration
from dwdp.predict.costmodel.deployment import Deployment, ForwardShape, Workload, formats, workload_shape
from dwdp.predict.costmodel.formats import ACT_BYTES
from dwdp.predict.costmodel.hardware import Hardware
from dwdp.predict.costmodel.interference import CopySlowdown, copy_slowdown
from dwdp.predict.costmodel.models import ModelSpec
from dwdp.predict.costmodel.operators import OpCost, attention_ops, attention_projections, dense_mlp_ops, moe_ops, norm_elems
from dwdp.predict.costmodel.outside import outside_forward
from dwdp.predict.costmodel.timeline import RankTimeline, dwdp_timeline


@dataclass(frozen=True)
class LayerCost:
    """Operator costs of layer `index` on one rank, in execution order. mlp: DWDP rank (all E
    experts' weights read); mlp_dep: DEP rank (its E/G experts, fed with T*k rows from all ranks)."""

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


def layer_costs(spec: ModelSpec, hw: Hardware, work: Workload | ForwardShape, deploy: Deployment, tokens=None,
                cal: Calibration = IDEAL) -> list[LayerCost]:
    """Costs of every layer for one forward. work: a Workload (tokens overrides its T, attention per
    token unchanged) or a ForwardShape (arrays give one cost per entry)."""
    fmt, dense = formats(deploy)
    shape = workload_shape(work, spec.window, tokens) if isinstance(work, Workload) else work
    t = shape.tokens
    dep_held = math.ceil(spec.num_experts / deploy.group_size)
    cache: dict = {}
    out = []
    for index, (moe, window) in enumerate(zip(spec.is_moe, spec.window)):
        key = (moe, window)
        if key not in cache:
            attn = attention_ops(spec, hw, t, shape.pairs[window], shape.keys_read[window], dense, cal)
            if moe:
                mlp = moe_ops(spec, hw, t, fmt, dense, spec.num_experts, cal=cal)
                # Balanced routing: every DEP rank computes T*k rows drawn from all G ranks' tokens.
                mlp_dep = moe_ops(spec, hw, t, fmt, dense, dep_held, routing_tokens=t * deploy.group_size, cal=cal)
            else:
                mlp = mlp_dep = dense_mlp_ops(spec, hw, t, dense, cal)
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
    """Uncontended T_prefetch at the nominal link rate: remote bytes over the rank's inbound link."""
    return remote_bytes_per_layer(spec, deploy) / hw.link_bytes_per_s


def copy_time(spec: ModelSpec, hw: Hardware, deploy: Deployment, stretch: float = 1.0) -> float:
    """One MoE layer's prefetch at the rate copy engines sustain, times the contention `stretch`
    (mean prefetch duration / uncontended, from dwdp.predict.contention; 1 = no contention)."""
    if stretch < 1.0:
        raise ValueError(f"stretch={stretch} must be >= 1: contention only lengthens a prefetch")
    return remote_bytes_per_layer(spec, deploy) / hw.copy_bytes_per_s * stretch


def merge_op(spec: ModelSpec, hw: Hardware, deploy: Deployment, cal: Calibration) -> OpCost | None:
    """The D2D copy of the L local experts into the layer's full [E, ...] buffer, beside the pulled
    ones, before a grouped GEMM that takes one tensor (read + write); None when the kernel reads the
    experts where they lie (docs/design.md 1.2)."""
    if not deploy.merge_copy:
        return None
    fmt, _ = formats(deploy)
    nbytes = 2 * deploy.local_experts(spec.num_experts) * sum(spec.expert_nbytes(fmt))
    return OpCost.make("merge_copy", OTHERS, 0.0, nbytes, "fp32", hw, cal)


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
    """Bytes one DEP rank sends (= receives, balanced) per MoE layer: the dispatch (tokens quantized as
    the expert GEMMs take them) plus the combine (bf16)."""
    per_elem = deploy.dispatch_bytes_per_elem + ACT_BYTES
    return tokens * remote_ranks_per_token(spec.num_experts, deploy.group_size, spec.top_k) * spec.hidden * per_elem


def all2all_time(spec: ModelSpec, hw: Hardware, deploy: Deployment, tokens, cal: Calibration = IDEAL):
    """Dispatch + combine of one MoE layer at the all-to-all's share of the link rate."""
    return all2all_bytes(spec, deploy, tokens) / (hw.link_bytes_per_s * cal.all_to_all)


def rank_timeline(spec: ModelSpec, hw: Hardware, layers: list[LayerCost], deploy: Deployment,
                  cal: Calibration = IDEAL, stretch: float = 1.0) -> tuple[RankTimeline, CopySlowdown]:
    """One DWDP rank's forward over `layers` with its prefetches, and the slowdown the copies cause."""
    t_copy = copy_time(spec, hw, deploy, stretch)
    remote = remote_bytes_per_layer(spec, deploy)
    slowdown = copy_slowdown(hw, remote / t_copy if t_copy > 0 else 0.0, cal)
    timeline = dwdp_timeline([list(l.attn + l.mlp) for l in layers], [l.is_moe for l in layers], t_copy, slowdown,
                             merge_op(spec, hw, deploy, cal), deploy.num_buffers)
    return timeline, slowdown


@dataclass(frozen=True)
class Prediction:
    """One rank, one forward, no imbalance, no contention (stretch 1). Per-layer figures are means
    over MoE layers; t_compute excludes interference, dwdp_forward_s includes it; outside_s: what
    either mode pays per forward outside it (dwdp.predict.costmodel.outside)."""

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
    t_prefetch: float  # s, one MoE layer's copy at the copy engines' sustained rate
    t_all2all: float
    a2a_bytes_per_layer: float
    dwdp_forward_s: float
    dwdp_exposed_s: float  # prefetch waits in one forward
    dep_forward_s: float
    slowdown: CopySlowdown
    dwdp_weight_bytes: float
    dep_weight_bytes: float
    hbm_bytes: float
    outside_s: float = 0.0

    @property
    def ratio(self) -> float:
        """Compute / prefetch: >= 1 means the prefetch can hide behind one layer's compute."""
        return self.t_compute / self.t_prefetch if self.t_prefetch > 0 else math.inf

    @property
    def speedup(self) -> float:
        """DEP / DWDP forward time (the roofline's T_DEP / T_DWDP)."""
        return self.dep_forward_s / self.dwdp_forward_s

    @property
    def tps_speedup(self) -> float:
        """DWDP / DEP tokens per second per GPU: the forwards and the time outside them."""
        return (self.dep_forward_s + self.outside_s) / (self.dwdp_forward_s + self.outside_s)

    @property
    def dwdp_fits(self) -> bool:
        return self.dwdp_weight_bytes <= self.hbm_bytes

    def row(self) -> dict:
        return {
            "isl": self.isl, "max_num_tokens": self.max_num_tokens, "tokens": self.tokens,
            "t_compute_ms": 1e3 * self.t_compute, "t_compute_dep_ms": 1e3 * self.t_compute_dep,
            "t_prefetch_ms": 1e3 * self.t_prefetch, "t_all2all_ms": 1e3 * self.t_all2all,
            "remote_gb_per_layer": self.remote_bytes_per_layer / 1e9, "ratio": self.ratio,
            "dwdp_forward_ms": 1e3 * self.dwdp_forward_s, "dwdp_exposed_ms": 1e3 * self.dwdp_exposed_s,
            "dep_forward_ms": 1e3 * self.dep_forward_s, "speedup": self.speedup,
            "outside_ms": 1e3 * self.outside_s, "tps_speedup": self.tps_speedup,
            "compute_slowdown": self.slowdown.compute, "memory_slowdown": self.slowdown.memory,
            "dwdp_weight_gb": self.dwdp_weight_bytes / 1e9, "dep_weight_gb": self.dep_weight_bytes / 1e9,
            "dwdp_fits": self.dwdp_fits,
        }


def replicated_weight_bytes(spec: ModelSpec, deploy: Deployment) -> int:
    """Weights every rank keeps in both DWDP and DEP: embeddings, attention, norms, router, shared
    experts, dense MLPs."""
    _, dense = formats(deploy)
    h = spec.hidden
    total = 2 * spec.vocab * h * ACT_BYTES  # embedding + LM head
    attn = sum(dense.matrix_bytes(r, c) for r, c in attention_projections(spec)) + norm_elems(spec) * ACT_BYTES
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


def dwdp_weight_bytes(spec: ModelSpec, deploy: Deployment) -> int:
    """Weights one DWDP rank holds: replicated + L local experts per MoE layer + the prefetch buffers."""
    fmt, _ = formats(deploy)
    local = deploy.local_experts(spec.num_experts) * sum(spec.expert_nbytes(fmt))
    return (replicated_weight_bytes(spec, deploy) + spec.num_moe_layers * local
            + deploy.num_buffers * remote_bytes_per_layer(spec, deploy))


def predict(spec: ModelSpec, hw: Hardware, workload: Workload, deploy: Deployment,
            cal: Calibration | None = None) -> Prediction:
    """Prediction of one forward on one rank for DWDP and DEP at the same group size; `cal` defaults
    to the calibrated constants (dwdp/predict/data/calibration.json), IDEAL gives the plain roofline."""
    cal = load_calibration() if cal is None else cal
    fmt, _ = formats(deploy)
    layers = layer_costs(spec, hw, workload, deploy, cal=cal)
    moe = [l.is_moe for l in layers]
    num_moe = max(1, sum(moe))
    timeline, slowdown = rank_timeline(spec, hw, layers, deploy, cal)
    t_a2a = float(all2all_time(spec, hw, deploy, workload.tokens, cal))
    local = deploy.local_experts(spec.num_experts)
    per_expert = sum(spec.expert_nbytes(fmt))
    replicated = replicated_weight_bytes(spec, deploy)
    return Prediction(
        model=spec.name, hardware=hw.name, weight_dtype=fmt.name, expert_compute_dtype=hw.flops_dtype(fmt.compute),
        group_size=deploy.group_size, num_local_experts=local, isl=workload.isl,
        max_num_tokens=workload.max_num_tokens, tokens=workload.tokens, layers=tuple(layers),
        remote_bytes_per_layer=remote_bytes_per_layer(spec, deploy),
        t_compute=sum(float(l.attn_s + l.mlp_s) for l in layers if l.is_moe) / num_moe,
        t_compute_dep=sum(float(l.attn_s + l.mlp_dep_s) for l in layers if l.is_moe) / num_moe,
        t_prefetch=copy_time(spec, hw, deploy), t_all2all=t_a2a,
        a2a_bytes_per_layer=float(all2all_bytes(spec, deploy, workload.tokens)),
        dwdp_forward_s=float(timeline.total_s), dwdp_exposed_s=float(timeline.wait_s),
        dep_forward_s=sum(float(l.attn_s + l.mlp_dep_s) for l in layers) + t_a2a * sum(moe),
        slowdown=slowdown,
        dwdp_weight_bytes=dwdp_weight_bytes(spec, deploy),
        dep_weight_bytes=replicated + spec.num_moe_layers * math.ceil(spec.num_experts / deploy.group_size) * per_expert,
        hbm_bytes=hw.hbm_bytes,
        outside_s=float(outside_forward(spec, hw, cal).seconds(workload.tokens)),
    )


def prefetch_hidden(spec: ModelSpec, hw: Hardware, workload: Workload, deploy: Deployment,
                    cal: Calibration | None = None) -> bool:
    """Whether a forward of `workload` waits for no prefetch (interference included; `cal` defaults
    to the calibrated constants)."""
    cal = load_calibration() if cal is None else cal
    timeline, _ = rank_timeline(spec, hw, layer_costs(spec, hw, workload, deploy, cal=cal), deploy, cal)
    return float(timeline.wait_s) <= 1e-9 * float(timeline.total_s)


def crossover_isl(spec: ModelSpec, hw: Hardware, deploy: Deployment, max_num_tokens: int = 8192,
                  batch: int | None = None, low: int = 1, high: int = 1 << 20,
                  cal: Calibration | None = None) -> int | None:
    """Smallest ISL at which no prefetch is exposed (bisection; the exposed time falls monotonically
    with ISL). None if still exposed at `high`."""
    def hidden(isl: int) -> bool:
        return prefetch_hidden(spec, hw, Workload(isl, max_num_tokens, batch), deploy, cal)

    if not hidden(high):
        return None
    if hidden(low):
        return low
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if hidden(mid) else (mid, high)
    return high
