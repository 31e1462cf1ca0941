"""Iteration simulator: DWDP vs DEP under imbalance, against values computed from the operator costs."""
import dataclasses
import math

import numpy as np
import pytest

from dwdp.predict import costmodel as cm
from dwdp.predict.simulate import SimConfig, copy_stretch, simulate, simulate_dep, simulate_dwdp

SPEC = cm.ModelSpec(
    name="tiny", hidden=64, vocab=100, num_heads=4, num_kv_heads=2, head_dim=16,
    is_moe=(False, True, True, True), window=(None,) * 4, num_experts=8, top_k=2, moe_intermediate=32,
    shared_intermediate=32, dense_intermediate=128,
)
# HBM so fast that every operator is FLOP-bound: DWDP and DEP expert GEMMs then cost the same; no power model.
HW = cm.Hardware("toy", {"bf16": 1e12, "fp8": 2e12, "fp4": None, "fp32": 1e11},
                 hbm_bytes_per_s=1e18, hbm_bytes=1e12, link_bytes_per_s=1e10, domain_size=8)
DEPLOY = cm.Deployment(4, weight_dtype="bf16")


def _shape(tokens, pairs_per_token=512.5):
    tokens = np.asarray(tokens, float)
    return cm.ForwardShape(tokens, {None: tokens * pairs_per_token}, {None: tokens})


def test_balanced_and_hidden_differs_by_all2all_only():
    shape = _shape(np.full((3, 4), 4096.0))
    rng = np.random.default_rng(0)
    dep, step = simulate_dep(SPEC, HW, DEPLOY, cm.IDEAL, shape, rng)
    dwdp, rank_time, slowdown = simulate_dwdp(SPEC, HW, DEPLOY, cm.IDEAL, shape, 1.0)
    assert dwdp["Prefetch wait"] == 0.0 and slowdown.compute == 1.0 and slowdown.memory < 1 + 1e-6, (dwdp, slowdown)
    # Dispatch (bf16) + combine (bf16): 4096 tokens x E[remote ranks] x 64 x (2 + 2) B over 1e10 B/s, 3 MoE layers.
    a2a = 4096 * cm.remote_ranks_per_token(8, 4, 2) * 64 * 4 / 1e10
    diff = dep["Iteration"] - dwdp["Iteration"]
    assert math.isclose(diff, 3 * a2a, rel_tol=1e-9), f"DEP - DWDP = {diff}, all-to-all = {3 * a2a}"
    assert math.isclose(dep["Communication"], 3 * a2a, rel_tol=1e-9), dep["Communication"]
    assert dep["Synchronization"] == 0.0, dep
    assert np.allclose(step, dep["Iteration"]) and np.allclose(rank_time, dwdp["Iteration"])


class _FixedNormal:
    """Stands in for the generator: every layer's expert-skew draw is `z`."""

    def __init__(self, z):
        self.z = np.asarray(z, float)

    def standard_normal(self, shape):
        return np.broadcast_to(self.z, shape).copy()


def _own_s(tokens: float) -> float:
    """One rank's time in the ops that scale with its own tokens: all but permute, routed experts and
    their SwiGLU, which run on the rows routed to it."""
    fmt, t = cm.weight_format("bf16"), float(tokens)
    total = 0.0
    for moe in SPEC.is_moe:
        total += sum(float(op.time_s) for op in cm.attention_ops(SPEC, HW, t, t * 512.5, t, fmt))
        if moe:
            ops = cm.moe_ops(SPEC, HW, t, fmt, fmt, 4, routed_tokens=6144.0, routing_tokens=6144.0)
            total += sum(float(op.time_s) for op in ops if op.name not in ("permute", "routed_experts", "expert_act"))
        else:
            total += sum(float(op.time_s) for op in cm.dense_mlp_ops(SPEC, HW, t, fmt))
    return total


def test_dep_waits_for_the_slowest_rank():
    # Two ranks, one with twice the tokens, no expert skew: the light rank waits, at the dispatches
    # and at the end of the step, for all the heavy rank's extra own-token work (everything but the
    # expert rows between dispatch and combine, which both ranks share equally).
    deploy = cm.Deployment(2, weight_dtype="bf16")
    dep, _ = simulate_dep(SPEC, HW, deploy, cm.IDEAL, _shape([[2048.0, 4096.0]]), np.random.default_rng(0))
    wait = _own_s(4096.0) - _own_s(2048.0)
    assert math.isclose(dep["Synchronization"] * 2, wait, rel_tol=1e-9), f"waited {dep['Synchronization'] * 2}, {wait}"


