"""Attention of a packed row piece by piece: each piece's queries against its own keys only.

Legend: P = prompts in the row (pieces of them), T = tokens of the row, Tc = cached tokens of earlier
chunks, Hq = query heads, Hkv = key / value heads, D = head dim, Dv = head dim of the values,
t = tokens of one piece, Tk = keys of one piece (its cached prefix, then its own t tokens).

A packed forward passes one [1, 1, T, Tc + T] mask per layer kind (dwdp.serve.packed). Attention under
that mask computes every query against every key of the row and throws away all pairs of different
prompts: with P pieces of equal length, P times the work one prompt alone needs. The mask is
block-diagonal by construction (a query only ever sees keys of its own piece), so attending each
piece to its own keys under its own block of the mask gives the same result for 1/P of the work.

`piecewise()` installs, for the duration of one forward, a layout that transformers' "sdpa" attention
consults: `attend()` replaces transformers' sdpa function while installed, and hands every call it
cannot cut (no layout, a batch of more than one row, shapes that are not the packed row's, extra
biases or sinks) to that function unchanged, which then runs the dense mask as before.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch

# Keyword arguments of an attention call that add terms across the whole row; such calls stay dense.
_ROW_WIDE_KWARGS = ("position_bias", "s_aux", "sinks", "softcap")


@dataclass(frozen=True)
class PieceSpan:
    """Where one piece lives in the row: its queries are row tokens [start, end); its keys are cached
    tokens [prefix_start, prefix_end) followed by its own new tokens."""

    start: int
    end: int
    prefix_start: int
    prefix_end: int


@dataclass(frozen=True)
class PackedLayout:
    """The pieces of one packed row: T = `tokens` new tokens after Tc = `cached` cached ones."""

    spans: tuple[PieceSpan, ...]
    tokens: int
    cached: int

    @classmethod
    def of(cls, lengths: list[int], prefix_lengths: list[int]) -> "PackedLayout":
        """The layout of pieces of `lengths` new tokens continuing `prefix_lengths` cached ones, laid
        out as dwdp.serve.packed.pack lays them (prefixes back to back, then the pieces)."""
        spans, start, prefix = [], 0, 0
        for n, k in zip(lengths, prefix_lengths):
            spans.append(PieceSpan(start, start + n, prefix, prefix + k))
            start, prefix = start + n, prefix + k
        return cls(tuple(spans), start, prefix)

    def keys_of(self, span: PieceSpan, kv: torch.Tensor) -> torch.Tensor:
        """The piece's keys (or values, or mask columns) out of `kv` [..., Tc + T, ...] along dim -2:
        [..., Tk, ...]."""
        own = kv[..., self.cached + span.start:self.cached + span.end, :]
        if span.prefix_end == span.prefix_start:
            return own
        return torch.cat([kv[..., span.prefix_start:span.prefix_end, :], own], dim=-2)


_LAYOUT: contextvars.ContextVar[PackedLayout | None] = contextvars.ContextVar("dwdp_packed_layout", default=None)
_DENSE = None  # transformers' own sdpa attention, which attend() falls back to


def _install() -> None:
    """Put attend() in front of transformers' sdpa attention (once per process)."""
    global _DENSE
    if _DENSE is not None:
        return
    from transformers.modeling_utils import AttentionInterface

    _DENSE = AttentionInterface._global_mapping["sdpa"]
    AttentionInterface.register("sdpa", attend)


@contextlib.contextmanager
def piecewise(layout: PackedLayout):
    """Attend piece by piece inside this block (in this thread or task only)."""
    _install()
    token = _LAYOUT.set(layout)
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def _cuttable(layout: PackedLayout | None, query: torch.Tensor, key: torch.Tensor, mask, kwargs: dict) -> bool:
    return (layout is not None and query.shape[0] == 1 and query.shape[2] == layout.tokens
            and key.shape[2] == layout.cached + layout.tokens and isinstance(mask, torch.Tensor)
            and mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[0] == 1
            and mask.shape[-2:] == (layout.tokens, layout.cached + layout.tokens)
            and all(kwargs.get(name) is None for name in _ROW_WIDE_KWARGS))


def attend(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask, dropout: float = 0.0,
           scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' sdpa attention signature. query [1, Hq, T, D], key / value [1, Hkv, Tc + T, D],
    attention_mask [1, 1 or Hq, T, Tc + T] bool. Returns ([1, T, Hq, Dv], None) like transformers' sdpa."""
    layout = _LAYOUT.get()
    if not _cuttable(layout, query, key, attention_mask, kwargs):
        return _DENSE(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                      is_causal=is_causal, **kwargs)
    outputs = []
    for span in layout.spans:
        rows = attention_mask[:, :, span.start:span.end]                             # [1, 1, t, Tc + T]
        mask = layout.keys_of(span, rows.transpose(-1, -2)).transpose(-1, -2)          # [1, 1, t, Tk]
        out, _ = _DENSE(module, query[:, :, span.start:span.end], layout.keys_of(span, key),
                        layout.keys_of(span, value), mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                        **kwargs)                                                       # [1, t, Hq, Dv]
        outputs.append(out)
    return torch.cat(outputs, dim=1), None                                             # [1, T, Hq, Dv]
