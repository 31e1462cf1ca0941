"""Packed (padding-free) forwards: several prompts, or chunks of prompts, as one sequence.

Legend: P = prompts in a forward (pieces of them), T = tokens of the pieces (sum of their lengths, no
padding), Tc = cached tokens of earlier chunks the pieces continue (the "prefix"), Hkv = key / value
heads (the cache's), D = head dim.

A piece is tokens [start, end) of one prompt. A forward lays its pieces back to back as one row of
T tokens, each with its own position ids (start, start+1, ...), in front of which the cache holds
the Tc keys/values of the earlier chunks of those pieces that continue a prompt. The mask lets a
token see exactly what it would see alone: the tokens of its own prompt at positions <= its own
(and within the layer's sliding window or attention chunk), cached or new. It is built here from
positions, not by transformers (whose packed-sequence detection, masking_utils.
find_packed_sequence_indices, runs only without a cache), in the attention implementation's format.

Families whose layers carry state along the sequence outside attention (linear attention, Mamba,
convolutions) cannot pack: that state would flow from one prompt into the next. Nor can the families
in NOT_PACKABLE, which the startup self-check (dwdp.serve.packcheck) found to fail a packed forward
for reasons no config field shows. They fall back to padded batches (`packing_support`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Layer kinds whose only mixing along the sequence is attention under a mask built here.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")

# model_type -> why its prompts cannot share a packed row, for families whose config looks packable
# but whose packed forward fails the startup self-check (tests/test_packcheck.py confirms each).
NOT_PACKABLE = {
    "doge": "its router (DogeCDMoE) reshapes router logits across the tokens of a row, so one prompt's tokens "
            "pick another's experts",
    "diffusion_gemma": "a block-diffusion model: its logits are those of a decoder canvas (random tokens "
                       "unless given) that attends to the whole cache, every prompt of a packed row included",
}


@dataclass(frozen=True)
class Piece:
    """Tokens [start, end) of the prompt `key`; `ids` are those tokens."""

    key: object
    ids: tuple[int, ...]
    start: int

    @property
    def end(self) -> int:
        return self.start + len(self.ids)


def text_config(config):
    """The config of the language model (multimodal configs keep it under text_config)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def layer_types(config) -> list[str]:
    """Each decoder layer's kind, as transformers names it ("full_attention", "sliding_attention", ...)."""
    cfg = text_config(config)
    types = getattr(cfg, "layer_types", None)
    if types:
        return list(types)
    window = getattr(cfg, "sliding_window", None)
    if window is not None and getattr(cfg, "use_sliding_window", True):
        return ["sliding_attention"] * cfg.num_hidden_layers
    return ["full_attention"] * cfg.num_hidden_layers


def packing_support(config) -> tuple[bool, str]:
    """(whether prompts of this model can share one packed forward, why not when they cannot)."""
    cfg = text_config(config)
    for model_type in dict.fromkeys((getattr(config, "model_type", None), getattr(cfg, "model_type", None))):
        if model_type in NOT_PACKABLE:
            return False, f"{model_type}: {NOT_PACKABLE[model_type]}"
    other = sorted({t for t in layer_types(cfg) if t not in ATTENTION_LAYER_TYPES})
    if other:
        return False, (f"layers of type {other} carry state along the sequence outside attention, so one prompt "
                       "would leak into the next in a packed row")
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if isinstance(rope, dict) and "mrope_section" in rope:
        return False, "multimodal rotary positions (mrope) take 3-D position ids, not one packed row"
    return True, ""


