"""The composite page planner (dwdp.runtime.composite), checked without any mapping: an emulator
resolves every view byte through `map_runs` onto plain byte tensors standing for each rank's segment
and pool, applies the composite copy plan, and compares each view with the unwrapped experts' bytes.

Legend: E = experts, G = ranks, g = granularity, nb[t] = bytes of one expert's tensor t.
"""
from __future__ import annotations

import pytest
import torch

from dwdp.runtime.composite import POOL, SEGMENT, CompositeLayout, build_composite_plan, composite_layouts, local_runs
from dwdp.runtime.placement import build_placement, surviving_sources

PAGE = 4096
TWO_MIB = 2 << 20


def _tensor_bytes(shape, dtype) -> int:
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


# (name, expert tensors' nbytes): the layouts the issue names.
TENSOR_SETS = {
    # bf16 gate_up [2I=2*24, H=40] and down [H, I]: neither a multiple of the page.
    "bf16_odd": (_tensor_bytes((48, 40), torch.bfloat16), _tensor_bytes((40, 24), torch.bfloat16)),
    # bf16 sized to exactly one and two pages.
    "bf16_pages": (2 * PAGE, PAGE),
    # gpt-oss style: weights plus biases that move with their expert.
    "bias": (_tensor_bytes((64, 32), torch.bfloat16), _tensor_bytes((64,), torch.bfloat16),
             _tensor_bytes((32, 32), torch.bfloat16), _tensor_bytes((32,), torch.bfloat16)),
    # fp8 weights with fp32 block scales (block 16).
    "fp8": (_tensor_bytes((64, 48), torch.float8_e4m3fn), _tensor_bytes((4, 3), torch.float32),
            _tensor_bytes((48, 32), torch.float8_e4m3fn), _tensor_bytes((3, 2), torch.float32)),
    # MXFP4: uint8 blocks [N, K/32, 16] and e8m0 scales [N, K/32].
    "mxfp4": (_tensor_bytes((64, 3, 16), torch.uint8), _tensor_bytes((64, 3), torch.uint8),
              _tensor_bytes((96, 1, 16), torch.uint8), _tensor_bytes((96, 1), torch.uint8)),
}

# (E, G, L): disjoint, G not dividing E, redundant, wrapping runs, one rank.
PLACEMENTS = [(8, 2, 4), (7, 3, 3), (8, 4, 3), (6, 4, 3), (5, 1, 5), (16, 3, 8)]


class Emulator:
    """Byte tensors for every rank's segment and pool; views resolved through map_runs."""

    def __init__(self, layouts):
        self.layouts = layouts
        self.segments = [torch.zeros(lay.segment_nbytes, dtype=torch.uint8) for lay in layouts]
        self.pools = [torch.zeros(lay.pool_nbytes, dtype=torch.uint8) for lay in layouts]

    def _backing(self, rank, backing):
        return self.segments[rank] if backing == SEGMENT else self.pools[rank]

    def write_view(self, rank, layer, offset, data):
        lay = self.layouts[rank]
        at = 0
        while at < data.numel():
            backing, file_offset = lay.backing_of(layer, offset + at)
            n = min(data.numel() - at, lay.granularity - (offset + at) % lay.granularity)
            self._backing(rank, backing)[file_offset:file_offset + n] = data[at:at + n]
            at += n

    def read_view(self, rank, layer):
        lay = self.layouts[rank]
        out = torch.empty(lay.layer_nbytes, dtype=torch.uint8)
        for run in lay.map_runs(layer):
            out[run.view_offset:run.view_offset + run.nbytes] = \
                self._backing(rank, run.backing)[run.file_offset:run.file_offset + run.nbytes]
        return out

    def load(self, weights):
        """Put each rank's owned experts into its segment: what loading does."""
        for r, lay in enumerate(self.layouts):
            for layer, per_tensor in enumerate(weights):
                for t, w in enumerate(per_tensor):
                    nb = lay.tensor_nbytes[t]
                    for e in lay.placement.owned[r]:
                        at = lay.segment_offset(layer, e, t)
                        self.segments[r][at:at + nb] = w[e * nb:(e + 1) * nb]

    def prefetch(self, rank, layer, slice_bytes, sources=None):
        plan = build_composite_plan(self.layouts, rank, layer, slice_bytes, sources)
        for s in plan.slices:
            self.write_view(rank, layer, s.dst_offset, self.segments[s.peer][s.src_offset:s.src_offset + s.nbytes])
        return plan


