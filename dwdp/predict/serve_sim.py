"""Queueing simulation of a prefill server under Poisson arrivals: TTFT of DWDP and DEP serving.

Legend: N = ranks, B = prompts in a forward, Tmax = its longest prompt.

The same arrival model as `dwdp bench serve` (dwdp.predict.packing.arrival_plan: Poisson times, lengths
from a RequestMix) and the same server rules as `dwdp serve`: the router gives each request to the
rank with the fewest outstanding prompt tokens (ties: least recently assigned); a rank takes its
queue in arrival order into forwards of B x Tmax <= max_num_tokens padded tokens, without waiting.
- DWDP: every rank runs its next forward as soon as it is free, alone: `forward_s(lengths)`.
- DEP: the ranks step together: a step starts when the previous one ends and any rank holds a
  prompt; every rank runs its forward (or an idle step) and the step lasts `step_s(per-rank lengths)`.
A request's TTFT is its forward's end minus its arrival, plus `overhead_s` (router, HTTP, KV write).
Service times are pluggable: `analytic_service` (the calibrated cost model, GPUs) or
`fitted_service` (lines fitted to a `dwdp bench serve` run's measured forwards).
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np

from dwdp.predict.packing import RequestMix, arrival_plan

PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Service:
    """forward_s([B] lengths) -> seconds of one DWDP forward; step_s(N lists of lengths, empty =
    idle) -> seconds of one DEP step; overhead_s[mode]: added to every request's TTFT."""

    forward_s: Callable[[list[int]], float]
    step_s: Callable[[list[list[int]]], float]
    overhead_s: dict
    source: str


def take_lengths(queue: deque, max_num_tokens: int) -> list[tuple[float, int]]:
    """dwdp.serve.scheduling.take_batch on (arrival, length) pairs."""
    batch, longest = [], 0
    while queue:
        n = queue[0][1]
        if batch and (len(batch) + 1) * max(longest, n) > max_num_tokens:
            break
        batch.append(queue.popleft())
        longest = max(longest, n)
    return batch


def _route(outstanding: list[int], last: list[int]) -> int:
    return min(range(len(outstanding)), key=lambda r: (outstanding[r], last[r]))


def simulate_dwdp_serving(plan: list[tuple[float, int]], ranks: int, max_num_tokens: int, service: Service):
    """[(arrival, forward end)] per request of `plan` ((arrival s, length), in time order)."""
    queues = [deque() for _ in range(ranks)]
    outstanding, last, free_at = [0] * ranks, [-1] * ranks, [0.0] * ranks
    done: list[tuple[float, float]] = []
    events: list = []  # (time, kind 0 = forward end / 1 = arrival, rank or index, batch)
    for i, (t, n) in enumerate(plan):
        heapq.heappush(events, (t, 1, i, None))
    busy = [False] * ranks

    def start(rank: int, now: float) -> None:
        batch = take_lengths(queues[rank], max_num_tokens)
        end = now + service.forward_s([n for _, n in batch])
        busy[rank] = True
        heapq.heappush(events, (end, 0, rank, batch))

    while events:
        now, kind, who, batch = heapq.heappop(events)
        if kind == 1:
            arrival, n = plan[who]
            rank = _route(outstanding, last)
            outstanding[rank] += n
            last[rank] = who
            queues[rank].append((arrival, n))
            if not busy[rank]:
                start(rank, now)
        else:
            for arrival, n in batch:
                done.append((arrival, now))
                outstanding[who] -= n
            busy[who] = False
            if queues[who]:
                start(who, now)
    return done


def simulate_dep_serving(plan: list[tuple[float, int]], ranks: int, max_num_tokens: int, service: Service):
    """[(arrival, step end)] per request of `plan`, the ranks stepping together."""
    queues = [deque() for _ in range(ranks)]
    outstanding, last = [0] * ranks, [-1] * ranks
    done: list[tuple[float, float]] = []
    index, now, step_end = 0, 0.0, None
    running: list = []
    while index < len(plan) or step_end is not None:
        next_arrival = plan[index][0] if index < len(plan) else math.inf
        if step_end is not None and step_end <= next_arrival:
            now = step_end
            for rank, batch in enumerate(running):
                for arrival, n in batch:
                    done.append((arrival, now))
                    outstanding[rank] -= n
            step_end, running = None, []
        else:
            now = next_arrival
            arrival, n = plan[index]
            rank = _route(outstanding, last)
            outstanding[rank] += n
            last[rank] = index
            queues[rank].append((arrival, n))
            index += 1
        if step_end is None and any(queues):
            running = [take_lengths(q, max_num_tokens) for q in queues]
            step_end = now + service.step_s([[n for _, n in b] for b in running])
    return done


