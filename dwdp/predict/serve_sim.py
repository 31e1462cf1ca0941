"""Queueing simulation of a prefill server under Poisson arrivals: TTFT of DWDP and DEP serving.

Legend: G = ranks, P = prompts in a forward, Tmax = longest prompt of the forward.

The same arrival model as `dwdp bench serve` (dwdp.predict.packing.arrival_plan: Poisson times, lengths
from a RequestMix) and the same server rules as `dwdp serve`: the router gives each request to the
rank with the fewest outstanding prompt tokens (ties: least recently assigned; a prefilled chunk
leaves them at once); a rank takes its queue in arrival order, without waiting, into
- packed forwards (`Service.packed`): at most max_num_tokens real tokens, prompts in progress
  first, a prompt that does not fit whole chunked (dwdp.serve.scheduling.take_pieces); a request is
  done when the forward of its last chunk ends;
- padded forwards: P x Tmax <= max_num_tokens padded tokens, whole prompts only.
- DWDP: every rank runs its next forward as soon as it is free, alone: `forward_s(lengths)`.
- DEP: the ranks step together: a step starts when the previous one ends and any rank holds a
  prompt; every rank runs its forward (or an idle step) and the step lasts `step_s(per-rank lengths)`.
After each forward a rank pays the time outside it (`Service.outside`, dwdp.predict.costmodel.outside:
the KV hand-off of the forward's real tokens, then host work such as taking the next requests) before
its next forward; a DEP step pays it once, the slowest rank's hand-off. A request is answered once its
forward's KV is handed off; its TTFT is that time minus its arrival, plus `overhead_s` (what holds no
rank: router, HTTP, client). `counts`, when given, sums the tokens the forwards computed ("computed", padding
included) and their real prompt tokens ("real").
Service times are pluggable: `analytic_service` (the calibrated cost model, GPUs), `line_service`
(lines measured on a `dwdp serve` run, bench/serve_outside.py) or `fitted_service` (lines fitted to a
`dwdp bench serve` run's per-request samples, which carry no time outside the forward: their packed
prefill times hold the KV writes).
"""
from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import numpy as np

from dwdp.predict.costmodel.outside import NONE
from dwdp.predict.packing import RequestMix, arrival_plan

PERCENTILES = (50, 90, 99)
MIN_FIT_SAMPLES = 20  # one-forward prompts a mix needs for its own line; fewer: the run's other mixes join in


@dataclass(frozen=True)
class Service:
    """forward_s([P] lengths) -> seconds of one DWDP forward; step_s(G lists of lengths, empty =
    idle) -> seconds of one DEP step; overhead_s[mode]: added to every request's TTFT. packed: the
    server packs (lengths are the real tokens of each prompt or chunk; no padding is computed);
    otherwise a forward computes P x Tmax. outside[mode]: what a rank pays after each forward before
    its next (missing: nothing)."""

    forward_s: Callable[[list[int]], float]
    step_s: Callable[[list[list[int]]], float]
    overhead_s: dict
    source: str
    packed: bool = False
    outside: dict = dataclasses.field(default_factory=dict)

    def outside_s(self, mode: str, per_rank: list[list[int]]) -> float:
        """Seconds a forward (DWDP: one list) or step (DEP: every rank's) holds its ranks after the
        forward: host and other once, the KV hand-off of the rank with the most real tokens."""
        return float(self.outside.get(mode, NONE).seconds(max(sum(lengths) for lengths in per_rank)))

    def handoff_s(self, mode: str, lengths: list[int]) -> float:
        """Seconds from a forward's end to its answers: the KV hand-off of its real tokens."""
        return sum(lengths) * self.outside.get(mode, NONE).kv_s_per_token


def computed_tokens(lengths: list[int], packed: bool) -> int:
    """Tokens a forward of prompts (or chunks) of `lengths` computes: their sum packed, P x Tmax padded."""
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


def take_lengths(queue: deque, max_num_tokens: int) -> list:
    """dwdp.serve.scheduling.take_batch on (arrival, length, ...) prompts."""
    batch, longest = [], 0
    while queue:
        n = queue[0][1]
        if batch and (len(batch) + 1) * max(longest, n) > max_num_tokens:
            break
        batch.append(queue.popleft())
        longest = max(longest, n)
    return batch


def take_chunks(active: list, queue: deque, max_num_tokens: int) -> list[tuple[list, int]]:
    """dwdp.serve.scheduling.take_pieces (fifo) on [arrival, length, tokens left] prompts: [(prompt,
    its tokens this forward)], prompts in progress (`active`) first; started ones join `active`."""
    pieces, left = [], max_num_tokens
    for prompt in active:
        if left == 0:
            break
        pieces.append((prompt, min(prompt[2], left)))
        left -= pieces[-1][1]
    while left and queue:
        prompt = queue.popleft()
        active.append(prompt)
        pieces.append((prompt, min(prompt[2], left)))
        left -= pieces[-1][1]
    return pieces


