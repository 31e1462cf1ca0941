"""One packed, chunked prefill forward of a worker (both modes), and the prompts it leaves in progress.

Legend: P = prompts in the forward (pieces of them), T = tokens of the pieces (real ones, <= max_num_tokens),
Tc = cached tokens of the earlier chunks they continue, Ld = decoder layers, Hkv = key / value heads
(the cache's), Dk = head dim of the keys, Dv = head dim of the values, V = vocabulary.

A prompt longer than what is left of a forward's token budget is prefilled in chunks: each chunk
is a piece of a later forward (beside other prompts' pieces) that attends to the keys and values of
the prompt's earlier chunks, which the worker keeps in an `InProgress` until the last chunk. The
cache a forward runs with is a plain DynamicCache (full layers everywhere, so no key of a prompt is
dropped by a sliding-window layer before it is cut out) holding the pieces' earlier chunks back to
back; dwdp.serve.packed builds the row and the mask, and attention runs piece by piece
(dwdp.serve.varlen).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from dwdp.serve.packed import Piece, attention_masks, pack
from dwdp.serve.protocol import PrefillJob, greedy_first
from dwdp.serve.varlen import PackedLayout, piecewise


@dataclass
class InProgress:
    """A prompt on this worker: `done` tokens prefilled in `chunks`, their KV in `kv` (Ld pairs of
    [1, Hkv, done, Dk] / [1, Hkv, done, Dv] on the model's device; None before the first chunk)."""

    job: PrefillJob
    done: int = 0
    chunks: list[int] = field(default_factory=list)
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    started: float | None = None  # monotonic time its first chunk's forward began

    @property
    def left(self) -> int:
        return len(self.job.input_ids) - self.done

    @property
    def is_finished(self) -> bool:
        return self.left == 0


def _prefix_cache(prefixes: list) -> DynamicCache:
    """A DynamicCache holding every given prefix back to back, layer by layer (empty if none)."""
    cache = DynamicCache()
    given = [p for p in prefixes if p is not None]
    if given:
        for layer in range(len(given[0])):
            keys = torch.cat([p[layer][0] for p in given], dim=-2)    # [1, Hkv, Tc, Dk]
            values = torch.cat([p[layer][1] for p in given], dim=-2)  # [1, Hkv, Tc, Dv]
            cache.update(keys, values, layer)
    return cache


def model_dtype(model) -> torch.dtype:
    return model.get_input_embeddings().weight.dtype


def packed_forward(model, pieces: list[Piece], prefixes: list) -> tuple[torch.Tensor, list]:
    """Run `pieces` as one packed row through `model` (a transformers causal LM, or a DWDPModel /
    DEPModel around one). prefixes[i]: the KV of piece i's earlier chunks (Ld pairs of [1, Hkv, start, Dk]
    / [1, Hkv, start, Dv]) or None when it starts its prompt.

    Returns the logits at each piece's last token [P, V] and each piece's own new KV: P lists of Ld
    pairs ([1, Hkv, len, Dk], [1, Hkv, len, Dv]) on the model's device.
    """
    packed = pack(pieces, [p.start for p in pieces])
    device = model.get_input_embeddings().weight.device
    cache = _prefix_cache(prefixes)
    cached = cache.get_seq_length() if any(p is not None for p in prefixes) else 0
    mask = attention_masks(model.config, packed, model_dtype(model), device)
    layout = PackedLayout.of([len(p.ids) for p in pieces], [p.start for p in pieces])
    with torch.inference_mode(), piecewise(layout):
        out = model(input_ids=packed["input_ids"].to(device), position_ids=packed["position_ids"].to(device),
                    attention_mask=mask, cache=cache, use_cache=True,
                    logits_to_keep=torch.tensor(packed["last"], device=device))
    logits = out.logits[0]                                                     # [P, V], or [T, V] when
    if logits.shape[0] != len(pieces):  # the model ignores logits_to_keep (qwen3_omni_moe's thinker)
        logits = logits[packed["last"]]                                        # [P, V]
    kv, offset = [], cached
    for piece in pieces:
        n = len(piece.ids)
        # Ld x ([1, Hkv, t, Dk], [1, Hkv, t, Dv]): this piece's own new keys and values
        kv.append([(layer.keys[:, :, offset:offset + n], layer.values[:, :, offset:offset + n])
                   for layer in out.cache.layers])
        offset += n
    return logits, kv


def advance(model, plan: list[tuple[InProgress, int]]) -> list[tuple[InProgress, int, torch.Tensor]]:
    """One packed forward of `plan`: the next `n` tokens of each InProgress. Updates each one's
    done / chunks / kv and returns [(finished prompt, its greedy first token, its last logits [V])]
    in plan order."""
    pieces = [Piece(state.job.request_id, state.job.input_ids[state.done:state.done + n], state.done)
              for state, n in plan]
    for (state, n), piece in zip(plan, pieces):
        if not 0 < n <= state.left:
            raise ValueError(f"{state.job.request_id}: a chunk of {n} tokens with {state.left} left to prefill")
    logits, kv = packed_forward(model, pieces, [state.kv for state, _ in plan])
    finished = []
    for (state, n), new, row in zip(plan, kv, logits):
        state.kv = new if state.kv is None else [(torch.cat([k, nk], dim=-2), torch.cat([v, nv], dim=-2))
                                                 for (k, v), (nk, nv) in zip(state.kv, new)]
        state.done += n
        state.chunks.append(n)
        if state.is_finished:
            finished.append((state, greedy_first(row, state.job.banned_first), row))
    return finished
