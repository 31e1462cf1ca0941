"""Composite expert views: the page plan that lets a rank see each (MoE layer, expert tensor) as one
plain `[E, ...]` tensor with no merge copy. Pure arithmetic; the backends map what it says.

Legend: E = experts per layer, G = ranks, g = allocation granularity in bytes (host: the page size;
CUDA: cuMemGetAllocationGranularity, usually 2 MiB), nb[t] = bytes of one expert's tensor t (its
natural size, no padding: the view must be the unwrapped model's contiguous `[E, *shape]`), B = prefetch
slots (pool slots).

View of (layer, t): `ceil(E * nb[t] / g)` pages; expert e is bytes [e * nb[t], (e + 1) * nb[t]).
A *local run* is a maximal range [a, b) of consecutive experts the rank owns (a placement that wraps
around, or a redundant one, gives several). Its *extent* is the view pages it touches,
[floor(a * nb / g), ceil(b * nb / g)); extents that share a page are merged. Every extent is one
piece of the rank's source segment with the same in-page phase as the view, so it is mapped into the
view in place: the local experts are never copied. The bytes of an extent's boundary pages that
belong to remote experts (and whole remote experts inside a merged extent) are filled by the
prefetch, like the rest of the remote bytes. Every other view page is a page of pool slot
`layer % S`: the k-th non-extent page of tensor t's view is the k-th page of tensor t's block of
that slot.

Allocations: every extent of every (layer, t) is an allocation of its own, and so is every gap
between extents of every (slot, t) (a *pool gap*). Each is mapped whole, at offset 0, wherever it
appears: the CUDA driver maps no piece of an allocation (cuMemMap's offset "currently must be zero"),
so the plan speaks of allocations, never of offsets into one. The host backend maps the same plan
from one file per backing at each allocation's `offset` (mmap takes file offsets).

Rank segment (shared with peers, who read owned experts from it): its extent allocations back to
back, in the order
    for layer: for t: for extent: its pages                      (each extent page-aligned)
so a peer that maps them in that order into one range reads expert e at `segment_offset`.
Layer range (what one reservation holds, per layer): [view of t=0 | view of t=1 | ...], each view
page-aligned; copy plans write into it at `view_start[t] + e * nb[t]`.
Pool (private to the rank): [slot 0: [gaps of t=0 | gaps of t=1 | ...] | slot 1: ... ].
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from dwdp.runtime.placement import NO_SOURCE, Placement
from dwdp.runtime.plan import CopyPlan, CopySlice, pull_order, slot_layout

SEGMENT, POOL = "segment", "pool"


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")


def local_runs(owned, num_experts: int) -> tuple[tuple[int, int], ...]:
    """Maximal ranges [a, b) of consecutive experts in `owned` (a wrapping placement gives two)."""
    runs: list[list[int]] = []
    for e in sorted(owned):
        if not 0 <= e < num_experts:
            raise ValueError(f"owned expert {e} is not in [0, {num_experts})")
        if runs and runs[-1][1] == e:
            runs[-1][1] = e + 1
        else:
            runs.append([e, e + 1])
    return tuple((a, b) for a, b in runs)


@dataclass(frozen=True)
class Extent:
    """A local allocation of one (layer, tensor): view pages [first_page, stop_page), stored from
    byte `segment_offset` of the rank's segment; `experts` are the owned experts in it; `allocation`
    its index in `CompositeLayout.segment_allocations`."""

    first_page: int
    stop_page: int
    experts: tuple[int, ...]
    segment_offset: int
    allocation: int

    @property
    def num_pages(self) -> int:
        return self.stop_page - self.first_page


@dataclass(frozen=True)
class Allocation:
    """One physical allocation behind a rank's views: `nbytes` (a multiple of the granularity) at byte
    `offset` of its backing (SEGMENT: the rank's segment; POOL: its pool). `index` is its place in
    `segment_allocations` or `pool_allocations`. On CUDA: one cuMemCreate, mapped whole at offset 0."""

    backing: str
    index: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class MapRun:
    """`nbytes` of a layer range from byte `view_offset`: the whole of allocation `allocation` of
    `backing` (SEGMENT or POOL), which sits at byte `file_offset` of that backing. Every field is a
    multiple of the granularity."""

    view_offset: int
    nbytes: int
    backing: str
    file_offset: int
    allocation: int


@dataclass(frozen=True)
class CompositeLayout:
    """The page plan of one rank (see the module docstring). Same for every layer except the slot."""

    placement: Placement
    rank: int
    num_layers: int
    tensor_nbytes: tuple[int, ...]
    granularity: int
    num_slots: int = 2

    def __post_init__(self):
        _check_positive_int("granularity", self.granularity)
        _check_positive_int("num_slots", self.num_slots)
        _check_positive_int("num_layers", self.num_layers)
        if not 0 <= self.rank < self.placement.group_size:
            raise ValueError(f"rank={self.rank!r} is not in [0, group_size={self.placement.group_size})")
        if not self.tensor_nbytes:
            raise ValueError("tensor_nbytes is empty: a composite view needs at least one expert tensor")
        for t, nb in enumerate(self.tensor_nbytes):
            _check_positive_int(f"tensor_nbytes[{t}]", nb)

    # -- views -----------------------------------------------------------------------------------
    def _pages(self, nbytes: int) -> int:
        return -(-nbytes // self.granularity)

    @cached_property
    def view_pages(self) -> tuple[int, ...]:
        """Pages of each tensor's view."""
        return tuple(self._pages(self.placement.num_experts * nb) for nb in self.tensor_nbytes)

    @cached_property
    def view_start(self) -> tuple[int, ...]:
        """Byte offset of each tensor's view inside a layer range."""
        starts, at = [], 0
        for pages in self.view_pages:
            starts.append(at)
            at += pages * self.granularity
        return tuple(starts)

    @property
    def layer_nbytes(self) -> int:
        return sum(self.view_pages) * self.granularity

    def view_span(self, layer: int, tensor: int, dtype, shape) -> tuple[int, int]:
        """(byte offset in the whole range of every layer, bytes) of `layer`'s view of `tensor` read as
        `dtype` [shape] (the stacked tensor's shape, e.g. [E, 2I, H]); a shape of other size is refused."""
        nbytes = self.placement.num_experts * self.tensor_nbytes[tensor]
        count = 1
        for s in shape:
            count *= s
        if count * dtype.itemsize != nbytes:
            raise ValueError(f"shape {tuple(shape)} of {dtype} is {count * dtype.itemsize} bytes; tensor {tensor} "
                             f"holds {nbytes} ({self.placement.num_experts} experts of {self.tensor_nbytes[tensor]})")
        return layer * self.layer_nbytes + self.view_start[tensor], nbytes

    def slot(self, layer: int) -> int:
        """The pool slot whose pages back `layer`'s remote experts: layers that run one after the
        other use different slots, so a prefetch never overwrites pages a running layer reads."""
        return layer % self.num_slots

    # -- local extents ---------------------------------------------------------------------------
    @cached_property
    def runs(self) -> tuple[tuple[int, int], ...]:
        return local_runs(self.placement.owned[self.rank], self.placement.num_experts)

    @cached_property
    def _extent_spans(self) -> tuple[tuple[tuple[int, int, tuple[int, ...]], ...], ...]:
        """Per tensor: (first_page, stop_page, owned experts) of each extent, runs sharing a page merged."""
        g = self.granularity
        spans = []
        for nb in self.tensor_nbytes:
            merged: list[list] = []
            for a, b in self.runs:
                first, stop = a * nb // g, -(-(b * nb) // g)
                if merged and first < merged[-1][1]:  # shares a page with the previous extent
                    merged[-1][1] = max(merged[-1][1], stop)
                    merged[-1][2] += tuple(range(a, b))
                else:
                    merged.append([first, stop, tuple(range(a, b))])
            spans.append(tuple((f, s, e) for f, s, e in merged))
        return tuple(spans)

    @property
    def extent_pages_per_layer(self) -> int:
        return sum(s - f for spans in self._extent_spans for f, s, _ in spans)

    @property
    def segment_nbytes(self) -> int:
        return self.num_layers * self.extent_pages_per_layer * self.granularity

    @property
    def extents_per_layer(self) -> int:
        return sum(len(spans) for spans in self._extent_spans)

    def extents(self, layer: int, tensor: int) -> tuple[Extent, ...]:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} is not in [0, {self.num_layers})")
        pages = layer * self.extent_pages_per_layer + sum(
            s - f for spans in self._extent_spans[:tensor] for f, s, _ in spans)
        index = layer * self.extents_per_layer + sum(len(spans) for spans in self._extent_spans[:tensor])
        out = []
        for first, stop, experts in self._extent_spans[tensor]:
            out.append(Extent(first, stop, experts, pages * self.granularity, index))
            pages += stop - first
            index += 1
        return tuple(out)

    @cached_property
    def segment_allocations(self) -> tuple[Allocation, ...]:
        """Every extent's allocation, in segment order (layer, tensor, extent): back to back they are
        the rank's segment, `segment_nbytes` in all."""
        return tuple(Allocation(SEGMENT, ext.allocation, ext.segment_offset, ext.num_pages * self.granularity)
                     for layer in range(self.num_layers) for t in range(len(self.tensor_nbytes))
                     for ext in self.extents(layer, t))

    def segment_offset(self, layer: int, expert: int, tensor: int) -> int:
        """Byte offset of owned `expert`'s tensor `tensor` of `layer` in this rank's segment."""
        nb = self.tensor_nbytes[tensor]
        for ext in self.extents(layer, tensor):
            if expert in ext.experts:
                return ext.segment_offset + expert * nb - ext.first_page * self.granularity
        raise ValueError(f"rank {self.rank} does not own expert {expert}; it owns {self.placement.owned[self.rank]}")

    # -- pool ------------------------------------------------------------------------------------
    @cached_property
    def _gap_spans(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per tensor: (first_page, stop_page) of each view gap between extents, in view order."""
        gaps = []
        for pages, spans in zip(self.view_pages, self._extent_spans):
            out, page = [], 0
            for first, stop, _ in spans:
                if first > page:
                    out.append((page, first))
                page = stop
            if pages > page:
                out.append((page, pages))
            gaps.append(tuple(out))
        return tuple(gaps)

    @cached_property
    def pool_pages(self) -> tuple[int, ...]:
        """Pool pages each tensor's view needs in one slot."""
        return tuple(sum(s - f for f, s in gaps) for gaps in self._gap_spans)

    @cached_property
    def pool_allocations(self) -> tuple[Allocation, ...]:
        """Every pool gap's allocation, in pool order (slot, tensor, gap)."""
        out, at = [], 0
        for _ in range(self.num_slots):
            for gaps in self._gap_spans:
                for first, stop in gaps:
                    nbytes = (stop - first) * self.granularity
                    out.append(Allocation(POOL, len(out), at, nbytes))
                    at += nbytes
        return tuple(out)

    @property
    def pool_slot_nbytes(self) -> int:
        return sum(self.pool_pages) * self.granularity

    @property
    def pool_nbytes(self) -> int:
        return self.num_slots * self.pool_slot_nbytes

    # -- mapping ---------------------------------------------------------------------------------
    def map_runs(self, layer: int) -> tuple[MapRun, ...]:
        """What backs every page of `layer`'s range, in view order, one run per allocation (never a
        piece of one, never two merged): the mmap / cuMemMap calls that build the layer's views."""
        g = self.granularity
        gaps_per_slot = sum(len(gaps) for gaps in self._gap_spans)
        gap = self.slot(layer) * gaps_per_slot
        runs: list[MapRun] = []
        for t in range(len(self.view_pages)):
            base = self.view_start[t] // g
            extents = {ext.first_page: ext for ext in self.extents(layer, t)}
            for first in sorted([*extents, *(first for first, _ in self._gap_spans[t])]):
                ext = extents.get(first)
                if ext is not None:
                    runs.append(MapRun((base + first) * g, ext.num_pages * g, SEGMENT, ext.segment_offset,
                                       ext.allocation))
                else:  # the next gap of this tensor, in view order: the next pool allocation of the slot
                    alloc = self.pool_allocations[gap]
                    runs.append(MapRun((base + first) * g, alloc.nbytes, POOL, alloc.offset, gap))
                    gap += 1
        return tuple(runs)

    def backing_of(self, layer: int, view_offset: int) -> tuple[str, int]:
        """(backing, byte offset in it) of byte `view_offset` of `layer`'s range."""
        for run in self.map_runs(layer):
            if run.view_offset <= view_offset < run.view_offset + run.nbytes:
                return run.backing, run.file_offset + view_offset - run.view_offset
        raise ValueError(f"view_offset={view_offset} is outside layer range [0, {self.layer_nbytes})")

    def remote_bytes_in_extents(self, layer: int) -> int:
        """Bytes of remote experts that live in local extents (boundary pages and merged gaps): the
        prefetch fills them in the rank's own segment."""
        total, g = 0, self.granularity
        for t, nb in enumerate(self.tensor_nbytes):
            end = self.placement.num_experts * nb  # page tails past the last expert are nobody's bytes
            for ext in self.extents(layer, t):
                total += min(ext.stop_page * g, end) - ext.first_page * g - len(ext.experts) * nb
        return total


def composite_layouts(placement: Placement, num_layers: int, tensor_nbytes, granularity: int,
                      num_slots: int = 2) -> tuple[CompositeLayout, ...]:
    """Every rank's layout: each rank computes all of them alone, to know where peers keep experts."""
    return tuple(CompositeLayout(placement, r, num_layers, tuple(tensor_nbytes), granularity, num_slots)
                 for r in range(placement.group_size))


def build_composite_plan(layouts, rank: int, layer: int, slice_bytes: int,
                         sources: tuple[int, ...] | None = None) -> CopyPlan:
    """The copies that fill `rank`'s views of `layer`: every remote expert's bytes, from its source's
    segment (`layouts[source].segment_offset`) to byte `view_start[t] + e * nb[t]` of the layer
    range, whether that lands on pool pages or on a boundary page of a local extent.

    Same order as plan.build_copy_plan: slices of at most `slice_bytes`, slice offset first and
    peers round-robin from (rank + 1) second. sources: as in build_copy_plan (NO_SOURCE leaves the
    expert out; the destination never moves)."""
    _check_positive_int("slice_bytes", slice_bytes)
    mine = layouts[rank]
    placement = mine.placement
    sources = placement.source[rank] if sources is None else sources
    grouping = slot_layout(placement, rank, mine.tensor_nbytes)
    streams: dict[int, list[CopySlice]] = {}
    for experts in grouping.experts_by_peer:
        for expert in experts:
            peer = sources[expert]
            if peer == NO_SOURCE:
                continue
            stream = streams.setdefault(peer, [])
            for t, nb in enumerate(mine.tensor_nbytes):
                src = layouts[peer].segment_offset(layer, expert, t)
                dst = mine.view_start[t] + expert * nb
                for start in range(0, nb, slice_bytes):
                    n = min(slice_bytes, nb - start)
                    stream.append(CopySlice(peer, src + start, dst + start, n, expert))
    ordered_streams = [streams[p] for p in pull_order(rank, placement.group_size) if p in streams]
    ordered = [stream[k] for k in range(max((len(s) for s in ordered_streams), default=0))
               for stream in ordered_streams if k < len(stream)]
    return CopyPlan(rank, layer, mine.slot(layer), tuple(ordered))
