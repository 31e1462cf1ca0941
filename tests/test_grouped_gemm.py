"""Multi-buffer grouped GEMM (Triton, run under TRITON_INTERPRET=1) against the PyTorch reference.

Legend: R = rows an experts call computes (sorted by expert), K = input features, N = output features (the
weight rows), E = experts, Bw = weight buffers (distinct ones).
Sizes stay tiny (interpreter) and tiles are 16 so that odd sizes cross tile edges.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from dwdp.kernels import ExpertWeightTable, GroupedGemmConfig, expert_weight_table, grouped_gemm, grouped_gemm_reference, local_first_split, swiglu_reference

pytestmark = pytest.mark.timeout(60)

TINY = GroupedGemmConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)
TOL = {  # kernel output is rounded once to the input dtype from an fp32 accumulator
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    torch.float16: dict(atol=4e-3, rtol=4e-3),
}


def _split_weights(gen: torch.Generator, num_experts: int, n: int, k: int, num_buffers: int, dtype: torch.dtype):
    """E views [N, K] spread round-robin over `num_buffers` flat buffers. Each buffer has a spare
    leading slot, so no view starts at its buffer's base address, and slots are padded to
    16 elements so that views of odd-sized experts stay 16-byte aligned. Returns (views, buffers)."""
    owner = [e % num_buffers for e in range(num_experts)]
    slot = -(-n * k // 16) * 16  # elements per expert slot
    buffers = []
    for b in range(num_buffers):
        held = owner.count(b)
        buffers.append((torch.randn((held + 1) * slot, generator=gen) / math.sqrt(k)).to(dtype))  # [(held + 1) * slot]
    views, used = [], [1] * num_buffers
    for e in range(num_experts):
        b = owner[e]
        views.append(buffers[b][used[b] * slot:used[b] * slot + n * k].view(n, k))  # [N, K]
        used[b] += 1
    return views, buffers


def _offsets(counts: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=dtype)  # [E + 1]


def _poisoned(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((rows, cols), float("nan"), dtype=dtype)


def _reference_fp32(x, offsets, views):
    return grouped_gemm_reference(x.float(), offsets, [w.float() for w in views])


def _check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert not actual.isnan().any(), f"{what}: {int(actual.isnan().sum())} output elements never written"
    torch.testing.assert_close(
        actual.float(), expected.float(), **TOL[dtype],
        msg=lambda m: f"{what}: max abs err {(actual.float() - expected.float()).abs().max().item():.3g}\n{m}",
    )


def _run(counts, n, k, num_buffers, dtype, seed, offsets_dtype=torch.int32, **kwargs):
    gen = torch.Generator().manual_seed(seed)
    views, buffers = _split_weights(gen, len(counts), n, k, num_buffers, dtype)
    offsets = _offsets(counts, offsets_dtype)
    x = torch.randn(sum(counts), k, generator=gen).to(dtype)  # [R, K]
    n_out = n // 2 if kwargs.get("activation") == "swiglu" else n
    out = _poisoned(sum(counts), n_out, dtype)  # [R, N_OUT]
    got = grouped_gemm(x, offsets, views, out=out, config=TINY, **kwargs)
    return got, x, offsets, views


@pytest.mark.parametrize("num_buffers", [1, 2, 5, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference_across_buffers(num_buffers, dtype):
    counts = [5, 0, 17, 1, 33, 2, 0, 9, 4]  # 9 experts, two without tokens
    got, x, offsets, views = _run(counts, n=24, k=40, num_buffers=num_buffers, dtype=dtype, seed=num_buffers)
    assert len({w.untyped_storage().data_ptr() for w in views}) == num_buffers
    _check(got, _reference_fp32(x, offsets, views), dtype, f"{num_buffers} buffers {dtype}")


def test_zero_tokens_for_some_experts():
    counts = [0, 0, 7, 0, 19, 0]  # first, last and middle experts empty
    got, x, offsets, views = _run(counts, n=16, k=32, num_buffers=3, dtype=torch.float32, seed=11)
    _check(got, _reference_fp32(x, offsets, views), torch.float32, "zero-token experts")


def test_one_token():
    got, x, offsets, views = _run([0, 1, 0], n=20, k=24, num_buffers=2, dtype=torch.bfloat16, seed=12)
    _check(got, _reference_fp32(x, offsets, views), torch.bfloat16, "one token")


def test_t_and_k_not_multiples_of_tile():
    counts = [15, 17, 1, 31]  # rows straddle tile edges; R = 64 + 0
    got, x, offsets, views = _run(counts, n=33, k=45, num_buffers=2, dtype=torch.float32, seed=13)
    _check(got, _reference_fp32(x, offsets, views), torch.float32, "R, K, N off the tile")


def test_offsets_int64():
    counts = [3, 21, 0, 8]
    got, x, offsets, views = _run(counts, n=16, k=24, num_buffers=2, dtype=torch.float32, seed=14,
                                  offsets_dtype=torch.int64)
    assert offsets.dtype == torch.int64
    _check(got, _reference_fp32(x, offsets, views), torch.float32, "int64 offsets")


def test_rows_past_last_offset_left_untouched():
    gen = torch.Generator().manual_seed(15)
    views, _ = _split_weights(gen, 3, 16, 16, 2, torch.float32)
    x = torch.randn(20, 16, generator=gen)  # [R, K], only 12 rows routed
    offsets = _offsets([4, 0, 8])
    out = _poisoned(20, 16, torch.float32)
    grouped_gemm(x, offsets, views, out=out, config=TINY)
    assert out[12:].isnan().all(), f"rows past offsets[E] were written: {out[12:]}"
    _check(out[:12], _reference_fp32(x[:12], offsets, views), torch.float32, "routed rows")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_epilogue(dtype):
    counts = [6, 0, 18, 3]
    got, x, offsets, views = _run(counts, n=40, k=24, num_buffers=3, dtype=dtype, seed=16, activation="swiglu")
    expected = swiglu_reference(_reference_fp32(x, offsets, views))  # [R, N / 2]
    assert got.shape == (sum(counts), 20), f"shape {tuple(got.shape)}"
    _check(got, expected, dtype, f"swiglu {dtype}")


def test_row_scale_epilogue_with_swiglu():
    counts = [9, 2, 0, 14]
    gen = torch.Generator().manual_seed(17)
    scale = torch.rand(sum(counts), generator=gen) + 0.5  # [R]
    got, x, offsets, views = _run(counts, n=32, k=24, num_buffers=2, dtype=torch.float32, seed=17,
                                  activation="swiglu", row_scale=scale)
    expected = swiglu_reference(_reference_fp32(x, offsets, views)) * scale[:, None]
    _check(got, expected, torch.float32, "row scale")


def test_weight_table_reused_across_calls():
    gen = torch.Generator().manual_seed(18)
    views, _ = _split_weights(gen, 4, 16, 24, 4, torch.float32)
    table = expert_weight_table(views)
    assert isinstance(table, ExpertWeightTable) and table.addresses.tolist() == [w.data_ptr() for w in views]
    for counts in ([3, 0, 5, 9], [0, 12, 1, 0]):
        x = torch.randn(sum(counts), 24, generator=gen)
        offsets = _offsets(counts)
        got = grouped_gemm(x, offsets, table, out=_poisoned(sum(counts), 16, torch.float32), config=TINY)
        _check(got, _reference_fp32(x, offsets, views), torch.float32, f"table reuse {counts}")


def _tiles(counts, n_out, cfg=TINY):
    return [math.ceil(c / cfg.block_m) * math.ceil(n_out / cfg.block_n) for c in counts]


@pytest.mark.parametrize("split_at,wave_size", [(3, 1), (3, 4), (5, 3), (0, 4), (7, 5)])
def test_local_first_parts_cover_every_row_once(split_at, wave_size):
    counts = [17, 3, 40, 0, 9, 22, 5]
    n, k = 40, 24
    got, x, offsets, views = _run(counts, n=n, k=k, num_buffers=3, dtype=torch.float32, seed=19,
                                  split_at=split_at, part="first", wave_size=wave_size)
    s = local_first_split(offsets, split_at, n_tiles=[math.ceil(n / TINY.block_n)], block_m=TINY.block_m,
                          wave_size=wave_size)
    assert s <= split_at
    first_rows = int(offsets[s])
    assert not got[:first_rows].isnan().any(), f"first part left rows of experts < {s} unwritten"
    assert got[first_rows:].isnan().all(), f"first part wrote rows of experts >= {s}"
    grouped_gemm(x, offsets, views, out=got, config=TINY, split_at=split_at, part="second", wave_size=wave_size)
    _check(got, _reference_fp32(x, offsets, views), torch.float32, f"first + second, split_at={split_at}")


@pytest.mark.parametrize("wave_size", [1, 2, 3, 4, 6, 7, 16])
def test_local_first_split_needs_no_extra_wave(wave_size):
    counts = [17, 3, 40, 0, 9, 22, 5, 1]
    tiles = _tiles(counts, 40)
    total_waves = math.ceil(sum(tiles) / wave_size)
    for split_at in range(len(counts) + 1):
        s = local_first_split(_offsets(counts), split_at, n_tiles=[3], block_m=TINY.block_m, wave_size=wave_size)
        head, tail = sum(tiles[:s]), sum(tiles[s:])
        waves = math.ceil(head / wave_size) + math.ceil(tail / wave_size)
        assert s <= split_at and waves == total_waves, (
            f"split_at={split_at} wave={wave_size}: s={s} needs {waves} waves, one launch {total_waves}"
        )
        if wave_size == 1:
            assert s == split_at, f"with unit waves every local expert goes first, got s={s} of {split_at}"


@settings(max_examples=8, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=7),
    num_buffers=st.integers(1, 4),
    k=st.integers(1, 40),
    n=st.integers(1, 36),
    seed=st.integers(0, 2**16),
)
def test_random_layouts_match_reference(counts, num_buffers, k, n, seed):
    got, x, offsets, views = _run(counts, n=n, k=k, num_buffers=num_buffers, dtype=torch.float32, seed=seed)
    _check(got, _reference_fp32(x, offsets, views), torch.float32, f"counts={counts} n={n} k={k}")


def _good_args():
    gen = torch.Generator().manual_seed(20)
    views, _ = _split_weights(gen, 3, 16, 16, 2, torch.float32)
    return dict(x_sorted=torch.randn(10, 16, generator=gen), expert_offsets=_offsets([4, 0, 6]), weights=views)


def _misaligned_view():
    flat = torch.randn(16 * 16 + 1)
    return flat[1:].view(16, 16)  # starts 4 bytes past a 16-byte boundary


@pytest.mark.parametrize(
    "name,change",
    [
        ("x_sorted", lambda a: a.update(x_sorted=a["x_sorted"].to(torch.int32))),
        ("x_sorted", lambda a: a.update(x_sorted=a["x_sorted"][:, 0])),
        ("x_sorted", lambda a: a.update(x_sorted=torch.randn(16, 10).t())),
        ("expert_offsets", lambda a: a.update(expert_offsets=a["expert_offsets"].float())),
        ("expert_offsets", lambda a: a.update(expert_offsets=_offsets([4, 6]))),
        ("expert_offsets", lambda a: a.update(expert_offsets=torch.tensor([0, 6, 4, 10], dtype=torch.int32))),
        ("expert_offsets", lambda a: a.update(expert_offsets=torch.tensor([0, 4, 4, 11], dtype=torch.int32))),
        ("weights", lambda a: a.update(weights=[])),
        ("weights", lambda a: a.update(weights=torch.randn(3, 16, 16))),
        ("weights[1]", lambda a: a["weights"].__setitem__(1, torch.randn(8, 16))),
        ("weights[2]", lambda a: a["weights"].__setitem__(2, a["weights"][2].double())),
        ("weights[1]", lambda a: a["weights"].__setitem__(1, torch.randn(16, 16).t())),
        ("weights[0]", lambda a: a["weights"].__setitem__(0, _misaligned_view())),
        ("weights", lambda a: a.update(weights=[w.bfloat16() for w in a["weights"]])),
        ("K", lambda a: a.update(weights=[torch.randn(16, 8) for _ in range(3)])),
        ("activation", lambda a: a.update(activation="gelu")),
        ("swiglu", lambda a: a.update(activation="swiglu", weights=[torch.randn(15, 16) for _ in range(3)])),
        ("row_scale", lambda a: a.update(row_scale=torch.ones(9))),
        ("out", lambda a: a.update(out=torch.empty(10, 8))),
        ("split_at", lambda a: a.update(split_at=4, part="first")),
        ("part", lambda a: a.update(split_at=1, part="local")),
        ("part", lambda a: a.update(part="first")),
        ("wave_size", lambda a: a.update(split_at=1, part="first", wave_size=0)),
        ("wave_size", lambda a: a.update(wave_size=-3)),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(name, change):
    args = _good_args()
    args["weights"] = list(args["weights"])
    change(args)
    with pytest.raises(ValueError, match=name.replace("[", r"\[").replace("]", r"\]")):
        grouped_gemm(config=TINY, **args)


@pytest.mark.parametrize("field,value", [("block_m", 24), ("block_k", 8), ("num_warps", 3), ("num_stages", 0),
                                         ("programs_per_sm", 0)])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        GroupedGemmConfig(**{field: value})
