"""Iteration simulator: DWDP vs DEP for one group over many forwards, from the prompts each rank packs.

Legend: F = forwards per rank, G = ranks (the DWDP group = the DEP group), M = MoE layers.
Times in seconds; breakdowns are per forward, averaged over ranks and forwards.

Workload (dwdp.predict.packing): each rank draws prompt lengths and packs them into forwards of at most
max_num_tokens, so per-rank work differs from step to step; `cv` overrides that spread.
Operator times: dwdp.predict.costmodel with the calibrated constants (dwdp/predict/data/calibration.json).

DEP: every MoE layer is two barriers. Dispatch waits for the slowest rank's attention side, the
experts then run on the rows routed to this rank (the group's T*k rows spread over ranks with the
calibrated expert-load CV, drawn per layer), combine waits for the slowest of those. The all-to-all
takes the busiest rank's bytes. Synchronization = time a rank waits at barriers (and for the
slowest rank's end of the step).
DWDP: each rank alone (dwdp.predict.costmodel.timeline): copies issued when a buffer is released, compute
slowed while they run, waits where a copy is late. The copy lasts remote bytes / copy-engine rate
times the contention stretch that dwdp.predict.contention's simulation measures for the copy plan.
Outside the forward (dwdp.predict.costmodel.outside): every mode pays host work, the KV hand-off and
the rest after each forward; a DEP step pays it once for the group (the slowest rank's hand-off), a
DWDP rank after each of its own forwards. Breakdown rows Host, KV hand-off, Other; "Iteration" is the
forward alone (the paper's Table 1), "Iteration + outside" what a rank spends per forward.
Throughput per GPU: DEP = all tokens / (G x summed step times); DWDP = mean over ranks of own tokens /
own time (each rank serves its own queue); both with the time outside the forward (`speedup`) and
without it (`forward_speedup`, the iteration ratio).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from dwdp.predict import costmodel as cm
from dwdp.predict.contention import PullConfig, simulate_pulls, uncontended_time
from dwdp.predict.costmodel.operators import COMBINE_AFTER, DISPATCH_BEFORE
from dwdp.predict.packing import RequestMix, forward_shapes, with_token_cv

FORWARD_ROWS = ("Attention", "GroupedGEMM", "DenseGEMM", "Others", "Communication", "D2D copy", "P2P copy",
                "Synchronization", "Prefetch wait", "Iteration")
ROWS = FORWARD_ROWS + cm.OUTSIDE_PARTS + ("Iteration + outside",)
PLANS = ("monolithic", "tdm", "none")


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment.

    isl, isl_ratio, isl_std: the prompt mix (dwdp.predict.packing.RequestMix). cv: None = the per-rank spread
    that packing gives; a number = per-rank token CV instead. plan: DWDP copy plan whose contention
    stretch is simulated (monolithic: one copy per expert, peers in turn; tdm: dwdp.runtime.plan's sliced
    round robin; none: no contention). merge_copy: DWDP copies the local experts beside the pulled
    ones before each grouped GEMM (the paper's Table 1 baseline) instead of reading them in place."""

    model: str = "DeepSeek-R1"
    hardware: str = "GB200-NVL72"
    group_size: int = 4
    weight_dtype: str = "nvfp4"
    isl: int = 8192
    isl_ratio: float = 0.8
    isl_std: float | None = None
    max_num_tokens: int = 32768
    cv: float | None = None
    iterations: int = 200
    num_local_experts: int | None = None
    num_buffers: int = 2
    plan: str = "tdm"
    slice_bytes: int = 1 << 20
    inflight: int = 2
    merge_copy: bool = False
    seed: int = 0

    def __post_init__(self):
        if self.iterations < 1 or self.group_size < 2:
            raise ValueError(f"iterations={self.iterations} must be >= 1 and group_size={self.group_size} >= 2")
        if self.cv is not None and self.cv < 0:
            raise ValueError(f"cv={self.cv} must be >= 0 (or None: the spread packing gives)")
        if self.plan not in PLANS:
            raise ValueError(f"plan={self.plan!r} must be one of {PLANS}")
        RequestMix(self.isl, self.isl_ratio, self.isl_std)
        cm.Deployment(self.group_size, self.num_local_experts, self.weight_dtype, num_buffers=self.num_buffers)

    @property
    def deployment(self) -> cm.Deployment:
        return cm.Deployment(self.group_size, self.num_local_experts, self.weight_dtype,
                             num_buffers=self.num_buffers, merge_copy=self.merge_copy)


