"""Fused MoE expert path (Triton under TRITON_INTERPRET=1) against the transformers-semantics reference.

Legend: T = tokens, k = experts per token, H = hidden, I = expert intermediate size, E = experts,
S = T * k token-expert pairs (slots).
"""
from __future__ import annotations

import math

import pytest
import torch

triton = pytest.importorskip("triton")

from dwdp.kernels import (  # noqa: E402
    Epilogue,
    GroupedGemmConfig,
    local_first_split,
    moe_experts,
    moe_experts_reference,
    sort_by_expert,
)

pytestmark = pytest.mark.timeout(60)

TINY = GroupedGemmConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)
# bf16: the kernel rounds h to bf16 between the GEMMs (as transformers does), the fp32 reference does not.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _experts(gen, num_experts, hidden_dim, inter, num_buffers, dtype):
    """gate_up [2I, H] and down [H, I] views of E experts spread round-robin over num_buffers
    stacked buffers per projection, like a local parameter plus one prefetch buffer per peer."""
    owner = [e % num_buffers for e in range(num_experts)]
    gate_up_bufs = [(torch.randn(owner.count(b), 2 * inter, hidden_dim, generator=gen) / math.sqrt(hidden_dim))
                    .to(dtype) for b in range(num_buffers)]  # [E_b, 2I, H]
    down_bufs = [(torch.randn(owner.count(b), hidden_dim, inter, generator=gen) / math.sqrt(inter)).to(dtype)
                 for b in range(num_buffers)]  # [E_b, H, I]
    gate_up, down = [], []
    for e in range(num_experts):
        gate_up.append(gate_up_bufs[owner[e]][e // num_buffers])
        down.append(down_bufs[owner[e]][e // num_buffers])
    return gate_up, down, gate_up_bufs, down_bufs


def _routing(gen, num_tokens, num_experts, top_k, dtype=torch.float32):
    logits = torch.randn(num_tokens, num_experts, generator=gen)  # [T, E]
    weights, index = torch.topk(logits.softmax(-1), top_k, dim=-1)  # [T, k] each
    return weights.to(dtype), index


def _reference_fp32(hidden, index, weights, gate_up, down):
    return moe_experts_reference(hidden.float(), index, weights.float(), [w.float() for w in gate_up],
                                 [w.float() for w in down])


def _check(actual, expected, dtype, what):
    assert actual.dtype == dtype, f"{what}: output dtype {actual.dtype}, expected {dtype}"
    assert not actual.isnan().any(), f"{what}: {int(actual.isnan().sum())} NaN outputs"
    torch.testing.assert_close(
        actual.float(), expected.float(), **TOL[dtype],
        msg=lambda m: f"{what}: max abs err {(actual.float() - expected.float()).abs().max().item():.3g}\n{m}",
    )


def _case(seed, num_tokens, num_experts, top_k, hidden_dim, inter, num_buffers, dtype):
    gen = torch.Generator().manual_seed(seed)
    gate_up, down, gate_up_bufs, down_bufs = _experts(gen, num_experts, hidden_dim, inter, num_buffers, dtype)
    hidden = torch.randn(num_tokens, hidden_dim, generator=gen).to(dtype)  # [T, H]
    weights, index = _routing(gen, num_tokens, num_experts, top_k)
    return hidden, index, weights, gate_up, down, gate_up_bufs, down_bufs


@pytest.mark.parametrize("num_buffers", [1, 2, 5, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference_across_buffers(num_buffers, dtype):
    hidden, index, weights, gate_up, down, *_ = _case(num_buffers, 13, 9, 2, 40, 24, num_buffers, dtype)
    got = moe_experts(hidden, index, weights, gate_up, down, config=TINY)
    _check(got, _reference_fp32(hidden, index, weights, gate_up, down), dtype, f"{num_buffers} buffers")


def test_reference_matches_transformers_loop_semantics():
    """The reference is the per-expert loop transformers documents (index_add_ of weighted outputs)."""
    hidden, index, weights, gate_up, down, *_ = _case(30, 11, 6, 3, 24, 16, 2, torch.float32)
    expected = torch.zeros_like(hidden)  # [T, H]
    for e in range(6):
        token_idx, pos = torch.where(index == e)
        gate, up = torch.nn.functional.linear(hidden[token_idx], gate_up[e]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, down[e]) * weights[token_idx, pos, None]
        expected.index_add_(0, token_idx, y)
    got = moe_experts_reference(hidden, index, weights, gate_up, down)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("combine", ["sum", "atomic"])
def test_combine_modes(combine):
    hidden, index, weights, gate_up, down, *_ = _case(31, 21, 5, 3, 24, 40, 3, torch.float32)
    got = moe_experts(hidden, index, weights, gate_up, down, combine=combine, config=TINY)
    _check(got, _reference_fp32(hidden, index, weights, gate_up, down), torch.float32, combine)


def test_zero_tokens_for_some_experts():
    hidden, index, weights, gate_up, down, *_ = _case(32, 5, 12, 2, 24, 16, 4, torch.float32)
    assert len(index.unique()) < 12, "case should leave experts without tokens"
    got = moe_experts(hidden, index, weights, gate_up, down, config=TINY)
    _check(got, _reference_fp32(hidden, index, weights, gate_up, down), torch.float32, "idle experts")


def test_one_token():
    hidden, index, weights, gate_up, down, *_ = _case(33, 1, 4, 2, 24, 16, 2, torch.bfloat16)
    got = moe_experts(hidden, index, weights, gate_up, down, config=TINY)
    _check(got, _reference_fp32(hidden, index, weights, gate_up, down), torch.bfloat16, "one token")


def test_sizes_not_multiples_of_tile_and_top1():
    # H = 45 is off the tile, I = 24 is 1.5 tiles; views stay 16-byte aligned.
    hidden, index, weights, gate_up, down, *_ = _case(34, 37, 3, 1, 45, 24, 2, torch.float32)
    got = moe_experts(hidden, index, weights, gate_up, down, config=TINY)
    _check(got, _reference_fp32(hidden, index, weights, gate_up, down), torch.float32, "odd sizes")


def test_int32_index_and_bf16_routing_weights():
    hidden, index, weights, gate_up, down, *_ = _case(35, 9, 4, 2, 24, 16, 2, torch.float32)
    got = moe_experts(hidden, index.int(), weights.bfloat16(), gate_up, down, config=TINY)
    expected = _reference_fp32(hidden, index, weights.bfloat16().float(), gate_up, down)
    _check(got, expected, torch.float32, "int32 ids, bf16 weights")


def test_sort_by_expert_offsets_and_slots():
    gen = torch.Generator().manual_seed(36)
    index = torch.randint(0, 7, (23, 3), generator=gen)  # [T, k]
    slots, offsets = sort_by_expert(index, 9)  # [S], [E + 1]
    flat = index.reshape(-1).tolist()
    expected_slots = [s for e in range(9) for s in range(len(flat)) if flat[s] == e]
    expected_offsets = [sum(1 for v in flat if v < e) for e in range(10)]
    assert slots.tolist() == expected_slots, f"slots {slots.tolist()} != {expected_slots}"
    assert offsets.tolist() == expected_offsets, f"offsets {offsets.tolist()} != {expected_offsets}"


@pytest.mark.parametrize("split_at,wave_size", [(4, 1), (4, 3), (2, 5), (6, 2)])
def test_local_first_reads_remote_experts_only_after_they_arrive(split_at, wave_size):
    """Remote buffers hold NaN until on_local_done 'lands' them: the first part must not read them."""
    num_experts, hidden_dim, inter = 6, 24, 40
    hidden, index, weights, gate_up, down, *_ = _case(37, 19, num_experts, 2, hidden_dim, inter, 1, torch.float32)
    local = len(gate_up[:split_at])
    remote_gate_up = torch.stack(gate_up[local:]) if local < num_experts else torch.empty(0, 2 * inter, hidden_dim)
    remote_down = torch.stack(down[local:]) if local < num_experts else torch.empty(0, hidden_dim, inter)
    landing_gate_up = torch.full_like(remote_gate_up, float("nan"))  # prefetch buffers before the copy
    landing_down = torch.full_like(remote_down, float("nan"))
    calls = []

    def land():
        calls.append(1)
        landing_gate_up.copy_(remote_gate_up)
        landing_down.copy_(remote_down)

    views_gate_up = list(gate_up[:local]) + list(landing_gate_up.unbind(0))
    views_down = list(down[:local]) + list(landing_down.unbind(0))
    got = moe_experts(hidden, index, weights, views_gate_up, views_down, split_at=split_at, on_local_done=land,
                      wave_size=wave_size, config=TINY)
    assert calls == [1], f"on_local_done called {len(calls)} times"
    _check(got, _reference_fp32(hidden, index, weights, gate_up, down), torch.float32,
           f"local-first split_at={split_at} wave={wave_size}")


def test_local_first_split_is_shared_by_both_gemms():
    """The in-kernel split checks the waves of both GEMMs; the host mirror agrees and fits both."""
    gen = torch.Generator().manual_seed(38)
    index = torch.randint(0, 8, (50, 2), generator=gen)
    _, offsets = sort_by_expert(index, 8)
    for wave_size in (2, 3, 5, 7):
        s = local_first_split(offsets, 6, n_tiles=[2, 3], block_m=16, wave_size=wave_size)
        counts = offsets.diff().tolist()
        for n in (2, 3):
            tiles = [math.ceil(c / 16) * n for c in counts]
            waves = math.ceil(sum(tiles[:s]) / wave_size) + math.ceil(sum(tiles[s:]) / wave_size)
            assert waves == math.ceil(sum(tiles) / wave_size), f"wave={wave_size} n={n} s={s}: {waves} waves"


def _good_args():
    hidden, index, weights, gate_up, down, *_ = _case(40, 6, 3, 2, 16, 16, 2, torch.float32)
    return dict(hidden=hidden, top_k_index=index, top_k_weights=weights, gate_up=list(gate_up), down=list(down))


@pytest.mark.parametrize(
    "name,change",
    [
        ("hidden", lambda a: a.update(hidden=a["hidden"][:, :8])),
        ("hidden", lambda a: a.update(hidden=a["hidden"].t().contiguous().t())),
        ("gate_up", lambda a: a.update(gate_up=[torch.randn(31, 16) for _ in range(3)])),
        ("gate_up", lambda a: a.update(gate_up=[w.double() for w in a["gate_up"]])),
        ("down", lambda a: a.update(down=[torch.randn(16, 8) for _ in range(3)])),
        ("down", lambda a: a.update(down=a["down"][:2])),
        ("down\\[1\\]", lambda a: a["down"].__setitem__(1, torch.randn(16, 16).t())),
        ("top_k_index", lambda a: a.update(top_k_index=a["top_k_index"] + 3)),
        ("top_k_index", lambda a: a.update(top_k_index=a["top_k_index"].float())),
        ("top_k_weights", lambda a: a.update(top_k_weights=a["top_k_weights"][:, :1])),
        ("combine", lambda a: a.update(combine="max")),
        ("split_at", lambda a: a.update(split_at=5)),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(name, change):
    args = _good_args()
    change(args)
    with pytest.raises(ValueError, match=name):
        moe_experts(config=TINY, **args)


# Layouts of transformers' experts beyond plain SwiGLU, each against the reference: biases, weights
# stored [in, out] (read through transposed views), no gate (up only), gate/up rows interleaved with
# gpt-oss's clamped SwiGLU, GELU-tanh, clamped SiLU.
LAYOUTS = {
    "bias": dict(bias=True),
    "transposed": dict(transposed=True),
    "no_gate_relu2": dict(epilogue=Epilogue(activation="relu2", gated=False)),
    "interleaved_gpt_oss": dict(bias=True, transposed=True,
                                epilogue=Epilogue(interleaved=True, alpha=1.702, limit=7.0, up_offset=1.0)),
    "gelu_tanh": dict(epilogue=Epilogue(activation="gelu_tanh")),
    "clamped_silu": dict(epilogue=Epilogue(limit=2.0)),
}


def _layout_case(seed, layout, num_experts=7, hidden_dim=40, inter=24, num_tokens=17, top_k=2, num_buffers=3,
                 dtype=torch.float32):
    """Views of each expert's tensors spread over `num_buffers` buffers per tensor, in the layout's storage."""
    gen = torch.Generator().manual_seed(seed)
    epilogue = layout.get("epilogue", Epilogue())
    n1 = 2 * inter if epilogue.gated else inter
    owner = [e % num_buffers for e in range(num_experts)]

    def spread(shape, scale, transposed):
        # [E_b, *shape] buffers ([E_b, in, out] when transposed); view e is [out, in] either way.
        stored = (shape[1], shape[0]) if transposed else shape
        bufs = [(torch.randn(owner.count(b), *stored, generator=gen) * scale).to(dtype) for b in range(num_buffers)]
        views = [bufs[owner[e]][e // num_buffers] for e in range(num_experts)]
        return [v.t() for v in views] if transposed else views

    transposed = layout.get("transposed", False)
    gate_up = spread((n1, hidden_dim), 2 / math.sqrt(hidden_dim), transposed)
    down = spread((hidden_dim, inter), 1 / math.sqrt(inter), transposed)
    biases = {}
    if layout.get("bias"):
        biases = dict(first_bias=spread((n1,), 0.5, False), down_bias=spread((hidden_dim,), 0.5, False))
    hidden = torch.randn(num_tokens, hidden_dim, generator=gen).to(dtype)  # [T, H]
    weights, index = _routing(gen, num_tokens, num_experts, top_k)
    return hidden, index, weights, gate_up, down, biases, epilogue


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_match_reference(layout, dtype):
    hidden, index, weights, gate_up, down, biases, epilogue = _layout_case(50, LAYOUTS[layout], dtype=dtype)
    got = moe_experts(hidden, index, weights, gate_up, down, epilogue=epilogue, config=TINY, **biases)
    expected = moe_experts_reference(
        hidden.float(), index, weights.float(), [w.float() for w in gate_up], [w.float() for w in down],
        epilogue=epilogue, **{k: [b.float() for b in v] for k, v in biases.items()},
    )
    _check(got, expected, dtype, layout)


@pytest.mark.parametrize("layout", ["interleaved_gpt_oss", "no_gate_relu2"])
def test_layouts_with_local_first_split(layout):
    hidden, index, weights, gate_up, down, biases, epilogue = _layout_case(51, LAYOUTS[layout])
    got = moe_experts(hidden, index, weights, gate_up, down, epilogue=epilogue, split_at=3,
                      on_local_done=lambda: None, config=TINY, **biases)
    expected = moe_experts_reference(hidden, index, weights, gate_up, down, epilogue=epilogue, **biases)
    _check(got, expected, torch.float32, f"{layout} split")


def test_epilogue_reference_is_gpt_oss_gate():
    """The interleaved clamped epilogue is transformers' gpt-oss `_apply_gate`, and the reference
    clamps: values past the limit change the result."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from dwdp.kernels import epilogue_reference

    class Holder:
        alpha, limit = 1.702, 7.0

    h = torch.randn(9, 48, generator=torch.Generator().manual_seed(52)) * 8  # [T, 2I], many |x| > 7
    expected = GptOssExperts._apply_gate(Holder(), h)
    got = epilogue_reference(h, LAYOUTS["interleaved_gpt_oss"]["epilogue"])
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    unclamped = epilogue_reference(h, Epilogue(interleaved=True, alpha=1.702, up_offset=1.0))
    assert (unclamped - expected).abs().max() > 1.0, "probe never reached the clamp: the check would be vacuous"


def test_bad_bias_raises_value_error_naming_it():
    hidden, index, weights, gate_up, down, biases, epilogue = _layout_case(53, LAYOUTS["bias"])
    with pytest.raises(ValueError, match="down_bias"):
        moe_experts(hidden, index, weights, gate_up, down, first_bias=biases["first_bias"],
                    down_bias=[b[:8] for b in biases["down_bias"]], config=TINY)
