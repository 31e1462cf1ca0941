import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dwdp.placement import build_placement
from dwdp.plan import PlanCache, SegmentLayout, build_copy_plan, pull_order, slot_layout

TENSOR_NBYTES = (6144, 3072)  # gate_up and down of one expert


def _plan(num_experts, group_size, rank, slice_bytes, layer=1, num_layers=3, local=None, nbytes=TENSOR_NBYTES):
    p = build_placement(num_experts, group_size, local)
    seg = SegmentLayout(num_layers, p.num_local_experts, nbytes)
    return p, seg, build_copy_plan(p, rank, layer, 0, seg, slice_bytes)


def _expected_transfers(p, seg, rank, layer, nbytes):
    """(src peer, src byte range, dst byte range) of every whole tensor the rank must receive."""
    layout = slot_layout(p, rank, nbytes)
    out = []
    for pi, peer in enumerate(layout.peers):
        for i, e in enumerate(layout.experts_by_peer[pi]):
            for t, n in enumerate(nbytes):
                src = seg.offset(layer, p.owned[peer].index(e), t)
                out.append((peer, src, layout.offset(pi, i, t), n, e))
    return out, layout


@settings(max_examples=150, deadline=None)
@given(
    num_experts=st.integers(2, 12),
    data=st.data(),
    slice_bytes=st.sampled_from([1, 1000, 1024, 3072, 4096, 5000, 6144, 1 << 20]),
)
def test_every_byte_copied_exactly_once(num_experts, data, slice_bytes):
    group_size = data.draw(st.integers(2, num_experts))
    rank = data.draw(st.integers(0, group_size - 1))
    nbytes = (96, 48) if slice_bytes == 1 else TENSOR_NBYTES
    p, seg, plan = _plan(num_experts, group_size, rank, slice_bytes, nbytes=nbytes)
    expected, layout = _expected_transfers(p, seg, rank, 1, nbytes)
    written = bytearray(layout.total_nbytes)
    for s in plan.slices:
        assert 1 <= s.nbytes <= slice_bytes
        for b in range(s.dst_offset, s.dst_offset + s.nbytes):
            written[b] += 1
    assert set(written) <= {1}, "some destination byte copied twice or never"
    assert len(written) == sum(n for *_, n, _ in expected)
    # Every slice reads the matching bytes of the matching source tensor.
    for peer, src, dst, n, e in expected:
        covering = [s for s in plan.slices if dst <= s.dst_offset < dst + n]
        assert sum(s.nbytes for s in covering) == n
        for s in covering:
            assert (s.peer, s.expert, s.src_offset - src) == (peer, e, s.dst_offset - dst), (s, peer, src, dst)
    assert plan.nbytes == len(p.missing_experts(rank)) * sum(nbytes)


def test_slices_interleave_peers_slice_offset_first():
    p, seg, plan = _plan(8, 4, rank=1, slice_bytes=2048)
    order = pull_order(1, 4)
    assert order == (2, 3, 0)
    # First round: slice 0 of each peer, in pull order starting at rank + 1.
    assert [s.peer for s in plan.slices[:3]] == [2, 3, 0]
    assert [s.peer for s in plan.slices[3:6]] == [2, 3, 0]
    first_of = {}
    for i, s in enumerate(plan.slices):
        first_of.setdefault(s.peer, i)
    assert first_of == {2: 0, 3: 1, 0: 2}


@pytest.mark.parametrize("rank", range(4))
def test_staggered_starts(rank):
    _, _, plan = _plan(8, 4, rank=rank, slice_bytes=4096)
    assert plan.slices[0].peer == (rank + 1) % 4, [s.peer for s in plan.slices[:4]]


def test_slice_not_dividing_tensor_leaves_short_last_slice():
    _, _, plan = _plan(4, 2, rank=0, slice_bytes=5000)
    sizes = [s.nbytes for s in plan.slices]
    # gate_up 6144 = 5000 + 1144, down 3072 = 3072, for each of the 2 missing experts
    assert sorted(sizes) == sorted([5000, 1144, 3072] * 2), sizes


def test_slice_larger_than_expert_is_one_slice_per_tensor():
    p, _, plan = _plan(4, 2, rank=0, slice_bytes=1 << 24)
    assert [s.nbytes for s in plan.slices] == [6144, 3072] * len(p.missing_experts(0))


def test_one_peer():
    p, seg, plan = _plan(6, 2, rank=1, slice_bytes=1024)
    assert plan.peers == (0,)
    assert plan.nbytes == 3 * sum(TENSOR_NBYTES)
    experts = [s.expert for s in plan.slices]
    # Expert-major within a source, so each expert becomes ready as early as possible.
    assert experts == sorted(experts), experts


def test_group_of_one_has_empty_plan():
    _, _, plan = _plan(4, 1, rank=0, slice_bytes=1024)
    assert plan.slices == () and plan.nbytes == 0


def test_plan_cache_builds_once_per_layer_and_slot():
    p = build_placement(8, 4)
    cache = PlanCache(p, 2, SegmentLayout(3, 2, TENSOR_NBYTES), 4096)
    a = cache.get(1, 0)
    assert cache.get(1, 0) is a
    assert cache.get(1, 1) is not a and cache.get(1, 1).slot == 1
    assert cache.get(2, 0).layer == 2


def test_layers_read_different_source_bytes():
    p = build_placement(8, 2)
    seg = SegmentLayout(3, 4, TENSOR_NBYTES)
    l0 = build_copy_plan(p, 0, 0, 0, seg, 4096)
    l2 = build_copy_plan(p, 0, 2, 0, seg, 4096)
    assert [s.src_offset + 2 * seg.layer_nbytes for s in l0.slices] == [s.src_offset for s in l2.slices]
    assert [s.dst_offset for s in l0.slices] == [s.dst_offset for s in l2.slices]