def test_dep_waits_at_dispatch_and_at_combine():
    # Rank 1 has twice the tokens, rank 0 gets 1.5x the mean routed rows and rank 1 0.5x: rank 0 waits
    # at every dispatch, rank 1 at every combine, for a full mean share of the expert rows each time.
    # (One barrier per layer would let the two differences cancel.)
    deploy = cm.Deployment(2, weight_dtype="bf16")
    cal = cm.IDEAL.replace(expert_load_cv=0.5)
    dep, _ = simulate_dep(SPEC, HW, deploy, cal, _shape([[2048.0, 4096.0]]), _FixedNormal([[1.0, -1.0]]))
    fmt = cm.weight_format("bf16")
    # The group has 6144 tokens, k = 2: 6144 rows per rank on average.
    rows = cm.moe_ops(SPEC, HW, 3072.0, fmt, fmt, 4, routed_tokens=6144.0, routing_tokens=6144.0)
    mid = sum(float(op.time_s) for op in rows if op.name in ("permute", "routed_experts", "expert_act"))
    wait = _own_s(4096.0) - _own_s(2048.0) + 3 * mid
    assert math.isclose(dep["Synchronization"] * 2, wait, rel_tol=1e-9), f"waited {dep['Synchronization'] * 2}, {wait}"


def test_expert_skew_costs_dep_only():
    shape = _shape(np.full((200, 4), 4096.0))
    rows = {}
    for cv in (0.0, 0.2, 0.4):
        cal = cm.IDEAL.replace(expert_load_cv=cv)
        dep, _ = simulate_dep(SPEC, HW, DEPLOY, cal, shape, np.random.default_rng(0))
        dwdp, _, _ = simulate_dwdp(SPEC, HW, DEPLOY, cal, shape, 1.0)
        rows[cv] = (dep["Synchronization"], dwdp["Iteration"])
    syncs = [rows[cv][0] for cv in (0.0, 0.2, 0.4)]
    assert syncs[0] == 0.0 < syncs[1] < syncs[2], f"DEP sync {syncs}"
    assert rows[0.0][1] == rows[0.4][1], f"DWDP time changed with expert skew: {rows}"


def test_packed_spread_makes_dep_wait():
    # Packing alone (no expert skew, no CV override) leaves ranks unequal, and DEP pays for it.
    cfg = SimConfig(iterations=30, isl=8192, isl_ratio=0.5, max_num_tokens=16384)
    result = simulate(cfg, cm.load_calibration().replace(expert_load_cv=0.0))
    assert result.token_cv > 0.02 and result.dep["Synchronization"] > 0.0, (result.token_cv, result.dep)


def test_copy_stretch_orders_the_plans():
    deploy = cm.Deployment(4, weight_dtype="nvfp4")
    mono = copy_stretch("DeepSeek-R1", "GB200-NVL72", deploy, "monolithic", 3.0)
    tdm = copy_stretch("DeepSeek-R1", "GB200-NVL72", deploy, "tdm", 3.0)
    assert mono > tdm >= 1.0 and copy_stretch("DeepSeek-R1", "GB200-NVL72", deploy, "none", 3.0) == 1.0, (mono, tdm)


def test_preset_simulation_without_imbalance_equals_the_roofline():
    """Two separate models of one deployment: with every rank at max-num-tokens of equal prompts, no
    expert skew and no copy contention, the simulator's speedup is the roofline's DEP / DWDP forward
    time (costmodel.predict), and with the time outside the forward its tokens/s ratio; imbalance then
    only adds DEP barrier waits, so the speedup must rise."""
    cal = cm.load_calibration().replace(expert_load_cv=0.0)
    balanced = simulate(SimConfig(iterations=20, isl_ratio=1.0, cv=0.0, plan="none"), cal)
    cfg = balanced.config
    roofline = cm.predict(cm.load_model(cfg.model), cm.load_hardware(cfg.hardware),
                          cm.Workload(cfg.isl, cfg.max_num_tokens),
                          cm.Deployment(cfg.group_size, cfg.num_local_experts, cfg.weight_dtype), cal=cal)
    assert math.isclose(balanced.forward_speedup, roofline.speedup, rel_tol=1e-9), (balanced.row(), roofline.speedup)
    assert math.isclose(balanced.speedup, roofline.tps_speedup, rel_tol=1e-9), (balanced.row(), roofline.tps_speedup)
    assert balanced.row()["dep_sync_frac"] == 0.0 and balanced.token_cv == 0.0, balanced.row()
    imbalanced = simulate(dataclasses.replace(cfg, cv=0.2), cal)
    assert imbalanced.row()["dep_sync_frac"] > 0 and imbalanced.speedup > balanced.speedup, (imbalanced.row(),
                                                                                           balanced.row())


def test_preset_simulation_runs_and_reports():
    cfg = SimConfig(iterations=20, cv=0.2)
    result = simulate(cfg)
    row = result.row()
    assert result.speedup > 0 and 0 < row["dep_sync_frac"] < 0.5 and row["stretch"] >= 1.0, row
    for bad, match in [(dict(cv=-0.1), "cv=-0.1"), (dict(plan="bulk"), "plan='bulk'"), (dict(group_size=1), "group_size=1"),
                       (dict(isl_ratio=1.5), "isl_ratio=1.5")]:
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(cfg, **bad)
