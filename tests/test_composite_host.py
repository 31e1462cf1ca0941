"""Host composite views over real /dev/shm segments and a memfd pool, mapped with MAP_FIXED: the views
hold the unwrapped experts' bytes after the host transport runs the composite plans, local experts are
the segment's own pages (a write through either side shows through the other at once), and a second
slot keeps a running layer's pages from being refilled.

Legend: E = experts, G = ranks, H = hidden, I = expert intermediate size.
"""
from __future__ import annotations

import os

import pytest
import torch

from dwdp.runtime.composite import build_composite_plan, composite_layouts
from dwdp.runtime.placement import build_placement, surviving_sources
from dwdp.runtime.transport.host import HostTransport, connect_in_process
from dwdp.runtime.transport.host_composite import (HostCompositeViews, Reservation, composite_unsupported_reason,
                                                   page_size)

pytestmark = pytest.mark.skipif(composite_unsupported_reason() is not None,
                                reason=str(composite_unsupported_reason()))

H, I = 40, 24
# (dtype, one expert's shape) of each moving tensor: bf16 gate_up and down (not page multiples),
# fp8 weights with fp32 block scales, MXFP4 blocks with uint8 scales, a moving bias.
TENSORS = {
    "bf16": ((torch.bfloat16, (2 * I, H)), (torch.bfloat16, (H, I))),
    "fp8": ((torch.float8_e4m3fn, (64, 48)), (torch.float32, (4, 3)), (torch.float8_e4m3fn, (48, 32)),
            (torch.float32, (3, 2))),
    "mxfp4_bias": ((torch.uint8, (64, 3, 16)), (torch.uint8, (64, 3)), (torch.bfloat16, (64,)),
                   (torch.uint8, (96, 1, 16)), (torch.uint8, (96, 1))),
}


def _nbytes(dtype, shape):
    n = dtype.itemsize
    for s in shape:
        n *= s
    return n


def _random(dtype, shape, gen):
    """Fresh random bytes of `dtype` (every bit pattern of uint8 is a value; NaN payloads compare as bytes)."""
    return torch.randint(0, 256, (_nbytes(dtype, shape),), dtype=torch.uint8, generator=gen).view(dtype).view(shape)


class Group:
    """G in-process ranks: host transports, composite layouts, views and the unwrapped experts."""

    def __init__(self, E, G, L, tensors, num_layers, granularity=None, num_slots=2, seed=0):
        self.tensors = TENSORS[tensors]
        self.E, self.num_layers = E, num_layers
        self.placement = build_placement(E, G, L)
        nbytes = tuple(_nbytes(d, s) for d, s in self.tensors)
        self.layouts = composite_layouts(self.placement, num_layers, nbytes, granularity or page_size(), num_slots)
        gen = torch.Generator().manual_seed(seed)
        # The unwrapped model's stacked experts: [E, *shape] per (layer, tensor).
        self.stacked = [[_random(d, (E, *s), gen) for d, s in self.tensors] for _ in range(num_layers)]
        self.transports = [HostTransport(r, inflight=1, min_batch_bytes=1 << 30) for r in range(G)]
        self.segments, self.views = [], []
        for r, (tr, lay) in enumerate(zip(self.transports, self.layouts)):
            seg = tr.alloc_segment(lay.segment_nbytes)
            self.segments.append(seg)
            fd = tr.segment_fd()
            try:
                self.views.append(HostCompositeViews(lay, fd))
            finally:
                os.close(fd)
            for layer in range(num_layers):  # what loading does: owned experts into the segment
                for t, w in enumerate(self.stacked[layer]):
                    for e in self.placement.owned[r]:
                        at = lay.segment_offset(layer, e, t)
                        seg[at:at + lay.tensor_nbytes[t]] = w[e].reshape(-1).view(torch.uint8)
        connect_in_process(self.transports)

    def view(self, rank, layer, t):
        dtype, shape = self.tensors[t]
        return self.views[rank].view(layer, t, dtype, (self.E, *shape))

    def prefetch(self, rank, layer, slice_bytes=1024, sources=None):
        plan = build_composite_plan(self.layouts, rank, layer, slice_bytes, sources)
        ticket = self.transports[rank].submit(plan, self.views[rank].layer_range(layer))
        ticket.wait(timeout=30)
        return plan

    def assert_view_matches(self, rank, layer):
        for t in range(len(self.tensors)):
            got = self.view(rank, layer, t).view(torch.uint8)
            want = self.stacked[layer][t].view(torch.uint8)
            bad = [e for e in range(self.E) if not torch.equal(got[e], want[e])]
            assert not bad, f"rank {rank} layer {layer} tensor {t}: experts {bad} differ from the unwrapped model"

    def close(self):
        for tr in self.transports:
            tr.close()


