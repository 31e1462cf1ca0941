"""Memory layouts of expert weights and the sliced, peer-interleaved copy plan of one layer.

Legend: L = local experts per rank, nb[t] = bytes of one expert's tensor t (one of the named tensors
that move with it, dwdp.models.expert_tensors: weights, biases, ...; its size padded to 16 bytes),
I = expert intermediate size, H = hidden size.

Source segment (one per rank, shared with peers): for each MoE layer, tensor-major blocks
    [tensor 0 of its L local experts][tensor 1 of its L local experts]...
e.g. [gate_up][down], so each rank's local tensors are plain views ([L, 2I, H] and [L, H, I]).

Prefetch slot (one per buffer, private): for each source peer in pull order, the same
tensor-major blocks for the experts pulled from that peer, so the experts path reads one
[n_p, ...] view per tensor and peer and never concatenates them.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from dwdp.runtime.placement import NO_SOURCE, Placement


@dataclass(frozen=True)
class SegmentLayout:
    """Byte offsets inside one rank's source segment."""

    num_layers: int
    num_local: int
    tensor_nbytes: tuple[int, ...]

    @property
    def layer_nbytes(self) -> int:
        return self.num_local * sum(self.tensor_nbytes)

    @property
    def total_nbytes(self) -> int:
        return self.num_layers * self.layer_nbytes

    def tensor_offset(self, layer: int, tensor: int) -> int:
        """Start of the [L, ...] block of `tensor` in `layer`."""
        return layer * self.layer_nbytes + self.num_local * sum(self.tensor_nbytes[:tensor])

    def offset(self, layer: int, local_index: int, tensor: int) -> int:
        return self.tensor_offset(layer, tensor) + local_index * self.tensor_nbytes[tensor]


@dataclass(frozen=True)
class SlotLayout:
    """Byte offsets inside one prefetch slot of `rank`: one block group per source peer."""

    peers: tuple[int, ...]                   # source peers in pull order
    experts_by_peer: tuple[tuple[int, ...], ...]  # experts pulled from each peer, sorted
    tensor_nbytes: tuple[int, ...]

    @property
    def total_nbytes(self) -> int:
        return sum(len(x) for x in self.experts_by_peer) * sum(self.tensor_nbytes)

    def peer_offset(self, peer_index: int) -> int:
        return sum(len(x) for x in self.experts_by_peer[:peer_index]) * sum(self.tensor_nbytes)

    def tensor_offset(self, peer_index: int, tensor: int) -> int:
        """Start of the [n_p, ...] block of `tensor` for the experts of peer number `peer_index`."""
        n = len(self.experts_by_peer[peer_index])
        return self.peer_offset(peer_index) + n * sum(self.tensor_nbytes[:tensor])

    def offset(self, peer_index: int, index_in_peer: int, tensor: int) -> int:
        return self.tensor_offset(peer_index, tensor) + index_in_peer * self.tensor_nbytes[tensor]


def pull_order(rank: int, group_size: int) -> tuple[int, ...]:
    """Peers in round-robin order starting at (rank + 1) mod G, so ranks start on different sources."""
    return tuple((rank + k) % group_size for k in range(1, group_size))


def slot_layout(placement: Placement, rank: int, tensor_nbytes: tuple[int, ...]) -> SlotLayout:
    peers, groups = [], []
    for peer in pull_order(rank, placement.group_size):
        experts = placement.pulls_from(rank, peer)
        if experts:
            peers.append(peer)
            groups.append(experts)
    return SlotLayout(tuple(peers), tuple(groups), tuple(tensor_nbytes))


@dataclass(frozen=True)
class CopySlice:
    """One copy: `nbytes` from byte `src_offset` of `peer`'s segment to byte `dst_offset` of the slot."""

    peer: int
    src_offset: int
    dst_offset: int
    nbytes: int
    expert: int


@dataclass(frozen=True)
class CopyPlan:
    """Every slice that brings layer `layer`'s missing experts into prefetch slot `slot`."""

    rank: int
    layer: int
    slot: int
    slices: tuple[CopySlice, ...]

    # Cached: a plan is built once and submitted every forward, and its slices never change.
    @cached_property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slices)

    @cached_property
    def peers(self) -> tuple[int, ...]:
        return tuple(sorted({s.peer for s in self.slices}))

    @cached_property
    def bytes_per_peer(self) -> tuple[tuple[int, int], ...]:
        """(source peer, bytes copied from it), by peer: what a submit adds to per-peer counters
        without walking the slices again."""
        totals: dict[int, int] = {}
        for s in self.slices:
            totals[s.peer] = totals.get(s.peer, 0) + s.nbytes
        return tuple(sorted(totals.items()))

    def slices_per_expert(self) -> dict[int, int]:
        """Expert -> its number of slices (a fresh dict)."""
        return dict(self._slice_counts[0])

    def slices_per_peer(self) -> dict[int, int]:
        """Source peer -> its number of slices (a fresh dict)."""
        return dict(self._slice_counts[1])

    @cached_property
    def _slice_counts(self) -> tuple[dict[int, int], dict[int, int]]:
        per_expert: dict[int, int] = {}
        per_peer: dict[int, int] = {}
        for s in self.slices:
            per_expert[s.expert] = per_expert.get(s.expert, 0) + 1
            per_peer[s.peer] = per_peer.get(s.peer, 0) + 1
        return per_expert, per_peer


