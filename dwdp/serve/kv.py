"""KV-cache artifacts: one safetensors file per request, for a generation server to load.

Legend: B = requests in a forward, T = prompt tokens, Tmax = longest prompt of the forward,
Hkv = cached heads, Dk / Dv = key / value head dims (the model's own: for DeepSeek-V3 MLA the
cache holds the decompressed keys [.., qk_nope + qk_rope] and values [.., v_head_dim]).

File layout: tensors `layers.{l}.keys` [1, Hkv, T, Dk] and `layers.{l}.values` [1, Hkv, T, Dv]
for every layer l, contiguous, in the model's dtype, holding positions 0 .. T-1 of the prompt
(every layer holds every position, sliding-window layers included: a loader keeps what its cache
keeps); string metadata records the format, the layout, the request, the layer count, the token
count, the dtype, the positions, the model, the first token, how the prompt was prefilled
(`forward`: "packed" or "padded"; `chunks`: its tokens per forward, comma-separated) and
`prompt_sha256`, the digest of the prompt's token ids (`prompt_digest`), so a decode engine can
refuse the KV of another prompt (dwdp.integrations.kv_transfer).

An artifact is read back whole (`read_kv_artifact`) or checked from its header alone
(`read_kv_header`: metadata, tensor shapes, whether the file is complete) before any tensor is read.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

KV_FORMAT = "dwdp-kv-v1"
KV_LAYOUT = "layers.{l}.keys [1, kv_heads, tokens, key_dim]; layers.{l}.values [1, kv_heads, tokens, value_dim]"


def prompt_digest(ids) -> str:
    """sha256 (hex) of token ids written as decimal numbers joined by commas: "5,17,9" for [5, 17, 9]."""
    return hashlib.sha256(",".join(str(int(t)) for t in ids).encode()).hexdigest()


def artifact_metadata(rank: int, model: str, first_token_id: int, chunks: tuple[int, ...], forward: str,
                      prompt_ids=()) -> dict:
    """The string metadata a worker adds to an artifact (see the module docstring); prompt_ids: the
    prompt's token ids, recorded as their digest (left out when not given)."""
    meta = {"rank": rank, "model": model, "first_token_id": first_token_id, "positions": f"0..{sum(chunks) - 1}",
            "chunks": ",".join(map(str, chunks)), "forward": forward}
    if len(prompt_ids):
        meta["prompt_sha256"] = prompt_digest(prompt_ids)
    return meta


def to_host(layers) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer as contiguous CPU tensors, ready for write_kv_artifact."""
    return [(k.to("cpu").contiguous(), v.to("cpu").contiguous()) for k, v in layers]


def request_cache(cache, row: int, pad: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One request's (keys, values) per layer out of a batched, left-padded cache.

    cache: transformers DynamicCache of a forward over [B, Tmax]; row: the request's batch row;
    pad: its left-padding, so its tokens are positions [pad, Tmax). Returns [1, Hkv, T, D] pairs on the
    CPU (the artifact is a file: a GPU worker's cache comes to host memory here).
    """
    layers = []
    for layer in cache.layers:
        keys = layer.keys[row : row + 1, :, pad:].to("cpu").contiguous()      # [1, Hkv, T, Dk]
        values = layer.values[row : row + 1, :, pad:].to("cpu").contiguous()  # [1, Hkv, T, Dv]
        layers.append((keys, values))
    return layers


def write_kv_artifact(directory: str | os.PathLike, request_id: str, layers, metadata: dict) -> dict:
    """Write `<directory>/<request_id>.safetensors` and return its descriptor: path, format,
    num_layers, num_tokens, dtype, bytes, prompt_sha256 and model (when the metadata has them) and one
    {name, layer, kind, shape, dtype} per tensor.

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
    named = {key: meta[key] for key in ("prompt_sha256", "model") if key in meta}
    return {"path": str(path), "format": KV_FORMAT, "num_layers": len(layers), "num_tokens": num_tokens,
            "dtype": dtype, "bytes": path.stat().st_size, **named, "tensors": entries}


def read_kv_artifact(path: str | os.PathLike) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict]:
    """Load an artifact back: [(keys [1, Hkv, T, Dk], values [1, Hkv, T, Dv])] per layer, metadata."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != KV_FORMAT:
            raise ValueError(f"{path}: format {meta.get('format')!r} is not {KV_FORMAT!r}")
        layers = [(f.get_tensor(f"layers.{i}.keys"), f.get_tensor(f"layers.{i}.values"))
                  for i in range(int(meta["num_layers"]))]
    return layers, meta


def read_kv_header(path: str | os.PathLike) -> tuple[dict, dict, int]:
    """An artifact's header without reading a tensor: (string metadata, {tensor name: {"dtype",
    "shape", "data_offsets"}}, the file size the header promises). A file shorter than that size was
    cut (a copy that did not finish); ValueError for a file that is not a safetensors file at all."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: {len(head)} bytes, not a safetensors file")
        (size,) = struct.unpack("<Q", head)
        if size > 100 << 20:
            raise ValueError(f"{path}: a header of {size} bytes, not a safetensors file")
        raw = f.read(size)
    if len(raw) < size:
        raise ValueError(f"{path}: header cut at {len(raw)} of {size} bytes")
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{path}: header is not JSON ({exc})") from None
    meta = header.pop("__metadata__", None) or {}
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    return meta, header, 8 + size + end