@dataclass(frozen=True)
class SimResult:
    """dep / dwdp: {row of ROWS: seconds per forward}; *_tps_per_gpu: tokens per second per GPU with the
    time outside the forward, *_forward_tps_per_gpu without it; stretch: copy contention stretch used;
    slowdown: the copies' interference factors; outside: the term both modes paid."""

    config: SimConfig
    dep: dict
    dwdp: dict
    dep_tps_per_gpu: float
    dwdp_tps_per_gpu: float
    dep_forward_tps_per_gpu: float
    dwdp_forward_tps_per_gpu: float
    outside: cm.OutsideForward
    tokens_per_forward: float
    token_cv: float
    stretch: float
    slowdown: cm.CopySlowdown
    dwdp_weight_bytes: float
    hbm_bytes: float

    @property
    def speedup(self) -> float:
        """DWDP / DEP tokens per second per GPU, the time outside the forward included."""
        return self.dwdp_tps_per_gpu / self.dep_tps_per_gpu

    @property
    def gain(self) -> float:
        """What DWDP adds to DEP's tokens per second per GPU: speedup - 1."""
        return self.speedup - 1.0

    @property
    def forward_speedup(self) -> float:
        """DWDP / DEP tokens per second per GPU over the forwards alone (the iteration ratio)."""
        return self.dwdp_forward_tps_per_gpu / self.dep_forward_tps_per_gpu

    def row(self) -> dict:
        c, dep, dwdp = self.config, self.dep, self.dwdp
        return {"isl": c.isl, "isl_ratio": c.isl_ratio, "isl_std": c.isl_std, "max_num_tokens": c.max_num_tokens,
                "group_size": c.group_size, "cv": c.cv, "token_cv": self.token_cv,
                "tokens_per_forward": self.tokens_per_forward, "speedup": self.speedup, "gain": self.gain,
                "forward_speedup": self.forward_speedup,
                "outside_ms": {mode: {part: 1e3 * row[part] for part in cm.OUTSIDE_PARTS}
                               for mode, row in (("dep", dep), ("dwdp", dwdp))},
                "dep_outside_frac": 1.0 - dep["Iteration"] / dep["Iteration + outside"],
                "dep_sync_frac": dep["Synchronization"] / dep["Iteration"],
                "dep_a2a_frac": dep["Communication"] / dep["Iteration"],
                "dwdp_wait_frac": dwdp["Prefetch wait"] / dwdp["Iteration"],
                "dwdp_interference_frac": interference_share(dep, dwdp),
                "dep_tps_per_gpu": self.dep_tps_per_gpu, "dwdp_tps_per_gpu": self.dwdp_tps_per_gpu,
                "stretch": self.stretch, "compute_slowdown": self.slowdown.compute,
                "memory_slowdown": self.slowdown.memory, "dwdp_weight_gb": self.dwdp_weight_bytes / 1e9,
                "dwdp_fits": self.dwdp_weight_bytes <= self.hbm_bytes}


def interference_share(dep: dict, dwdp: dict) -> float:
    """Share of DWDP's forward lost to copy interference: its kernel time over DEP's, same tokens."""
    kernels = ("Attention", "GroupedGEMM", "DenseGEMM", "Others")
    return (sum(dwdp[k] for k in kernels) - sum(dep[k] for k in kernels)) / dwdp["Iteration"]


def _split_moe(ops):
    """(before dispatch, between dispatch and combine, after combine) of one MoE layer's ops."""
    names = [op.name for op in ops]
    a, b = names.index(DISPATCH_BEFORE), names.index(COMBINE_AFTER) + 1
    return ops[:a], ops[a:b], ops[b:]


def _by_category(ops, scale=1.0) -> dict:
    out = {}
    for op in ops:
        out[op.category] = out.get(op.category, 0.0) + op.time_s * scale
    return out


