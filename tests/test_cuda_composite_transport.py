"""The cuda transport with VMM mappings and composite views, on a CPU through both recording fakes:
tests/fake_cuda.py (runtime API: streams, events, copies by memmove) and tests/fake_cuda_vmm.py's
HostBackedDriver (driver API: cuMem allocations that are memfds mapped at the addresses handed out).
Ranks live in one process, each with a driver of its own; POSIX fds move with the real pidfd_getfd.
These check the calls and bytes as written, not a device; the same code ran on one H200 (bench/README.md).

Legend: g = granularity, E = experts, G = ranks.
"""
from __future__ import annotations

import gc
import os
import threading

import pytest
import torch
from cuda.bindings import driver as real

from dwdp.runtime.composite import build_composite_plan, composite_layouts
from dwdp.runtime.placement import build_placement
from dwdp.runtime.transport.base import PrefetchError
from dwdp.runtime.transport.cuda import CudaTransport
from fake_cuda import FakeCudaApi, FakeDevice
from fake_cuda_vmm import GRANULARITY, HostBackedDriver
from test_composite_layout import PLACEMENTS, TENSOR_SETS

PAGE = 4096
CASES = {  # granularity, bytes of one expert's tensors (not multiples of g: boundary pages are shared)
    "page": (PAGE, (3000, 1700)),
    "2MiB": (GRANULARITY, (700_001, 300_003)),
}


class VmmGroup:
    """G cuda transports with mapping='vmm-posix-fd', segments filled with the owned experts of
    seeded [E * nb] tensors, handles exchanged as the setup's all-gather would, opened and sealed."""

    def __init__(self, case="page", E=8, G=3, L=None, num_layers=2, slice_bytes=1000, gpu: int | None = None):
        g, self.nbytes = CASES[case] if isinstance(case, str) else case  # a name, or (granularity, nbytes)
        self.E, self.G, self.num_layers, self.slice_bytes = E, G, num_layers, slice_bytes
        self.placement = build_placement(E, G, L)
        self.layouts = composite_layouts(self.placement, num_layers, self.nbytes, g, num_slots=2)
        gen = torch.Generator().manual_seed(11)
        self.stacked = [[torch.randint(0, 256, (E * nb,), dtype=torch.uint8, generator=gen) for nb in self.nbytes]
                        for _ in range(num_layers)]  # [layer][tensor]: the unwrapped model's bytes
        self.device = FakeDevice()
        self.drivers = [HostBackedDriver(g) for _ in range(G)]
        # gpu: every rank's device (its streams and events are that device's); None: "cpu", device 0's.
        self.apis = [FakeCudaApi(self.device, r, gpu=gpu or 0) for r in range(G)]
        where = "cpu" if gpu is None else f"cuda:{gpu}"
        self.transports = [CudaTransport(r, where, copy="batch", copy_batches=3, mapping="vmm-posix-fd",
                                         api=self.apis[r], driver=self.drivers[r]) for r in range(G)]
        self.segments, self.views = [], []
        for r, t in enumerate(self.transports):
            layout = self.layouts[r]
            segment = t.alloc_segment(layout.segment_nbytes, tuple(a.nbytes for a in layout.segment_allocations))
            self.views.append(t.composite_views(layout))
            for layer in range(num_layers):
                for k, nb in enumerate(self.nbytes):
                    for e in self.placement.owned[r]:
                        at = layout.segment_offset(layer, e, k)
                        segment[at:at + nb] = self.stacked[layer][k][e * nb:(e + 1) * nb]
            self.segments.append(segment)
        self.setup_calls = [len(d.names()) for d in self.drivers]
        self.handles = [t.register() for t in self.transports]

    def open(self):
        for t in self.transports:
            t.open(self.handles)
        for t in self.transports:  # after the setup barrier
            t.seal()
        return self

    def prefetch(self, rank: int, layer: int):
        plan = build_composite_plan(self.layouts, rank, layer, self.slice_bytes)
        ticket = self.transports[rank].submit(plan, self.views[rank].layer_range(layer))
        ticket.synchronize(5.0)
        return plan

    def view_bytes(self, rank: int, layer: int, k: int) -> torch.Tensor:
        return self.views[rank].view(layer, k, torch.uint8, (self.E * self.nbytes[k],))

    def close(self):
        for t in self.transports:
            t.close()


