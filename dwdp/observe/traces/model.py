"""The in-memory form every trace reader produces and every analysis reads.

Times are microseconds (float) on the clock of the source: the host monotonic clock for our own
Chrome traces, the profiler's clock for torch.profiler and Nsight Systems. One `Trace` holds one
run: a `RankTrace` per rank (our files: one per rank; Nsight: one per CUDA device).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class TraceFormatError(ValueError):
    """A trace file that cannot be read: the message names the file and what is wrong with it."""

    def __init__(self, path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = str(path), problem


@dataclass(frozen=True)
class Span:
    """One named interval on one rank: a runtime phase, a kernel or a CPU operator."""

    name: str
    start: float
    end: float
    lane: str = "compute"                       # thread / stream the interval ran on
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def dur(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Copy:
    """One copy (a slice of a prefetch, or a CUDA memcpy).

    kind: "P2P" (between ranks), "D2D" (within one device), "H2D", "D2H" or "other".
    is_critical: it ran on a lane that also runs compute, so it delays compute (a copy on a
    dedicated copy lane or copier thread overlaps compute instead).
    layer / slot / expert: the MoE layer, prefetch slot and expert it carries, when known.
    """

    src: int
    dst: int
    nbytes: int
    start: float
    end: float
    kind: str = "P2P"
    lane: str = "copy"
    is_critical: bool = False
    layer: int | None = None
    slot: int | None = None
    expert: int | None = None

    @property
    def dur(self) -> float:
        return self.end - self.start


@dataclass
class RankTrace:
    """What one rank did.

    phases: runtime phase ranges (our compute lane, NVTX ranges, record_function annotations),
      including the FORWARD spans; names from `dwdp.observe.phases` where the runtime wrote them.
    kernels: device kernels (or, for a CPU-only torch.profiler trace, the operators of the
      thread that ran the forwards); empty for our own Chrome traces.
    copies: copies this rank performed (for pulls: the rank is the destination).
    iterations: one Span per iteration (a FORWARD span, a profiler step, or the whole trace).
    """

    rank: int
    phases: list[Span] = field(default_factory=list)
    kernels: list[Span] = field(default_factory=list)
    copies: list[Copy] = field(default_factory=list)
    iterations: list[Span] = field(default_factory=list)

    def phases_named(self, name: str) -> list[Span]:
        return [p for p in self.phases if p.name == name]


@dataclass
class Trace:
    """One run: its ranks plus what the runtime recorded about the group (None when unknown)."""

    source: str
    format: str                                  # "dwdp-chrome", "torch-profiler" or "nsys-sqlite"
    ranks: dict[int, RankTrace]
    group_size: int | None = None
    num_moe_layers: int | None = None
    plan_bytes: dict[int, dict[int, int]] = field(default_factory=dict)  # rank -> {MoE layer: bytes pulled}

    @property
    def all_copies(self) -> list[Copy]:
        return [c for r in self.ranks.values() for c in r.copies]
