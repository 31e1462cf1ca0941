"""Which worker takes a request: the healthy one with the fewest outstanding prompt tokens."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerLoad:
    rank: int
    is_alive: bool
    outstanding_tokens: int  # prompt tokens queued or running on the worker
    last_assigned: int       # sequence number of its latest assignment (-1: never)


class NoHealthyWorker(RuntimeError):
    """Every worker is dead (or excluded)."""


class Overloaded(RuntimeError):
    """Every healthy worker's queue is full."""


def pick_worker(loads: list[WorkerLoad], num_tokens: int, max_queue_tokens: int,
                exclude: frozenset[int] = frozenset()) -> int:
    """Rank of the healthy worker (not in `exclude`) with the fewest outstanding tokens that can
    still take `num_tokens` within `max_queue_tokens`; ties go to the least recently assigned, so
    an idle group is used evenly. Raises NoHealthyWorker or Overloaded."""
    healthy = [w for w in loads if w.is_alive and w.rank not in exclude]
    if not healthy:
        raise NoHealthyWorker(f"no healthy worker among ranks {[w.rank for w in loads]}")
    fits = [w for w in healthy if w.outstanding_tokens + num_tokens <= max_queue_tokens]
    if not fits:
        least = min(w.outstanding_tokens for w in healthy)
        raise Overloaded(f"every worker's queue is full: the least loaded holds {least} outstanding tokens; "
                         f"{num_tokens} more would pass max_queue_tokens={max_queue_tokens}")
    return min(fits, key=lambda w: (w.outstanding_tokens, w.last_assigned)).rank
