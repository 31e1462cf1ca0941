"""Per-rank request streams for imbalanced benchmarks, batched into forwards under a token budget.

Legend: G = ranks, Tr = mean total tokens per rank, ISL = longest input, P = prompts in a forward (its
requests), Tmax = longest prompt of the forward.

Each rank r gets a total of Tr * f_r tokens, where the factors f = 1 + cv * z have mean 1 and
coefficient of variation `cv` across ranks: z is a seeded standard-normal draw, standardised to
mean 0 and standard deviation 1 so even two ranks see the requested imbalance (for G >= 2; factors
are floored at MIN_FACTOR, which lowers the CV only when cv * |z| approaches 1). Requests arrive
with lengths uniform in [ceil(ratio * ISL), ISL] (mean (1 + ratio) / 2 * ISL) until the rank's
total is reached; the last request is cut to land on it exactly. Requests are batched into
forwards in arrival order, as many as fit in `max_num_tokens` padded tokens (P * Tmax).

Everything derives from `seed`; `Workload.describe()` prints what a run needs to be repeated.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

MIN_FACTOR = 0.05


@dataclass(frozen=True)
class WorkloadConfig:
    """num_ranks: G; tokens_per_rank: Tr (mean over ranks); isl: longest request; isl_ratio: shortest
    request / isl; cv: coefficient of variation of per-rank totals; max_num_tokens: padded tokens
    per forward (>= isl); seed: every draw."""

    num_ranks: int
    tokens_per_rank: int
    isl: int
    isl_ratio: float = 0.8
    cv: float = 0.0
    max_num_tokens: int = 2048
    seed: int = 0

    def __post_init__(self):
        for name in ("num_ranks", "tokens_per_rank", "isl", "max_num_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if not 0.0 < self.isl_ratio <= 1.0:
            raise ValueError(f"isl_ratio={self.isl_ratio} must be in (0, 1]")
        if not 0.0 <= self.cv < 1.0:
            raise ValueError(f"cv={self.cv} must be in [0, 1)")
        if self.max_num_tokens < self.isl:
            raise ValueError(
                f"max_num_tokens={self.max_num_tokens} must be >= isl={self.isl}: a request must fit one forward")


@dataclass(frozen=True)
class Forward:
    """One forward of one rank: the lengths of the requests batched into it."""

    lengths: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def padded_tokens(self) -> int:
        return len(self.lengths) * max(self.lengths)


@dataclass(frozen=True)
class RankStream:
    rank: int
    target_tokens: int
    requests: tuple[int, ...]        # request lengths in arrival order
    forwards: tuple[Forward, ...]

    @property
    def num_tokens(self) -> int:
        return sum(self.requests)


@dataclass(frozen=True)
class Workload:
    config: WorkloadConfig
    factors: tuple[float, ...]       # f_r, mean 1
    streams: tuple[RankStream, ...]

    @property
    def num_steps(self) -> int:
        """Forwards of the busiest rank: the lockstep steps an expert-parallel run needs."""
        return max(len(s.forwards) for s in self.streams)

    @property
    def realized_cv(self) -> float:
        return coefficient_of_variation([s.num_tokens for s in self.streams])

    def describe(self) -> str:
        c = self.config
        tokens = [s.num_tokens for s in self.streams]
        forwards = [len(s.forwards) for s in self.streams]
        return (f"workload seed={c.seed} ranks={c.num_ranks} tokens/rank={c.tokens_per_rank} isl={c.isl} "
                f"ratio={c.isl_ratio} cv={c.cv} (realized {self.realized_cv:.3f}) max_num_tokens={c.max_num_tokens}: "
                f"tokens per rank {tokens}, forwards per rank {forwards}")

    def as_dict(self) -> dict:
        return {
            "config": asdict(self.config), "factors": list(self.factors), "realized_cv": self.realized_cv,
            "tokens_per_rank": [s.num_tokens for s in self.streams],
            "forwards_per_rank": [len(s.forwards) for s in self.streams],
            "requests_per_rank": [len(s.requests) for s in self.streams],
        }


def coefficient_of_variation(values) -> float:
    """Population standard deviation / mean (0 for fewer than two values)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size < 2 or x.mean() == 0:
        return 0.0
    return float(x.std() / x.mean())


def rank_factors(num_ranks: int, cv: float, seed: int) -> tuple[float, ...]:
    """Per-rank total-token factors with mean 1 and CV `cv` (exact before the MIN_FACTOR floor)."""
    if num_ranks < 2 or cv == 0.0:
        return (1.0,) * num_ranks
    z = np.random.default_rng(np.random.SeedSequence([seed, 0])).standard_normal(num_ranks)  # [G]
    z = (z - z.mean()) / z.std()
    return tuple(float(max(MIN_FACTOR, 1.0 + cv * v)) for v in z)


def _requests(rng: np.random.Generator, total: int, isl: int, ratio: float) -> tuple[int, ...]:
    shortest = max(1, math.ceil(ratio * isl))
    lengths, left = [], total
    while left > 0:
        n = min(int(rng.integers(shortest, isl + 1)), left)
        lengths.append(n)
        left -= n
    return tuple(lengths)


def _batch(requests: tuple[int, ...], max_num_tokens: int) -> tuple[Forward, ...]:
    forwards, current = [], []
    for n in requests:
        if current and (len(current) + 1) * max(max(current), n) > max_num_tokens:
            forwards.append(Forward(tuple(current)))
            current = []
        current.append(n)
    if current:
        forwards.append(Forward(tuple(current)))
    return tuple(forwards)


def make_workload(config: WorkloadConfig) -> Workload:
    """Every rank's request stream and forwards; identical in every process for the same config."""
    factors = rank_factors(config.num_ranks, config.cv, config.seed)
    streams = []
    for rank, f in enumerate(factors):
        rng = np.random.default_rng(np.random.SeedSequence([config.seed, 1, rank]))
        target = max(1, round(config.tokens_per_rank * f))
        requests = _requests(rng, target, config.isl, config.isl_ratio)
        streams.append(RankStream(rank, target, requests, _batch(requests, config.max_num_tokens)))
    return Workload(config, factors, tuple(streams))


def forward_inputs(forward: Forward, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """Random token ids for one forward, right-padded: input_ids [P, Tmax], attention_mask [P, Tmax]."""
    gen = torch.Generator().manual_seed(seed)
    width = max(forward.lengths)
    ids = torch.zeros(len(forward.lengths), width, dtype=torch.long)    # [P, Tmax]
    mask = torch.zeros(len(forward.lengths), width, dtype=torch.long)   # [P, Tmax]
    for i, n in enumerate(forward.lengths):
        ids[i, :n] = torch.randint(3, vocab, (n,), generator=gen)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask}