def pack(pieces: list[Piece], prefix_lengths: list[int]) -> dict:
    """The packed row of `pieces`, continuing `prefix_lengths[i]` cached tokens for piece i (its
    `start`, or 0 for a first chunk).

    Returns input_ids [1, T], position_ids [1, T], segment ids of the queries [T] and of the keys
    [Tc + T], positions of the keys [Tc + T], and `last` [P]: each piece's last index in the row.
    The cache's Tc tokens are laid out piece by piece in the order of `pieces`.
    """
    ids, positions, q_segment, kv_segment, kv_position, last = [], [], [], [], [], []
    for i, (piece, prefix) in enumerate(zip(pieces, prefix_lengths)):
        if prefix != piece.start:
            raise ValueError(f"piece {i} starts at {piece.start} but continues {prefix} cached tokens")
        kv_segment += [i] * prefix
        kv_position += list(range(prefix))
    for i, piece in enumerate(pieces):
        ids += piece.ids
        positions += range(piece.start, piece.end)
        q_segment += [i] * len(piece.ids)
        last.append(len(ids) - 1)
    return {"input_ids": torch.tensor([ids], dtype=torch.long),                    # [1, T]
            "position_ids": torch.tensor([positions], dtype=torch.long),          # [1, T]
            "q_segment": torch.tensor(q_segment, dtype=torch.long),               # [T]
            "kv_segment": torch.tensor(kv_segment + q_segment, dtype=torch.long),  # [Tc + T]
            "kv_position": torch.tensor(kv_position + positions, dtype=torch.long),  # [Tc + T]
            "last": last}


def allowed(q_segment: torch.Tensor, q_position: torch.Tensor, kv_segment: torch.Tensor, kv_position: torch.Tensor,
            kind: str = "full_attention", window: int | None = None) -> torch.Tensor:
    """[T, Tc + T] bool: query i may attend to key j. Same prompt, key not after the query, and for
    "sliding_attention" at most `window - 1` positions back (transformers' sliding_window_overlay),
    for "chunked_attention" in the same chunk of `window` positions."""
    q_pos, kv_pos = q_position[:, None], kv_position[None, :]
    ok = (q_segment[:, None] == kv_segment[None, :]) & (kv_pos <= q_pos)
    if kind == "sliding_attention":
        ok &= q_pos - kv_pos < window
    elif kind == "chunked_attention":
        ok &= torch.div(q_pos, window, rounding_mode="floor") == torch.div(kv_pos, window, rounding_mode="floor")
    elif kind != "full_attention":
        raise ValueError(f"layer kind {kind!r} is not one of {ATTENTION_LAYER_TYPES}")
    return ok


def _window(cfg, kind: str) -> int | None:
    if kind == "sliding_attention":
        return int(cfg.sliding_window)
    if kind == "chunked_attention":
        return int(cfg.attention_chunk_size)
    return None


def _in_format(ok: torch.Tensor, implementation: str, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, T, Tc + T] in what the attention implementation adds or selects with: a bool mask for
    sdpa, an additive float mask (0 or dtype min) for eager."""
    ok = ok[None, None]
    if implementation == "sdpa":
        return ok
    if implementation == "eager":
        return torch.zeros(ok.shape, dtype=dtype).masked_fill_(~ok, torch.finfo(dtype).min)
    raise ValueError(f"attention implementation {implementation!r}: packed masks are built for 'sdpa' and 'eager'")


def attention_masks(config, packed: dict, dtype: torch.dtype, device) -> torch.Tensor | dict:
    """The mask(s) to pass as `attention_mask` for `packed`: one [1, 1, T, Tc + T] tensor when every
    layer is of one kind (the model uses a 4-D mask as given), else {layer kind: mask}, the mapping
    the models with mixed layers take."""
    cfg = text_config(config)
    implementation = getattr(cfg, "_attn_implementation", None) or "eager"
    q_segment, kv_segment, kv_position = packed["q_segment"], packed["kv_segment"], packed["kv_position"]
    q_position = packed["position_ids"][0]
    masks = {}
    for kind in dict.fromkeys(layer_types(cfg)):
        ok = allowed(q_segment, q_position, kv_segment, kv_position, kind, _window(cfg, kind))
        masks[kind] = _in_format(ok, implementation, dtype).to(device)
    return next(iter(masks.values())) if len(masks) == 1 else masks
