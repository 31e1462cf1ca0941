"""Which queued prompts the next forward of a worker takes (both modes use it).

Legend: B = prompts in the forward, Tmax = its longest prompt; a forward's padded tokens are B x Tmax
(prompts are left-padded to the longest), at most `max_num_tokens`.

- "fifo": arrival order, as many as fit (`take_batch`).
- "shortest": shortest prompt first, so a short prompt is not stuck behind long ones and prompts of
  similar length share a forward (less padding); a prompt queued for `fairness_s` or longer goes
  first whatever its length (oldest first), so no prompt starves under a stream of shorter ones.

A worker never waits to fill a forward: it takes what is queued when its previous forward ends.
"""
from __future__ import annotations

from collections import deque

from dwdp.serve.protocol import PrefillJob

def take_batch(pending: deque, max_num_tokens: int) -> list[PrefillJob]:
    """Pop jobs from the front of `pending`, in arrival order, while B x Tmax stays within
    `max_num_tokens`. The first job is always taken (the router rejects longer prompts)."""
    batch: list[PrefillJob] = []
    longest = 0
    while pending:
        n = len(pending[0].input_ids)
        if batch and (len(batch) + 1) * max(longest, n) > max_num_tokens:
            break
        batch.append(pending.popleft())
        longest = max(longest, n)
    return batch


def take_forward(pending: deque, max_num_tokens: int, order: str = "fifo", fairness_s: float = 0.5,
                 now: float = 0.0) -> list[PrefillJob]:
    """Remove and return the prompts of the next forward from `pending` (arrival order), keeping
    B x Tmax within `max_num_tokens`; the first candidate is always taken (the router rejects
    longer prompts). `now`: time.monotonic(), against which PrefillJob.enqueued ages a prompt."""
    if order == "fifo":
        return take_batch(pending, max_num_tokens)
    if order != "shortest":
        raise ValueError(f"order={order!r} is not 'fifo' or 'shortest'")
    jobs = list(pending)
    aged = sorted((i for i, job in enumerate(jobs) if now - job.enqueued >= fairness_s), key=lambda i: jobs[i].enqueued)
    is_aged = set(aged)
    fresh = sorted((i for i, job in enumerate(jobs) if now - job.enqueued < fairness_s),
                   key=lambda i: (len(jobs[i].input_ids), i))
    chosen, longest = [], 0
    for i in aged + fresh:
        n = len(jobs[i].input_ids)
        if chosen and (len(chosen) + 1) * max(longest, n) > max_num_tokens:
            if i in is_aged:
                break  # an aged prompt that does not fit waits for the next forward, still first
            continue
        chosen.append(i)
        longest = max(longest, n)
    taken = set(chosen)
    pending.clear()
    pending.extend(job for i, job in enumerate(jobs) if i not in taken)
    return [jobs[i] for i in chosen]
