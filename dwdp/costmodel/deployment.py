"""What a rank's forward carries (Workload) and how the model is spread (Deployment)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .formats import ACT_BYTES, WeightFormat, weight_format


@dataclass(frozen=True)
class Workload:
    """What one rank's forward carries.

    isl: prompt length. max_num_tokens: token budget per forward.
    batch: prompts per rank; None = a saturated context server whose every forward is filled to
        max_num_tokens with prefill chunks of isl-token prompts. With a batch, its batch * isl tokens
        run in ceil(batch * isl / max_num_tokens) chunked forwards and the outputs are per-forward means.
    """

    isl: int
    max_num_tokens: int = 8192
    batch: int | None = None

    def __post_init__(self):
        for name in ("isl", "max_num_tokens") + (("batch",) if self.batch is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")

    @property
    def chunks_per_prompt(self) -> int:
        return math.ceil(self.isl / self.max_num_tokens)

    @property
    def tokens(self) -> float:
        """T: tokens per forward."""
        if self.batch is None:
            return float(self.max_num_tokens)
        total = self.batch * self.isl
        return total / math.ceil(total / self.max_num_tokens)

    def pairs_per_token(self, window: int | None) -> float:
        """Mean keys each query attends to (causal, optionally sliding)."""
        return causal_pairs(self.isl, window) / self.isl

    def keys_read_per_token(self, window: int | None) -> float:
        """Mean K/V rows read per new token: every chunk reads its visible context once."""
        chunk = min(self.isl, self.max_num_tokens)
        total = 0
        for start in range(0, self.isl, chunk):
            end = min(self.isl, start + chunk)
            total += end if window is None else min(end, (end - start) + window)
        return total / self.isl


def causal_pairs(seq_len, window: int | None = None):
    """(query, key) pairs of causal attention over seq_len tokens; a sliding window caps keys per query."""
    s = np.asarray(seq_len, dtype=np.float64)
    full = s * (s + 1) / 2
    if window is None:
        return full
    w = float(window)
    return np.where(s <= w, full, w * (w + 1) / 2 + (s - w) * w)


@dataclass(frozen=True)
class Deployment:
    """How the model is spread. weight_dtype applies to every linear layer but the router;
    dense_dtype overrides it for attention, dense MLP and shared experts (None = same)."""

    group_size: int
    num_local_experts: int | None = None
    weight_dtype: str = "nvfp4"
    dense_dtype: str | None = None
    a2a_bytes_per_elem: int = ACT_BYTES  # DEP dispatch / combine payload
    num_buffers: int = 2

    def local_experts(self, num_experts: int) -> int:
        low = math.ceil(num_experts / self.group_size)
        n = low if self.num_local_experts is None else self.num_local_experts
        if not low <= n <= num_experts:
            raise ValueError(f"num_local_experts={n} must be in [{low}, {num_experts}] for group_size={self.group_size}")
        return n

    def __post_init__(self):
        if self.group_size < 1:
            raise ValueError(f"group_size={self.group_size} must be >= 1")
        weight_format(self.weight_dtype)
        if self.dense_dtype is not None:
            weight_format(self.dense_dtype)


# ---------------------------------------------------------------------------------------------


def formats(deploy: Deployment) -> tuple[WeightFormat, WeightFormat]:
    """(expert format, dense format) of a deployment."""
    fmt = weight_format(deploy.weight_dtype)
    return fmt, weight_format(deploy.dense_dtype or deploy.weight_dtype)
