"""Iteration simulator: DWDP vs DEP for one group over many forwards under per-rank imbalance.

Legend: I = iterations, N = ranks in the group (DWDP group = DEP group), T[i, r] = tokens of rank r
in iteration i, M = MoE layers. Times in seconds.

Per-layer operator times come from dwdp.costmodel at each rank's own token count. Imbalance:
T[i, r] = max_num_tokens * f, f ~ lognormal with mean 1 and coefficient of variation `cv`, drawn
independently per rank and iteration (longer prompts, worse prefix-cache hits: more new tokens).

DEP: attention (data parallel) on own tokens, then every MoE layer is a barrier: dispatch waits for
the slowest rank, experts run on T*k rows gathered from all ranks (routing balanced over experts),
combine returns them; all-to-all time is the busiest rank's send or receive bytes over the link.
DWDP: ranks never wait for each other; each MoE layer exposes the part of the prefetch its window
does not hide, read from an exposure curve: mean exposed wait / T_prefetch as a function of
window / T_prefetch, measured by dwdp.contention's simulation of the whole group pulling at once
(or the uncontended max(0, 1 - ratio) when no curve is given).
Throughput: DEP = all tokens / summed iteration times; DWDP = sum over ranks of each rank's own
tokens / its own time (each rank serves its own queue).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from . import costmodel as cm
from .contention import PullConfig, simulate_pulls, uncontended_time


@dataclass(frozen=True)
class ExposureCurve:
    """Mean exposed wait per MoE layer / T_prefetch at each window / T_prefetch ratio (increasing)."""

    ratios: tuple[float, ...]
    exposed: tuple[float, ...]

    def __call__(self, ratio):
        # Past the last measured ratio the wait stays at its last value (it only falls with the window).
        return np.interp(ratio, self.ratios, self.exposed)


def uncontended_curve() -> ExposureCurve:
    return ExposureCurve((0.0, 1.0, 2.0), (1.0, 0.0, 0.0))


def measure_exposure(base: PullConfig, ratios=(0.0, 0.5, 0.8, 1.0, 1.2, 1.5, 2.0)) -> ExposureCurve:
    """Run the contention simulation at window = ratio * uncontended prefetch; layer 0 (no peers yet
    pulling at full rate) is left out of the mean."""
    if base.num_layers < 2:
        raise ValueError(f"num_layers={base.num_layers} must be >= 2: layer 0 is left out")
    uncontended = uncontended_time(base)
    exposed = []
    for ratio in ratios:
        result = simulate_pulls(dataclasses.replace(base, window_s=ratio * uncontended))
        exposed.append(float(result.exposed_s[:, 1:].mean() / uncontended))
    return ExposureCurve(tuple(float(r) for r in ratios), tuple(exposed))


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment. cv: per-rank token imbalance; iterations: forwards simulated."""

    model: str = "DeepSeek-R1"
    hardware: str = "GB200-NVL72"
    group_size: int = 4
    weight_dtype: str = "nvfp4"
    isl: int = 8192
    max_num_tokens: int = 8192
    cv: float = 0.2
    iterations: int = 200
    num_local_experts: int | None = None
    seed: int = 0

    def __post_init__(self):
        if self.cv < 0 or self.iterations < 1 or self.group_size < 2:
            raise ValueError(f"cv={self.cv} must be >= 0, iterations={self.iterations} >= 1, "
                             f"group_size={self.group_size} >= 2")


@dataclass(frozen=True)
class SimResult:
    config: SimConfig
    dwdp_tokens_per_s: float
    dep_tokens_per_s: float
    dep_wait_frac: float  # share of DEP time ranks spend waiting at MoE barriers (mean over ranks)
    dwdp_exposed_frac: float  # share of DWDP time spent waiting for prefetch
    dep_a2a_frac: float  # share of DEP time in all-to-all
    dwdp_iter_s: float  # mean forward time of one DWDP rank
    dep_iter_s: float  # mean DEP iteration time (slowest rank, barriers included)

    @property
    def speedup(self) -> float:
        return self.dwdp_tokens_per_s / self.dep_tokens_per_s

    def row(self) -> dict:
        c = self.config
        return {"cv": c.cv, "max_num_tokens": c.max_num_tokens, "group_size": c.group_size, "isl": c.isl,
                "speedup": self.speedup, "dep_wait_frac": self.dep_wait_frac,
                "dep_a2a_frac": self.dep_a2a_frac, "dwdp_exposed_frac": self.dwdp_exposed_frac,
                "dwdp_tok_s": self.dwdp_tokens_per_s, "dep_tok_s": self.dep_tokens_per_s}


def draw_tokens(mean_tokens: float, cv: float, shape, rng: np.random.Generator) -> np.ndarray:
    """Per-rank token counts with mean `mean_tokens` and coefficient of variation `cv`. [*shape]"""
    if cv == 0:
        return np.full(shape, float(mean_tokens))
    sigma = math.sqrt(math.log1p(cv ** 2))
    return mean_tokens * rng.lognormal(-sigma ** 2 / 2, sigma, size=shape)


def _sum_time(ops) -> np.ndarray:
    return sum(op.time_s for op in ops)


