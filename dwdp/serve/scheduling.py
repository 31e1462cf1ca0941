"""Which queued prompts the next forward of a worker takes (both modes use it).

Packed forwards (`take_pieces`, every family whose attention packs: dwdp.serve.packed): a forward
is at most `max_num_tokens` real tokens. Prompts already in progress (chunked) continue first,
oldest first; then queued prompts in the order below, each taking what is left of the budget, so a
prompt longer than that is cut into chunks that later forwards continue.

Padded forwards (`take_forward`, the fallback): B = prompts in the forward, Tmax = its longest
prompt; a forward's padded tokens are B x Tmax (left-padded to the longest), at most `max_num_tokens`.

- "fifo": arrival order, as many as fit (`take_batch`).
- "shortest": shortest prompt first, so a short prompt is not stuck behind long ones and prompts of
  similar length share a forward (less padding); a prompt queued for `fairness_s` or longer goes
  first whatever its length (oldest first), so no prompt starves under a stream of shorter ones.

A worker never waits to fill a forward: it takes what is queued when its previous forward ends.
"""
from __future__ import annotations

from collections import deque

from dwdp.serve.prefill import InProgress
from dwdp.serve.protocol import PrefillJob


def queue_order(jobs: list[PrefillJob], order: str, fairness_s: float, now: float) -> list[int]:
    """Indices of `jobs` (arrival order) in the order a forward considers them: arrival ("fifo"),
    or prompts queued `fairness_s` or longer oldest first, then the rest shortest first ("shortest")."""
    if order == "fifo":
        return list(range(len(jobs)))
    if order != "shortest":
        raise ValueError(f"order={order!r} is not 'fifo' or 'shortest'")
    aged = sorted((i for i, job in enumerate(jobs) if now - job.enqueued >= fairness_s), key=lambda i: jobs[i].enqueued)
    fresh = sorted((i for i, job in enumerate(jobs) if now - job.enqueued < fairness_s),
                   key=lambda i: (len(jobs[i].input_ids), i))
    return aged + fresh


def take_pieces(active: list[InProgress], pending: deque, max_num_tokens: int, order: str = "fifo",
                fairness_s: float = 0.5, now: float = 0.0) -> list[tuple[InProgress, int]]:
    """The next packed forward: [(prompt, tokens of it this forward)], at most `max_num_tokens` real
    tokens in all. Continues every prompt of `active` first (oldest first), then starts queued ones
    (removed from `pending`, appended to `active`) in `queue_order`, chunking the last one taken
    when it does not fit whole."""
    plan, left = [], max_num_tokens
    for state in active:
        if left == 0:
            break
        n = min(state.left, left)
        plan.append((state, n))
        left -= n
    if left and pending:
        jobs = list(pending)
        taken = set()
        for i in queue_order(jobs, order, fairness_s, now):
            if left == 0:
                break
            state = InProgress(jobs[i])
            n = min(state.left, left)
            active.append(state)
            plan.append((state, n))
            taken.add(i)
            left -= n
        pending.clear()
        pending.extend(job for i, job in enumerate(jobs) if i not in taken)
    return plan

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