def build_copy_plan(
    placement: Placement,
    rank: int,
    layer: int,
    slot: int,
    segment: SegmentLayout,
    slice_bytes: int,
    sources: tuple[int, ...] | None = None,
) -> CopyPlan:
    """Slices of at most `slice_bytes` (each tensor's last slice shorter), ordered slice offset
    first and peers round-robin second, so pulls from different sources interleave.

    sources: the owner to read each expert from (placement.source[rank] by default; after a loss,
    a row of placement.surviving_sources, where NO_SOURCE leaves the expert out). The slot layout
    stays the placement's whatever the sources, so weight tables never move.
    """
    if slice_bytes < 1:
        raise ValueError(f"slice_bytes={slice_bytes} must be >= 1")
    sources = placement.source[rank] if sources is None else sources
    layout = slot_layout(placement, rank, segment.tensor_nbytes)
    streams: dict[int, list[CopySlice]] = {}
    for p_index, experts in enumerate(layout.experts_by_peer):
        for i, expert in enumerate(experts):
            peer = sources[expert]
            if peer == NO_SOURCE:
                continue
            src_index = placement.owned[peer].index(expert)
            stream = streams.setdefault(peer, [])
            for t, nbytes in enumerate(segment.tensor_nbytes):
                src = segment.offset(layer, src_index, t)
                dst = layout.offset(p_index, i, t)
                for start in range(0, nbytes, slice_bytes):
                    n = min(slice_bytes, nbytes - start)
                    stream.append(CopySlice(peer, src + start, dst + start, n, expert))
    ordered_streams = [streams[p] for p in pull_order(rank, placement.group_size) if p in streams]
    ordered = []
    for k in range(max((len(s) for s in ordered_streams), default=0)):
        for stream in ordered_streams:
            if k < len(stream):
                ordered.append(stream[k])
    return CopyPlan(rank, layer, slot, tuple(ordered))


def arrival_order(plan: CopyPlan) -> tuple[int, ...]:
    """The plan's experts in the order their last slice comes in the plan: the order in which they
    become ready when slices land in plan order."""
    last = {s.expert: i for i, s in enumerate(plan.slices)}
    return tuple(sorted(last, key=last.__getitem__))


class PlanCache:
    """Copy plans built once per (layer, slot) for one rank and reused on every forward, until
    `set_sources` (a lost peer) makes every plan read from new owners."""

    def __init__(self, placement: Placement, rank: int, segment: SegmentLayout, slice_bytes: int):
        self.placement, self.rank, self.segment, self.slice_bytes = placement, rank, segment, slice_bytes
        self.sources = placement.source[rank]
        self.get = lru_cache(maxsize=None)(self._build)

    def _build(self, layer: int, slot: int) -> CopyPlan:
        return build_copy_plan(self.placement, self.rank, layer, slot, self.segment, self.slice_bytes, self.sources)

    def set_sources(self, sources: tuple[int, ...]) -> None:
        """Read each expert from `sources[e]` from now on (NO_SOURCE: nowhere); drops every plan."""
        self.sources = tuple(sources)
        self.get.cache_clear()


def coalesce(slices) -> list[tuple[int, int, int, int]]:
    """The copies that move `slices` (CopySlice each, in plan order): each run of slices that follow
    each other in the list, come from the same peer and continue each other's source and
    destination bytes becomes one copy. (peer, src_offset, dst_offset, nbytes) each, in order.

    Only list neighbours merge, so wherever the plan alternates peers (round-robin slices of
    several sources) every slice stays its own copy and the interleaving is kept; where one peer's
    slices follow each other (a single source, or the tail of the longest stream) the slicing buys
    no interleaving and each extra copy would only cost the driver's per-copy work."""
    copies: list[list[int]] = []
    for s in slices:
        last = copies[-1] if copies else None
        if last is not None and last[0] == s.peer and last[1] + last[3] == s.src_offset \
                and last[2] + last[3] == s.dst_offset:
            last[3] += s.nbytes
        else:
            copies.append([s.peer, s.src_offset, s.dst_offset, s.nbytes])
    return [tuple(c) for c in copies]


@dataclass(frozen=True)
class CopyBatch:
    """Slices `start:stop` of a plan, issued as one unordered batch; after it every expert in
    `completes` has all of its slices landed (earlier batches are stream-ordered before it)."""

    start: int
    stop: int
    completes: tuple[int, ...]
    peers: tuple[int, ...]


def cut_batches(plan: CopyPlan, max_batches: int) -> tuple[CopyBatch, ...]:
    """Cut `plan` into at most `max_batches` batches of about equal bytes, only where an expert's
    last slice ends, so each expert becomes ready with the batch that holds its last slice.

    Copies inside a batch have no order, so a cut elsewhere would buy no readiness; slices keep
    their round-robin order across batches.
    """
    if max_batches < 1:
        raise ValueError(f"max_batches={max_batches} must be >= 1")
    if not plan.slices:
        return ()
    last = {s.expert: i for i, s in enumerate(plan.slices)}
    ends = {}  # slice index -> experts whose last slice it is
    for expert, i in last.items():
        ends.setdefault(i, []).append(expert)
    total = plan.nbytes
    batches, start, done_bytes = [], 0, 0
    for i, s in enumerate(plan.slices):
        done_bytes += s.nbytes
        is_last = i == len(plan.slices) - 1
        wanted = len(batches) + 1  # the batch being filled: cut once its share of the bytes is in
        if i in ends and (is_last or (wanted < max_batches and done_bytes * max_batches >= wanted * total)):
            chunk = plan.slices[start : i + 1]
            completes = tuple(sorted(e for j in range(start, i + 1) for e in ends.get(j, ())))
            batches.append(CopyBatch(start, i + 1, completes, tuple(sorted({c.peer for c in chunk}))))
            start = i + 1
    return tuple(batches)
