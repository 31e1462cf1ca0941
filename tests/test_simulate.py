"""Iteration simulator: DWDP vs DEP under imbalance."""
import dataclasses
import math

import numpy as np
import pytest

from dwdp import costmodel as cm
from dwdp.contention import PullConfig
from dwdp.simulate import ExposureCurve, SimConfig, draw_tokens, measure_exposure, simulate, simulate_tokens

SPEC = cm.ModelSpec(
    name="tiny", hidden=64, vocab=100, num_heads=4, num_kv_heads=2, head_dim=16,
    is_moe=(False, True, True, True), window=(None,) * 4, num_experts=8, top_k=2, moe_intermediate=32,
    shared_intermediate=32, dense_intermediate=128,
)
# HBM so fast that every operator is FLOP-bound: DWDP and DEP expert GEMMs then cost the same.
HW = cm.Hardware("toy", {"bf16": 1e12, "fp8": 2e12, "fp4": None, "fp32": 1e11},
                 hbm_bytes_per_s=1e18, hbm_bytes=1e12, link_bytes_per_s=1e10, domain_size=8)
DEPLOY = cm.Deployment(4, weight_dtype="bf16")
WORKLOAD = cm.Workload(isl=1024, max_num_tokens=4096)


def test_balanced_and_hidden_differs_by_all2all_only():
    tokens = np.full((3, 4), 4096.0)
    result = simulate_tokens(SPEC, HW, WORKLOAD, DEPLOY, tokens, ExposureCurve((0.0, 1.0), (1.0, 0.0)))
    t_prefetch = cm.prefetch_time(SPEC, HW, DEPLOY)
    layers = cm.layer_costs(SPEC, HW, WORKLOAD, DEPLOY)
    windows = cm.prefetch_windows([float(l.attn_s) for l in layers], [float(l.mlp_s) for l in layers], SPEC.is_moe)
    assert min(windows) > t_prefetch, f"prefetch {t_prefetch} not hidden by windows {windows}"
    # One dispatch or combine: 4096 tokens x E[remote ranks] x 64 x 2 B over 1e10 B/s.
    a2a = 4096 * cm.remote_ranks_per_token(8, 4, 2) * 64 * 2 / 1e10
    expected = 3 * 2 * a2a
    diff = result.dep_iter_s - result.dwdp_iter_s
    assert math.isclose(diff, expected, rel_tol=1e-9), f"DEP - DWDP = {diff}, all-to-all = {expected}"
    assert result.dep_wait_frac == 0.0 and result.dwdp_exposed_frac == 0.0, result


def test_dep_waits_for_the_slowest_rank():
    # Two ranks, one with twice the tokens: at each MoE layer the light rank waits for the heavy one.
    tokens = np.array([[2048.0, 4096.0]])
    deploy = cm.Deployment(2, weight_dtype="bf16")
    light = cm.layer_costs(SPEC, HW, WORKLOAD, deploy, tokens=2048.0)
    heavy = cm.layer_costs(SPEC, HW, WORKLOAD, deploy, tokens=4096.0)
    result = simulate_tokens(SPEC, HW, WORKLOAD, deploy, tokens, ExposureCurve((0.0, 1.0), (1.0, 0.0)))
    # Before the first barrier: dense layer + attention + router/shared of layer 1; later barriers
    # see only attention + router/shared of one layer.
    def own(costs, l):
        return float(costs[l].attn_s) + sum(float(op.time_s) for op in costs[l].mlp_dep if op.name != "routed_experts")
    wait = (own(heavy, 0) - own(light, 0)) + sum(own(heavy, l) - own(light, l) for l in (1, 2, 3))
    got = result.dep_wait_frac * 2 * result.dep_iter_s
    assert math.isclose(got, wait, rel_tol=1e-9), f"waited {got} s, expected {wait} s"


def test_imbalance_costs_dep_more_than_dwdp():
    rows = {}
    for cv in (0.0, 0.2, 0.4):
        rng = np.random.default_rng(0)
        tokens = draw_tokens(4096, cv, (400, 4), rng)
        rows[cv] = simulate_tokens(SPEC, HW, WORKLOAD, DEPLOY, tokens, ExposureCurve((0.0, 1.0), (1.0, 0.0)))
    waits = [rows[cv].dep_wait_frac for cv in (0.0, 0.2, 0.4)]
    speedups = [rows[cv].speedup for cv in (0.0, 0.2, 0.4)]
    assert waits[0] == 0.0 < waits[1] < waits[2], f"DEP wait share {waits}"
    assert speedups[0] < speedups[1] < speedups[2], f"speedup {speedups}"


def test_drawn_tokens_have_requested_mean_and_cv():
    tokens = draw_tokens(1000.0, 0.2, (20000,), np.random.default_rng(1))
    assert abs(tokens.mean() / 1000.0 - 1) < 0.01, tokens.mean()
    assert abs(tokens.std() / tokens.mean() - 0.2) < 0.01, tokens.std() / tokens.mean()


def test_uncontended_exposure_curve_is_one_minus_ratio():
    base = PullConfig(4, 32, (3 << 20, 1 << 20), 1e9, mode="tdm", serialise=False, window_cv=0.0, num_layers=3)
    curve = measure_exposure(base, ratios=(0.0, 0.5, 1.0, 1.5))
    assert np.allclose(curve.exposed, [1.0, 0.5, 0.0, 0.0], atol=1e-9), curve.exposed


def test_preset_simulation_without_imbalance_equals_the_roofline():
    """Two separate models of one deployment: with every rank at max-num-tokens and no contention the
    simulator's speedup is the roofline's DEP / DWDP forward time (costmodel.predict); imbalance
    then only adds DEP barrier waits, so the speedup must rise."""
    balanced = simulate(SimConfig(iterations=20, cv=0.0))
    cfg = balanced.config
    roofline = cm.predict(cm.load_model(cfg.model), cm.load_hardware(cfg.hardware),
                          cm.Workload(cfg.isl, cfg.max_num_tokens),
                          cm.Deployment(cfg.group_size, cfg.num_local_experts, cfg.weight_dtype))
    assert math.isclose(balanced.speedup, roofline.speedup, rel_tol=1e-9), (balanced.row(), roofline.speedup)
    # Equal tokens on every rank: throughput ratio = DEP iteration time / DWDP iteration time.
    assert math.isclose(balanced.speedup, balanced.dep_iter_s / balanced.dwdp_iter_s, rel_tol=1e-9), balanced.row()
    assert balanced.dep_wait_frac == 0.0, balanced.row()
    imbalanced = simulate(SimConfig(iterations=20, cv=0.2))
    assert imbalanced.dep_wait_frac > 0 and imbalanced.speedup > balanced.speedup, (imbalanced.row(), balanced.row())
    with pytest.raises(ValueError, match="cv=-0.1"):
        dataclasses.replace(cfg, cv=-0.1)
