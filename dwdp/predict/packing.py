"""Prompt lengths drawn like the paper's workloads, packed into forwards of at most max-num-tokens.

Legend: F = forwards per rank, G = ranks, T = tokens of one prompt (its length: `describe()` names it
L, as the stored runs that key on it do), MNT = max_num_tokens.

A context server takes prompts in arrival order and puts as many as fit into one forward of at most
MNT tokens (ragged batching, no padding); every prompt fits one forward (no chunked prefill here).
Lengths are uniform integers in [ceil(ratio * isl), isl], or, with a standard deviation, normal
around isl (rounded, clipped to [1, MNT]). Each rank draws its own stream, so ranks' forwards differ
in tokens and, more, in attention work (sum of T^2 / 2): the per-step spread DEP must wait for.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dwdp.predict.costmodel import ForwardShape, causal_pairs

VOCAB = 512  # the tiny preset's; prompt ids are drawn in [3, VOCAB)


@dataclass(frozen=True)
class RequestMix:
    """isl: longest (uniform) or mean (normal) prompt; isl_ratio: shortest / isl for uniform lengths;
    isl_std: standard deviation in tokens (None = uniform lengths)."""

    isl: int
    isl_ratio: float = 1.0
    isl_std: float | None = None

    def __post_init__(self):
        if isinstance(self.isl, bool) or not isinstance(self.isl, int) or self.isl < 1:
            raise ValueError(f"isl={self.isl!r} must be an int >= 1")
        if not 0.0 < self.isl_ratio <= 1.0:
            raise ValueError(f"isl_ratio={self.isl_ratio} must be in (0, 1]")
        if self.isl_std is not None and self.isl_std < 0:
            raise ValueError(f"isl_std={self.isl_std} must be >= 0")

    def describe(self) -> str:
        if self.isl_std is not None:
            return f"L ~ normal({self.isl}, {self.isl_std:g})"
        return f"L ~ uniform[{math.ceil(self.isl_ratio * self.isl)}, {self.isl}]"

    @classmethod
    def from_description(cls, text: str) -> "RequestMix":
        """The mix back from its describe() (a prefix such as 'long: ' allowed): 'L ~ uniform[256, 512]'
        or 'L ~ normal(384, 115.2)'."""
        kind, _, numbers = text.partition("~ ")[2].partition("(" if "normal" in text else "[")
        a, b = (float(x) for x in numbers.rstrip(")]").split(","))
        if kind == "normal":
            return cls(int(a), isl_std=b)
        return cls(int(b), a / b)


def draw_lengths(mix: RequestMix, count: int, max_num_tokens: int, rng: np.random.Generator) -> np.ndarray:
    """`count` prompt lengths. [count] int"""
    if mix.isl_std is None:
        return rng.integers(max(1, math.ceil(mix.isl_ratio * mix.isl)), mix.isl + 1, size=count)
    return np.clip(np.rint(rng.normal(mix.isl, mix.isl_std, size=count)), 1, max_num_tokens).astype(np.int64)


def pack(lengths: np.ndarray, max_num_tokens: int, num_forwards: int) -> list[np.ndarray]:
    """The first `num_forwards` forwards of a stream: prompts in order while their sum fits."""
    forwards, current, used = [], [], 0
    for n in lengths.tolist():
        if current and used + n > max_num_tokens:
            forwards.append(np.array(current, dtype=np.float64))
            if len(forwards) == num_forwards:
                return forwards
            current, used = [], 0
        current.append(n)
        used += n
    raise ValueError(f"{len(lengths)} prompts fill fewer than {num_forwards} forwards")


def _rank_forwards(mix: RequestMix, max_num_tokens: int, num_forwards: int, rng) -> list[np.ndarray]:
    """One rank's forwards; draws more prompts until the stream fills them."""
    count = 2 * num_forwards * max(1, max_num_tokens // max(1, mix.isl // 2)) + 16
    lengths = draw_lengths(mix, count, max_num_tokens, rng)
    while True:
        try:
            return pack(lengths, max_num_tokens, num_forwards)
        except ValueError:
            lengths = np.concatenate([lengths, draw_lengths(mix, count, max_num_tokens, rng)])


def forward_shapes(mix: RequestMix, max_num_tokens: int, num_ranks: int, num_forwards: int, windows,
                   rng: np.random.Generator) -> ForwardShape:
    """Every rank's first `num_forwards` forwards: tokens [F, G], and for each attention window the
    causal pairs and K/V rows read, [F, G] (each prompt attends its own tokens only)."""
    if mix.isl > max_num_tokens:
        raise ValueError(f"isl={mix.isl} exceeds max_num_tokens={max_num_tokens}: chunked prefill is not simulated")
    windows = sorted(set(windows), key=lambda w: -1 if w is None else w)
    tokens = np.zeros((num_forwards, num_ranks))
    pairs = {w: np.zeros((num_forwards, num_ranks)) for w in windows}
    for r in range(num_ranks):
        for i, forward in enumerate(_rank_forwards(mix, max_num_tokens, num_forwards, rng)):
            tokens[i, r] = forward.sum()
            for w in windows:
                pairs[w][i, r] = causal_pairs(forward, w).sum()
    return ForwardShape(tokens, pairs, {w: tokens.copy() for w in windows})


def with_token_cv(shape: ForwardShape, cv: float, rng: np.random.Generator) -> ForwardShape:
    """Override the per-rank spread: every forward's tokens become mean(tokens) times a lognormal factor
    of mean 1 and coefficient of variation `cv`; attention work per token is kept."""
    if cv < 0:
        raise ValueError(f"cv={cv} must be >= 0")
    sigma = math.sqrt(math.log1p(cv ** 2))
    factor = rng.lognormal(-sigma ** 2 / 2, sigma, size=np.shape(shape.tokens)) if cv > 0 else 1.0
    scale = float(np.mean(shape.tokens)) * factor / shape.tokens  # [F, G]
    return ForwardShape(shape.tokens * scale, {w: p * scale for w, p in shape.pairs.items()},
                        {w: k * scale for w, k in shape.keys_read.items()})


def arrival_plan(mix: RequestMix, rate: float, duration_s: float, max_num_tokens: int,
                 seed: int) -> list[tuple[float, list[int]]]:
    """(send time s, prompt ids) of every Poisson arrival at `rate` within `duration_s`."""
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1.0 / rate, size=int(rate * duration_s * 2) + 16))
    times = times[times <= duration_s]
    lengths = draw_lengths(mix, len(times), max_num_tokens, rng)
    return [(float(t), rng.integers(3, VOCAB, int(n)).tolist()) for t, n in zip(times, lengths)]
