"""The TMA path of the grouped GEMM (device-built tensor descriptors over the pointer table), run in
the Triton interpreter, which executes the descriptors' indexing: odd shapes against the reference.

Legend: R = rows an experts call computes (sorted by expert), K = input features, N = output features (the
weight rows), E = experts, Bw = weight buffers (distinct ones).
Tiles are 16 (tma=True) so that sizes cross tile edges; K is a multiple of 4 (fp32) or 8 (bf16): TMA
needs 16-byte rows, and shapes that are not go to the pointer path (checked below too).
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from dwdp.kernels import BlockQuant, Epilogue, GroupedGemmConfig, device_info, expert_weight_table, grouped_gemm, grouped_gemm_reference, launch_config, moe_experts, moe_experts_reference, quantize_fp8
from dwdp.kernels.grouped_gemm import kernel_problem  # noqa: E402

pytestmark = pytest.mark.timeout(120)

TMA = GroupedGemmConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1, tma=True)
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
CPU = torch.device("cpu")


def _buffers(gen, shapes_per_expert, num_buffers, dtype, scale):
    """E views of the given shape spread round-robin over `num_buffers` flat buffers, each starting one
    16-element-padded slot into its buffer (never at the buffer's base)."""
    num_experts = len(shapes_per_expert)
    numel = math.prod(shapes_per_expert[0])
    slot = -(-numel // 16) * 16
    owner = [e % num_buffers for e in range(num_experts)]
    flats = [(torch.randn((owner.count(b) + 1) * slot, generator=gen) * scale).to(dtype) for b in range(num_buffers)]
    used, views = [1] * num_buffers, []
    for e in range(num_experts):
        b = owner[e]
        views.append(flats[b][used[b] * slot:used[b] * slot + numel].view(shapes_per_expert[e]))
        used[b] += 1
    return views


def _offsets(counts):
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32)


def _check(got, want, dtype, what):
    assert not got.isnan().any(), f"{what}: {int(got.isnan().sum())} outputs never written"
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype],
                               msg=lambda m: f"{what}: max abs err {(got.float() - want.float()).abs().max():.3g}\n{m}")


def test_tma_is_taken_where_asked_and_refused_where_rows_are_not_16_byte_multiples():
    gen = torch.Generator().manual_seed(1)
    views = _buffers(gen, [(36, 40)] * 3, 2, torch.float32, 0.1)
    problem = kernel_problem(torch.float32, expert_weight_table(views), num_rows=20)
    launch = launch_config(problem, device_info(CPU), TMA)
    assert launch.w_tma and launch.a_tma, launch
    odd = kernel_problem(torch.float32, expert_weight_table(_buffers(gen, [(36, 37)] * 3, 2, torch.float32, 0.1)),
                         num_rows=20)
    launch = launch_config(odd, device_info(CPU), TMA)
    assert not launch.w_tma and "not a multiple of 16" in launch.tma_note, launch
    interleaved = kernel_problem(torch.float32, expert_weight_table(views), num_rows=20,
                                 epilogue=Epilogue(interleaved=True))
    assert not launch_config(interleaved, device_info(CPU), TMA).w_tma


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("counts,n,k,num_buffers", [
    ([17, 0, 40, 3, 0, 22, 9], 36, 40, 7),  # zero-row experts, N and K not multiples of 16, 7 buffers
    ([0, 0, 5], 48, 24, 3),                 # only the last expert has rows
    ([33], 16, 64, 1),                      # one expert, one buffer
], ids=["zero_rows_7_buffers", "last_only", "single"])
def test_tma_grouped_gemm_matches_reference(dtype, counts, n, k, num_buffers):
    gen = torch.Generator().manual_seed(sum(counts) + n)
    views = _buffers(gen, [(n, k)] * len(counts), num_buffers, dtype, 1 / math.sqrt(k))
    x = torch.randn(sum(counts), k, generator=gen).to(dtype)  # [R, K]
    offsets = _offsets(counts)
    out = torch.full((sum(counts), n), float("nan"), dtype=dtype)
    got = grouped_gemm(x, offsets, views, out=out, config=TMA)
    want = grouped_gemm_reference(x.float(), offsets, [w.float() for w in views])
    _check(got, want, dtype, f"counts={counts} n={n} k={k} Bw={num_buffers}")


