"""Cost model: operator FLOPs and bytes against hand-computed values for a small config."""
import dataclasses
import math

import pytest

from dwdp.predict import costmodel as cm

# H = 64, 4 query heads, 2 KV heads, head_dim 16, E = 8 experts, top-2, I = 32, two MoE layers.
SPEC = cm.ModelSpec(
    name="tiny", hidden=64, vocab=100, num_heads=4, num_kv_heads=2, head_dim=16,
    is_moe=(True, True), window=(None, None), num_experts=8, top_k=2, moe_intermediate=32,
    shared_intermediate=0, dense_intermediate=128,
)
HW = cm.Hardware("toy", {"bf16": 1e12, "fp8": 2e12, "fp4": None, "fp32": 1e11},
                 hbm_bytes_per_s=1e9, hbm_bytes=1e12, link_bytes_per_s=1e8, domain_size=8)
BF16 = cm.weight_format("bf16")
REL = 1e-12


def _ops(workload, deploy=cm.Deployment(2, weight_dtype="bf16")):
    layer = cm.layer_costs(SPEC, HW, workload, deploy)[0]
    return {op.name: op for op in layer.ops()}


def test_operator_flops_and_bytes_by_hand():
    # Saturated: T = 16 tokens of isl-8 prompts -> 36 / 8 = 4.5 keys per query, 1 K/V row read per token.
    layer = cm.layer_costs(SPEC, HW, cm.Workload(isl=8, max_num_tokens=16), cm.Deployment(2, weight_dtype="bf16"))[0]
    names = [op.name for op in layer.ops()]
    # bf16 GEMMs take bf16 inputs: no quantize passes; no MLA, no shared experts.
    assert names == ["input_norm", "qkv_proj", "attn_prep", "attn_core", "o_proj", "post_norm", "router", "permute",
                     "routed_experts", "expert_act", "finalize"], names
    ops = {op.name: op for op in layer.ops()}
    expected = {
        # residual add + RMSNorm: read x and residual, write both (4 x 64 x 2 B per token) + the weight.
        "input_norm": (4 * 16 * 64, 16 * 64 * 4 * 2 + 64 * 2, cm.OTHERS),
        # q [64,64] k [32,64] v [32,64]: 8192 params; acts in+out 320 per token.
        "qkv_proj": (2 * 16 * 8192, 8192 * 2 + 16 * 320 * 2, cm.DENSE_GEMM),
        # read q,k,v (128 elements), write q,k after RoPE (96) and the K/V cache rows (64).
        "attn_prep": (0, 16 * 288 * 2, cm.OTHERS),
        # 72 pairs x 4 heads x (16 + 16) x 2; Q+O 16x4x32, K+V 16x2x32 elements in bf16.
        "attn_core": (2 * 72 * 4 * 32, (16 * 4 * 32 + 16 * 2 * 32) * 2, cm.ATTENTION),
        "o_proj": (2 * 16 * 4096, 4096 * 2 + 16 * 128 * 2, cm.DENSE_GEMM),
        "post_norm": (4 * 16 * 64, 16 * 64 * 4 * 2 + 64 * 2, cm.OTHERS),
        "router": (2 * 16 * 64 * 8, 64 * 8 * 2 + 16 * 64 * 2 + 16 * 8 * 4, cm.DENSE_GEMM),
        # 32 token-expert rows of 64, read and written.
        "permute": (0, 32 * 64 * 2 * 2, cm.OTHERS),
        # 32 rows through [64, 64] + [64, 32]; 8 * (1 - 0.75^16) experts touched.
        "routed_experts": (2 * 32 * 3 * 64 * 32, 8 * (1 - 0.75 ** 16) * (8192 + 4096) + 32 * (128 + 96) * 2,
                           cm.GROUPED_GEMM),
        # SwiGLU: read [32, 64] gate|up, write [32, 32].
        "expert_act": (0, 32 * 32 * (4 + 2), cm.OTHERS),
        # read 32 rows of 64, read the residual side and write [16, 64].
        "finalize": (0, 32 * 64 * 2 + 2 * 16 * 64 * 2, cm.OTHERS),
    }
    for name, (flops, nbytes, category) in expected.items():
        assert math.isclose(float(ops[name].flops), flops, rel_tol=REL), f"{name} flops {ops[name].flops} != {flops}"
        assert math.isclose(float(ops[name].bytes), nbytes, rel_tol=REL), f"{name} bytes {ops[name].bytes} != {nbytes}"
        assert ops[name].category == category, f"{name} category {ops[name].category} != {category}"
    # qkv_proj: 26624 B / 1e9 B/s beats 262144 FLOP / 1e12: memory bound.
    assert math.isclose(float(ops["qkv_proj"].time_s), 26624 / 1e9, rel_tol=REL), ops["qkv_proj"].time_s
    assert not ops["qkv_proj"].compute_bound, ops["qkv_proj"]
    assert math.isclose(float(ops["input_norm"].time_s), max(4096 / 1e11, 8320 / 1e9), rel_tol=REL)


