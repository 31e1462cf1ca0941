"""Where dwdp's KV travels to a decode engine, seen from the decode side: the transfer half of the
connector (dwdp.integrations.vllm_connector writes what this reads into the engine's pages).

Legend: Hkv = key / value heads (the cached ones), T = tokens (of the artifact's prompt), Dk = head dim
of the keys, Dv = head dim of the values, Rkv = MLA's kv_lora_rank, Dr = MLA's qk_rope_head_dim.

Nothing here imports a decode engine, so the checks run (and are tested) anywhere. One request's
life, on the engine's two sides:
  scheduler side  `check(params, prompt_ids, expected)`: picks the artifact of this prompt out of the
                  request's `kv_transfer_params` and checks its header (no tensor is read): present,
                  complete, the format (per-head keys and values, or MLA's latent for an MLA engine),
                  the model, layers, heads, dims, dtype and the prompt's token ids (their digest). Any
                  mismatch raises `Refused(reason)`: the engine recomputes.
                  `release(ref)` once the engine holds the KV: the artifact is removed.
  worker side     `open(ref)` -> `LayerReader`: `layer(l)` gives that layer's keys [1, Hkv, T, Dk] and
                  values [1, Hkv, T, Dv] (MLA: latent [1, T, Rkv] and rope [1, T, Dr]), one layer at a time,
                  as the engine's attention reaches it.

`FileTransfer` reads files in a directory both servers see (/dev/shm on one node, a shared file
system across nodes). Another transport (NIXL: RDMA reads from the prefill node's registered memory)
is another class with these three methods; the page writing does not change (docs/decode-with-vllm.md).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from dwdp.serve.kv import KV_FORMAT, KV_MLA_FORMAT, prompt_digest, read_kv_header

# safetensors dtype names -> torch's (the ones an artifact is written in)
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


class Refused(Exception):
    """An artifact the engine must not load; str() is the one-line reason it recomputes instead."""


@dataclass(frozen=True)
class EngineKV:
    """What the decode engine caches, to check an artifact against.

    model: the model id an artifact must name (None: not checked); num_layers: decoder layers;
    num_kv_heads: cached heads of the whole model (before tensor parallelism); key_dim / value_dim:
    head dims; dtype: the dtype its cache writes take ("float32", "bfloat16", "float16").
    latent_dim / rope_dim: an MLA engine's kv_lora_rank and qk_rope_head_dim (it caches the latent and
    the roped shared key, rope dims in interleaved pairs, and takes `dwdp-kv-mla-v1` artifacts only);
    None for an engine that caches per-head keys and values (`dwdp-kv-v1`).
    """

    model: str | None
    num_layers: int
    num_kv_heads: int
    key_dim: int
    value_dim: int
    dtype: str
    latent_dim: int | None = None
    rope_dim: int | None = None

    @property
    def is_mla(self) -> bool:
        return self.latent_dim is not None


@dataclass(frozen=True)
class ArtifactRef:
    """One artifact a decode request names: its path, its prompt tokens and their digest."""

    path: str
    num_tokens: int
    prompt_sha256: str


def requested_artifacts(params) -> list[dict] | None:
    """The dwdp artifact descriptors of a request's kv_transfer_params (dwdp serve's own answer:
    {"kv_artifacts": [descriptor, ...]}), or None when the request names none (not ours: no log)."""
    if not isinstance(params, dict) or not isinstance(params.get("kv_artifacts"), list):
        return None
    return [d for d in params["kv_artifacts"] if isinstance(d, dict)] or None


def pick_artifact(descriptors: list[dict], prompt_ids) -> ArtifactRef:
    """The descriptor whose prompt is a prefix of `prompt_ids` (by digest), as an ArtifactRef."""
    seen = []
    for desc in descriptors:
        try:
            ref = ArtifactRef(str(desc["path"]), int(desc["num_tokens"]), str(desc["prompt_sha256"]))
        except (KeyError, TypeError, ValueError):
            raise Refused(f"kv_artifacts entry without path, num_tokens and prompt_sha256: {sorted(desc)}") from None
        if 0 < ref.num_tokens <= len(prompt_ids) and prompt_digest(prompt_ids[:ref.num_tokens]) == ref.prompt_sha256:
            return ref
        seen.append(f"{os.path.basename(ref.path)} ({ref.num_tokens} tokens)")
    raise Refused(f"the prompt's token ids ({len(prompt_ids)}) do not start with the prompt of "
                  f"{', '.join(seen)}")


def check_header(ref: ArtifactRef, expected: EngineKV) -> None:
    """Refused naming the first thing in the artifact's header that does not fit `expected` or `ref`."""
    try:
        size = os.stat(ref.path).st_size
    except FileNotFoundError:
        raise Refused(f"{ref.path} is missing (expired, or removed after an earlier load)") from None
    except OSError as exc:
        raise Refused(f"{ref.path} cannot be read: {exc}") from None
    try:
        meta, tensors, promised = read_kv_header(ref.path)
    except (OSError, ValueError) as exc:
        raise Refused(f"{ref.path}: not a readable artifact: {exc}") from None
    if size < promised:
        raise Refused(f"{ref.path} is truncated: {size} of {promised} bytes")
    fmt = meta.get("format")
    if expected.is_mla and fmt == KV_FORMAT:
        raise Refused(f"{ref.path} holds per-head keys and values ({KV_FORMAT}); this engine runs MLA and caches "
                      f"the latent ({KV_MLA_FORMAT})")
    if not expected.is_mla and fmt == KV_MLA_FORMAT:
        raise Refused(f"{ref.path} holds an MLA latent ({KV_MLA_FORMAT}); this engine caches per-head keys and "
                      f"values ({KV_FORMAT})")
    if fmt not in (KV_FORMAT, KV_MLA_FORMAT):
        raise Refused(f"{ref.path}: format {fmt!r}, this connector reads {KV_FORMAT!r} and {KV_MLA_FORMAT!r}")
    if meta.get("prompt_sha256") != ref.prompt_sha256:
        raise Refused(f"{ref.path} holds the KV of another prompt (prompt_sha256 {meta.get('prompt_sha256')!r}, "
                      f"the request's is {ref.prompt_sha256!r})")
    if expected.model is not None and meta.get("model") != expected.model:
        raise Refused(f"{ref.path} was made by model {meta.get('model')!r}, this engine runs {expected.model!r}")
    layers = int(meta.get("num_layers", -1))
    if layers != expected.num_layers:
        raise Refused(f"{ref.path} has {layers} layers, this engine's model has {expected.num_layers}")
    if int(meta.get("num_tokens", -1)) != ref.num_tokens:
        raise Refused(f"{ref.path} holds {meta.get('num_tokens')} tokens, the request says {ref.num_tokens}")
    if meta.get("positions", f"0..{ref.num_tokens - 1}") != f"0..{ref.num_tokens - 1}":
        raise Refused(f"{ref.path}: positions {meta['positions']}, expected 0..{ref.num_tokens - 1}")
    if expected.is_mla:
        if meta.get("rope_layout") != "interleaved":
            raise Refused(f"{ref.path}: rope dims laid out as {meta.get('rope_layout')!r}; this engine ropes "
                          "interleaved pairs")
        kinds = (("latent", [1, ref.num_tokens, expected.latent_dim], "[1, tokens, kv_lora_rank]"),
                 ("rope", [1, ref.num_tokens, expected.rope_dim], "[1, tokens, qk_rope_head_dim]"))
    else:
        legend = "[1, kv heads, tokens, head dim]"
        kinds = (("keys", [1, expected.num_kv_heads, ref.num_tokens, expected.key_dim], legend),
                 ("values", [1, expected.num_kv_heads, ref.num_tokens, expected.value_dim], legend))
    for layer in range(layers):
        for kind, want, legend in kinds:
            info = tensors.get(f"layers.{layer}.{kind}")
            if info is None:
                raise Refused(f"{ref.path} has no layers.{layer}.{kind}")
            if list(info["shape"]) != want:
                raise Refused(f"{ref.path}: layers.{layer}.{kind} is {list(info['shape'])}, this engine caches "
                              f"{want} ({legend})")
            dtype = _DTYPES.get(info["dtype"], info["dtype"])
            if dtype != expected.dtype:
                raise Refused(f"{ref.path}: dtype {dtype}, this engine's cache takes {expected.dtype}")


