"""Attention of a packed row piece by piece (dwdp.serve.varlen) against the dense masked attention
it replaces, on seeded random queries, keys and values."""
import pytest
import torch
from torch import nn

from dwdp.models.tiny import build_tiny_model
from dwdp.serve import prefill, varlen
from dwdp.serve.packed import Piece, allowed, pack


class Heads(nn.Module):
    """What transformers' sdpa attention reads off an attention module."""

    def __init__(self, groups: int):
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def row(lengths, starts, heads=4, kv_heads=2, dim=16, kind="full_attention", window=None, seed=0):
    """Random q [1, H, N, D], k / v [1, Hk, K + N, D] and the packed row's bool mask [1, 1, N, K + N]."""
    gen = torch.Generator().manual_seed(seed)
    pieces = [Piece(i, tuple(range(n)), start) for i, (n, start) in enumerate(zip(lengths, starts))]
    packed = pack(pieces, list(starts))
    ok = allowed(packed["q_segment"], packed["position_ids"][0], packed["kv_segment"], packed["kv_position"],
                 kind, window)
    n, total = ok.shape
    q = torch.randn(1, heads, n, dim, generator=gen)
    k = torch.randn(1, kv_heads, total, dim, generator=gen)
    v = torch.randn(1, kv_heads, total, dim, generator=gen)
    return q, k, v, ok[None, None], varlen.PackedLayout.of(list(lengths), list(starts))


def dense(module, q, k, v, mask):
    varlen._install()
    return varlen._DENSE(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5)[0]


@pytest.mark.parametrize("lengths,starts,kind,window", [
    ((7, 3, 12), (0, 0, 0), "full_attention", None),
    ((5, 9, 4), (6, 0, 11), "full_attention", None),       # two pieces continue earlier chunks
    ((5, 9, 4), (6, 0, 11), "sliding_attention", 4),
    ((8, 8), (3, 13), "chunked_attention", 5),
    ((1, 1, 1), (0, 2, 0), "full_attention", None),       # one-token pieces
])
def test_piece_by_piece_equals_the_dense_masked_row(lengths, starts, kind, window):
    module = Heads(groups=2)
    q, k, v, mask, layout = row(lengths, starts, kind=kind, window=window, seed=len(lengths) + sum(starts))
    want = dense(module, q, k, v, mask)
    with varlen.piecewise(layout):
        got, _ = varlen.attend(module, q, k, v, mask, scaling=q.shape[-1] ** -0.5)
    assert got.shape == want.shape == (1, sum(lengths), 4, 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_each_piece_is_one_attention_call_over_its_own_keys(monkeypatch):
    module = Heads(groups=2)
    q, k, v, mask, layout = row((5, 9, 4), (6, 0, 11))
    calls = []
    varlen._install()
    real = varlen._DENSE

    def spy(module, q, k, v, mask, **kwargs):
        calls.append((q.shape[2], k.shape[2], tuple(mask.shape)))
        return real(module, q, k, v, mask, **kwargs)

    monkeypatch.setattr(varlen, "_DENSE", spy)
    with varlen.piecewise(layout):
        varlen.attend(module, q, k, v, mask)
    assert calls == [(5, 11, (1, 1, 5, 11)), (9, 9, (1, 1, 9, 9)), (4, 15, (1, 1, 4, 15))]
    calls.clear()
    varlen.attend(module, q, k, v, mask)  # outside a packed forward: the dense row, as given
    assert calls == [(18, 35, (1, 1, 18, 35))]


def test_calls_that_cannot_be_cut_stay_dense(monkeypatch):
    module = Heads(groups=2)
    q, k, v, mask, layout = row((5, 9), (0, 0))
    shapes = []
    varlen._install()
    real = varlen._DENSE
    monkeypatch.setattr(varlen, "_DENSE", lambda m, q, k, v, mask, **kw: (shapes.append(q.shape[2]),
                                                                          real(m, q, k, v, mask, **kw))[1])
    with varlen.piecewise(layout):
        varlen.attend(module, q[:, :, :7], k[:, :, :7], v[:, :, :7], mask[..., :7, :7])  # another sequence
        varlen.attend(module, q, k, v, torch.zeros(mask.shape))                        # an additive mask
        varlen.attend(module, q, k, v, mask, position_bias=torch.zeros(1, 4, 14, 14))   # a row-wide bias
    assert shapes == [7, 14, 14]


def test_the_layout_lays_pieces_out_as_pack_does():
    layout = varlen.PackedLayout.of([3, 2, 4], [5, 0, 1])
    assert (layout.tokens, layout.cached) == (9, 6)
    assert [(s.start, s.end, s.prefix_start, s.prefix_end) for s in layout.spans] == [(0, 3, 0, 5), (3, 5, 5, 5),
                                                                                    (5, 9, 5, 6)]
    kv = torch.arange(15.0)[None, :, None]                                             # [1, K + N, 1]
    assert layout.keys_of(layout.spans[2], kv).flatten().tolist() == [5.0, 11.0, 12.0, 13.0, 14.0]


@pytest.mark.timeout(60)
def test_a_packed_forward_of_a_model_attends_piece_by_piece(monkeypatch):
    """A real family's packed forward goes through the cut: every attention call is one piece's."""
    model = build_tiny_model("qwen3_moe", seed=0)
    pieces = [Piece("a", tuple(range(3, 14)), 0), Piece("b", tuple(range(20, 27)), 0)]
    seen = []
    varlen._install()
    real = varlen._DENSE
    monkeypatch.setattr(varlen, "_DENSE", lambda m, q, k, v, mask, **kw: (seen.append(q.shape[2]),
                                                                          real(m, q, k, v, mask, **kw))[1])
    prefill.packed_forward(model, pieces, [None, None])
    layers = model.config.num_hidden_layers
    assert seen == [11, 7] * layers