@pytest.fixture
def group_factory():
    made = []

    def make(*args, **kwargs):
        made.append(Group(*args, **kwargs))
        return made[-1]

    yield make
    for g in made:
        g.close()


@pytest.mark.parametrize("E,G,L,tensors,granularity", [
    (8, 2, 4, "bf16", None),          # disjoint halves, experts not page multiples
    (7, 3, 3, "fp8", None),           # G does not divide E: redundant experts, fp8 + scales
    (8, 3, 4, "mxfp4_bias", None),    # wrapping run on rank 2, MXFP4 blocks + scales + a bias
    (6, 4, 3, "bf16", 4 * 4096),      # heavy redundancy, granularity of 4 pages
    (8, 2, 4, "bf16", 2 << 20),       # the CUDA granularity: every view is one page
])
def test_views_hold_the_unwrapped_experts(group_factory, E, G, L, tensors, granularity):
    if granularity and granularity % page_size():
        pytest.skip(f"granularity {granularity} is not a multiple of this page size {page_size()}")
    g = group_factory(E, G, L, tensors, num_layers=3, granularity=granularity, seed=E * G)
    for layer in range(3):
        for r in range(G):
            g.prefetch(r, layer)
            g.assert_view_matches(r, layer)


def test_writes_through_segment_and_view_show_through_the_other(group_factory):
    g = group_factory(8, 2, 4, "bf16", num_layers=2, seed=1)
    gen = torch.Generator().manual_seed(2)
    lay = g.layouts[0]
    for layer in range(2):
        for t, (dtype, shape) in enumerate(g.tensors):
            view = g.view(0, layer, t)
            for e in g.placement.owned[0]:
                fresh = _random(dtype, shape, gen)
                at = lay.segment_offset(layer, e, t)
                g.segments[0][at:at + lay.tensor_nbytes[t]] = fresh.reshape(-1).view(torch.uint8)
                assert torch.equal(view[e].view(torch.uint8), fresh.view(torch.uint8)), \
                    f"layer {layer} tensor {t} expert {e}: a segment write is not visible in the view"
                back = _random(dtype, shape, gen)
                view[e].view(torch.uint8).copy_(back.view(torch.uint8))
                seg_bytes = g.segments[0][at:at + lay.tensor_nbytes[t]]
                assert torch.equal(seg_bytes, back.reshape(-1).view(torch.uint8)), \
                    f"layer {layer} tensor {t} expert {e}: a view write is not in the segment"
    # And the peer copies what the view wrote: rank 1 pulls rank 0's experts from the segment.
    for layer in range(2):
        g.stacked[layer] = [g.view(0, layer, t).clone() for t in range(len(g.tensors))]
        g.prefetch(1, layer)
        for t in range(len(g.tensors)):
            for e in g.placement.owned[0]:
                assert torch.equal(g.view(1, layer, t)[e].view(torch.uint8), g.stacked[layer][t][e].view(torch.uint8))