def _route(outstanding: list[int], last: list[int]) -> int:
    return min(range(len(outstanding)), key=lambda r: (outstanding[r], last[r]))


class _Rank:
    """One simulated worker: its queue of [arrival, length, tokens left] prompts, the prompts it has
    chunks of, and its outstanding prompt tokens."""

    def __init__(self):
        self.queue, self.active, self.outstanding, self.last = deque(), [], 0, -1

    def take(self, max_num_tokens: int, packed: bool) -> list[tuple[list, int]]:
        if packed:
            return take_chunks(self.active, self.queue, max_num_tokens)
        return [(prompt, prompt[2]) for prompt in take_lengths(self.queue, max_num_tokens)]

    def finish(self, pieces, answered: float, done: list, counts: dict | None, packed: bool) -> None:
        """The forward of `pieces` is answered at `answered`: chunks leave the outstanding tokens,
        finished prompts go to `done` as (arrival, answered)."""
        for prompt, n in pieces:
            prompt[2] -= n
            self.outstanding -= n
            if prompt[2] == 0:
                done.append((prompt[0], answered))
        self.active = [p for p in self.active if p[2] > 0]
        if counts is not None:
            counts["computed"] = counts.get("computed", 0) + computed_tokens([n for _, n in pieces], packed)
            counts["real"] = counts.get("real", 0) + sum(n for _, n in pieces)

    @property
    def has_work(self) -> bool:
        return bool(self.queue or self.active)


def _assign(ranks: list[_Rank], index: int, arrival: float, n: int) -> int:
    r = _route([w.outstanding for w in ranks], [w.last for w in ranks])
    ranks[r].outstanding += n
    ranks[r].last = index
    ranks[r].queue.append([arrival, n, n])
    return r


def simulate_dwdp_serving(plan: list[tuple[float, int]], ranks: int, max_num_tokens: int, service: Service,
                          counts: dict | None = None):
    """[(arrival, answer)] per request of `plan` ((arrival s, length), in time order)."""
    workers = [_Rank() for _ in range(ranks)]
    done: list[tuple[float, float]] = []
    events: list = []  # (time, kind 0 = rank free / 1 = arrival, rank or index, (pieces, answered))
    for i, (t, n) in enumerate(plan):
        heapq.heappush(events, (t, 1, i, None))
    busy = [False] * ranks

    def start(rank: int, now: float) -> None:
        pieces = workers[rank].take(max_num_tokens, service.packed)
        lengths = [n for _, n in pieces]
        end = now + service.forward_s(lengths)
        busy[rank] = True
        heapq.heappush(events, (end + service.outside_s("dwdp", [lengths]), 0, rank,
                                (pieces, end + service.handoff_s("dwdp", lengths))))

    while events:
        now, kind, who, forward = heapq.heappop(events)
        if kind == 1:
            arrival, n = plan[who]
            rank = _assign(workers, who, arrival, n)
            if not busy[rank]:
                start(rank, now)
        else:
            pieces, answered = forward
            workers[who].finish(pieces, answered, done, counts, service.packed)
            busy[who] = False
            if workers[who].has_work:
                start(who, now)
    return done


def simulate_dep_serving(plan: list[tuple[float, int]], ranks: int, max_num_tokens: int, service: Service,
                         counts: dict | None = None):
    """[(arrival, answer)] per request of `plan`, the ranks stepping together."""
    workers = [_Rank() for _ in range(ranks)]
    done: list[tuple[float, float]] = []
    index, now, step_end = 0, 0.0, None
    running: list = []  # per rank: (pieces, when they are answered)
    while index < len(plan) or step_end is not None:
        next_arrival = plan[index][0] if index < len(plan) else math.inf
        if step_end is not None and step_end <= next_arrival:
            now = step_end
            for worker, (pieces, answered) in zip(workers, running):
                worker.finish(pieces, answered, done, counts, service.packed)
            step_end, running = None, []
        else:
            now = next_arrival
            arrival, n = plan[index]
            _assign(workers, index, arrival, n)
            index += 1
        if step_end is None and any(w.has_work for w in workers):
            taken = [w.take(max_num_tokens, service.packed) for w in workers]
            lengths = [[n for _, n in pieces] for pieces in taken]
            forward_end = now + service.step_s(lengths)
            running = [(pieces, forward_end + service.handoff_s("dep", n)) for pieces, n in zip(taken, lengths)]
            step_end = forward_end + service.outside_s("dep", lengths)
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
            counts: dict = {}
            done = run(plan, ranks, max_num_tokens, service, counts)
            row = summarise_ttft(plan, done, service.overhead_s.get(mode, 0.0), rate, ranks)
            row["padding_waste"] = counts["computed"] / counts["real"] if counts.get("real") else float("nan")
            out[mode].append(row)
    return out