def test_calibration_divides_peaks_per_category():
    cal = cm.Calibration(attention=0.5, grouped_gemm=0.25, dense_gemm=0.8, memory=0.4)
    hw = cm.Hardware("fast-hbm", HW.peak_flops, hbm_bytes_per_s=1e18, hbm_bytes=1e12, link_bytes_per_s=1e8,
                     domain_size=8)
    w, d = cm.Workload(isl=8, max_num_tokens=16), cm.Deployment(2, weight_dtype="bf16")
    ideal = {op.name: op for op in cm.layer_costs(SPEC, hw, w, d)[0].ops()}
    real = {op.name: op for op in cm.layer_costs(SPEC, hw, w, d, cal=cal)[0].ops()}
    for name, eff in [("attn_core", 0.5), ("routed_experts", 0.25), ("qkv_proj", 0.8), ("router", 0.8)]:
        ratio = float(real[name].time_s / ideal[name].time_s)
        assert math.isclose(ratio, 1 / eff, rel_tol=1e-9), f"{name}: time ratio {ratio} != 1/{eff}"
    # Memory-bound passes take the memory efficiency on their bytes (HBM here is so fast the FLOP term rules).
    slow_hbm = {op.name: op for op in cm.layer_costs(SPEC, HW, w, d, cal=cal)[0].ops()}
    assert math.isclose(float(slow_hbm["permute"].time_s), 32 * 64 * 4 / (1e9 * 0.4), rel_tol=REL)
    with pytest.raises(ValueError, match="memory=1.5"):
        cm.Calibration(memory=1.5)


def test_quantized_formats_add_quantize_passes():
    spec = dataclasses.replace(SPEC, shared_intermediate=32)
    layer = cm.layer_costs(spec, HW, cm.Workload(isl=8, max_num_tokens=16), cm.Deployment(2, weight_dtype="nvfp4"))[0]
    ops = {op.name: op for op in layer.ops()}
    # nvfp4 activations: half a byte per value + one e4m3 scale per 16 = 0.5625 B.
    assert float(ops["quantize_attn_in"].bytes) == 16 * 64 * (2 + 0.5625), ops["quantize_attn_in"].bytes
    assert float(ops["quantize_attn_out"].bytes) == 16 * 64 * (2 + 0.5625), ops["quantize_attn_out"].bytes
    assert float(ops["quantize_moe_in"].bytes) == 16 * 64 * (2 + 0.5625), ops["quantize_moe_in"].bytes
    assert float(ops["permute"].bytes) == 32 * 64 * 0.5625 * 2, ops["permute"].bytes
    assert float(ops["shared_experts_act"].bytes) == 16 * 32 * (4 + 0.5625), ops["shared_experts_act"].bytes
    assert cm.weight_format("fp8").act_bytes == 1 + 4 / 128