def test_tma_swiglu_bias_row_scale_and_transposed_weights():
    """Gated [gate; up] rows read as two tiles of one descriptor (the up half N_OUT rows in), with a bias
    and a row scale; then weights stored [K, N], read through a descriptor over [K, N]."""
    from dwdp.kernels import swiglu_reference

    gen = torch.Generator().manual_seed(7)
    counts, n_out, k = [9, 0, 21, 4, 13], 24, 40
    views = _buffers(gen, [(2 * n_out, k)] * len(counts), 3, torch.float32, 1 / math.sqrt(k))
    bias = [torch.randn(2 * n_out, generator=gen) for _ in counts]
    x = torch.randn(sum(counts), k, generator=gen)
    scale = torch.rand(sum(counts), generator=gen)
    offsets = _offsets(counts)
    got = grouped_gemm(x, offsets, views, activation="swiglu", bias=bias, row_scale=scale, config=TMA)
    want = swiglu_reference(grouped_gemm_reference(x, offsets, views, bias)) * scale[:, None]
    _check(got, want, torch.float32, "swiglu + bias + row scale")
    stored = [torch.randn(k, 2 * n_out, generator=gen) / math.sqrt(k) for _ in counts]  # [K, N] storage
    problem = kernel_problem(torch.float32, expert_weight_table([w.t() for w in stored]), num_rows=sum(counts),
                             epilogue=Epilogue())
    assert dict(launch_config(problem, device_info(CPU), TMA).constexprs)["W_TRANSPOSED"] is True
    got = grouped_gemm(x, offsets, [w.t() for w in stored], activation="swiglu", config=TMA)
    want = swiglu_reference(grouped_gemm_reference(x, offsets, [w.t() for w in stored]))
    _check(got, want, torch.float32, "swiglu, weights stored [K, N]")


@pytest.mark.parametrize("fp8_activations", [False, True], ids=["dequantized", "fp8_dots"])
def test_tma_fp8_weights_match_reference(fp8_activations):
    gen = torch.Generator().manual_seed(11)
    counts, n, k = [10, 0, 19, 6], 48, 64
    quant = BlockQuant("fp8", (16, 32))
    q, s = quantize_fp8(torch.randn(len(counts), n, k, generator=gen) / math.sqrt(k), quant)
    weights, scales = list(q.clone().unbind(0)), list(s.unbind(0))
    x = torch.randn(sum(counts), k, generator=gen)
    offsets = _offsets(counts)
    got = grouped_gemm(x, offsets, weights, weight_scales=scales, quant=quant, fp8_activations=fp8_activations,
                       config=TMA)
    want = grouped_gemm_reference(x, offsets, weights, weight_scales=scales, quant=quant,
                                  fp8_activations=fp8_activations)
    _check(got, want, torch.float32, f"fp8 weights, fp8_activations={fp8_activations}")


def test_tma_moe_experts_local_first_matches_reference():
    """The fused path: gate_up gathers A rows (pointers) with its weights through descriptors, down reads
    h through a descriptor; both GEMMs split at the same expert across the wait."""
    gen = torch.Generator().manual_seed(13)
    num_tokens, hidden, inter, experts, top_k = 19, 40, 24, 7, 2
    gate_up = _buffers(gen, [(2 * inter, hidden)] * experts, 7, torch.float32, 1 / math.sqrt(hidden))
    down = _buffers(gen, [(hidden, inter)] * experts, 7, torch.float32, 1 / math.sqrt(inter))
    hidden_states = torch.randn(num_tokens, hidden, generator=gen)
    logits = torch.randn(num_tokens, experts, generator=gen)
    logits[:, 3] = -1e9  # expert 3 gets no rows
    weights, index = torch.topk(logits.softmax(-1), top_k, dim=-1)
    want = moe_experts_reference(hidden_states, index, weights, gate_up, down)
    calls = []
    got = moe_experts(hidden_states, index, weights, gate_up, down, split_at=4, on_local_done=lambda: calls.append(1),
                      wave_size=3, config=TMA)
    assert calls == [1]
    _check(got, want, torch.float32, "moe_experts, TMA, local-first")