def _weights(layouts, num_layers, seed):
    gen = torch.Generator().manual_seed(seed)
    E = layouts[0].placement.num_experts
    return [[torch.randint(0, 256, (E * nb,), dtype=torch.uint8, generator=gen) for nb in layouts[0].tensor_nbytes]
            for _ in range(num_layers)]


def _check_view(lay, view, weights_of_layer, experts=None):
    E = lay.placement.num_experts
    for t, nb in enumerate(lay.tensor_nbytes):
        got = view[lay.view_start[t]:lay.view_start[t] + E * nb]
        want = weights_of_layer[t]
        for e in (range(E) if experts is None else experts):
            assert torch.equal(got[e * nb:(e + 1) * nb], want[e * nb:(e + 1) * nb]), \
                f"rank {lay.rank} tensor {t} expert {e}: view bytes differ from the unwrapped expert"


# Every tensor set and placement at the page size; the other granularities on a subset that still
# covers page-multiple and odd experts, redundancy and wrapping runs.
VIEW_CASES = [(*p, t, PAGE) for p in PLACEMENTS for t in sorted(TENSOR_SETS)] + [
    (8, 2, 4, "bf16_odd", TWO_MIB), (7, 3, 3, "fp8", TWO_MIB), (16, 3, 8, "bias", TWO_MIB),
    (8, 4, 3, "bf16_pages", 64), (7, 3, 3, "mxfp4", 64), (6, 4, 3, "bf16_odd", 64), (5, 1, 5, "fp8", 64),
]


@pytest.mark.parametrize("E,G,L,tensors,granularity", VIEW_CASES)
def test_views_hold_the_unwrapped_experts_after_prefetch(E, G, L, tensors, granularity):
    num_layers = 3
    placement = build_placement(E, G, L)
    layouts = composite_layouts(placement, num_layers, TENSOR_SETS[tensors], granularity, num_slots=2)
    emu = Emulator(layouts)
    weights = _weights(layouts, num_layers, seed=E * 100 + G * 10 + L)
    emu.load(weights)
    for layer in range(num_layers):
        for r in range(G):
            emu.prefetch(r, layer, slice_bytes=1000)
            _check_view(layouts[r], emu.read_view(r, layer), weights[layer])


