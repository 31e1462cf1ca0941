import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dwdp.runtime.placement import build_placement
from dwdp.runtime.plan import PlanCache, SegmentLayout, build_copy_plan, pull_order

TENSOR_NBYTES = (6144, 3072)  # gate_up and down of one expert


def _plan(num_experts, group_size, rank, slice_bytes, layer=1, num_layers=3, local=None, nbytes=TENSOR_NBYTES):
    p = build_placement(num_experts, group_size, local)
    seg = SegmentLayout(num_layers, p.num_local_experts, nbytes)
    return p, seg, build_copy_plan(p, rank, layer, 0, seg, slice_bytes)


def _expert_bytes(num_layers, num_experts, nbytes, seed):
    """full[l][e][t]: seeded random uint8 bytes of tensor t of expert e in layer l."""
    gen = torch.Generator().manual_seed(seed)
    return [[[torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in nbytes]
             for _ in range(num_experts)] for _ in range(num_layers)]


def _segment(full, owned):
    """A rank's source segment as documented: per layer, [tensor 0 of its experts][tensor 1 of its experts]."""
    return torch.cat([full[l][e][t] for l in range(len(full)) for t in range(len(full[0][0])) for e in owned])


@settings(max_examples=150, deadline=None)
@given(
    num_experts=st.integers(2, 12),
    data=st.data(),
    slice_bytes=st.sampled_from([1, 1000, 1024, 3072, 4096, 5000, 6144, 1 << 20]),
)
def test_plan_fills_the_documented_slot_layout_with_the_right_bytes(num_experts, data, slice_bytes):
    """Run the plan on segments built from the documented layout and read the slot back by hand:
    per source peer in pull order (rank + 1, rank + 2, ...), tensor 0 of the experts pulled from it
    (ascending), then tensor 1. Every byte must be the pulled expert's own, written exactly once."""
    group_size = data.draw(st.integers(2, num_experts))
    rank = data.draw(st.integers(0, group_size - 1))
    local = data.draw(st.one_of(st.none(), st.integers(-(-num_experts // group_size), num_experts)))
    nbytes = (96, 48) if slice_bytes == 1 else TENSOR_NBYTES
    layer = 1
    p, _, plan = _plan(num_experts, group_size, rank, slice_bytes, layer=layer, local=local, nbytes=nbytes)
    full = _expert_bytes(3, num_experts, nbytes, seed=num_experts * 100 + rank)
    segments = [_segment(full, p.owned[r]) for r in range(group_size)]
    missing = [e for e in range(num_experts) if e not in p.owned[rank]]
    slot = torch.zeros(len(missing) * sum(nbytes), dtype=torch.uint8)
    written = torch.zeros(slot.numel(), dtype=torch.int32)
    for s in plan.slices:
        assert 1 <= s.nbytes <= slice_bytes, s
        slot[s.dst_offset : s.dst_offset + s.nbytes] = segments[s.peer][s.src_offset : s.src_offset + s.nbytes]
        written[s.dst_offset : s.dst_offset + s.nbytes] += 1
    assert written.eq(1).all(), f"slot bytes written {sorted(set(written.tolist()))} times, expected once each"
    offset = 0
    for k in range(1, group_size):
        peer = (rank + k) % group_size
        pulled = [e for e in missing if p.source[rank][e] == peer]
        for t, n in enumerate(nbytes):
            for e in pulled:
                assert torch.equal(slot[offset : offset + n], full[layer][e][t]), (
                    f"rank {rank}: slot bytes [{offset}, {offset + n}) are not tensor {t} of expert {e} from peer {peer}")
                offset += n
    assert offset == slot.numel() == plan.nbytes, (offset, slot.numel(), plan.nbytes)


def test_one_small_plan_by_hand():
    """E=4, G=2, 2 layers, tensors of 6 and 3 bytes, slices of 4, rank 0 pulling layer 1 from rank 1.
    Rank 1's segment per layer (18 bytes): gate_up e2 @0, gate_up e3 @6, down e2 @12, down e3 @15;
    layer 1 starts at 18. Rank 0's slot: gate_up e2 @0, e3 @6, down e2 @12, e3 @15. Expert-major."""
    p = build_placement(4, 2)
    plan = build_copy_plan(p, 0, 1, 0, SegmentLayout(2, 2, (6, 3)), 4)
    got = [(s.peer, s.src_offset, s.dst_offset, s.nbytes, s.expert) for s in plan.slices]
    assert got == [
        (1, 18, 0, 4, 2), (1, 22, 4, 2, 2), (1, 30, 12, 3, 2),
        (1, 24, 6, 4, 3), (1, 28, 10, 2, 3), (1, 33, 15, 3, 3),
    ], got


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


@settings(max_examples=120, deadline=None)
@given(
    num_experts=st.integers(2, 12),
    data=st.data(),
    slice_bytes=st.sampled_from([1000, 1024, 3072, 5000, 1 << 20]),
    nbytes=st.sampled_from([TENSOR_NBYTES, (4096,), (3000, 1700, 16)]),
)
def test_coalesce_merges_only_neighbouring_contiguous_slices_of_one_peer(num_experts, data, slice_bytes, nbytes):
    """Each copy is a run of consecutive slices of the plan from one peer whose source and
    destination bytes continue each other, and no two neighbouring copies could have been one: the
    same bytes move, and wherever the plan alternates peers each slice stays its own copy."""
    from dwdp.runtime.plan import coalesce

    group_size = data.draw(st.integers(2, num_experts))
    rank = data.draw(st.integers(0, group_size - 1))
    local = data.draw(st.integers(-(-num_experts // group_size), num_experts))
    _, _, plan = _plan(num_experts, group_size, rank, slice_bytes, local=local, nbytes=nbytes)
    copies = coalesce(plan.slices)
    rest = list(plan.slices)
    for peer, src, dst, n in copies:
        run_bytes = 0
        while run_bytes < n:
            s = rest.pop(0)
            assert (s.peer, s.src_offset, s.dst_offset) == (peer, src + run_bytes, dst + run_bytes), (s, (peer, src, dst))
            run_bytes += s.nbytes
        assert run_bytes == n, f"copy {(peer, src, dst, n)} ends inside a slice"
    assert not rest, f"{len(rest)} slices left over"
    for (p0, s0, d0, n0), (p1, s1, d1, _) in zip(copies, copies[1:]):
        assert not (p0 == p1 and s0 + n0 == s1 and d0 + n0 == d1), "two neighbouring copies should have been one"
    alternations = sum(a.peer != b.peer for a, b in zip(plan.slices, plan.slices[1:]))
    assert len(copies) >= alternations + bool(plan.slices), "a copy spans slices of two peers"


def test_coalesce_one_source_is_one_copy_per_tensor_and_round_robin_keeps_every_slice():
    from dwdp.runtime.plan import coalesce

    _, seg, plan = _plan(8, 2, 0, 1000)  # one source: each expert's tensors are slice runs
    assert len(coalesce(plan.slices)) == 4 * len(TENSOR_NBYTES) < len(plan.slices)
    _, _, plan = _plan(9, 3, 1, 1000)    # two sources with equal streams: peers alternate throughout
    assert len(coalesce(plan.slices)) == len(plan.slices)


def test_coalesce_keeps_apart_what_only_looks_contiguous():
    from dwdp.runtime.plan import CopySlice, coalesce

    other_peer = (CopySlice(1, 0, 0, 100, 0), CopySlice(2, 100, 100, 100, 0))    # same offsets, two segments
    dst_jumps = (CopySlice(1, 0, 0, 100, 0), CopySlice(1, 100, 500, 100, 0))     # source continues, slot does not
    src_jumps = (CopySlice(1, 0, 0, 100, 0), CopySlice(1, 900, 100, 100, 0))     # slot continues, source does not
    for slices in (other_peer, dst_jumps, src_jumps):
        assert coalesce(slices) == [(s.peer, s.src_offset, s.dst_offset, s.nbytes) for s in slices], slices
    merged = (CopySlice(1, 0, 0, 100, 0), CopySlice(1, 100, 100, 60, 1), CopySlice(1, 160, 160, 1, 1))
    assert coalesce(merged) == [(1, 0, 0, 161)]
    assert coalesce(()) == []
