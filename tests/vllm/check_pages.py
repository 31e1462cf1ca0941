"""The connector's page writing (dwdp.integrations.vllm_pages) against vLLM's CPU attention backend, for
every dtype it takes and several block and head sizes: the pages equal what vLLM's own
cpu_attn_reshape_and_cache writes from the same keys and values, and vLLM's paged attention over
them equals attention computed in torch on the artifact's tensors.

Legend: H = kv heads, Hq = query heads, T = artifact tokens, D = head dim, B = tokens per block."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dwdp.integrations.vllm_pages import head_share, rows, slot_mapping, write_kv

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def cpu_layer(monkeypatch, dtype: torch.dtype, block_size: int, head_dim: int, num_heads: int, num_kv_heads: int):
    """vLLM's CPU attention impl and a layer carrying what its cache write reads (the backend's
    instruction set for this dtype and block size, unit scales)."""
    from vllm.v1.attention.backends import cpu_attn

    monkeypatch.setattr(cpu_attn, "get_current_vllm_config", lambda: SimpleNamespace(
        model_config=SimpleNamespace(dtype=dtype)))
    impl = cpu_attn.CPUAttentionBackendImpl(num_heads=num_heads, head_size=head_dim, scale=head_dim ** -0.5,
                                            num_kv_heads=num_kv_heads, alibi_slopes=None, sliding_window=None,
                                            kv_cache_dtype="auto")
    isa = cpu_attn._get_attn_isa(dtype, block_size, head_dim, "auto")
    return SimpleNamespace(impl=impl, isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)


def blocks_for(num_tokens: int, block_size: int, num_blocks: int, gen: torch.Generator) -> list[int]:
    """Distinct block ids, shuffled (a request's blocks are scattered over the cache)."""
    return torch.randperm(num_blocks, generator=gen)[:-(-num_tokens // block_size)].tolist()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("block_size, head_dim, num_tokens", [(32, 32, 1), (32, 32, 33), (64, 64, 97),
                                                              (96, 32, 200), (128, 128, 129)])
def test_pages_equal_vllms_own_cache_write(monkeypatch, dtype, block_size, head_dim, num_tokens):
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(num_tokens)
    heads, num_blocks = 2, 12
    layer = cpu_layer(monkeypatch, dtype, block_size, head_dim, 4, heads)
    keys = torch.randn(1, heads, num_tokens, head_dim, generator=gen).to(dtype)    # [1, H, T, D]
    values = torch.randn(1, heads, num_tokens, head_dim, generator=gen).to(dtype)  # [1, H, T, D]
    block_ids = blocks_for(num_tokens, block_size, num_blocks, gen)
    start = num_tokens // 3  # tokens below were computed by vLLM itself (a local prefix hit)

    cache = torch.zeros(num_blocks, heads, block_size, 2 * head_dim, dtype=dtype)  # the CPU backend's page layout
    write_kv(layer, cache, rows(keys, (0, heads), start, num_tokens), rows(values, (0, heads), start, num_tokens),
             slot_mapping(block_ids, block_size, start, num_tokens))

    want = torch.zeros_like(cache)
    slots = torch.tensor([block_ids[t // block_size] * block_size + t % block_size for t in range(start, num_tokens)])
    paged = want.view(num_blocks, heads, 2 * block_size, head_dim)
    key_cache, value_cache = paged.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(keys[0, :, start:].transpose(0, 1).contiguous(),
                                   values[0, :, start:].transpose(0, 1).contiguous(), key_cache, value_cache, slots,
                                   layer.isa)
    assert torch.equal(cache, want), (layer.isa, (cache != want).nonzero()[:5].tolist())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("block_size, head_dim, num_tokens", [(32, 32, 5), (32, 64, 70), (64, 128, 130)])
def test_vllms_paged_attention_reads_the_artifacts_keys_and_values(monkeypatch, dtype, block_size, head_dim,
                                                                   num_tokens):
    """A query at the last position, through vLLM's CPU paged attention over the written pages, equals
    attention over the artifact's keys and values in torch: the pages hold the right tokens in the right
    places, keys as keys and values as values."""
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(7)
    heads, q_heads, num_blocks = 2, 4, 10
    layer = cpu_layer(monkeypatch, dtype, block_size, head_dim, q_heads, heads)
    keys = torch.randn(1, heads, num_tokens, head_dim, generator=gen).to(dtype)    # [1, H, T, D]
    values = torch.randn(1, heads, num_tokens, head_dim, generator=gen).to(dtype)  # [1, H, T, D]
    query = torch.randn(1, q_heads, head_dim, generator=gen).to(dtype)             # [1, Hq, D]
    block_ids = blocks_for(num_tokens, block_size, num_blocks, gen)
    cache = torch.zeros(num_blocks, heads, block_size, 2 * head_dim, dtype=dtype)
    write_kv(layer, cache, rows(keys, (0, heads), 0, num_tokens), rows(values, (0, heads), 0, num_tokens),
             slot_mapping(block_ids, block_size, 0, num_tokens))

    paged = cache.view(num_blocks, heads, 2 * block_size, head_dim)
    key_cache, value_cache = paged.chunk(2, dim=2)
    query_start = torch.tensor([0, 1], dtype=torch.int32)
    seq_lens = torch.tensor([num_tokens], dtype=torch.int32)
    table = torch.tensor([block_ids + [0] * (num_blocks - len(block_ids))], dtype=torch.int32)
    scheduler = ops.cpu_attn_get_scheduler_metadata(num_reqs=1, num_heads=q_heads, num_kv_heads=heads,
                                                    head_dim=head_dim, seq_lens=seq_lens, dtype=dtype,
                                                    query_start_loc=query_start, causal=True, sliding_window_size=-1,
                                                    isa=layer.isa, enable_kv_split=False)
    got = torch.zeros_like(query)
    ops.cpu_attention_with_kv_cache(query=query, key_cache=key_cache, value_cache=value_cache, output=got,
                                    query_start_loc=query_start, seq_lens=seq_lens, scale=head_dim ** -0.5,
                                    causal=True, alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0,
                                    scheduler_metadata=scheduler, s_aux=None)

    k = keys[0].float().repeat_interleave(q_heads // heads, dim=0)    # [Hq, T, D]
    v = values[0].float().repeat_interleave(q_heads // heads, dim=0)  # [Hq, T, D]
    want = torch.nn.functional.scaled_dot_product_attention(query.float().transpose(0, 1), k, v)  # [Hq, 1, D]
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.transpose(0, 1), atol=tol, rtol=tol)


def test_slots_follow_the_block_table():
    assert slot_mapping([7, 2, 5], 4, 0, 10).tolist() == [28, 29, 30, 31, 8, 9, 10, 11, 20, 21]
    assert slot_mapping([7, 2, 5], 4, 6, 9).tolist() == [10, 11, 20]


@pytest.mark.parametrize("heads, tp, want", [(8, 1, [(0, 8)]), (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
                                             (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)])])
def test_each_tensor_parallel_rank_takes_the_heads_vllm_gives_it(heads, tp, want):
    assert [head_share(heads, rank, tp) for rank in range(tp)] == want


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("num_tokens, start", [(1, 0), (40, 0), (70, 33)])
def test_an_mla_layers_pages_hold_the_latent_then_the_roped_key(dtype, num_tokens, start):
    """vLLM's CPU MLA cache write, as the connector calls it: each token's slot of the [blocks, B, R + P]
    cache holds its latent, then its roped key (R = 512, P = 64, B = 16: the CPU MLA backend's only shape)."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    from dwdp.integrations.vllm_pages import write_latent

    gen = torch.Generator().manual_seed(num_tokens)
    rank, rope_dim, block_size, num_blocks = 512, 64, 16, 8
    impl = object.__new__(CPUMLAImpl)  # its cache write reads nothing of the instance: no model to build
    layer = SimpleNamespace(impl=impl, kv_cache_dtype="auto", _k_scale=torch.tensor(1.0))
    latent = torch.randn(1, num_tokens, rank, generator=gen).to(dtype)      # [1, T, R]
    rope = torch.randn(1, num_tokens, rope_dim, generator=gen).to(dtype)    # [1, T, P]
    block_ids = blocks_for(num_tokens, block_size, num_blocks, gen)
    cache = torch.zeros(num_blocks, block_size, rank + rope_dim, dtype=dtype)
    write_latent(layer, cache, latent[0, start:], rope[0, start:], slot_mapping(block_ids, block_size, start,
                                                                                 num_tokens))
    want = torch.zeros_like(cache)
    for t in range(start, num_tokens):
        want[block_ids[t // block_size], t % block_size] = torch.cat([latent[0, t], rope[0, t]])
    assert torch.equal(cache, want), (cache != want).nonzero()[:5].tolist()
