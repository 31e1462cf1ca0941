"""Many-to-one contention of asynchronous expert pulls (docs/design.md 1.3): the analytic table and a
discrete-event simulation of a DWDP group's prefetch traffic.

Legend: G = ranks (the group size), C = contention degree (pullers on one source, the puller included),
Q = slices a destination keeps in flight, BW = link bandwidth per direction (bytes/s).

Analytic: if each of G ranks pulls from a source chosen uniformly among the other G-1, the number of
other pulls on the same source is X ~ Binomial(G-2, 1/(G-1)) and C = X + 1.

Simulation model (one MoE layer after another, per rank):
  - rank r issues the prefetch of layer l+1 when its MoE l starts, then computes for a window
    (MoE l + attention l+1); at the window's end it waits for the prefetch (the exposed wait), then
    starts MoE l+1 and issues the next prefetch. Ranks start at random offsets (asynchronous).
  - a prefetch is a list of transfers (source, bytes) in plan order; the destination keeps up to
    Q of them issued. Its inbound port moves one transfer at a time at BW.
  - a source's outbound port serves one transfer at a time at BW, the oldest issued first among
    those whose destination port is free (a copy engine serialising its readers). With
    serialise=False sources serve any number of readers at once (no contention cost).
Plan orders: "monolithic" = one transfer per expert, peers in round-robin order from (rank+1)
(all of one peer, then the next); "tdm" = dwdp.runtime.plan's copy plan, slices of slice_bytes issued
slice offset first, peers round-robin; "random" = one transfer per expert in a random order (the
analytic table's premise).
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from dwdp.observe.traces.contention import contention_pmf
from dwdp.runtime.placement import build_placement
from dwdp.runtime.plan import SegmentLayout, build_copy_plan, pull_order

MODES = ("monolithic", "tdm", "random")



def contention_table(group_sizes=range(3, 17)) -> dict[int, np.ndarray]:
    """{G: P(C = 1 .. G-1)} for each group size."""
    return {n: contention_pmf(n) for n in group_sizes}


@dataclass(frozen=True)
class PullConfig:
    """One simulated DWDP group.

    expert_nbytes: bytes of each weight tensor of one expert (e.g. gate_up, down).
    window_s: mean compute window per layer; window_cv: its per-rank, per-layer spread (lognormal).
    inflight: transfers a destination keeps issued (Q). num_samples: contention snapshots taken
    at evenly spaced times while every rank is still busy.
    """

    group_size: int
    num_experts: int
    expert_nbytes: tuple[int, ...]
    link_bytes_per_s: float
    mode: str = "tdm"
    slice_bytes: int = 1 << 20
    inflight: int = 2
    num_local_experts: int | None = None
    window_s: float = 0.0
    window_cv: float = 0.1
    num_layers: int = 8
    serialise: bool = True
    num_samples: int = 2000
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not one of {MODES}")
        if self.group_size < 2:
            raise ValueError(f"group_size={self.group_size} must be >= 2")
        if self.inflight < 1 or self.slice_bytes < 1 or self.num_layers < 1:
            raise ValueError(f"inflight={self.inflight}, slice_bytes={self.slice_bytes}, "
                             f"num_layers={self.num_layers} must all be >= 1")


@dataclass(frozen=True)
class PullResult:
    """exposed_s[r, l]: wait of rank r before MoE of layer l; prefetch_s[r, l]: issue to last byte.
    contention_counts[c-1]: snapshots in which a pulling rank's current source had c pullers.
    uncontended_s: one prefetch alone on the link."""

    exposed_s: np.ndarray  # [G, layers]
    prefetch_s: np.ndarray  # [G, layers]
    contention_counts: np.ndarray  # [G-1]
    uncontended_s: float
    transfers_per_layer: int

    @property
    def contention_hist(self) -> np.ndarray:
        total = self.contention_counts.sum()
        return self.contention_counts / total if total else self.contention_counts.astype(float)


def build_transfers(cfg: PullConfig, rank: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """(source, bytes) of one layer's prefetch for `rank`, in issue order."""
    placement = build_placement(cfg.num_experts, cfg.group_size, cfg.num_local_experts)
    expert_bytes = sum(cfg.expert_nbytes)
    if cfg.mode == "tdm":
        segment = SegmentLayout(1, placement.num_local_experts, tuple(cfg.expert_nbytes))
        plan = build_copy_plan(placement, rank, 0, 0, segment, cfg.slice_bytes)
        return [(s.peer, s.nbytes) for s in plan.slices]
    pulls = [(peer, expert_bytes) for peer in pull_order(rank, cfg.group_size)
             for _ in placement.pulls_from(rank, peer)]
    if cfg.mode == "random":
        pulls = [pulls[i] for i in rng.permutation(len(pulls))]
    return pulls