def _open_fds() -> set[int]:
    return set(int(x) for x in os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("E,G,L", [(8, 3, None), (7, 3, 3), (8, 2, 5)])  # even, non-dividing, redundant
def test_prefetch_fills_the_views_bit_exact_and_local_experts_are_never_copied(case, E, G, L):
    group = VmmGroup(case, E, G, L).open()
    for r in range(G):
        for layer in range(group.num_layers):
            group.prefetch(r, layer)
            for k in range(len(group.nbytes)):
                assert torch.equal(group.view_bytes(r, layer, k), group.stacked[layer][k]), (r, layer, k)
    # Zero copy: a write through the segment is what the view reads, at once.
    layout, r = group.layouts[0], 0
    e = group.placement.owned[r][0]
    at = layout.segment_offset(1, e, 0)
    group.segments[r][at:at + 16] = torch.arange(16, dtype=torch.uint8)
    nb = group.nbytes[0]
    assert torch.equal(group.view_bytes(r, 1, 0)[e * nb:e * nb + 16], torch.arange(16, dtype=torch.uint8))
    group.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_copies_write_inside_the_views_and_read_inside_the_peers_imports(case):
    group = VmmGroup(case).open()
    rank, layer = 1, 1
    t, views, layout = group.transports[rank], group.views[rank], group.layouts[rank]
    start = len(group.device.calls)
    plan = group.prefetch(rank, layer)
    batches = [args for r, name, args in group.device.calls[start:] if r == rank and name == "prepare_batch"]
    assert batches, "no copy was prepared"
    lo = views.layer_pointer(layer)
    imports = {p: t.mapper.peer_ranges[p] for p in range(group.G) if p != rank}
    owned = set(group.placement.owned[rank])
    copied = 0
    for dsts, srcs, sizes, _ in batches:
        for dst, src, n in zip(dsts, srcs, sizes):
            copied += n
            assert lo <= dst and dst + n <= lo + layout.layer_nbytes, "a copy writes outside the layer's views"
            assert any(m.ptr <= src and src + n <= m.ptr + m.nbytes for m in imports.values()), \
                "a copy reads outside every peer's imported mapping"
            # Never onto a local expert's bytes: those are the segment itself.
            off = dst - lo
            k = max(i for i, s in enumerate(layout.view_start) if s <= off)
            nb = group.nbytes[k]
            first, last = (off - layout.view_start[k]) // nb, (off + n - 1 - layout.view_start[k]) // nb
            assert not owned & set(range(first, last + 1)), f"a copy writes local experts {owned & set(range(first, last + 1))}"
    assert copied == plan.nbytes


@pytest.mark.parametrize("case", sorted(CASES))
def test_call_sequence_sizes_alignments_and_one_set_access_per_range(case):
    group = VmmGroup(case).open()
    g = group.layouts[0].granularity
    for r, driver in enumerate(group.drivers):
        layout, names = group.layouts[r], driver.names()
        assert not driver.errors, driver.errors
        # Setup: the segment's allocations (created, mapped whole and back to back, one set-access), the
        # views' pool gaps, the exports, then per peer its imports, one reserve, their maps, one set-access.
        own = [a.nbytes for a in layout.segment_allocations]
        creates = [args for name, args in driver.calls if name == "cuMemCreate"]
        assert [size for size, _, _ in creates] == own + [a.nbytes for a in layout.pool_allocations]
        assert all(prop.requestedHandleTypes == real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                   for _, prop, _ in creates[:len(own)])
        maps = [args for name, args in driver.calls if name == "cuMemMap"]
        assert all(offset == 0 for _, _, offset, _, _ in maps), "a piece of an allocation was mapped"
        assert names.count("cuMemExportToShareableHandle") == len(own)
        peers_allocations = sum(len(group.layouts[p].segment_allocations) for p in range(group.G) if p != r)
        assert names.count("cuMemImportFromShareableHandle") == peers_allocations
        for name, args in driver.calls:
            if name == "cuMemAddressReserve":
                size, alignment, _, _ = args
                assert size % g == 0 and alignment == g
        # One set-access per reserved range, covering it whole: the segment, each layer's views, each import.
        ranges = sorted(driver.reserved.items())
        own_range = group.transports[r].mapper.own_range
        layer_ranges = [(group.views[r].layer_pointer(x), layout.layer_nbytes) for x in range(layout.num_layers)]
        imports = [(m.ptr, m.nbytes) for m in group.transports[r].mapper.peer_ranges.values()]
        assert sorted(driver.access) == sorted([(own_range.ptr, own_range.nbytes), *layer_ranges, *imports])
        assert len(driver.access) == 1 + layout.num_layers + group.G - 1
        assert len(ranges) == 1 + 1 + group.G - 1  # the segment, the views (all layers), each import
    group.close()


def test_seal_closes_the_exported_fds_and_close_releases_everything_in_reverse():
    before = _open_fds()
    group = VmmGroup("page")
    exported = [fd for h in group.handles for fd in h["fds"]]
    assert all(h["pid"] == os.getpid() and h["allocations"] for h in group.handles)
    group.open()
    for fd in exported:
        with pytest.raises(OSError):
            os.fstat(fd)  # sealed: the exporter's fds are closed (each peer holds its own imports)
    group.prefetch(0, 0)
    marks = [len(d.names()) for d in group.drivers]
    group.close()
    for r, driver in enumerate(group.drivers):
        assert not driver.errors, driver.errors
        assert not driver.mapped and not driver.reserved and not driver.memory, f"rank {r} left something behind"
        tail = driver.names()[marks[r]:]
        layout = group.layouts[r]
        maps = sum(len(layout.map_runs(x)) for x in range(group.num_layers))

        def range_teardown(count):  # map_back_to_back's reverse, then the handles
            return ["cuMemUnmap"] * count + ["cuMemAddressFree"] + ["cuMemRelease"] * count

        imports = [range_teardown(len(group.layouts[p].segment_allocations))
                   for p in reversed(range(group.G)) if p != r]
        # The reverse of setup: imports (last opened first), the views, then the segment.
        want = [n for names in imports for n in names] + ["cuMemUnmap"] * maps + ["cuMemAddressFree"] + \
            ["cuMemRelease"] * len(layout.pool_allocations) + range_teardown(len(layout.segment_allocations)) + \
            ["cuDeviceGet", "cuDevicePrimaryCtxRelease"]  # the primary context Vmm retained (no torch here)
        assert tail == want, tail
        assert driver.retained == 0
    del group, driver  # the fake's own mmaps hold a descriptor each until they are freed
    gc.collect()
    assert _open_fds() <= before, "file descriptors leaked"


def test_every_imported_fd_is_closed_right_after_its_import(monkeypatch):
    from dwdp.runtime.transport import cuda_vmm_peers

    taken = []  # (fd, inode) of every descriptor taken from a peer

    def recording(handle, *args, **kwargs):
        fds, how = cuda_vmm_take_fds(handle, *args, **kwargs)
        taken.extend((fd, os.fstat(fd).st_ino) for fd in fds)
        return fds, how

    from dwdp.runtime.transport.cuda_vmm import take_fds as cuda_vmm_take_fds

    monkeypatch.setattr(cuda_vmm_peers, "take_fds", recording)
    group = VmmGroup("page").open()
    assert len(taken) == sum(len(group.layouts[p].segment_allocations) for p in range(group.G)) * (group.G - 1)
    for fd, inode in taken:  # closed, or its number reused for another file since
        try:
            still = os.fstat(fd).st_ino == inode
        except OSError:
            still = False
        assert not still, f"descriptor {fd} taken from a peer is still open after its import"
    group.close()


def test_where_pidfd_getfd_is_refused_the_fds_go_over_the_socket_until_seal(monkeypatch, caplog):
    import errno
    import logging
    import threading

    from dwdp.runtime.transport import cuda_vmm
    from dwdp.runtime.transport.cuda_vmm import fetch_fds

    def refused(pid, fds):
        raise OSError(errno.EPERM, "Operation not permitted (seccomp)")

    monkeypatch.setattr(cuda_vmm, "pidfd_getfds", refused)
    before, threads = _open_fds(), threading.active_count()
    group = VmmGroup("2MiB")
    names = [h["socket"] for h in group.handles]
    from dwdp.runtime.transport.cuda_vmm import pid_namespace

    assert all(name.startswith(f"dwdp-vmm-{pid_namespace()}-{os.getpid()}-") for name in names), names
    assert len(set(names)) == group.G
    with caplog.at_level(logging.INFO, logger="dwdp"):
        group.open()
    lines = [r.getMessage() for r in caplog.records if "cuda transport on" in r.getMessage()]
    assert len(lines) == group.G and all("socket (pidfd_getfd: EPERM)" in line for line in lines), lines
    for r in range(group.G):
        group.prefetch(r, 1)
        for k in range(len(group.nbytes)):
            assert torch.equal(group.view_bytes(r, 1, k), group.stacked[1][k]), (r, k)
    for name in names:  # sealed: nobody serves the fds any more
        with pytest.raises(OSError):
            fetch_fds(name, timeout_s=1.0)
    assert threading.active_count() == threads, "a server thread outlived seal"
    group.close()
    del group
    gc.collect()
    assert _open_fds() <= before, "file descriptors leaked"


def test_a_peer_whose_fds_cannot_be_taken_is_named_and_nothing_leaks():
    before = _open_fds()
    group = VmmGroup("page")
    bad = dict(group.handles[2], fds=[fd + 10_000 for fd in group.handles[2]["fds"]])  # not open in that process
    handles = [*group.handles[:2], bad]
    with pytest.raises(PrefetchError, match=r"rank 0: cannot import the segment of peer 2 .*pidfd_getfd"):
        group.transports[0].open(handles)
    assert group.drivers[0].names().count("cuMemImportFromShareableHandle") == \
        len(group.layouts[1].segment_allocations)  # peer 1's, then released
    for t in group.transports:
        t.close()
    for driver in group.drivers:
        assert not driver.mapped and not driver.reserved and not driver.memory and not driver.errors
    del group, driver, bad, handles, t  # the fake's own mmaps hold a descriptor each until they are freed
    gc.collect()
    assert _open_fds() <= before, "file descriptors leaked"


def test_forgetting_a_peer_releases_its_import_once_its_copies_have_run():
    group = VmmGroup("page").open()
    t, driver = group.transports[0], group.drivers[0]
    peer = 1
    imported = t.mapper.peer_ranges[peer]
    group.device.stalled.add(t._stream)  # a copy from the peer is still on the copy stream
    plan = build_composite_plan(group.layouts, 0, 0, group.slice_bytes)
    t.submit(plan, group.views[0].layer_range(0))
    t.forget_peer(peer)
    assert imported.ptr in driver.mapped, "unmapped under a copy still in flight"
    group.device.stalled.clear()
    group.device.run()
    t._unmap_landed()
    assert imported.ptr not in driver.mapped and not set(imported.handles) & set(driver.memory)
    assert peer not in t.mapper.peer_ranges
    group.close()
    assert not group.drivers[0].errors and not group.drivers[0].memory


def test_close_releases_the_import_of_a_peer_forgotten_while_its_copies_ran():
    """A lost peer's import still behind its fence when the transport closes goes with the close, once
    the copy stream drained (nobody polls the fence in between)."""
    group = VmmGroup("page").open()
    t, driver = group.transports[0], group.drivers[0]
    imported = t.mapper.peer_ranges[1]
    group.device.stalled.add(t._stream)
    t.submit(build_composite_plan(group.layouts, 0, 0, group.slice_bytes), group.views[0].layer_range(0))
    t.forget_peer(1)
    group.device.stalled.clear()
    t.close()
    assert imported.ptr not in driver.mapped and not set(imported.handles) & set(driver.memory), \
        "the retired import outlived close"
    group.close()
    assert not driver.errors and not driver.memory and not driver.mapped, (driver.errors, driver.mapped)


def test_composite_views_need_a_vmm_mapping():
    device = FakeDevice()
    t = CudaTransport(0, "cpu", mapping="ipc", api=FakeCudaApi(device, 0))
    t.alloc_segment(4096)
    with pytest.raises(ValueError, match="mapping='ipc' has no cuMem granularity"):
        t.granularity()
    with pytest.raises(ValueError, match="allocations= needs 'vmm-posix-fd'"):
        CudaTransport(1, "cpu", mapping="ipc", api=FakeCudaApi(device, 1)).alloc_segment(4096, (4096,))
    with pytest.raises(RuntimeError, match="needs a VMM segment"):
        t.composite_views(composite_layouts(build_placement(4, 2), 1, (100,), PAGE)[0])
    t.close()
    with pytest.raises(ValueError, match="mapping='nvlink' must be"):
        CudaTransport(0, "cpu", mapping="nvlink", api=FakeCudaApi(device, 0))


FAKED = ["cuMemCreate", "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle", "cuMemAddressReserve",
         "cuMemMap", "cuMemUnmap", "cuMemAddressFree", "cuMemRelease"]


@pytest.mark.parametrize("name", FAKED)
def test_host_backed_fake_keeps_the_real_signatures(name):
    import inspect

    want = list(inspect.signature(getattr(real, name)).parameters)
    got = list(inspect.signature(getattr(HostBackedDriver, name)).parameters)[1:]  # less self
    assert got == want, f"{name}: fake takes {got}, the bindings take {want}"


@pytest.mark.no_cuda_driver
def test_every_driver_call_of_the_lifecycle_gets_the_no_driver_error_from_the_real_bindings():
    """The real bindings check argument types before they load libcuda (a wrong type is a TypeError
    here, V): every call the transport made, replayed with its arguments, must reach the driver load."""
    from dwdp.runtime.transport.cuda_api import NoCudaDriverError, _check_driver

    group = VmmGroup("page").open()
    group.prefetch(0, 0)
    group.transports[0].forget_peer(2)
    group.close()
    calls = [call for driver in group.drivers for call in driver.calls]
    names = {name for name, _ in calls}
    assert set(FAKED) | {"cuMemGetAllocationGranularity", "cuMemSetAccess"} <= names, sorted(names)
    for name, args in calls:
        if name == "cuMemImportFromShareableHandle":
            args = (3, args[1])  # the fd it was given is closed by now; any int is one to the bindings
        with pytest.raises(NoCudaDriverError):
            _check_driver(name, getattr(real, name), *args)
    fabric = real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC  # the fabric import takes the 64 bytes
    with pytest.raises(NoCudaDriverError):
        _check_driver("cuMemImportFromShareableHandle", real.cuMemImportFromShareableHandle, bytes(64), fabric)


# Every layout case of tests/test_composite_layout.py at the page size, and its 2 MiB cases, built on the
# strict fakes through the transport: experts that are and are not multiples of g, redundant, wrapping
# and one-rank placements, biases, fp8 and MXFP4 scales.
STRICT_CASES = [(*p, t, PAGE) for p in PLACEMENTS for t in sorted(TENSOR_SETS)] + [
    (8, 2, 4, "bf16_odd", GRANULARITY), (7, 3, 3, "fp8", GRANULARITY), (16, 3, 8, "bias", GRANULARITY)]


@pytest.mark.parametrize("E,G,L,tensors,granularity", STRICT_CASES)
def test_every_layout_case_builds_on_the_strict_fakes_and_the_views_hold_the_experts(E, G, L, tensors, granularity):
    group = VmmGroup((granularity, TENSOR_SETS[tensors]), E, G, L, num_layers=3, slice_bytes=1000).open()
    for r in range(G):
        for layer in range(group.num_layers):
            group.prefetch(r, layer)
            for k in range(len(group.nbytes)):
                assert torch.equal(group.view_bytes(r, layer, k), group.stacked[layer][k]), (r, layer, k)
        assert not group.drivers[r].errors, group.drivers[r].errors
    group.close()


def _unmaps_so_far(driver) -> int:
    return driver.names().count("cuMemUnmap")


@pytest.mark.parametrize("where", ["compute", "side"])
def test_close_drains_every_stream_before_the_first_unmap(where):
    """A kernel still queued when close comes (on the compute stream, or on a side stream the forward ran
    on: torch.cuda.stream(s)) runs before the first cuMemUnmap; the copy stream is waited on too."""
    group = VmmGroup("page").open()
    t, driver, api = group.transports[0], group.drivers[0], group.apis[0]
    group.prefetch(0, 0)
    stream = api.compute if where == "compute" else api.side_stream()
    ran_at = []
    with api.use_stream(stream):
        api.launch(lambda: ran_at.append(_unmaps_so_far(driver)))  # a kernel reading the views
    group.device.stalled.add(stream)  # it has not run by the time close is called
    threading.Timer(0.2, group.device.stalled.discard, (stream,)).start()
    t.close()
    assert ran_at == [0], f"the {where} stream's kernel ran after {ran_at} cuMemUnmap calls"
    assert _unmaps_so_far(driver) > 0 and t._stream is None
    group.close()


def test_a_close_whose_drain_times_out_unmaps_nothing_and_says_so(caplog):
    import logging

    group = VmmGroup("page").open()
    t, driver, api = group.transports[0], group.drivers[0], group.apis[0]
    group.prefetch(0, 0)
    api.launch(lambda: None)
    group.device.stalled.add(api.compute)  # a kernel that never finishes
    t.close_timeout_s = 0.3
    mark = len(driver.names())
    with caplog.at_level(logging.ERROR, logger="dwdp"):
        t.close()
    tail = driver.names()[mark:]
    assert not {"cuMemUnmap", "cuMemRelease", "cuMemAddressFree"} & set(tail), tail
    lines = [r.getMessage() for r in caplog.records if "work still in flight at close" in r.getMessage()]
    assert len(lines) == 1 and "every mapping is left in place" in lines[0], lines
    assert not t.mapper.holds_exports()
    group.device.stalled.clear()
    for other in group.transports[1:]:
        other.close()


def test_a_peer_segment_is_a_tensor_over_its_mapping_not_a_copy():
    group = VmmGroup("page").open()
    t = group.transports[0]
    for peer in (1, 2):
        tensor = t.peer_segment(peer)
        assert tensor.data_ptr() == t.mapper.peer_ranges[peer].ptr, "the peer's segment was copied"
        assert torch.equal(tensor[:group.segments[peer].numel()], group.segments[peer])
    group.close()


def _placement_4(kind):
    """A 4-rank group: 10 experts, 3 each, some owned twice (each rank pulls 2 or 3 from each peer: uneven),
    or 8 experts, 4 each, every one owned twice (redundant, wrapping)."""
    return {"uneven": build_placement(10, 4, 3), "redundant": build_placement(8, 4, 4)}[kind]


@pytest.mark.parametrize("kind", ["uneven", "redundant"])
def test_the_composite_plan_keeps_time_division_order_for_every_rank(kind):
    """Slices of at most slice_bytes, slice offset first, peers round-robin from rank + 1: a plan that
    pulls its peers in rank order would make every rank hit peer 0 first."""
    from dwdp.runtime.plan import pull_order

    placement = _placement_4(kind)
    slice_bytes = 1000
    layouts = composite_layouts(placement, 2, TENSOR_SETS["bf16_odd"], PAGE)
    for rank in range(4):
        plan = build_composite_plan(layouts, rank, 1, slice_bytes)
        assert plan.slices and all(0 < s.nbytes <= slice_bytes for s in plan.slices)
        order = [p for p in pull_order(rank, 4) if p in plan.peers]
        assert plan.slices[0].peer == order[0] == (rank + 1) % 4 or (rank + 1) % 4 not in plan.peers
        # Round k holds the k-th slice of every peer that still has one, in pull order.
        per_peer = {p: [s for s in plan.slices if s.peer == p] for p in order}
        want = [per_peer[p][k] for k in range(max(len(v) for v in per_peer.values())) for p in order
                if k < len(per_peer[p])]
        assert list(plan.slices) == want, f"rank {rank}: slices are not round-robin over {order}"


def test_the_copies_issued_keep_the_peers_round_robin():
    group = VmmGroup("page", E=10, G=4, L=3, slice_bytes=500).open()
    for rank in range(4):
        start = len(group.device.calls)
        plan = group.prefetch(rank, 1)
        srcs = [src for r, name, args in group.device.calls[start:] if r == rank and name == "prepare_batch"
                for src in args[1]]
        peers = [next(p for p, m in group.transports[rank].mapper.peer_ranges.items()
                      if m.ptr <= src < m.ptr + m.nbytes) for src in srcs]
        first_round = list(dict.fromkeys(peers))
        assert first_round == [p for p in ((rank + k) % 4 for k in range(1, 4)) if p in plan.peers], \
            f"rank {rank} issued its peers in the order {first_round}"
    group.close()


def _on_a_new_thread(fn, *args):
    """fn(*args) on a thread that never set a device (a health thread, a finaliser); its exception, if any."""
    raised = []

    def run():
        try:
            fn(*args)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return raised[0] if raised else None


def test_transport_calls_from_a_thread_that_never_set_a_device_run_on_the_ranks_device():
    """On a rank whose device is 1, the health thread's failover (forget_peer), a ticket's wait and close
    from other threads record their events on device 1 and make no context on device 0."""
    group = VmmGroup("page", gpu=1).open()
    t = group.transports[0]
    group.device.contexts.clear()
    plan = build_composite_plan(group.layouts, 0, 0, group.slice_bytes)
    ticket = t.submit(plan, group.views[0].layer_range(0))
    assert _on_a_new_thread(ticket.wait, 5.0) is None
    assert _on_a_new_thread(t.forget_peer, 1) is None
    assert 1 in t._forgotten and not t.mapper.peer_ranges.get(1)
    assert _on_a_new_thread(t.close) is None
    assert group.device.contexts == {1}, f"contexts made on devices {sorted(group.device.contexts)}"
    for other in group.transports[1:]:
        other.close()


@pytest.mark.parametrize("which", ["a_peer_import", "a_view", "the_segment"])
def test_a_close_whose_unmap_fails_once_still_releases_the_rest_and_holds_no_export(which):
    """cuMemUnmap fails once during close (in a peer's import, the composite views or the segment): every
    other piece is still unmapped and released, the exported fds (kept for the board) are closed and the
    fd server stops; the failure is raised at the end."""
    from dwdp.runtime.transport.cuda_api import CudaError

    threads = threading.active_count()
    group = VmmGroup("page")
    for t in group.transports:
        t.open(group.handles)
        t.board_handle()  # the exports outlive seal (a rank started later takes them)
        t.seal()
    t, driver = group.transports[0], group.drivers[0]
    exported = list(t.mapper.exported_fds)
    assert exported and t.mapper.fd_server is not None
    imports = sum(len(group.layouts[p].segment_allocations) for p in range(1, group.G))
    views = sum(len(group.layouts[0].map_runs(layer)) for layer in range(group.num_layers))
    skip = {"a_peer_import": 0, "a_view": imports + views // 2, "the_segment": imports + views}[which]
    driver.fail_once("cuMemUnmap", skip=skip)
    with pytest.raises(CudaError, match="cuMemUnmap failed"):
        t.close()
    assert t.mapper.exported_fds == [] and t.mapper.fd_server is None
    for fd in exported:
        with pytest.raises(OSError):
            os.fstat(fd)
    left = [(ptr, size) for ptr, (size, _) in driver.mapped.items()]
    assert len(left) == 1, f"one piece stays mapped (its unmap failed), not {left}"
    assert driver.names().count("cuMemRelease") == driver.names().count("cuMemCreate") + \
        driver.names().count("cuMemImportFromShareableHandle"), "an allocation was not released"
    assert driver.retained == 0, "the primary context Vmm retained was not released"
    for other in group.transports[1:]:
        other.close()
    assert threading.active_count() == threads, "an fd server thread outlived close"


def test_two_exports_of_one_process_get_different_socket_names():
    from dwdp.runtime.transport.cuda_vmm import fd_socket_name, pid_namespace

    names = {fd_socket_name(0) for _ in range(2)} | {fd_socket_name(1)}
    assert len(names) == 3 and all(n.startswith(f"dwdp-vmm-{pid_namespace()}-{os.getpid()}-") for n in names), names


def test_the_layout_granularity_fits_the_segments_handle_type_and_the_pools():
    """The driver may answer another granularity for the pool's allocations (no handle type) than for the
    segment's (POSIX fds): every size and address is a multiple of both."""
    placement = build_placement(8, 2)
    driver = HostBackedDriver(PAGE)
    driver.none_granularity = 4 * PAGE
    t = CudaTransport(0, "cpu", mapping="vmm-posix-fd", api=FakeCudaApi(FakeDevice(), 0), driver=driver)
    assert t.granularity() == 4 * PAGE
    layout = composite_layouts(placement, 2, (3000, 1700), t.granularity(), num_slots=2)[0]
    t.alloc_segment(layout.segment_nbytes, tuple(a.nbytes for a in layout.segment_allocations))
    t.composite_views(layout)
    assert not driver.errors, driver.errors
    t.close()
    assert not driver.mapped and not driver.memory


def test_a_lost_peers_release_that_fails_half_way_is_finished_by_close():
    """The import of a lost peer is released once its fence has run; a cuMemUnmap failing then neither
    escapes forget_peer (the failover would stop half way) nor leaks: close finishes what is left."""
    group = VmmGroup("page").open()
    t, driver = group.transports[0], group.drivers[0]
    driver.fail_once("cuMemUnmap", skip=1)  # the second piece of peer 1's import
    t.forget_peer(1)
    assert len(t.mapper.retired) == 1 and sum(t.mapper.retired[0].mapped) == 1, "the failed piece is remembered"
    t.close()
    assert not driver.mapped and not driver.reserved and not driver.memory, (driver.mapped, driver.reserved)
    assert driver.errors == ["cuMemUnmap failed once, on demand"], driver.errors
    for other in group.transports[1:]:
        other.close()


def test_posix_fds_of_a_peer_on_another_host_are_refused_in_one_line(monkeypatch):
    """POSIX fds cross no host: a handle naming another host is refused before any fd is taken, naming both
    hosts and what a group over hosts needs."""
    group = VmmGroup("page")
    far = dict(group.handles[2], host="another-tray")
    with pytest.raises(PrefetchError, match=r"rank 0: cannot import the segment of peer 2 \(host another-tray.*"
                       r"POSIX fds do not cross hosts.*'another-tray'.*fabric handles"):
        group.transports[0].open([*group.handles[:2], far])
    assert group.drivers[0].names().count("cuMemImportFromShareableHandle") == \
        len(group.layouts[1].segment_allocations)  # peer 1's only, then released
    group.close()
