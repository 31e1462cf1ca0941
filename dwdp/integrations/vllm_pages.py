"""The cache-writing half of the vLLM connector: an artifact layer's rows into vLLM's paged KV cache.

Legend: Hkv = key / value heads (the artifact's), Hw = key / value heads one decode worker holds (its
tensor-parallel share), T = tokens (the artifact's), Tw = tokens written into a paged KV cache at once,
Dk = head dim of the keys, Dv = head dim of the values, Bt = tokens per block of a paged KV cache,
Rkv = MLA's kv_lora_rank, Dr = MLA's qk_rope_head_dim.

Pages are written with the attention backend's own cache write (`impl.do_kv_cache_update`, the
call vLLM's `unified_kv_cache_update` makes in every forward), never with an assumed layout: on the
CPU backend that is `cpu_attn_reshape_and_cache` with the instruction set the backend picked (the
order inside a page differs between AVX2, AVX-512 and AMX), on CUDA's flash-attention backend
`reshape_and_cache_flash`; an MLA layer's (`write_latent`) takes the latent and the roped shared key
(CPU MLA: a slot-indexed copy into [blocks, Bt, Rkv + Dr]; CUDA: `concat_and_cache_mla`). Whatever
backend runs, the artifact's KV lands where that backend's forward would have put it.
"""
from __future__ import annotations

import torch


def slot_mapping(block_ids: list[int], block_size: int, start: int, stop: int) -> torch.Tensor:
    """Cache slot of each token position in [start, stop): block_ids[t // Bt] * Bt + t % Bt, [Tw] int64."""
    positions = torch.arange(start, stop)                                   # [Tw]
    blocks = torch.tensor(block_ids, dtype=torch.long)[positions // block_size]  # [Tw]
    return blocks * block_size + positions % block_size


def rows(tensor: torch.Tensor, heads: tuple[int, int], start: int, stop: int) -> torch.Tensor:
    """Token-major rows [Tw, Hw, D] of an artifact tensor [1, Hkv, T, D]: heads [heads[0], heads[1]),
    positions [start, stop)."""
    return tensor[0, heads[0]:heads[1], start:stop].transpose(0, 1).contiguous()  # [Tw, Hw, D]


def head_share(num_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, int]:
    """[first, end) of the kv heads a tensor-parallel rank caches: an equal share, or one replicated
    head when there are fewer heads than ranks (vLLM's split)."""
    local = max(1, num_kv_heads // tp_size)
    first = tp_rank * num_kv_heads // tp_size
    return first, first + local


def write_kv(attn_layer, kv_cache: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Write keys [Tw, Hw, Dk] and values [Tw, Hw, Dv] into the slots [Tw] of one layer's cache with the
    layer's own backend op (vLLM's attention layer `attn_layer`, its cache tensor `kv_cache`)."""
    if keys.shape[0] != slots.shape[0] or values.shape[0] != slots.shape[0]:
        raise ValueError(f"{keys.shape[0]} key rows, {values.shape[0]} value rows for {slots.shape[0]} slots")
    device = kv_cache.device
    attn_layer.impl.do_kv_cache_update(attn_layer, keys.to(device), values.to(device), kv_cache,
                                       slots.to(device))


def write_latent(attn_layer, kv_cache: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """Write MLA's latent [Tw, Rkv] and roped shared key [Tw, Dr] into the slots [Tw] of one MLA layer's
    cache with the layer's own backend op (what vLLM's MLAAttention.update_kv_cache calls)."""
    if latent.shape[0] != slots.shape[0] or rope.shape[0] != slots.shape[0]:
        raise ValueError(f"{latent.shape[0]} latent rows, {rope.shape[0]} rope rows for {slots.shape[0]} slots")
    device = kv_cache.device
    attn_layer.impl.do_kv_cache_update(latent.to(device), rope.unsqueeze(1).to(device), kv_cache, slots.to(device),
                                       attn_layer.kv_cache_dtype, attn_layer._k_scale)