def test_mla_projections_and_core_by_hand():
    mla = cm.MLA(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    spec = cm.ModelSpec("mla", 64, 100, 2, 2, 12, (True,), (None,), 8, 2, 32, 32, 128, mla=mla)
    proj = cm.attention_projections(spec)
    assert proj == [(24, 64), (2 * 12, 24), (16 + 4, 64), (2 * (8 + 8), 16), (64, 2 * 8)], proj
    ops = {op.name: op for op in cm.attention_ops(spec, HW, 10.0, 30.0, 10.0, BF16)}
    assert float(ops["attn_core"].flops) == 2 * 30 * 2 * (12 + 8), ops["attn_core"].flops
    assert float(ops["latent_norms"].flops) == 4 * 10 * (24 + 16), ops["latent_norms"].flops
    # Read q (2x12), k_nope|v (2x16), k_pe (4); write Q, K (2x12 each), V (2x8), latent cache (16 + 4).
    assert float(ops["attn_prep"].bytes) == 10 * 2 * (24 + 32 + 4 + 48 + 16 + 20), ops["attn_prep"].bytes
    # shared experts (32 wide) run beside the routed ones.
    names = [op.name for op in cm.moe_ops(spec, HW, 10.0, BF16, BF16, 8)]
    assert names == ["post_norm", "router", "shared_experts", "shared_experts_act", "permute", "routed_experts",
                     "expert_act", "finalize"], names


def test_weight_format_bytes_exact():
    assert cm.weight_format("bf16").matrix_bytes(64, 32) == 4096
    # fp8: values + one fp32 scale per 128x128 block (2 x 3 blocks).
    assert cm.weight_format("fp8").matrix_bytes(256, 300) == 256 * 300 + 6 * 4
    # nvfp4: half a byte per value + one byte per 16 values + a 4-byte tensor scale.
    assert cm.weight_format("nvfp4").matrix_bytes(64, 32) == 1024 + 128 + 4
    spec = cm.load_model("DeepSeek-R1")
    per_param = sum(spec.expert_nbytes(cm.weight_format("nvfp4"))) / (3 * 7168 * 2048)
    assert abs(per_param - 0.5625) < 1e-6, f"nvfp4 bytes per param {per_param}"


@pytest.mark.parametrize("dtype,group_size,local,expected", [
    ("bf16", 3, None, 5 * (8192 + 4096)),          # L = ceil(8/3) = 3, 5 missing
    ("nvfp4", 3, None, 5 * (2308 + 1156)),         # gate_up 2048+256+4, down 1024+128+4
    ("nvfp4", 3, 4, 4 * (2308 + 1156)),            # one redundant local expert
    ("fp8", 2, None, 4 * (4096 + 4 + 2048 + 4)),   # one 128x128 block scale per matrix
    ("bf16", 1, None, 0),
])
def test_remote_bytes_per_layer_exact(dtype, group_size, local, expected):
    got = cm.remote_bytes_per_layer(SPEC, cm.Deployment(group_size, local, dtype))
    assert got == expected, f"{dtype} G={group_size} L={local}: {got} != {expected}"
    hw_time = cm.prefetch_time(SPEC, HW, cm.Deployment(group_size, local, dtype))
    assert math.isclose(hw_time, expected / 1e8, rel_tol=REL), hw_time


def test_chunked_and_windowed_attention_counts():
    w = cm.Workload(isl=20, max_num_tokens=8)
    assert w.pairs_per_token(None) == 210 / 20, w.pairs_per_token(None)
    assert w.keys_read_per_token(None) == (8 + 16 + 20) / 20, w.keys_read_per_token(None)
    assert w.pairs_per_token(4) == (10 + 16 * 4) / 20, w.pairs_per_token(4)
    assert w.keys_read_per_token(4) == (8 + 12 + 8) / 20, w.keys_read_per_token(4)
    assert cm.Workload(isl=10, max_num_tokens=16, batch=3).tokens == 15.0
    with pytest.raises(ValueError, match="isl=0"):
        cm.Workload(isl=0)


def test_remote_ranks_per_token_by_hand():
    # E = 8 on 2 ranks of 4, top-2: P(token reaches the other rank) = 1 - C(4,2)/C(8,2) = 22/28.
    got = cm.remote_ranks_per_token(8, 2, 2)
    assert math.isclose(got, 22 / 28, rel_tol=REL), got
    assert cm.remote_ranks_per_token(8, 1, 2) == 0.0


def test_presets_read_from_transformers_configs():
    ds = cm.load_model("DeepSeek-R1")
    assert ds.is_moe[:3] == (False,) * 3 and ds.num_moe_layers == 58, ds.is_moe[:5]
    assert ds.mla is not None and ds.mla.kv_lora_rank == 512 and ds.shared_intermediate == 2048
    qw = cm.load_model("Qwen3-235B-A22B")
    assert (qw.num_moe_layers, qw.num_experts, qw.num_kv_heads, qw.qk_norm) == (94, 128, 4, True)
    oss = cm.load_model("gpt-oss-120b")
    assert oss.window[:2] == (128, None) and oss.expert_bias and oss.top_k == 4, oss.window[:2]
    mx = cm.load_model("Mixtral-8x22B")
    assert (mx.head_dim, mx.num_experts, mx.moe_intermediate) == (128, 8, 16384)
    for name in cm.hardware_names():
        hw = cm.load_hardware(name)
        assert hw.peak("fp4") >= hw.peak("fp8") >= hw.peak("bf16") > 0, name


@pytest.mark.parametrize("model", ["DeepSeek-R1", "gpt-oss-120b"])
@pytest.mark.parametrize("hw_name", ["H100-HGX", "GB200-NVL72"])
def test_monotonic_in_isl(model, hw_name):
    spec, hw = cm.load_model(model), cm.load_hardware(hw_name)
    deploy = cm.Deployment(4, weight_dtype="fp8")
    isls = [512, 1024, 4096, 8192, 16384, 65536]
    for batch, mnt in [(None, 8192), (1, 65536)]:
        preds = [cm.predict(spec, hw, cm.Workload(isl, mnt, batch), deploy) for isl in isls]
        compute = [p.t_compute for p in preds]
        # Non-decreasing (short prompts leave attention memory-bound and flat), rising overall.
        assert all(a <= b for a, b in zip(compute, compute[1:])), f"batch={batch}: T_compute {compute}"
        assert compute[-1] > 1.5 * compute[0], f"batch={batch}: T_compute {compute}"
        prefetch = {p.t_prefetch for p in preds}
        assert len(prefetch) == 1, f"T_prefetch depends on ISL: {prefetch}"


def test_crossover_is_the_first_hidden_isl():
    spec, hw = cm.load_model("DeepSeek-R1"), cm.load_hardware("GB200-NVL72")
    deploy = cm.Deployment(4, weight_dtype="nvfp4")
    isl = cm.crossover_isl(spec, hw, deploy, max_num_tokens=8192)
    assert isl is not None and isl > 1, isl
    at, before = (cm.predict(spec, hw, cm.Workload(i, 8192), deploy) for i in (isl, isl - 1))
    assert at.dwdp_exposed_s <= 1e-9 * at.dwdp_forward_s < before.dwdp_exposed_s, (isl, at.dwdp_exposed_s,
                                                                                  before.dwdp_exposed_s)