def layer_times(spec: cm.ModelSpec, hw: cm.Hardware, workload: cm.Workload, deploy: cm.Deployment,
                tokens: np.ndarray) -> dict:
    """Per-layer times for tokens [I, N]: attn, dwdp_mlp, dep_own (router + shared), dep_routed
    (expert GEMMs on gathered rows, [I, 1]); dense layers put their MLP in both dwdp_mlp and dep_own."""
    fmt, dense = cm.formats(deploy)
    n = tokens.shape[1]
    gathered = tokens.sum(axis=1, keepdims=True)  # [I, 1] tokens routed over the whole group
    held = math.ceil(spec.num_experts / n)
    zero = np.zeros((tokens.shape[0], 1))
    kinds = {}
    for moe, window in set(zip(spec.is_moe, spec.window)):
        attn = _sum_time(cm.attention_ops(spec, hw, tokens, tokens * workload.pairs_per_token(window),
                                          tokens * workload.keys_read_per_token(window), dense))
        if moe:
            dwdp = _sum_time(cm.moe_ops(spec, hw, tokens, fmt, dense, spec.num_experts))
            dep_ops = cm.moe_ops(spec, hw, tokens, fmt, dense, held,
                                 routed_tokens=gathered * spec.top_k / n, routing_tokens=gathered)
            own = _sum_time([op for op in dep_ops if op.name != "routed_experts"])
            routed = _sum_time([op for op in dep_ops if op.name == "routed_experts"])
        else:
            dwdp = own = _sum_time(cm.dense_mlp_ops(spec, hw, tokens, dense))
            routed = zero
        kinds[(moe, window)] = (attn, dwdp, own, routed)
    keys = list(zip(spec.is_moe, spec.window))
    return {name: [kinds[key][i] for key in keys] for i, name in enumerate(("attn", "dwdp_mlp", "dep_own", "dep_routed"))}


def simulate(cfg: SimConfig, curve: ExposureCurve | None = None) -> SimResult:
    """Simulate cfg.iterations forwards of both schemes on the same drawn token counts."""
    spec, hw = cm.load_model(cfg.model), cm.load_hardware(cfg.hardware)
    deploy = cm.Deployment(cfg.group_size, cfg.num_local_experts, cfg.weight_dtype)
    workload = cm.Workload(cfg.isl, cfg.max_num_tokens)
    rng = np.random.default_rng(cfg.seed)
    tokens = draw_tokens(cfg.max_num_tokens, cfg.cv, (cfg.iterations, cfg.group_size), rng)  # [I, N]
    return simulate_tokens(spec, hw, workload, deploy, tokens, curve or uncontended_curve(), cfg)


def simulate_tokens(spec, hw, workload, deploy, tokens: np.ndarray, curve: ExposureCurve, cfg=None) -> SimResult:
    """Both schemes on given per-rank token counts [I, N]."""
    n = tokens.shape[1]
    t = layer_times(spec, hw, workload, deploy, tokens)
    # DWDP: each rank alone; exposure read from the curve at its own windows.
    t_prefetch = cm.prefetch_time(spec, hw, deploy)
    windows = cm.prefetch_windows(t["attn"], t["dwdp_mlp"], spec.is_moe)
    exposed = sum(t_prefetch * curve(w / t_prefetch) for w in windows)  # [I, N]
    dwdp_time = sum(a + m for a, m in zip(t["attn"], t["dwdp_mlp"])) + exposed  # [I, N]

    # DEP: clocks per rank, synchronised at each MoE layer's dispatch.
    per_token = cm.remote_ranks_per_token(spec.num_experts, n, spec.top_k) * spec.hidden * deploy.a2a_bytes_per_elem
    total = tokens.sum(axis=1, keepdims=True)
    busiest = np.maximum(tokens, (total - tokens) / (n - 1)).max(axis=1)  # [I] tokens' worth per direction
    t_a2a = busiest * per_token / hw.link_bytes_per_s  # [I] one of dispatch / combine
    clock = np.zeros_like(tokens)
    waited = np.zeros_like(tokens)
    for l, moe in enumerate(spec.is_moe):
        clock = clock + t["attn"][l] + t["dep_own"][l]
        if moe:
            barrier = clock.max(axis=1, keepdims=True)
            waited += barrier - clock
            clock = np.broadcast_to(barrier + 2 * t_a2a[:, None] + t["dep_routed"][l], clock.shape).copy()
    dep_time = clock.max(axis=1)  # [I]
    dep_total = dep_time.sum()
    dwdp_rate = (tokens.sum(axis=0) / dwdp_time.sum(axis=0)).sum()
    return SimResult(
        config=cfg,
        dwdp_tokens_per_s=float(dwdp_rate),
        dep_tokens_per_s=float(tokens.sum() / dep_total),
        dep_wait_frac=float(waited.sum() / (n * dep_total)),
        dwdp_exposed_frac=float(exposed.sum() / dwdp_time.sum()),
        dep_a2a_frac=float(2 * t_a2a.sum() * spec.num_moe_layers / dep_total),
        dwdp_iter_s=float(dwdp_time.mean()),
        dep_iter_s=float(dep_time.mean()),
    )