def uncontended_time(cfg: PullConfig) -> float:
    """Seconds one rank's layer prefetch takes alone on its link."""
    rng = np.random.default_rng(cfg.seed)
    return sum(b for _, b in build_transfers(cfg, 0, rng)) / cfg.link_bytes_per_s


def simulate_pulls(cfg: PullConfig) -> PullResult:
    """Run the group for cfg.num_layers layers; see the module docstring for the model."""
    n, k, bw = cfg.group_size, cfg.inflight, cfg.link_bytes_per_s
    rng = np.random.default_rng(cfg.seed)
    static = [build_transfers(cfg, r, rng) for r in range(n)] if cfg.mode != "random" else None
    uncontended = uncontended_time(cfg)
    sigma = math.sqrt(math.log1p(cfg.window_cv ** 2))
    windows = cfg.window_s * rng.lognormal(-sigma ** 2 / 2, sigma, size=(n, cfg.num_layers))
    offsets = rng.uniform(0.0, uncontended, size=n)

    exposed = np.zeros((n, cfg.num_layers))
    prefetch = np.zeros((n, cfg.num_layers))
    plan: list[list] = [[] for _ in range(n)]
    cursor = [0] * n
    outstanding: list[deque] = [deque() for _ in range(n)]  # issued, unfinished transfers, oldest first
    layer = [0] * n
    issued_at = [0.0] * n
    window_end = [math.inf] * n
    waiting = [False] * n
    finished = [False] * n
    port_busy = [False] * n  # destination inbound ports
    src_busy = [False] * n  # source outbound ports
    pending: list[list] = [[] for _ in range(n)]  # per source: issued transfers not yet started
    demand = [[0] * n for _ in range(n)]  # demand[s][d]: transfers of d outstanding at s
    counts = np.zeros(n - 1, dtype=np.int64)
    events: list = []
    seq = 0

    def push(t, kind, payload):
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, payload))

    def issue_next(r):
        nonlocal seq
        while len(outstanding[r]) < k and cursor[r] < len(plan[r]):
            src, nbytes = plan[r][cursor[r]]
            cursor[r] += 1
            seq += 1
            transfer = [seq, r, src, nbytes]
            outstanding[r].append(transfer)
            pending[src].append(transfer)
            demand[src][r] += 1

    def start_prefetch(r, t):
        plan[r] = static[r] if static is not None else build_transfers(cfg, r, rng)
        cursor[r] = 0
        issued_at[r] = t
        issue_next(r)
        window_end[r] = t + windows[r, layer[r]]
        push(window_end[r], 1, r)

    def dispatch(t):
        # Start transfers while some free source has a request whose destination port is free,
        # oldest request first across sources.
        while True:
            best = None
            for s in range(n):
                if src_busy[s] or not pending[s]:
                    continue
                for transfer in pending[s]:
                    if not port_busy[transfer[1]]:
                        if best is None or transfer[0] < best[0]:
                            best = transfer
                        break
            if best is None:
                return
            _, d, s, nbytes = best
            pending[s].remove(best)
            port_busy[d] = True
            src_busy[s] = cfg.serialise
            push(t + nbytes / bw, 2, best)

    def advance(r, t):
        # Prefetch of layer[r] has landed and the window is over: run MoE, issue the next prefetch.
        exposed[r, layer[r]] = max(0.0, t - window_end[r])
        layer[r] += 1
        if layer[r] == cfg.num_layers:
            finished[r] = True
            return
        start_prefetch(r, t)

    for r in range(n):
        push(offsets[r], 0, r)
    # Snapshots from the last rank's start until the earliest any rank could finish.
    sample_start = float(offsets.max())
    sample_dt = (float(offsets.min()) + cfg.num_layers * uncontended - sample_start) / cfg.num_samples
    push(sample_start + sample_dt / 2, 3, 1)
    while events:
        t, _, kind, payload = heapq.heappop(events)
        if kind == 0:  # rank starts
            start_prefetch(payload, t)
        elif kind == 1:  # window over
            r = payload
            if cursor[r] == len(plan[r]) and not outstanding[r]:
                advance(r, t)
            else:
                waiting[r] = True
        elif kind == 2:  # transfer done
            _, d, s, _ = payload
            port_busy[d] = False
            src_busy[s] = False
            outstanding[d].remove(payload)
            demand[s][d] -= 1
            issue_next(d)
            if cursor[d] == len(plan[d]) and not outstanding[d]:
                prefetch[d, layer[d]] = t - issued_at[d]
                if waiting[d]:
                    waiting[d] = False
                    advance(d, t)
        else:  # contention snapshot
            if any(finished):
                continue
            for r in range(n):
                if outstanding[r]:
                    src = outstanding[r][0][2]
                    counts[sum(1 for d in range(n) if demand[src][d]) - 1] += 1
            if payload < cfg.num_samples:
                push(t + sample_dt, 3, payload + 1)
        dispatch(t)
    return PullResult(exposed, prefetch, counts, uncontended, len(static[0]) if static else len(plan[0]))
