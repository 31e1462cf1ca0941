"""KV-cache artifacts: one safetensors file per request, for a generation server to load.

Legend: P = prompts in a forward (its requests), T = tokens of a prompt, Tmax = longest prompt of the
forward, Hkv = key / value heads (the cache's), Dk = head dim of the keys, Dv = head dim of the values
(the model's own: for DeepSeek-V3 MLA the cache holds the decompressed keys [.., qk_nope + qk_rope]
and values [.., v_head_dim]).

File layout: tensors `layers.{l}.keys` [1, Hkv, T, Dk] and `layers.{l}.values` [1, Hkv, T, Dv]
for every layer l, contiguous, in the model's dtype, holding positions 0 .. T-1 of the prompt
(every layer holds every position, sliding-window layers included: a loader keeps what its cache
keeps); string metadata records the format, the layout, the request, the layer count, the token
count, the dtype, the positions, the model, the first token and how the prompt was prefilled
(`forward`: "packed" or "padded"; `chunks`: its tokens per forward, comma-separated).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

KV_FORMAT = "dwdp-kv-v1"
KV_LAYOUT = "layers.{l}.keys [1, kv_heads, tokens, key_dim]; layers.{l}.values [1, kv_heads, tokens, value_dim]"


def artifact_metadata(rank: int, model: str, first_token_id: int, chunks: tuple[int, ...], forward: str) -> dict:
    """The string metadata a worker adds to an artifact (see the module docstring)."""
    return {"rank": rank, "model": model, "first_token_id": first_token_id, "positions": f"0..{sum(chunks) - 1}",
            "chunks": ",".join(map(str, chunks)), "forward": forward}


def to_host(layers) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer as contiguous CPU tensors, ready for write_kv_artifact."""
    return [(k.to("cpu").contiguous(), v.to("cpu").contiguous()) for k, v in layers]


def request_cache(cache, row: int, pad: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One request's (keys, values) per layer out of a batched, left-padded cache.

    cache: transformers DynamicCache of a forward over [P, Tmax]; row: the request's batch row;
    pad: its left-padding, so its tokens are positions [pad, Tmax). Returns ([1, Hkv, T, Dk], [1, Hkv, T, Dv])
    pairs on the CPU (the artifact is a file: a GPU worker's cache comes to host memory here).
    """
    layers = []
    for layer in cache.layers:
        keys = layer.keys[row : row + 1, :, pad:].to("cpu").contiguous()      # [1, Hkv, T, Dk]
        values = layer.values[row : row + 1, :, pad:].to("cpu").contiguous()  # [1, Hkv, T, Dv]
        layers.append((keys, values))
    return layers


def write_kv_artifact(directory: str | os.PathLike, request_id: str, layers, metadata: dict) -> dict:
    """Write `<directory>/<request_id>.safetensors` and return its descriptor: path, format,
    num_layers, num_tokens, dtype, bytes and one {name, layer, kind, shape, dtype} per tensor.

    The file appears atomically (written under a temporary name, then renamed), so a reader never
    sees half of one even if the worker dies mid-write.
    """
    path = Path(directory) / f"{request_id}.safetensors"
    tensors, entries = {}, []
    for index, (keys, values) in enumerate(layers):
        for kind, tensor in (("keys", keys), ("values", values)):
            name = f"layers.{index}.{kind}"
            tensors[name] = tensor
            entries.append({"name": name, "layer": index, "kind": kind, "shape": list(tensor.shape),
                            "dtype": str(tensor.dtype).removeprefix("torch.")})
    dtype = entries[0]["dtype"] if entries else "none"
    num_tokens = int(layers[0][0].shape[-2]) if layers else 0
    meta = {"format": KV_FORMAT, "layout": KV_LAYOUT, "request_id": request_id, "num_layers": str(len(layers)),
            "num_tokens": str(num_tokens), "dtype": dtype}
    meta.update({k: str(v) for k, v in metadata.items()})
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)
    return {"path": str(path), "format": KV_FORMAT, "num_layers": len(layers), "num_tokens": num_tokens,
            "dtype": dtype, "bytes": path.stat().st_size, "tensors": entries}


def read_kv_artifact(path: str | os.PathLike) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict]:
    """Load an artifact back: [(keys [1, Hkv, T, Dk], values [1, Hkv, T, Dv])] per layer, metadata."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != KV_FORMAT:
            raise ValueError(f"{path}: format {meta.get('format')!r} is not {KV_FORMAT!r}")
        layers = [(f.get_tensor(f"layers.{i}.keys"), f.get_tensor(f"layers.{i}.values"))
                  for i in range(int(meta["num_layers"]))]
    return layers, meta