class LayerReader:
    """Reads one artifact layer by layer (worker side); close() when done."""

    def __init__(self, path: str):
        from safetensors import safe_open

        self.path = path
        self._file = safe_open(path, framework="pt")
        self._handle = self._file.__enter__()
        self.is_mla = (self._handle.metadata() or {}).get("format") == KV_MLA_FORMAT
        self._kinds = ("latent", "rope") if self.is_mla else ("keys", "values")

    def layer(self, index: int):
        """Decoder layer `index` on the CPU: (keys [1, Hkv, T, Dk], values [1, Hkv, T, Dv]), or for an MLA
        artifact (latent [1, T, Rkv], rope [1, T, Dr])."""
        first, second = self._kinds
        return self._handle.get_tensor(f"layers.{index}.{first}"), self._handle.get_tensor(f"layers.{index}.{second}")

    def close(self) -> None:
        self._file.__exit__(None, None, None)


class FileTransfer:
    """KV artifacts as files in a directory both servers see."""

    def check(self, params, prompt_ids, expected: EngineKV) -> ArtifactRef | None:
        """The artifact this request may load (None: the request names no dwdp artifact); raises
        Refused with the reason when it names one that must not be loaded."""
        descriptors = requested_artifacts(params)
        if descriptors is None:
            return None
        ref = pick_artifact(descriptors, list(prompt_ids))
        check_header(ref, expected)
        return ref

    def open(self, ref: ArtifactRef) -> LayerReader:
        return LayerReader(ref.path)

    def release(self, ref: ArtifactRef) -> None:
        """The engine holds this KV now: remove the file (gone already is fine)."""
        try:
            os.remove(ref.path)
        except FileNotFoundError:
            pass