def summarise_ttft(plan, done, overhead_s: float, rate: float, ranks: int, sustained_share: float = 0.9) -> dict:
    lengths = {a: n for a, n in plan}
    ttft = np.array([end - arrival + overhead_s for arrival, end in done])
    first = min(a for a, _ in plan)
    makespan = max(end for _, end in done) + overhead_s - first
    achieved = float(len(done) / makespan)
    return {"offered_rps": rate, "requests": len(done), "achieved_rps": achieved,
            "tokens_per_s_per_rank": sum(lengths[a] for a, _ in done) / makespan / ranks,
            **{f"ttft_p{q}_s": float(np.percentile(ttft, q)) for q in PERCENTILES},
            "sustained": bool(achieved >= sustained_share * rate)}


def simulate_rates(mix: RequestMix, rates: list[float], duration_s: float, ranks: int, max_num_tokens: int,
                   service: Service, seed: int = 0) -> dict:
    """{mode: [row per rate]} of both modes on the same seeded arrival plans."""

    out = {"dwdp": [], "dep": []}
    for i, rate in enumerate(rates):
        plan = [(t, len(ids)) for t, ids in arrival_plan(mix, rate, duration_s, max_num_tokens, seed + i)]
        for mode, run in (("dwdp", simulate_dwdp_serving), ("dep", simulate_dep_serving)):
            done = run(plan, ranks, max_num_tokens, service)
            out[mode].append(summarise_ttft(plan, done, service.overhead_s.get(mode, 0.0), rate, ranks))
    return out


def fitted_service(results: dict, mix: str) -> Service:
    """Lines `seconds = a + b x padded tokens` fitted to the forwards a `dwdp bench serve` run measured
    (fifo variants, the rates they sustained, or every rate when none was); DEP's step is its line at
    the busiest rank's padded tokens. Overheads are the measured mean TTFT minus queue and forward
    time. Forwards of overloaded rates are left out: there the client and the router, busy with
    hundreds of open requests, take CPU from the workers of a small machine and stretch them."""
    fits, overhead = {}, {}
    for mode in ("dwdp", "dep"):
        rows = [r for r in results[mix][mode]["rows"] if r.get("sustained", True)] or results[mix][mode]["rows"]
        samples = [s for row in rows for s in row["samples"] if s["ok"]]
        x = np.array([s["batch_tokens"] for s in samples], float)
        y = np.array([s["prefill_s"] for s in samples], float)
        b, a = np.polyfit(x, y, 1)
        fits[mode] = (max(float(a), 0.0), max(float(b), 0.0))
        overhead[mode] = float(np.mean([s["ttft_s"] - s["queue_s"] - s["prefill_s"] for s in samples]))

    def padded(lengths: list[int]) -> int:
        return len(lengths) * max(lengths) if lengths else 0

    def forward_s(lengths):
        a, b = fits["dwdp"]
        return a + b * padded(lengths)

    def step_s(per_rank):
        a, b = fits["dep"]
        return a + b * max(padded(lengths) for lengths in per_rank)

    return Service(forward_s, step_s, overhead, f"fitted to measured forwards: dwdp {fits['dwdp']}, "
                   f"dep {fits['dep']} (seconds, seconds per padded token)")


def analytic_service(sim_config) -> Service:
    """The calibrated cost model (dwdp.predict.simulate) of `sim_config`'s model, hardware and group; the
    DWDP copies' contention stretch is the one dwdp.predict.simulate.simulate finds for that setting."""
    from dwdp.predict import costmodel as cm
    from dwdp.predict.simulate import simulate, simulate_dep, simulate_dwdp

    spec, hw, deploy = (cm.load_model(sim_config.model), cm.load_hardware(sim_config.hardware),
                        sim_config.deployment)
    cal = cm.load_calibration()
    stretch = simulate(sim_config, cal).stretch
    rng = np.random.default_rng(sim_config.seed)
    windows = sorted(set(spec.window), key=lambda w: -1 if w is None else w)

    def shape(per_rank: list[list[int]]) -> cm.ForwardShape:
        padded = [[max(lengths)] * len(lengths) if lengths else [] for lengths in per_rank]
        tokens = np.array([[float(sum(p)) for p in padded]])                           # [1, N]
        pairs = {w: np.array([[float(np.sum(cm.causal_pairs(np.array(p), w))) if p else 0.0 for p in padded]])
                 for w in windows}
        return cm.ForwardShape(tokens, pairs, {w: tokens.copy() for w in windows})

    @lru_cache(maxsize=4096)
    def padded_forward_s(num_prompts: int, longest: int) -> float:
        _, rank_time, _ = simulate_dwdp(spec, hw, deploy, cal, shape([[longest] * num_prompts]), stretch)
        return float(np.asarray(rank_time)[0, 0])

    def forward_s(lengths):  # a DWDP forward depends on its padded shape only (no randomness): cached
        return padded_forward_s(len(lengths), max(lengths))

    def step_s(per_rank):
        _, step = simulate_dep(spec, hw, deploy, cal, shape(per_rank), rng)
        return float(step[0])

    return Service(forward_s, step_s, {}, f"analytic cost model: {sim_config.model} {sim_config.weight_dtype} on "
                   f"{sim_config.hardware}, group {sim_config.group_size}, copy stretch {stretch:.2f}")
