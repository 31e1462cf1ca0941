"""KV-cache artifacts: one safetensors file per request, for a generation server to load.

Legend: P = prompts in a forward (its requests), T = tokens of a prompt, Tmax = longest prompt of the
forward, Hkv = key / value heads (the cache's), Dk = head dim of the keys, Dv = head dim of the values,
Rkv = MLA's kv_lora_rank (its latent), Dr = MLA's qk_rope_head_dim (its roped key).

Two formats. `dwdp-kv-v1`, what a model's transformers cache holds per layer: tensors
`layers.{l}.keys` [1, Hkv, T, Dk] and `layers.{l}.values` [1, Hkv, T, Dv] for every layer l,
contiguous, in the model's dtype, holding positions 0 .. T-1 of the prompt
(every layer holds every position, sliding-window layers included: a loader keeps what its cache
keeps); string metadata records the format, the layout, the request, the layer count, the token
count, the dtype, the positions, the model, the first token, how the prompt was prefilled
(`forward`: "packed" or "padded"; `chunks`: its tokens per forward, comma-separated) and
`prompt_sha256`, the digest of the prompt's token ids (`prompt_digest`: fixed-width ids), so a decode
engine can refuse the KV of another prompt (dwdp.integrations.kv_transfer). Files are mode 0600.

`dwdp-kv-mla-v1`, for the MLA families whose transformers cache holds the compressed latent and whose
rope order is known (`latent_layout`: DeepSeek-V3/R1 and Kimi-K2, DeepSeek-V2; transformers 5 caches
`kv_a_layernorm`'s output as the keys and the roped shared key as the values, one head): tensors
`layers.{l}.latent` [1, T, Rkv] and `layers.{l}.rope` [1, T, Dr], the rope dims in the checkpoint's order
(`rope_layout` "interleaved": pairs (0, 1), (2, 3), ... as DeepSeek's weights lay them out and vLLM
and SGLang cache them; DeepSeek-V3's transformers code rotates them as two halves, so its cache holds
them de-interleaved and they are re-interleaved here); metadata adds `kv_lora_rank`, `rope_dim`,
`rope_layout` and `cache_rope` (the order transformers caches them in). For DeepSeek-R1 that is 576
values per token per layer instead of 128 heads x (192 + 128) decompressed: 71x fewer bytes.
`read_kv_artifact` hands both formats back as the transformers cache holds them.

An artifact is read back whole (`read_kv_artifact`) or checked from its header alone
(`read_kv_header`: metadata, tensor shapes, whether the file is complete) before any tensor is read.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

KV_FORMAT = "dwdp-kv-v1"
KV_LAYOUT = "layers.{l}.keys [1, kv_heads, tokens, key_dim]; layers.{l}.values [1, kv_heads, tokens, value_dim]"
KV_MLA_FORMAT = "dwdp-kv-mla-v1"
KV_MLA_LAYOUT = "layers.{l}.latent [1, tokens, kv_lora_rank]; layers.{l}.rope [1, tokens, rope_dim] (roped)"
FORMATS = (KV_FORMAT, KV_MLA_FORMAT)


@dataclass(frozen=True)
class LatentLayout:
    """How an MLA model's transformers cache holds its latent: keys [.., 1, T, kv_lora_rank] (the
    normed latent), values [.., 1, T, rope_dim] (the roped shared key). rope_layout: the order of the
    rope dims in the checkpoint, "interleaved" (pairs (0, 1), (2, 3), ...: DeepSeek's) or "halves";
    cache_rope: the order transformers caches them in ("halves" after DeepSeek-V3's interleaved rope,
    "pairs" after DeepSeek-V2's complex one)."""

    kv_lora_rank: int
    rope_dim: int
    rope_layout: str = "interleaved"
    cache_rope: str = "halves"

    @property
    def reorders(self) -> bool:
        """Whether the cache's rope order differs from the checkpoint's (halves cached, pairs meant)."""
        return self.rope_layout == "interleaved" and self.cache_rope == "halves"

    def holds(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether a cache layer's (keys, values) are this latent (not decompressed heads)."""
        return (keys.shape[1] == 1 and values.shape[1] == 1 and keys.shape[-1] == self.kv_lora_rank
                and values.shape[-1] == self.rope_dim)


def latent_layout(config) -> LatentLayout | None:
    """The latent layout of an MLA model whose transformers cache was checked to hold the latent and
    whose rope order is known (DeepSeek-V3 and what shares its model type, such as Kimi-K2; DeepSeek-V2),
    else None (its artifacts are written as `dwdp-kv-v1`)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    rank, rope = getattr(config, "kv_lora_rank", None), getattr(config, "qk_rope_head_dim", None)
    if not rank or not rope:
        return None
    if config.model_type == "deepseek_v3":
        interleaved = bool(getattr(config, "rope_interleave", True))
        return LatentLayout(int(rank), int(rope), "interleaved" if interleaved else "halves", "halves")
    if config.model_type == "deepseek_v2":
        return LatentLayout(int(rank), int(rope), "interleaved", "pairs")
    return None


def interleave_halves(x: torch.Tensor) -> torch.Tensor:
    """[.., Dr] two halves (a, b) -> pairs (a0, b0, a1, b1, ...): transformers' rope order to the checkpoint's."""
    half = x.shape[-1] // 2
    return torch.stack((x[..., :half], x[..., half:]), dim=-1).flatten(-2)


def halve_pairs(x: torch.Tensor) -> torch.Tensor:
    """[.., Dr] pairs -> two halves (evens, odds): the inverse of interleave_halves."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


PROMPT_DIGEST_TAG = b"dwdp-prompt-ids-u32le-v1"


def prompt_digest(ids) -> str:
    """sha256 (hex) of a prompt's token ids in a fixed-width encoding: a tag, the count as 8 bytes and every
    id as 4 bytes, little-endian. Fixed width keeps ids apart ([1, 23, 4] and [12, 3, 4] never share a
    digest, as a decimal join without separators would let them); an id outside [0, 2**32) is a ValueError."""
    values = [int(t) for t in ids]
    try:
        body = struct.pack(f"<Q{len(values)}I", len(values), *values)
    except struct.error:
        bad = next(t for t in values if not 0 <= t < 2**32)
        raise ValueError(f"token id {bad} is outside [0, 2**32): no prompt digest") from None
    return hashlib.sha256(PROMPT_DIGEST_TAG + body).hexdigest()


def artifact_metadata(rank: int, model: str, first_token_id: int, chunks: tuple[int, ...], forward: str,
                      prompt_ids=(), latent: LatentLayout | None = None) -> dict:
    """The string metadata a worker adds to an artifact (see the module docstring); prompt_ids: the
    prompt's token ids, recorded as their digest (left out when not given); latent: the model's MLA
    latent layout (`latent_layout(config)`): its cache is written as `dwdp-kv-mla-v1`."""
    meta = {"rank": rank, "model": model, "first_token_id": first_token_id, "positions": f"0..{sum(chunks) - 1}",
            "chunks": ",".join(map(str, chunks)), "forward": forward}
    if len(prompt_ids):
        meta["prompt_sha256"] = prompt_digest(prompt_ids)
    if latent is not None:
        meta.update(kv_lora_rank=latent.kv_lora_rank, rope_dim=latent.rope_dim, rope_layout=latent.rope_layout,
                    cache_rope=latent.cache_rope)
    return meta


_LATENT_KEYS = ("kv_lora_rank", "rope_dim", "rope_layout", "cache_rope")


def _latent_of(metadata: dict) -> LatentLayout | None:
    if "kv_lora_rank" not in metadata:
        return None
    return LatentLayout(int(metadata["kv_lora_rank"]), int(metadata["rope_dim"]), str(metadata["rope_layout"]),
                        str(metadata["cache_rope"]))


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
    num_layers, num_tokens, dtype, bytes, prompt_sha256 and model (when the metadata has them) and one
    {name, layer, kind, shape, dtype} per tensor.

    layers: (keys, values) per layer as the transformers cache holds them. With an MLA latent layout in
    the metadata (artifact_metadata's `latent`) and layers that hold that latent, the file is
    `dwdp-kv-mla-v1`; otherwise `dwdp-kv-v1`. The file appears atomically (written under a temporary
    name, then renamed), so a reader never sees half of one even if the worker dies mid-write.
    """
    path = Path(directory) / f"{request_id}.safetensors"
    latent = _latent_of(metadata)
    if latent is not None and not all(latent.holds(k, v) for k, v in layers):
        latent = None  # a cache that holds decompressed heads after all: written as it is
    tensors, entries = {}, []
    for index, (keys, values) in enumerate(layers):
        if latent is None:
            pair = (("keys", keys), ("values", values))
        else:
            rope = interleave_halves(values[:, 0]) if latent.reorders else values[:, 0]  # [1, T, Dr]
            pair = (("latent", keys[:, 0].contiguous()), ("rope", rope.contiguous()))         # [1, T, Rkv]
        for kind, tensor in pair:
            name = f"layers.{index}.{kind}"
            tensors[name] = tensor
            entries.append({"name": name, "layer": index, "kind": kind, "shape": list(tensor.shape),
                            "dtype": str(tensor.dtype).removeprefix("torch.")})
    dtype = entries[0]["dtype"] if entries else "none"
    num_tokens = int(layers[0][0].shape[-2]) if layers else 0
    fmt, layout = (KV_FORMAT, KV_LAYOUT) if latent is None else (KV_MLA_FORMAT, KV_MLA_LAYOUT)
    meta = {"format": fmt, "layout": layout, "request_id": request_id, "num_layers": str(len(layers)),
            "num_tokens": str(num_tokens), "dtype": dtype}
    metadata = metadata if latent is not None else {k: v for k, v in metadata.items() if k not in _LATENT_KEYS}
    meta.update({k: str(v) for k, v in metadata.items()})
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=meta)
    _owner_only(tmp)
    os.replace(tmp, path)
    named = {key: meta[key] for key in ("prompt_sha256", "model") if key in meta}
    return {"path": str(path), "format": fmt, "num_layers": len(layers), "num_tokens": num_tokens,
            "dtype": dtype, "bytes": path.stat().st_size, **named, "tensors": entries}


def _owner_only(path: Path) -> None:
    """Mode 0600 on a file just written, whatever the writer's umask or release did (safetensors 0.8 writes
    through a temporary file of its own, so its files come out 0600; older releases use the umask)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def read_kv_artifact(path: str | os.PathLike) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict]:
    """Load an artifact back as the transformers cache holds it: [(keys [1, Hkv, T, Dk], values
    [1, Hkv, T, Dv])] per layer (an MLA latent: keys [1, 1, T, Rkv], values [1, 1, T, Dr] in
    transformers' rope order), and its metadata."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") not in FORMATS:
            raise ValueError(f"{path}: format {meta.get('format')!r} is not one of {FORMATS}")
        num_layers = int(meta["num_layers"])
        if meta["format"] == KV_FORMAT:
            layers = [(f.get_tensor(f"layers.{i}.keys"), f.get_tensor(f"layers.{i}.values")) for i in range(num_layers)]
        else:
            latent = _latent_of(meta)
            layers = []
            for i in range(num_layers):
                rope = f.get_tensor(f"layers.{i}.rope")                                  # [1, T, Dr]
                rope = halve_pairs(rope) if latent.reorders else rope
                layers.append((f.get_tensor(f"layers.{i}.latent").unsqueeze(1), rope.unsqueeze(1)))
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
