"""The Triton grouped GEMM on fp8 weights with block scales (interpreter on CPU) against the reference,
which dequantizes each expert's weights to the activations' dtype and multiplies in that dtype; and
with fp8 activations (fp8 x fp8 dots), against the reference quantizing the activations alike.

Legend: R = rows an experts call computes, K = input features, N = output features, E = experts, bn = weight
rows one block scale covers, bk = weight columns one block scale covers.
The kernel dequantizes each weight tile in fp32 and rounds it to the activations' dtype, exactly as
the reference does, so fp32 differs only in summation order (1e-5 relative); in bf16 each side rounds
its fp32 sums once, so outputs differ by at most two bf16 steps of the largest output (2^-6 relative).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from dwdp.kernels import BlockQuant, Epilogue, GroupedGemmConfig, grouped_gemm, grouped_gemm_reference, moe_experts, moe_experts_reference, quantize_fp8

pytestmark = pytest.mark.timeout(120)

TINY = GroupedGemmConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2**-6)}


def _experts(gen, num_experts, rows, cols, quant, scale_fmt="float", num_buffers=2):
    """E fp8 weight views [N, K] and their scale views, spread over `num_buffers` stacked buffers each
    (a local parameter and a prefetch slot)."""
    dense = torch.randn(num_experts, rows, cols, generator=gen) / cols ** 0.5
    q, s = quantize_fp8(dense, quant, scale_fmt)
    buffers = [(q[b::num_buffers].clone(), s[b::num_buffers].clone()) for b in range(num_buffers)]
    weights = [buffers[e % num_buffers][0][e // num_buffers] for e in range(num_experts)]
    scales = [buffers[e % num_buffers][1][e // num_buffers] for e in range(num_experts)]
    return weights, scales


def _close(actual, expected, dtype, what, tol=None):
    """max |actual - expected| <= atol + rtol * max |expected|."""
    assert actual.dtype == expected.dtype == dtype, (what, actual.dtype, expected.dtype)
    tol = tol or TOL[dtype]
    bound = tol["atol"] + tol["rtol"] * expected.float().abs().max().item()
    diff = (actual.float() - expected.float()).abs().max().item()
    assert diff <= bound, f"{what}: max|diff|={diff:.3e} > {bound:.3e}"


@pytest.mark.parametrize("rows,cols,block,scale_fmt", [
    (32, 48, (16, 16), "float"),     # blocks divide both dims
    (40, 36, (7, 5), "float"),       # neither dim a multiple of the block (ragged last blocks)
    (24, 40, (128, 128), "ue8m0"),   # one block per matrix, e8m0 scales
    (48, 20, (32, 24), "float"),     # block wider than the kernel's K tile, K not a multiple of either
], ids=["divide", "ragged", "one_block_e8m0", "wide_block"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_gemm_fp8_matches_reference(rows, cols, block, scale_fmt, dtype):
    gen = torch.Generator().manual_seed(rows * cols)
    quant = BlockQuant("fp8", block)
    weights, scales = _experts(gen, 4, rows, cols, quant, scale_fmt)
    offsets = [0, 5, 5, 6, 23]                                              # expert 1 has no rows, expert 2 one
    x = torch.randn(offsets[-1], cols, generator=gen).to(dtype)
    got = grouped_gemm(x, torch.tensor(offsets), weights, weight_scales=scales, quant=quant, config=TINY)
    expected = grouped_gemm_reference(x, offsets, weights, weight_scales=scales, quant=quant)
    _close(got, expected, dtype, f"{rows}x{cols} blocks {block} {scale_fmt}")


@pytest.mark.parametrize("block,scale_fmt", [((16, 16), "float"), ((7, 32), "ue8m0")], ids=["16x16", "7x32_e8m0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grouped_gemm_fp8_activations_match_reference(block, scale_fmt, dtype):
    """fp8 x fp8 dots: x quantized per row and block of K columns, each K tile scaled by both scales.
    The reference dequantizes both to fp32 and multiplies: the same products, summed in another order."""
    gen = torch.Generator().manual_seed(11)
    quant = BlockQuant("fp8", block)
    weights, scales = _experts(gen, 3, 40, 36, quant, scale_fmt)
    offsets = [0, 4, 4, 11]
    x = torch.randn(offsets[-1], 36, generator=gen).to(dtype)
    args = dict(weight_scales=scales, quant=quant, fp8_activations=True)
    got = grouped_gemm(x, torch.tensor(offsets), weights, config=TINY, **args)
    expected = grouped_gemm_reference(x, offsets, weights, **args)
    _close(got, expected, dtype, f"fp8 activations {block} {scale_fmt}")


@pytest.mark.parametrize("fp8_activations", [False, True], ids=["bf16_dots", "fp8_dots"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_experts_fp8_gate_up_blocked_per_half(dtype, fp8_activations):
    """The fused MoE path: [gate; up] with I = 24 not a multiple of bn = 16 (each half blocked apart),
    local-first split, routing weights applied in the down GEMM."""
    gen = torch.Generator().manual_seed(7)
    hidden_dim, inter, num_experts, tokens, top_k = 40, 24, 5, 9, 2
    first_quant, down_quant = BlockQuant("fp8", (16, 16), halves=2), BlockQuant("fp8", (16, 16))
    gate_up, gate_up_scales = _experts(gen, num_experts, 2 * inter, hidden_dim, first_quant)
    down, down_scales = _experts(gen, num_experts, hidden_dim, inter, down_quant)
    hidden = torch.randn(tokens, hidden_dim, generator=gen).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=gen)
    weights, index = torch.topk(logits.softmax(-1), top_k, dim=-1)
    args = dict(first_scales=gate_up_scales, down_scales=down_scales, first_quant=first_quant, down_quant=down_quant,
                fp8_activations=fp8_activations)
    got = moe_experts(hidden, index, weights, gate_up, down, split_at=2, on_local_done=lambda: None, config=TINY,
                      **args)
    # fp32 reference on the same fp8 weights: as in test_moe_kernel, the bf16 kernel rounds h between the
    # GEMMs, the fp32 reference does not (bf16 within 3e-2 of the largest output). With fp8 dots the
    # reference quantizes the activations as the kernel does, h rounded to the kernel's dtype first.
    reference_hidden = hidden.float() if not fp8_activations else hidden
    expected = moe_experts_reference(reference_hidden, index, weights, gate_up, down, **args).float()
    assert got.dtype == dtype, got.dtype
    tol = TOL[dtype] if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    _close(got.float(), expected, torch.float32, "moe_experts fp8", tol)


def test_fp8_weights_need_their_scales():
    gen = torch.Generator().manual_seed(3)
    quant = BlockQuant("fp8", (16, 16))
    weights, scales = _experts(gen, 2, 32, 32, quant)
    x = torch.randn(4, 32, generator=gen)
    offsets = torch.tensor([0, 2, 4])
    with pytest.raises(ValueError, match=r"weights have dtype torch.float8_e4m3fn but x_sorted has torch.float32 "
                                         r"\(fp8 weights need weight_scales\)"):
        grouped_gemm(x, offsets, weights, config=TINY)
    with pytest.raises(ValueError, match=r"weight_scales\[1\] has shape \[2, 1\], expected \[2, 2\]: one scale per "
                                         r"16 x 16 block of its \[32, 32\] weight"):
        grouped_gemm(x, offsets, weights, weight_scales=[scales[0], scales[1][:, :1]], quant=quant, config=TINY)
    with pytest.raises(ValueError, match=r"weight_scales: the Triton kernel reads fp8 weights with block scales, not "
                                         r"mxfp4"):
        grouped_gemm(x, offsets, weights, weight_scales=scales, quant=BlockQuant("mxfp4", (1, 32)), config=TINY)
    down = [torch.randn(32, 16, generator=gen) for _ in range(2)]                      # [H, I]
    with pytest.raises(ValueError, match=r"fp8_activations needs scale blocks whose 8 columns a power-of-two K tile "
                                         r">= 16 divides \(weight_scales\)"):
        grouped_gemm(x, offsets, weights, weight_scales=[s.repeat_interleave(2, 1) for s in scales],
                     quant=BlockQuant("fp8", (16, 8)), fp8_activations=True, config=TINY)
    with pytest.raises(ValueError, match=r"first_scales needs its BlockQuant"):
        moe_experts(x, torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1), weights, down, first_scales=scales,
                    epilogue=Epilogue(), config=TINY)


@pytest.mark.parametrize("fp8_activations", [False, True], ids=["bf16_dots", "fp8_dots"])
@pytest.mark.parametrize("scale_fmt", ["float", "ue8m0"])
def test_one_weight_scale_per_tile_where_tiles_sit_in_scale_blocks(fp8_activations, scale_fmt):
    """[gate; up] of 2 x 32 rows blocked per half in 32 x 32 blocks, 16-row tiles: the kernel reads one
    weight scale per tile and K step (gate and up alike) instead of one per column."""
    from dwdp.kernels import device_info, expert_weight_table, launch_config, scale_table, swiglu_reference
    from dwdp.kernels.grouped_gemm import kernel_problem

    gen = torch.Generator().manual_seed(23)
    quant = BlockQuant("fp8", (32, 32), halves=2)
    weights, scales = _experts(gen, 3, 64, 64, quant, scale_fmt)
    offsets = [0, 9, 9, 30]
    x = torch.randn(offsets[-1], 64, generator=gen)
    table = expert_weight_table(weights)
    problem = kernel_problem(torch.float8_e4m3fn if fp8_activations else torch.float32, table, num_rows=30,
                             epilogue=Epilogue(), scales=scale_table(scales, quant, table, "scales"))
    assert dict(launch_config(problem, device_info(torch.device("cpu")), TINY).constexprs)["W_SCALE_TILE"] is True
    args = dict(weight_scales=scales, quant=quant, fp8_activations=fp8_activations)
    got = grouped_gemm(x, torch.tensor(offsets), weights, activation="swiglu", config=TINY, **args)
    expected = swiglu_reference(grouped_gemm_reference(x, offsets, weights, **args))
    _close(got, expected, torch.float32, f"per-tile scales {scale_fmt} fp8_activations={fp8_activations}")


@pytest.mark.parametrize("down_block_cols", [16, 32], ids=["h_fp8_from_gate_up", "h_quantized_apart"])
def test_fp8_dots_h_leaves_gate_up_in_fp8_where_its_tiles_hold_whole_groups(down_block_cols):
    """With fp8 dots the down GEMM reads h in fp8 with one scale per row and block of its K columns. Where
    gate_up's 16-column tiles hold whole groups (16), its epilogue writes h so; where they do not (32),
    h is stored and quantized apart. Both equal the reference, which quantizes h rounded to bf16."""
    from dwdp.kernels import device_info, expert_weight_table, moe_launch_configs, scale_table

    gen = torch.Generator().manual_seed(29)
    hidden_dim, inter, num_experts, tokens, top_k = 48, 32, 4, 11, 2
    first_quant, down_quant = BlockQuant("fp8", (16, 16), halves=2), BlockQuant("fp8", (16, down_block_cols))
    gate_up, gate_up_scales = _experts(gen, num_experts, 2 * inter, hidden_dim, first_quant)
    down, down_scales = _experts(gen, num_experts, hidden_dim, inter, down_quant)
    hidden = torch.randn(tokens, hidden_dim, generator=gen).bfloat16()
    weights, index = torch.topk(torch.randn(tokens, num_experts, generator=gen).softmax(-1), top_k, dim=-1)
    args = dict(first_scales=gate_up_scales, down_scales=down_scales, first_quant=first_quant, down_quant=down_quant,
                fp8_activations=True)
    gate_up_table, down_table = expert_weight_table(gate_up), expert_weight_table(down)
    first, _ = moe_launch_configs(
        torch.bfloat16, gate_up_table, down_table, num_slots=tokens * top_k, device=device_info(torch.device("cpu")),
        first_scales=scale_table(gate_up_scales, first_quant, gate_up_table, "first"),
        down_scales=scale_table(down_scales, down_quant, down_table, "down"), fp8_activations=True, config=TINY)
    assert first.quant_out == (down_block_cols == 16), first
    got = moe_experts(hidden, index, weights, gate_up, down, split_at=2, on_local_done=lambda: None, config=TINY,
                      **args)
    expected = moe_experts_reference(hidden, index, weights, gate_up, down, **args)
    _close(got.float(), expected.float(), torch.float32, f"h blocks of {down_block_cols}", dict(atol=1e-2, rtol=2**-6))