def simulate_dep(spec, hw, deploy, cal, shape: cm.ForwardShape, rng: np.random.Generator) -> tuple[dict, np.ndarray]:
    """DEP over forwards shape [F, G]: ({row: seconds per forward}, step times [F])."""
    fmt, dense = cm.formats(deploy)
    tokens = np.asarray(shape.tokens, float)
    n = tokens.shape[1]
    gathered = tokens.sum(axis=1, keepdims=True)  # [F, 1]
    held = math.ceil(spec.num_experts / n)
    attn = {w: cm.attention_ops(spec, hw, tokens, shape.pairs[w], shape.keys_read[w], dense, cal)
            for w in set(spec.window)}
    pre, mid, post = _split_moe(cm.moe_ops(spec, hw, tokens, fmt, dense, held, routed_tokens=gathered * spec.top_k / n,
                                           routing_tokens=gathered, cal=cal))
    dense_mlp = cm.dense_mlp_ops(spec, hw, tokens, dense, cal)
    busiest = np.maximum(tokens, (gathered - tokens) / (n - 1)).max(axis=1, keepdims=True)  # [F, 1]
    a2a = cm.all2all_time(spec, hw, deploy, busiest, cal) / 2  # [F, 1] one of dispatch / combine
    pre_s, mid_s, post_s = (sum(op.time_s for op in ops) for ops in (pre, mid, post))
    spent = {c: 0.0 for c in cm.KERNEL_CATEGORIES}
    clock = np.zeros_like(tokens)
    waited = np.zeros_like(tokens)
    num_moe = 0
    for moe, window in zip(spec.is_moe, spec.window):
        layer_attn = sum(op.time_s for op in attn[window])
        for c, t in _by_category(attn[window]).items():
            spent[c] = spent[c] + t
        if not moe:
            clock = clock + layer_attn + sum(op.time_s for op in dense_mlp)
            for c, t in _by_category(dense_mlp).items():
                spent[c] = spent[c] + t
            continue
        num_moe += 1
        # Rows routed to each rank's experts this layer: the group's rows spread by expert skew.
        z = rng.standard_normal(tokens.shape)
        share = np.clip(1.0 + cal.expert_load_cv * (z - z.mean(axis=1, keepdims=True)), 0.0, None)
        clock = clock + layer_attn + pre_s
        barrier = clock.max(axis=1, keepdims=True)
        waited, clock = waited + barrier - clock, barrier + a2a + mid_s * share
        barrier = clock.max(axis=1, keepdims=True)
        waited, clock = waited + barrier - clock, barrier + a2a + post_s
        for c, t in _by_category(pre + post).items():
            spent[c] = spent[c] + t
        for c, t in _by_category(mid).items():
            spent[c] = spent[c] + t * share
    step = clock.max(axis=1)  # [F]: the next step starts when the slowest rank is done
    waited = waited + step[:, None] - clock
    mean = lambda x: float(np.mean(np.broadcast_to(x, tokens.shape)))  # noqa: E731
    row = {c: mean(spent[c]) for c in cm.KERNEL_CATEGORIES}
    row.update({"Communication": mean(2 * a2a * num_moe), "D2D copy": 0.0, "P2P copy": 0.0,
                "Synchronization": mean(waited), "Prefetch wait": 0.0})
    row["Iteration"] = float(step.mean())
    return row, step


@lru_cache(maxsize=64)
def copy_stretch(spec_name: str, hw_name: str, deploy: cm.Deployment, plan: str, window_ratio: float,
                 slice_bytes: int = 1 << 20, inflight: int = 2, seed: int = 0) -> float:
    """Mean prefetch duration / uncontended for the group pulling one layer after another with a
    compute window of `window_ratio` x the uncontended prefetch (dwdp.predict.contention), layer 0 left out.
    Runs differ by their random start offsets more than by their length, so the mean is over many
    seeded runs: 16 of 24 layers for one copy per expert, 4 of 8 for the sliced plan (thousands of
    slices per layer, and a spread four times smaller)."""
    if plan == "none":
        return 1.0
    spec, hw = cm.load_model(spec_name), cm.load_hardware(hw_name)
    runs, layers = (4, 8) if plan == "tdm" else (16, 24)
    stretches = []
    for run in range(runs):
        cfg = PullConfig(deploy.group_size, spec.num_experts, spec.expert_nbytes(cm.weight_format(deploy.weight_dtype)),
                         hw.copy_bytes_per_s, mode=plan, slice_bytes=slice_bytes,
                         inflight=1 if plan == "monolithic" else inflight, num_local_experts=deploy.num_local_experts,
                         num_layers=layers, num_samples=100, seed=seed * 1000 + run)
        unc = uncontended_time(cfg)
        result = simulate_pulls(dataclasses.replace(cfg, window_s=window_ratio * unc))
        stretches.append(float(result.prefetch_s[:, 1:].mean() / unc))
    return max(1.0, float(np.mean(stretches)))