def test_one_descriptor_per_expert_and_program_not_per_tile(monkeypatch):
    """Each program builds its A descriptor once and one weight descriptor per expert it works on, however
    many of that expert's tiles it runs."""
    from triton.runtime import interpreter

    made = []
    original = interpreter.interpreter_builder.create_make_tensor_descriptor

    def counting(*args, **kwargs):
        made.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(interpreter.interpreter_builder, "create_make_tensor_descriptor", counting)
    gen = torch.Generator().manual_seed(17)
    counts, n, k, wave = [40, 0, 35, 8], 48, 32, 3
    views = _buffers(gen, [(n, k)] * len(counts), 2, torch.float32, 0.1)
    x = torch.randn(sum(counts), k, generator=gen)
    grouped_gemm(x, _offsets(counts), views, wave_size=wave, config=TMA)
    # Tiles in expert-major order: expert e has ceil(rows / 16) * ceil(n / 16) tiles; program p runs
    # tiles p, p + wave, ...
    owners = [e for e, c in enumerate(counts) for _ in range(math.ceil(c / 16) * math.ceil(n / 16))]
    expected = sum(1 + len(set(owners[p::wave])) for p in range(wave))
    assert len(made) == expected, (len(made), expected, len(owners))


def test_tma_scratch_allocator_is_set_once_per_context_and_never_replaces_a_users():
    """Device-built descriptors need global scratch: a launch on the TMA path sets an allocator where this
    context (thread) has none, and leaves one the user set alone."""
    import contextvars

    import triton
    from triton.runtime import _allocation

    from dwdp.kernels.grouped_gemm import _tma_scratch, ensure_tma_allocator

    def fresh():
        assert isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
        ensure_tma_allocator()
        return _allocation._allocator.get()

    assert contextvars.Context().run(fresh) is _tma_scratch

    def users():
        def mine(size, alignment, stream):
            return None
        triton.set_allocator(mine)
        ensure_tma_allocator()
        return _allocation._allocator.get() is mine

    assert contextvars.Context().run(users)


@pytest.mark.parametrize("tma", [True, False], ids=["tma", "pointers"])
def test_grouped_tile_order_covers_every_tile_once(tma):
    """group_m=2: an expert's m-tiles run in groups of two per n-tile, the last group ragged (5 m-tiles)."""
    from dataclasses import replace

    gen = torch.Generator().manual_seed(19)
    counts, n, k = [70, 0, 33, 16], 48, 32
    views = _buffers(gen, [(n, k)] * len(counts), 3, torch.float32, 1 / math.sqrt(k))
    x = torch.randn(sum(counts), k, generator=gen)
    offsets = _offsets(counts)
    out = torch.full((sum(counts), n), float("nan"))
    got = grouped_gemm(x, offsets, views, out=out, wave_size=3, config=replace(TMA, group_m=2, tma=tma))
    _check(got, grouped_gemm_reference(x, offsets, views), torch.float32, f"group_m=2 tma={tma}")


def test_tma_moe_fp8_dots_with_h_quantized_in_the_epilogue():
    """fp8 experts through descriptors and fp8 dots, h leaving gate_up in fp8 with its scales, I = 24: the
    last gate tile's descriptor rows run into the up half, and with an up offset its columns past I must
    still leave h's last group and its scale alone."""
    gen = torch.Generator().manual_seed(31)
    num_tokens, hidden, inter, experts, top_k = 13, 32, 24, 5, 2
    first_quant, down_quant = BlockQuant("fp8", (16, 16), halves=2), BlockQuant("fp8", (16, 16))
    gate_up, gate_up_scales = quantize_fp8(torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5,
                                           first_quant)
    down, down_scales = quantize_fp8(torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5, down_quant)
    hidden_states = torch.randn(num_tokens, hidden, generator=gen)
    weights, index = torch.topk(torch.randn(num_tokens, experts, generator=gen).softmax(-1), top_k, dim=-1)
    args = dict(first_scales=list(gate_up_scales), down_scales=list(down_scales), first_quant=first_quant,
                down_quant=down_quant, fp8_activations=True, epilogue=Epilogue(up_offset=1.0))
    got = moe_experts(hidden_states, index, weights, list(gate_up), list(down), config=TMA, **args)
    want = moe_experts_reference(hidden_states, index, weights, list(gate_up), list(down), **args)
    _check(got, want, torch.float32, "moe_experts fp8 dots, TMA")
