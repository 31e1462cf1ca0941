"""Prompt lengths and their packing into forwards of at most max-num-tokens."""
import numpy as np
import pytest

from dwdp.predict import costmodel as cm
from dwdp.predict.packing import RequestMix, draw_lengths, forward_shapes, pack, with_token_cv


def test_pack_is_greedy_in_arrival_order():
    forwards = pack(np.array([5, 3, 4, 6, 2, 7]), 8, 3)
    assert [f.tolist() for f in forwards] == [[5, 3], [4], [6, 2]], forwards
    with pytest.raises(ValueError, match="fewer than 3 forwards"):
        pack(np.array([5, 3, 4, 6, 2]), 8, 3)  # the third forward is still open


def test_uniform_lengths_fill_forwards_exactly_as_counted():
    # Lengths in [81, 100] under a 400-token budget: 4 always fit, 5 never do.
    rng = np.random.default_rng(0)
    lengths = draw_lengths(RequestMix(100, 0.81), 20000, 400, rng)
    assert lengths.min() == 81 and lengths.max() == 100, (lengths.min(), lengths.max())
    shape = forward_shapes(RequestMix(100, 0.81), 400, 3, 500, [None, 16], rng)
    tokens = shape.tokens
    assert tokens.shape == (500, 3) and tokens.min() >= 4 * 81 and tokens.max() <= 400, (tokens.min(), tokens.max())
    assert abs(tokens.mean() - 4 * 90.5) < 1.0, tokens.mean()
    # Full causal pairs per prompt L(L+1)/2: between the bounds of four prompts of the forward's mean length.
    mean_len = tokens / 4
    lower = 4 * mean_len * (mean_len + 1) / 2
    assert np.all(shape.pairs[None] >= lower - 1e-9) and np.all(shape.pairs[None] <= lower + 4 * 19 ** 2 / 8 + 1e-9)
    # A 16-token window: 136 pairs for the first 16 keys, then 16 per token.
    assert np.allclose(shape.pairs[16], 4 * 136 + (tokens - 4 * 16) * 16), "windowed pairs"
    assert np.array_equal(shape.keys_read[None], tokens)


def test_normal_lengths_and_errors():
    rng = np.random.default_rng(1)
    lengths = draw_lengths(RequestMix(1000, isl_std=300.0), 50000, 10000, rng)
    assert abs(lengths.mean() - 1000) < 5 and abs(lengths.std() - 300) < 5, (lengths.mean(), lengths.std())
    clipped = draw_lengths(RequestMix(1000, isl_std=600.0), 50000, 1500, rng)
    assert clipped.min() == 1 and clipped.max() == 1500, (clipped.min(), clipped.max())
    with pytest.raises(ValueError, match="isl=2000 exceeds max_num_tokens=1024"):
        forward_shapes(RequestMix(2000), 1024, 2, 4, [None], rng)
    with pytest.raises(ValueError, match="isl_ratio=0"):
        RequestMix(100, 0.0)
    with pytest.raises(ValueError, match="isl_std=-1"):
        RequestMix(100, isl_std=-1.0)


def test_token_cv_override_keeps_attention_per_token():
    rng = np.random.default_rng(2)
    shape = forward_shapes(RequestMix(100, 0.81), 400, 4, 3000, [None], rng)
    out = with_token_cv(shape, 0.3, rng)
    cv = out.tokens.std() / out.tokens.mean()
    assert abs(cv - 0.3) < 0.02 and abs(out.tokens.mean() / shape.tokens.mean() - 1) < 0.02, (cv, out.tokens.mean())
    assert np.allclose(out.pairs[None] / out.tokens, shape.pairs[None] / shape.tokens)
    flat = with_token_cv(shape, 0.0, rng)
    assert np.allclose(flat.tokens, shape.tokens.mean()), "cv 0 gives every rank the mean"
    assert isinstance(flat, cm.ForwardShape)
