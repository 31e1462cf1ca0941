"""Block-scaled weights in one process: the formats against transformers' own dequantization, the
reference path dequantizing one expert at a time, plans carrying scales with their expert, and bad
input (scales that do not match their weight's blocks, an unsupported quantization_config)."""
import json
import weakref

import pytest
import torch

from dwdp.models.adapters import Unsupported, find_experts
from dwdp.kernels import grouped_gemm_reference
from dwdp.kernels import reference as reference_module
from dwdp.kernels.block_scales import (
    BlockQuant,
    check_scale_shape,
    dequantize_fp8,
    dequantize_mxfp4,
    dequantize_rows,
    quantize_fp8,
    quantize_mxfp4,
    quantize_rows_fp8,
)
from dwdp.models.loading import CheckpointError
from dwdp.runtime.model import DWDPModel
from dwdp.runtime.placement import build_placement
from dwdp.runtime.plan import SegmentLayout, build_copy_plan, slot_layout
from dwdp.models.quantization import ExpertsQuantization
from dwdp.models.tiny_quantized import build_tiny_quantized, save_quantized_checkpoint

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("block", [(128, 128), (16, 48), (7, 5)], ids=str)
def test_fp8_dequantize_matches_transformers(block):
    """Plain blocking (halves=1) is transformers' Fp8Dequantize on shapes its grid divides; ours also
    takes ceil blocks. Either way: W = W_q * s[n // bn, k // bk] exactly, and the round trip is within
    half an fp8 step (2^-4 relative to the block's max)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(2, 70, 100, generator=gen)                         # [E, N, K]
    quant = BlockQuant("fp8", block)
    q, s = quantize_fp8(weight, quant)
    assert q.dtype == torch.float8_e4m3fn and tuple(s.shape) == (2, *quant.scale_shape(70, 100)), (q.dtype, s.shape)
    for e in range(2):
        got = dequantize_fp8(q[e], s[e], quant, torch.float32)
        rows = torch.arange(70).div(block[0], rounding_mode="floor")
        cols = torch.arange(100).div(block[1], rounding_mode="floor")
        expected = q[e].float() * s[e][rows][:, cols]
        assert torch.equal(got, expected), (got - expected).abs().max()
        step = s[e][rows][:, cols] * 16                                       # 2^-4 of 448 per scale unit
        assert ((got - weight[e]).abs() <= step).all(), ((got - weight[e]).abs() - step).max()
    if 70 % block[0] == 0 and 100 % block[1] == 0:
        theirs = Fp8Dequantize(None)._dequantize_one(q[0], s[0], torch.float32)
        assert torch.equal(theirs, dequantize_fp8(q[0], s[0], quant, torch.float32))


def test_fused_gate_up_halves_blocked_apart():
    """[gate; up] with I not a multiple of the block: each half has its own scale rows, as gate_proj and
    up_proj quantized apart and concatenated (per-expert checkpoints) give."""
    gen = torch.Generator().manual_seed(2)
    gate, up = torch.randn(2, 24, 32, generator=gen), 5 * torch.randn(2, 24, 32, generator=gen)
    plain = BlockQuant("fp8", (16, 16))
    halves = BlockQuant("fp8", (16, 16), halves=2)
    q_gate, s_gate = quantize_fp8(gate, plain)
    q_up, s_up = quantize_fp8(up, plain)
    q, s = quantize_fp8(torch.cat([gate, up], dim=1), halves)
    assert torch.equal(q.view(torch.uint8), torch.cat([q_gate, q_up], dim=1).view(torch.uint8))
    assert torch.equal(s, torch.cat([s_gate, s_up], dim=1)), (s.shape, s_gate.shape)
    both = dequantize_fp8(q[1], s[1], halves, torch.float32)
    assert torch.equal(both[:24], dequantize_fp8(q_gate[1], s_gate[1], plain, torch.float32))
    assert torch.equal(both[24:], dequantize_fp8(q_up[1], s_up[1], plain, torch.float32))


def test_ue8m0_scales_are_powers_of_two():
    weight = torch.randn(40, 64, generator=torch.Generator().manual_seed(3)) * 3
    q, s = quantize_fp8(weight, BlockQuant("fp8", (16, 32)), "ue8m0")
    assert s.dtype == torch.float8_e8m0fnu
    exponents = torch.log2(s.float())
    assert torch.equal(exponents, exponents.round()), exponents
    got = dequantize_fp8(q, s, BlockQuant("fp8", (16, 32)), torch.float32)
    assert (got - weight).abs().max() <= s.float().max() * 32, (got - weight).abs().max()


@pytest.mark.parametrize("rows,cols", [(1, 300), (2, 300), (3, 300), (17, 300), (1, 100), (5, 100)])
def test_groups_first_activation_scales_are_laid_out_group_after_group_at_every_row_count(rows, cols):
    """quantize_rows_fp8(groups_first=True): scales [R, G] over [G, R] storage, strides (1, R), also for one
    row or one group (where `.t().contiguous().t()` leaves (G, 1) and the kernel would specialise apart),
    with the same values as the row-major layout."""
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 3  # [R, K]
    q, scales = quantize_rows_fp8(x, 128, groups_first=True)
    q_rows, scales_rows = quantize_rows_fp8(x, 128)
    groups = -(-cols // 128)
    assert scales.shape == (rows, groups) and scales.stride() == (1, rows), (scales.shape, scales.stride())
    assert torch.equal(q.view(torch.uint8), q_rows.view(torch.uint8)) and torch.equal(scales, scales_rows)
    # e4m3: 3 mantissa bits (half a step: 2^-4 relative), subnormals spaced 2^-9 times the scale
    torch.testing.assert_close(dequantize_rows(q, scales, 128), x, rtol=2**-4, atol=scales.max().item() * 2**-10)


def test_mxfp4_matches_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    weight = torch.randn(3, 20, 64, generator=torch.Generator().manual_seed(4))   # [E, N, K]
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (3, 20, 2, 16) and scales.shape == (3, 20, 2), (blocks.shape, scales.shape)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)       # [E, K, N]
    ours = torch.stack([dequantize_mxfp4(blocks[e], scales[e], torch.float32) for e in range(3)])
    assert torch.equal(theirs.transpose(1, 2), ours)
    # Within half the largest e2m1 step (1 of the scaled 6) times the group's scale, itself below max / 3.
    group_max = weight.abs().unflatten(-1, (2, 32)).amax(-1).repeat_interleave(32, -1)
    assert ((ours - weight).abs() <= group_max / 3).all(), ((ours - weight).abs() - group_max / 3).max()


def test_reference_dequantizes_one_expert_at_a_time(monkeypatch):
    """grouped_gemm_reference never holds two dequantized experts, and skips experts without rows."""
    gen = torch.Generator().manual_seed(5)
    quant = BlockQuant("fp8", (16, 16))
    q, s = quantize_fp8(torch.randn(6, 32, 48, generator=gen), quant)           # [E, N, K]
    x = torch.randn(10, 48, generator=gen)
    offsets = [0, 3, 3, 5, 9, 9, 10]                                            # experts 1 and 4 have no rows
    alive, calls = [], []
    original = reference_module.dequantize

    def tracking(weight, scale, quant_, dtype):
        assert not [r for r in alive if r() is not None], "a dequantized expert is still alive"
        out = original(weight, scale, quant_, dtype)
        alive.append(weakref.ref(out))
        calls.append(weight.data_ptr())
        return out

    monkeypatch.setattr(reference_module, "dequantize", tracking)
    got = grouped_gemm_reference(x, offsets, list(q.unbind(0)), weight_scales=list(s.unbind(0)), quant=quant)
    assert calls == [q[e].data_ptr() for e in (0, 2, 3, 5)], calls
    dense = [dequantize_fp8(q[e], s[e], quant, torch.float32) for e in range(6)]
    expected = grouped_gemm_reference(x, offsets, dense)
    assert torch.equal(got, expected), (got - expected).abs().max()


def test_plan_lands_scales_with_their_expert():
    """Each expert's slices cover its values and its scales in the slot, and nothing else: the
    expert is ready (its last slice landed) only with its scales."""
    model, _ = build_tiny_quantized("deepseek_v3", ExpertsQuantization("fp8", (16, 16)), seed=0)
    spec = find_experts(model)[0].spec
    nbytes = tuple(t.stride_bytes for t in spec.moving)
    assert len(nbytes) == 4, [t.name for t in spec.moving]                       # values and scales of 2 projections
    placement = build_placement(spec.num_experts, 3)
    segment = SegmentLayout(2, placement.num_local_experts, nbytes)
    plan = build_copy_plan(placement, 0, 1, 0, segment, slice_bytes=40)
    layout = slot_layout(placement, 0, nbytes)
    for p_index, experts in enumerate(layout.experts_by_peer):
        for i, expert in enumerate(experts):
            wanted = {b for t in range(4) for b in range(layout.offset(p_index, i, t),
                                                          layout.offset(p_index, i, t) + nbytes[t])}
            covered = {b for s in plan.slices if s.expert == expert for b in range(s.dst_offset, s.dst_offset + s.nbytes)}
            assert covered == wanted, (expert, len(covered), len(wanted))


# -- bad input --------------------------------------------------------------------------------------
def test_scale_shape_not_matching_blocks_in_memory():
    model, _ = build_tiny_quantized("deepseek_v3", ExpertsQuantization("fp8", (16, 16)), seed=0)
    experts = find_experts(model)[0].module
    experts.down_proj_scale_inv = torch.nn.Parameter(torch.ones(8, 2, 4), requires_grad=False)
    with pytest.raises(Unsupported, match=r"down_proj_scale_inv has shape \[8, 2, 4\], expected \[8, 2, 3\]: one "
                                          r"scale per 16 x 16 block of down_proj \[8, 32, 48\]"):
        DWDPModel(model)
    with pytest.raises(ValueError, match=r"w_scale has \[2, 4\] scales per expert, expected \[2, 3\]"):
        check_scale_shape(BlockQuant("fp8", (16, 16)), 32, 48, (2, 4), "w_scale")


def test_fp8_values_without_scales_in_memory():
    model, _ = build_tiny_quantized("deepseek_v3", ExpertsQuantization("fp8", (16, 16)), seed=0)
    experts = find_experts(model)[0].module
    del experts._parameters["gate_up_proj_scale_inv"]
    with pytest.raises(Unsupported, match=r"gate_up_proj_scale_inv is missing; float8_e4m3fn gate_up_proj needs its "
                                          r"block scales"):
        DWDPModel(model)


@pytest.fixture
def fp8_checkpoint(tmp_path):
    save_quantized_checkpoint(tmp_path, "deepseek_v3", ExpertsQuantization("fp8", (16, 16)), seed=0, num_shards=2)
    return tmp_path


def _rewrite(path, key, change):
    from safetensors.torch import load_file, save_file

    shard = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][key]
    tensors = load_file(str(path / shard))
    change(tensors)
    save_file(tensors, str(path / shard), metadata={"format": "pt"})
    return shard


def test_checkpoint_scale_shape_not_matching_blocks(fp8_checkpoint):
    key = "model.layers.1.mlp.experts.gate_up_proj_scale_inv"
    shard = _rewrite(fp8_checkpoint, key, lambda t: t.update({key: t[key][:, :3].clone()}))
    with pytest.raises(CheckpointError, match=rf"{shard}: tensor '{key}' has shape \[8, 3, 2\], expected \[8, 6, 2\]: "
                                              r"one scale per 16 x 16 block of model.layers.1.mlp.experts.gate_up_proj "
                                              r"\[96, 32\] per expert \(gate and up blocked apart\)"):
        DWDPModel.from_pretrained(fp8_checkpoint)


def test_checkpoint_dense_scale_shape_not_matching_blocks(fp8_checkpoint):
    key = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    shard = _rewrite(fp8_checkpoint, key, lambda t: t.update({key: torch.ones(5, 5)}))
    with pytest.raises(CheckpointError, match=rf"{shard}: tensor '{key}' has shape \[5, 5\], expected \[2, 2\]: one "
                                              r"scale per 16 x 16 block of 'model.layers.0.self_attn.o_proj.weight'"):
        DWDPModel.from_pretrained(fp8_checkpoint)


@pytest.mark.parametrize("config, message", [
    ({"quant_method": "awq", "bits": 4}, r"quant_method='awq' is not supported; dwdp reads 'fp8'"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, r"activation_scheme='static' is not supported"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "fp4"},
     r"expert_dtype='fp4' is not supported"),
], ids=["awq", "static", "fp4"])
def test_unsupported_quantization_config(fp8_checkpoint, config, message):
    path = fp8_checkpoint / "config.json"
    data = json.loads(path.read_text())
    data["quantization_config"] = config
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=rf"config.json: quantization_config {message}"):
        DWDPModel.from_pretrained(fp8_checkpoint)


def test_fp8_checkpoint_without_quantization_config(fp8_checkpoint):
    path = fp8_checkpoint / "config.json"
    data = json.loads(path.read_text())
    del data["quantization_config"]
    path.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"gate_up_proj_scale_inv' looks like quantized weights: is config.json "
                                              r"missing the checkpoint's quantization_config\?"):
        DWDPModel.from_pretrained(fp8_checkpoint)
    # The scales alone, gone too: the fp8 values are still never cast to the model's dtype.
    index_path = fp8_checkpoint / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.endswith("_scale_inv")}
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"is torch.float8_e4m3fn where the model expects torch.bfloat16: quantized "
                                              r"values are never cast"):
        DWDPModel.from_pretrained(fp8_checkpoint)
