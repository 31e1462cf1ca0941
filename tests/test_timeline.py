"""Copy interference (power and HBM sharing) and the DWDP rank timeline, against hand-computed values."""
import math

import numpy as np
import pytest

from dwdp.predict import costmodel as cm
from dwdp.predict.costmodel.timeline import uniform_layers_wait

POWER = cm.PowerFigures(limit_w=1200, idle=0.129, compute=0.967, copy_w_per_tb_s=163.7)
HW = cm.Hardware("toy", {"bf16": 1e15, "fp8": 2e15, "fp4": None, "fp32": 1e14}, hbm_bytes_per_s=8e12,
                 hbm_bytes=1e11, link_bytes_per_s=9e11, domain_size=72, power=POWER, copy_engine_efficiency=0.85)


def test_copy_slowdown_by_hand():
    s = cm.copy_slowdown(HW, 0.5e12, cm.Calibration(memory=0.5))
    # 1 TB/s in + out of 4 TB/s reachable: a quarter of the bandwidth.
    assert math.isclose(s.hbm_share, 0.25) and math.isclose(s.memory, 1 / 0.75), s
    copy_power = 163.7 / 1200  # 1 TB/s of copy traffic
    assert math.isclose(s.power_demand, 0.967 + copy_power), s
    clock = (1 - 0.129 - copy_power) / (0.967 - 0.129)
    assert math.isclose(s.clock, clock) and math.isclose(s.compute, 1 / clock), s
    cubic = cm.copy_slowdown(HW, 0.5e12, cm.Calibration(memory=0.5, clock_power_exponent=3.0))
    assert math.isclose(cubic.clock, clock ** (1 / 3)), cubic
    # A trickle of copies keeps the demand under the limit: no clock drop.
    assert cm.copy_slowdown(HW, 1e10, cm.IDEAL).compute == 1.0
    no_power = cm.Hardware("toy", HW.peak_flops, 8e12, 1e11, 9e11, 72)
    assert cm.copy_slowdown(no_power, 0.5e12, cm.IDEAL).compute == 1.0


def test_copy_slowdown_rejects_impossible_traffic():
    with pytest.raises(ValueError, match="takes all the HBM bandwidth"):
        cm.copy_slowdown(HW, 2e12, cm.Calibration(memory=0.5))
    with pytest.raises(ValueError, match="pull_bytes_per_s=-1"):
        cm.copy_slowdown(HW, -1, cm.IDEAL)


def test_gb200_power_figures_give_the_papers_demand():
    # The paper: attention 96.7 % + copies 30.5 % - idle 12.9 % -> ~114 % at Table 1's copy traffic.
    hw = cm.load_hardware("GB200-NVL72")
    s = cm.copy_slowdown(hw, 1.29e12 / 2, cm.IDEAL)
    assert abs(s.power_demand - (0.967 + 0.305 - 0.129)) < 1e-3, s.power_demand
    for name in cm.hardware_names():
        sources = cm.hardware_sources(name)
        for key in ("power_limit_w", "idle_power_fraction", "compute_power_fraction", "copy_power_w_per_tb_s",
                    "copy_engine_efficiency"):
            assert len(sources[key]) > 20, f"{name}.{key} has no source: {sources[key]!r}"


def _op(name, category, seconds, compute_bound=True):
    return cm.OpCost(name, category, 0.0, 0.0, "fp32", seconds, compute_bound)


def test_timeline_slows_what_overlaps_the_copy():
    # Two MoE layers of [attention 2 s, grouped GEMM 1 s]; copies of 1.5 s double compute time.
    layer = [_op("attn_core", cm.ATTENTION, 2.0), _op("routed_experts", cm.GROUPED_GEMM, 1.0)]
    slow = cm.CopySlowdown(compute=2.0, memory=1.0)
    t = cm.dwdp_timeline([layer, layer], [True, True], 1.5, slow)
    # Steady state: each copy is issued at the end of a MoE block and covers 1.5 s of the next
    # attention (0.75 s of its work at half speed), the other 1.25 s runs at full speed: 2.75 s.
    assert math.isclose(float(t.category_s[cm.ATTENTION]), 5.5), t.category_s
    assert math.isclose(float(t.overlapped_s[cm.ATTENTION]), 3.0), t.overlapped_s
    assert math.isclose(float(t.category_s[cm.GROUPED_GEMM]), 2.0), t.category_s
    assert float(t.wait_s) == 0.0 and math.isclose(float(t.total_s), 7.5), (t.wait_s, t.total_s)
    assert math.isclose(float(t.copy_s), 3.0), t.copy_s


def test_timeline_exposes_a_copy_longer_than_a_layer():
    # Layers of 3 s, copies of 4 s on one engine: a copy every 4 s at best, 1 s waited per layer.
    layer = [_op("attn_core", cm.ATTENTION, 2.0), _op("routed_experts", cm.GROUPED_GEMM, 1.0)]
    t = cm.dwdp_timeline([layer, layer], [True, True], 4.0, cm.CopySlowdown(1.0, 1.0))
    assert math.isclose(float(t.wait_s), 2.0) and math.isclose(float(t.total_s), 8.0), (t.wait_s, t.total_s)
    # Per-rank arrays walk elementwise: the short copy hides, the long one does not.
    t = cm.dwdp_timeline([layer, layer], [True, True], np.array([1.0, 4.0]), cm.CopySlowdown(1.0, 1.0))
    assert np.allclose(t.wait_s, [0.0, 2.0]), t.wait_s
    assert math.isclose(uniform_layers_wait(1.0, 1.5, 10), 0.5) and uniform_layers_wait(1.0, 1.0, 10) == 0.0


def test_timeline_merge_copy_and_dense_layers():
    # A dense layer first: its MLP is not a MoE block (no wait, no release); the merge copy runs
    # before every grouped GEMM, slowed as a memory-bound op while copies run. Copies of 1.2 s: the
    # one issued after MoE 0 still runs 0.2 s into MoE 1's merge (0.1 s of work at half speed).
    dense = [_op("attn_core", cm.ATTENTION, 1.0), _op("dense_mlp", cm.DENSE_GEMM, 1.0)]
    moe = [_op("attn_core", cm.ATTENTION, 1.0), _op("routed_experts", cm.GROUPED_GEMM, 1.0)]
    merge = _op("merge_copy", cm.OTHERS, 0.25, compute_bound=False)
    t = cm.dwdp_timeline([dense, moe, moe], [False, True, True], 1.2, cm.CopySlowdown(1.0, 2.0), merge)
    assert math.isclose(float(t.merge_s), 0.25 + 0.35) and float(t.wait_s) == 0.0, (t.merge_s, t.wait_s)
    assert math.isclose(float(t.total_s), 6.6), t.total_s
    with pytest.raises(ValueError, match="num_buffers=1"):
        cm.dwdp_timeline([moe], [True], 0.5, cm.CopySlowdown(1.0, 1.0), num_buffers=1)