def simulate_dwdp(spec, hw, deploy, cal, shape: cm.ForwardShape, stretch: float) -> tuple[dict, np.ndarray, cm.CopySlowdown]:
    """DWDP over forwards shape [F, G]: ({row: seconds per forward}, rank times [F, G], slowdown)."""
    layers = cm.layer_costs(spec, hw, shape, deploy, cal=cal)
    timeline, slowdown = cm.rank_timeline(spec, hw, layers, deploy, cal, stretch)
    mean = lambda x: float(np.mean(np.broadcast_to(x, np.shape(shape.tokens))))  # noqa: E731
    row = {c: mean(timeline.category_s[c]) for c in cm.KERNEL_CATEGORIES}
    row.update({"Communication": 0.0, "D2D copy": mean(timeline.merge_s), "P2P copy": mean(timeline.copy_s),
                "Synchronization": 0.0, "Prefetch wait": mean(timeline.wait_s), "Iteration": mean(timeline.total_s)})
    return row, np.broadcast_to(timeline.total_s, np.shape(shape.tokens)), slowdown


def workload(cfg: SimConfig, rng: np.random.Generator) -> cm.ForwardShape:
    """Every rank's forwards for cfg: packed prompts, or the CV override."""
    spec = cm.load_model(cfg.model)
    shape = forward_shapes(RequestMix(cfg.isl, cfg.isl_ratio, cfg.isl_std), cfg.max_num_tokens, cfg.group_size,
                           cfg.iterations, spec.window, rng)
    return shape if cfg.cv is None else with_token_cv(shape, cfg.cv, rng)


def simulate(cfg: SimConfig, cal: cm.Calibration | None = None) -> SimResult:
    """Both schemes on the same drawn forwards."""
    cal = cm.load_calibration() if cal is None else cal
    spec, hw, deploy = cm.load_model(cfg.model), cm.load_hardware(cfg.hardware), cfg.deployment
    rng = np.random.default_rng(cfg.seed)
    shape = workload(cfg, rng)
    tokens = np.asarray(shape.tokens)
    dep, step = simulate_dep(spec, hw, deploy, cal, shape, rng)
    # Contention depends on how long a layer lasts against the prefetch: measure it at this run's pace.
    stretch = 1.0
    if cfg.plan != "none" and spec.num_moe_layers:
        first, _, _ = simulate_dwdp(spec, hw, deploy, cal, shape, 1.0)
        ratio = first["Iteration"] / spec.num_moe_layers / cm.copy_time(spec, hw, deploy)
        stretch = copy_stretch(cfg.model, cfg.hardware, deploy, cfg.plan, round(ratio, 2), cfg.slice_bytes,
                               cfg.inflight, cfg.seed)
    dwdp, rank_time, slowdown = simulate_dwdp(spec, hw, deploy, cal, shape, stretch)
    outside = cm.outside_forward(spec, hw, cal)
    busiest = tokens.max(axis=1)  # [I]: a DEP step hands off the slowest rank's KV before the next starts
    dep_step, dwdp_time = step + outside.seconds(busiest), rank_time + outside.seconds(tokens)
    for row, parts, total in ((dep, outside.parts(busiest), dep_step), (dwdp, outside.parts(tokens), dwdp_time)):
        row.update({part: float(np.mean(t)) for part, t in parts.items()})
        row["Iteration + outside"] = float(np.mean(total))
    tps = lambda step_s, rank_s: (float(tokens.sum() / (tokens.shape[1] * step_s.sum())),  # noqa: E731
                                  float(np.mean(tokens.sum(axis=0) / rank_s.sum(axis=0))))
    (dep_tps, dwdp_tps), (dep_forward_tps, dwdp_forward_tps) = tps(dep_step, dwdp_time), tps(step, rank_time)
    return SimResult(
        config=cfg, dep=dep, dwdp=dwdp, dep_tps_per_gpu=dep_tps, dwdp_tps_per_gpu=dwdp_tps,
        dep_forward_tps_per_gpu=dep_forward_tps, dwdp_forward_tps_per_gpu=dwdp_forward_tps, outside=outside,
        tokens_per_forward=float(tokens.mean()), token_cv=float(np.mean(tokens.std(axis=1) / tokens.mean(axis=1))),
        stretch=stretch, slowdown=slowdown, dwdp_weight_bytes=cm.dwdp_weight_bytes(spec, deploy),
        hbm_bytes=hw.hbm_bytes)