def fitted_service(results: dict, mix: str, packed: bool = False, variants: tuple[str, str] = ("dwdp", "dep")) -> Service:
    """Lines `seconds = a + b x computed tokens` fitted to the forwards a `dwdp bench serve` run measured
    (batch_tokens: padded tokens of a padded forward, real ones of a packed one) of `variants` (DWDP,
    DEP); `packed`: the simulated server packs (and chunks)
    (fifo variants, the rates they sustained, or every rate when none was); DEP's step is its line at
    the busiest rank's padded tokens. Overheads are the measured mean TTFT minus queue and forward
    time. Forwards of overloaded rates are left out: there the client and the router, busy with
    hundreds of open requests, take CPU from the workers of a small machine and stretch them."""
    fits, overhead = {}, {}
    for mode, variant in zip(("dwdp", "dep"), variants):
        rows = [r for r in results[mix][variant]["rows"] if r.get("sustained", True)] or results[mix][variant]["rows"]
        # a chunked prompt's prefill_s spans several forwards: only one-forward prompts time one forward
        samples = [s for row in rows for s in row["samples"] if s["ok"] and s.get("chunks", 1) <= 1]
        if len(samples) < MIN_FIT_SAMPLES:  # a mix of mostly chunked prompts: this variant's forwards of every mix
            samples = [s for entry in results.values() if variant in entry for row in entry[variant]["rows"]
                       for s in row["samples"] if s["ok"] and s.get("chunks", 1) <= 1]
        x = np.array([s["batch_tokens"] for s in samples], float)
        y = np.array([s["prefill_s"] for s in samples], float)
        b, a = np.polyfit(x, y, 1)
        fits[mode] = (max(float(a), 0.0), max(float(b), 0.0))
        overhead[mode] = float(np.mean([s["ttft_s"] - s["queue_s"] - s["prefill_s"] for s in samples]))

    source = (f"fitted to measured forwards of {variants}: dwdp {fits['dwdp']}, dep {fits['dep']} "
              "(seconds, seconds per computed token)")
    return line_service(fits, {}, overhead, packed, source)


def line_service(lines: dict, outside: dict, overhead_s: dict, packed: bool, source: str) -> Service:
    """Forwards on measured lines, lines[mode] = (a s, b s per computed token): a DWDP forward a + b x its
    tokens, a DEP step a + b x the busiest rank's; outside[mode] (OutsideForward) after each."""
    def forward_s(lengths):
        a, b = lines["dwdp"]
        return a + b * computed_tokens(lengths, packed)

    def step_s(per_rank):
        a, b = lines["dep"]
        return a + b * max(computed_tokens(lengths, packed) for lengths in per_rank)

    return Service(forward_s, step_s, overhead_s, source, packed, outside)


def analytic_service(sim_config, packed: bool = False) -> Service:
    """The calibrated cost model (dwdp.predict.simulate) of `sim_config`'s model, hardware and group; the
    DWDP copies' contention stretch is the one dwdp.predict.simulate.simulate finds for that setting.
    packed: forwards compute their real tokens (a chunk's attention to its earlier chunks is not
    charged: the model counts causal pairs within each piece); otherwise P x Tmax."""
    from dwdp.predict import costmodel as cm
    from dwdp.predict.simulate import simulate, simulate_dep, simulate_dwdp

    spec, hw, deploy = (cm.load_model(sim_config.model), cm.load_hardware(sim_config.hardware),
                        sim_config.deployment)
    cal = cm.load_calibration()
    stretch = simulate(sim_config, cal).stretch
    rng = np.random.default_rng(sim_config.seed)
    windows = sorted(set(spec.window), key=lambda w: -1 if w is None else w)

    def shape(per_rank: list[list[int]]) -> cm.ForwardShape:
        padded = [list(lengths) if packed else [max(lengths)] * len(lengths) if lengths else []
                  for lengths in per_rank]
        tokens = np.array([[float(sum(p)) for p in padded]])                           # [1, G]
        pairs = {w: np.array([[float(np.sum(cm.causal_pairs(np.array(p), w))) if p else 0.0 for p in padded]])
                 for w in windows}
        return cm.ForwardShape(tokens, pairs, {w: tokens.copy() for w in windows})

    @lru_cache(maxsize=4096)
    def one_forward_s(lengths: tuple[int, ...]) -> float:
        _, rank_time, _ = simulate_dwdp(spec, hw, deploy, cal, shape([list(lengths)]), stretch)
        return float(np.asarray(rank_time)[0, 0])

    def forward_s(lengths):  # a DWDP forward depends on its shape only (no randomness): cached
        return one_forward_s(tuple(sorted(lengths)) if packed else (max(lengths),) * len(lengths))

    def step_s(per_rank):
        _, step = simulate_dep(spec, hw, deploy, cal, shape(per_rank), rng)
        return float(step[0])

    outside = cm.outside_forward(spec, hw, cal)
    return Service(forward_s, step_s, {}, f"analytic cost model: {sim_config.model} {sim_config.weight_dtype} on "
                   f"{sim_config.hardware}, group {sim_config.group_size}, copy stretch {stretch:.2f}, "
                   f"{1e3 * outside.host_s:.0f} ms host per forward{', packed' if packed else ', padded'}", packed,
                   {"dwdp": outside, "dep": outside})