def test_prefetch_lands_in_pool_slot_pages_and_boundary_pages(group_factory):
    g = group_factory(8, 4, 2, "bf16", num_layers=2, seed=3)
    lay = g.layouts[1]
    assert lay.remote_bytes_in_extents(0) > 0, "this case needs boundary pages shared with remote experts"
    before = g.segments[1].clone()
    g.prefetch(1, 0)
    g.assert_view_matches(1, 0)
    changed = (g.segments[1] != before).nonzero().flatten()
    # The prefetch wrote into the rank's own segment only on its extents' remote bytes.
    for at in changed.tolist():
        assert all(not (lay.segment_offset(0, e, t) <= at < lay.segment_offset(0, e, t) + nb)
                   for t, nb in enumerate(lay.tensor_nbytes) for e in g.placement.owned[1]), \
            f"segment byte {at} of an owned expert changed: a local expert was overwritten"


def test_next_layer_refill_leaves_the_running_layer_alone(group_factory):
    """Write-after-read over many layers with 2 slots: layer l + 1's prefetch never touches the
    pages layer l reads; layer l + 2 reuses them, after layer l is done."""
    g = group_factory(7, 3, 3, "fp8", num_layers=10, seed=4)
    for r in range(3):
        g.prefetch(r, 0)
        for layer in range(9):
            running = [g.view(r, layer, t).view(torch.uint8).clone() for t in range(len(g.tensors))]
            g.prefetch(r, layer + 1)
            for t in range(len(g.tensors)):
                assert torch.equal(g.view(r, layer, t).view(torch.uint8), running[t]), \
                    f"rank {r}: prefetch of layer {layer + 1} changed tensor {t} of running layer {layer}"
            g.assert_view_matches(r, layer + 1)
        # Parity: once layer 9 is in, layer 7 (same slot) shows layer 9's remote bytes.
        lay, nb = g.layouts[r], g.layouts[r].tensor_nbytes[0]
        remote = next(e for e in g.placement.missing_experts(r)
                      if lay.backing_of(7, e * nb)[0] == lay.backing_of(7, (e + 1) * nb - 1)[0] == "pool")
        assert torch.equal(g.view(r, 7, 0)[remote].view(torch.uint8), g.stacked[9][0][remote].view(torch.uint8))


def test_lost_peer_views_refilled_from_redundant_owners(group_factory):
    g = group_factory(6, 3, 4, "bf16", num_layers=2, seed=5)
    sources = surviving_sources(g.placement, {2})
    g.transports[0].forget_peer(2)
    for layer in range(2):
        plan = g.prefetch(0, layer, sources=sources[0])
        assert 2 not in plan.peers
        g.assert_view_matches(0, layer)


def test_views_outlive_the_views_object_and_the_transport(group_factory):
    g = group_factory(8, 2, 4, "bf16", num_layers=1, seed=6)
    g.prefetch(0, 0)
    view = g.view(0, 0, 1)
    want = g.stacked[0][1].view(torch.uint8).clone()
    g.views[0] = None
    g.transports[0].close()
    assert torch.equal(view.view(torch.uint8), want)  # the mapping lives as long as a tensor over it


@pytest.mark.parametrize("kwargs,match", [
    (dict(offset=1, nbytes=4096, file_offset=0), "multiple of the page size"),
    (dict(offset=0, nbytes=4096, file_offset=100), "multiple of the page size"),
    (dict(offset=4096, nbytes=4096, file_offset=0), "outside the range"),
])
def test_map_fixed_refuses_unaligned_or_outside(kwargs, match):
    if page_size() != 4096:
        pytest.skip("cases written for 4 KiB pages")
    res = Reservation(4096)
    fd = os.memfd_create("dwdp-test")
    try:
        os.ftruncate(fd, 8192)
        with pytest.raises(ValueError, match=match):
            res.map_fixed(fd=fd, **kwargs)
    finally:
        os.close(fd)


def test_granularity_not_a_page_multiple_is_refused():
    lay = composite_layouts(build_placement(4, 2, 2), 1, (100,), 1000)[0]
    fd = os.memfd_create("dwdp-test")
    try:
        with pytest.raises(ValueError, match="granularity=1000"):
            HostCompositeViews(lay, fd)
    finally:
        os.close(fd)