@pytest.mark.parametrize("granularity", [PAGE, TWO_MIB])
@pytest.mark.parametrize("E,G,L", PLACEMENTS)
def test_local_experts_are_mapped_in_place_and_never_copied(E, G, L, granularity):
    placement = build_placement(E, G, L)
    layouts = composite_layouts(placement, 2, TENSOR_SETS["bf16_odd"], granularity)
    emu = Emulator(layouts)
    weights = _weights(layouts, 2, seed=7)
    emu.load(weights)
    for r, lay in enumerate(layouts):
        owned = placement.owned[r]
        for layer in range(2):
            plan = build_composite_plan(layouts, r, layer, 512)
            assert not {s.expert for s in plan.slices} & set(owned), "a local expert is in the copy plan"
            for t, nb in enumerate(lay.tensor_nbytes):
                for e in owned:  # every byte of an owned expert resolves to its own segment bytes
                    for byte in (0, nb // 2, nb - 1):
                        backing, at = lay.backing_of(layer, lay.view_start[t] + e * nb + byte)
                        assert (backing, at) == (SEGMENT, lay.segment_offset(layer, e, t) + byte), \
                            f"rank {r} layer {layer} tensor {t} expert {e} byte {byte} -> {(backing, at)}"
            # Write through the segment, read through the view, with no prefetch in between.
            fresh = _weights(layouts, 1, seed=100 + layer)[0]
            for t, nb in enumerate(lay.tensor_nbytes):
                for e in owned:
                    at = lay.segment_offset(layer, e, t)
                    emu.segments[r][at:at + nb] = fresh[t][e * nb:(e + 1) * nb]
            _check_view(lay, emu.read_view(r, layer), fresh, experts=owned)


def test_boundary_pages_belong_to_the_local_allocation():
    # nb = 3000 with g = 4096: expert 1 spans pages 0-1, so rank 1 (experts 2..3) has a boundary page
    # shared with remote expert 1 (page 1) and one shared with remote expert 4 (page 2).
    placement = build_placement(8, 4, 2)
    lay = CompositeLayout(placement, 1, 1, (3000,), PAGE)
    (ext,) = lay.extents(0, 0)
    assert (ext.first_page, ext.stop_page) == (6000 // PAGE, -(-12000 // PAGE)) == (1, 3)
    assert lay.backing_of(0, 5999)[0] == SEGMENT, "remote expert 1's bytes on the boundary page: local page"
    assert lay.backing_of(0, 12000)[0] == SEGMENT, "remote expert 4's first bytes share page 2"
    assert lay.backing_of(0, 4095)[0] == POOL
    # Remote bytes on the local extent: the prefetch fills them.
    assert lay.remote_bytes_in_extents(0) == (6000 - 4096) + (3 * 4096 - 12000)
    plan = build_composite_plan(composite_layouts(placement, 1, (3000,), PAGE), 1, 0, 4096)
    dst = {(s.dst_offset, s.dst_offset + s.nbytes) for s in plan.slices if s.expert in (1, 4)}
    assert any(a < 6000 <= b for a, b in dst) and any(a <= 12000 < b for a, b in dst)


def test_runs_sharing_a_page_merge_into_one_extent():
    # Rank 0 owns {0, 2} of 8 experts of 1000 bytes with g = 4096: one page holds 0..4, one extent.
    lay = CompositeLayout(_Owned(8, ((0, 2), (1, 3, 4, 5, 6, 7))), 0, 1, (1000,), PAGE)
    assert local_runs((0, 2), 8) == ((0, 1), (2, 3))
    (ext,) = lay.extents(0, 0)
    assert (ext.first_page, ext.stop_page, ext.experts) == (0, 1, (0, 2))
    assert lay.pool_pages == (1,)


class _Owned:
    """A placement stand-in with explicit ownership (the planner reads only these fields)."""

    def __init__(self, num_experts, owned):
        self.num_experts, self.owned, self.group_size = num_experts, owned, len(owned)


def test_wrapping_placement_gives_one_local_run_per_contiguous_range():
    placement = build_placement(8, 3, 4)  # rank 2 owns 5, 6, 7, 0
    assert placement.owned[2] == (0, 5, 6, 7)
    lay = CompositeLayout(placement, 2, 1, (PAGE,), PAGE)
    assert lay.runs == ((0, 1), (5, 8))
    assert [(x.first_page, x.stop_page) for x in lay.extents(0, 0)] == [(0, 1), (5, 8)]
    runs = [(m.view_offset // PAGE, m.nbytes // PAGE, m.backing) for m in lay.map_runs(0)]
    assert runs == [(0, 1, SEGMENT), (1, 4, POOL), (5, 3, SEGMENT)]


def test_slots_alternate_by_layer_parity():
    placement = build_placement(8, 2, 4)
    for num_slots in (2, 3):
        lay = CompositeLayout(placement, 0, 6, (5000, 3000), PAGE, num_slots=num_slots)
        for layer in range(6):
            pool = [m.file_offset // lay.pool_slot_nbytes for m in lay.map_runs(layer) if m.backing == POOL]
            assert pool and set(pool) == {layer % num_slots}, f"layer {layer}: pool runs in slots {pool}"
            assert build_composite_plan(composite_layouts(placement, 6, (5000, 3000), PAGE, num_slots), 0,
                                        layer, 4096).slot == layer % num_slots


def test_consecutive_layers_never_share_pool_pages():
    """Write-after-read at the page level: with 2 slots, refilling layer l + 1 must not touch any
    page layer l reads; layer l + 2 reuses layer l's pages."""
    placement = build_placement(7, 3, 3)
    layouts = composite_layouts(placement, 6, TENSOR_SETS["fp8"], PAGE, num_slots=2)
    emu = Emulator(layouts)
    weights = _weights(layouts, 6, seed=3)
    emu.load(weights)
    for r in range(3):
        for layer in range(5):
            emu.prefetch(r, layer, 777)
            before = emu.read_view(r, layer)
            emu.prefetch(r, layer + 1, 777)
            assert torch.equal(emu.read_view(r, layer), before), f"rank {r}: layer {layer + 1} overwrote layer {layer}"
            _check_view(layouts[r], emu.read_view(r, layer + 1), weights[layer + 1])


def test_map_runs_are_aligned_and_cover_each_view_once():
    for granularity in (PAGE, TWO_MIB, 4 * PAGE):
        placement = build_placement(16, 3, 8)
        for r in range(3):
            lay = CompositeLayout(placement, r, 4, TENSOR_SETS["mxfp4"], granularity, num_slots=2)
            for layer in range(4):
                runs = lay.map_runs(layer)
                at = 0
                for m in runs:
                    assert m.view_offset == at and m.nbytes > 0
                    assert m.view_offset % granularity == m.file_offset % granularity == m.nbytes % granularity == 0
                    limit = lay.segment_nbytes if m.backing == SEGMENT else lay.pool_nbytes
                    assert m.file_offset + m.nbytes <= limit, f"{m} past its backing of {limit} bytes"
                    at += m.nbytes
                assert at == lay.layer_nbytes


def test_pool_and_segment_sizes():
    placement = build_placement(8, 2, 4)
    lay = CompositeLayout(placement, 0, 5, (PAGE, 2 * PAGE), PAGE, num_slots=2)
    assert lay.view_pages == (8, 16)
    assert lay.extent_pages_per_layer == 4 + 8
    assert lay.segment_nbytes == 5 * 12 * PAGE
    assert lay.pool_pages == (4, 8) and lay.pool_nbytes == 2 * 12 * PAGE
    assert lay.remote_bytes_in_extents(0) == 0  # page-multiple experts: no shared page


def test_lost_peer_is_refilled_from_redundant_owners():
    placement = build_placement(6, 3, 4)  # every expert has two owners
    layouts = composite_layouts(placement, 2, TENSOR_SETS["bias"], PAGE)
    emu = Emulator(layouts)
    weights = _weights(layouts, 2, seed=11)
    emu.load(weights)
    sources = surviving_sources(placement, {1})
    emu.segments[1].fill_(0xEE)  # the lost rank's memory must not be read
    for r in (0, 2):
        plan = emu.prefetch(r, 1, 300, sources=sources[r])
        assert 1 not in plan.peers
        _check_view(layouts[r], emu.read_view(r, 1), weights[1])


def test_plan_interleaves_peers_slice_first():
    placement = build_placement(8, 4, 2)
    layouts = composite_layouts(placement, 1, (3000, 1000), PAGE)
    plan = build_composite_plan(layouts, 0, 0, 1000)
    assert [s.peer for s in plan.slices[:3]] == [1, 2, 3], "slices must start round-robin from rank + 1"


@pytest.mark.parametrize("kwargs,match", [
    (dict(granularity=0), "granularity=0"),
    (dict(num_slots=0), "num_slots=0"),
    (dict(tensor_nbytes=()), "tensor_nbytes is empty"),
    (dict(tensor_nbytes=(100, 0)), r"tensor_nbytes\[1\]=0"),
    (dict(rank=2), "rank=2"),
])
def test_bad_input_names_the_value(kwargs, match):
    args = dict(placement=build_placement(4, 2, 2), rank=0, num_layers=1, tensor_nbytes=(100,),
                granularity=PAGE)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        CompositeLayout(**args)


def test_segment_offset_refuses_a_remote_expert():
    lay = CompositeLayout(build_placement(4, 2, 2), 0, 1, (100,), PAGE)
    with pytest.raises(ValueError, match="does not own expert 3"):
        lay.segment_offset(0, 3, 0)
