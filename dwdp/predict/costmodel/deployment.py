"""What a rank's forward carries (Workload, ForwardShape) and how the model is spread (Deployment)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dwdp.predict.costmodel.formats import ACT_BYTES, WeightFormat, weight_format


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
    num_buffers: int = 2
    merge_copy: bool = False  # copy the local experts next to the prefetched ones before each grouped GEMM

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
        if self.num_buffers < 2:
            raise ValueError(f"num_buffers={self.num_buffers} must be >= 2")

    @property
    def dispatch_bytes_per_elem(self) -> float:
        """DEP sends tokens quantized as its expert GEMMs take them; the combine returns bf16."""
        return min(weight_format(self.weight_dtype).act_bytes, ACT_BYTES)


def formats(deploy: Deployment) -> tuple[WeightFormat, WeightFormat]:
    """(expert format, dense format) of a deployment."""
    fmt = weight_format(deploy.weight_dtype)
    return fmt, weight_format(deploy.dense_dtype or deploy.weight_dtype)


@dataclass(frozen=True)
class ForwardShape:
    """Token counts of one forward per rank, the attention work they carry, for every attention window
    of the model. tokens [X]; pairs[window], keys_read[window]: causal (query, key) pairs and K/V rows
    read, [X]. X: scalar, [F] or [F, G]."""

    tokens: float | np.ndarray
    pairs: dict
    keys_read: dict


def workload_shape(workload: Workload, windows, tokens=None) -> ForwardShape:
    """A Workload's forward; `tokens` overrides T (attention per token stays the workload's)."""
    t = workload.tokens if tokens is None else np.asarray(tokens, float)
    return ForwardShape(t, {w: t * workload.pairs_per_token(w) for w in set(windows)},
                        {w: t * workload.keys_read_per_token(w) for w in set(windows)})
