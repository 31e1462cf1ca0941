"""CUDA composite views (dwdp.runtime.transport.cuda_vmm) against the strict recording fake of the driver
bindings (tests/fake_cuda_vmm.py, whose rules R1-R9 stand for the documentation and the H200 probe):
call sequence, every allocation mapped whole at offset 0, one cuMemSetAccess per layer range, the real
structs and signatures, bytes through the mappings, the reverse on close, the mapping choice, fd passing.
These check the calls as written, not a device; the same code ran on one H200 (bench/README.md).

Legend: g = granularity (2 MiB here), E = experts.
"""
from __future__ import annotations

import errno
import inspect
import logging
import os
import resource
import socket

import pytest
import torch
from cuda.bindings import driver as real

from dwdp.runtime.composite import SEGMENT, build_composite_plan, composite_layouts
from dwdp.runtime.placement import build_placement
from dwdp.runtime.transport import cuda_vmm
from dwdp.runtime.transport.cuda_api import CudaError
from dwdp.runtime.transport.cuda_vmm import (SCM_MAX_FD, CudaCompositeViews, FdServer, Vmm, choose_mapping,
                                             ensure_fd_room, fetch_fds, recv_fds, send_fds, take_fds)
from dwdp.runtime.transport.dlpack import tensor_over
from fake_cuda_vmm import GRANULARITY, FakeDriver

FAKED = ["cuInit", "cuDeviceGet", "cuCtxGetCurrent", "cuCtxSetCurrent", "cuDevicePrimaryCtxRetain",
         "cuDevicePrimaryCtxRelease", "cuDeviceGetAttribute", "cuMemGetAllocationGranularity", "cuMemCreate",
         "cuMemExportToShareableHandle", "cuMemImportFromShareableHandle", "cuMemAddressReserve", "cuMemMap",
         "cuMemSetAccess", "cuMemUnmap", "cuMemAddressFree", "cuMemRelease"]
TENSOR_NBYTES = (3000 * 1000 + 17, 1500 * 1000 + 5)  # ~3 and ~1.5 MB per expert: not multiples of 2 MiB
POSIX = real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


@pytest.mark.parametrize("name", FAKED)
def test_fake_has_the_real_signatures(name):
    want = list(inspect.signature(getattr(real, name)).parameters)
    got = list(inspect.signature(getattr(FakeDriver, name)).parameters)[1:]  # less self
    assert got == want, f"{name}: fake takes {got}, the bindings take {want}"


def _group(E=8, G=3, L=4, num_layers=3):
    placement = build_placement(E, G, L)
    return placement, composite_layouts(placement, num_layers, TENSOR_NBYTES, GRANULARITY, num_slots=2)


def _segment(layout, vmm):
    return [vmm.create(a.nbytes, "posix_fd") for a in layout.segment_allocations]


def _build(layout, driver):
    vmm = Vmm(0, driver)
    segment = _segment(layout, vmm)
    return vmm, segment, CudaCompositeViews(layout, segment, vmm)


# -- the fake's rules (each stands for a documented or measured refusal) ---------------------------------
def _ready(driver=None):
    driver = driver or FakeDriver()
    driver.make_current()
    return driver


def _prop(handle_type, device=0):
    return Vmm(device, FakeDriver()).prop(handle_type)


def test_r1_cumem_calls_need_cuinit_and_a_current_context():
    driver = FakeDriver()
    assert driver.cuMemCreate(GRANULARITY, _prop("posix_fd"), 0)[0] == real.CUresult.CUDA_ERROR_NOT_INITIALIZED
    driver.cuInit(0)
    assert driver.cuMemCreate(GRANULARITY, _prop("posix_fd"), 0)[0] == real.CUresult.CUDA_ERROR_INVALID_CONTEXT


def test_vmm_makes_the_primary_context_current_on_every_thread_and_retains_it_once():
    import threading

    driver = FakeDriver()
    vmm = Vmm(0, driver)
    vmm.release(vmm.create(vmm.granularity("posix_fd"), "posix_fd"))
    assert driver.names(queries=True)[:5] == ["cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxGetCurrent",
                                              "cuCtxSetCurrent"]
    # Another thread (a health thread's failover, a finaliser) gets the context made current too, with no
    # second retain: one reference per object, released once.
    worker = threading.Thread(target=lambda: vmm.release(vmm.create(GRANULARITY, "posix_fd")))
    worker.start()
    worker.join()
    assert driver.retained == 1 and driver.names().count("cuCtxSetCurrent") == 2 and not driver.errors, driver.errors
    vmm.close()
    assert driver.retained == 0
    vmm.close()
    assert driver.retained == 0


def test_vmm_keeps_the_primary_context_torch_made_current():
    driver = _ready()
    vmm = Vmm(0, driver)
    vmm.release(vmm.create(GRANULARITY, "posix_fd"))
    assert "cuCtxSetCurrent" not in driver.names() and driver.retained == 1 and not driver.errors
    vmm.close()
    assert driver.retained == 0


def test_r2_fabric_without_an_imex_channel_is_refused_at_create():
    driver = _ready(FakeDriver(imex=False))
    assert driver.cuMemCreate(GRANULARITY, _prop("fabric"), 0)[0] == real.CUresult.CUDA_ERROR_NOT_PERMITTED


def test_r3_minimum_and_recommended_granularity_differ_and_vmm_uses_the_minimum():
    driver = _ready()
    option = real.CUmemAllocationGranularity_flags
    assert driver.cuMemGetAllocationGranularity(_prop("posix_fd"), option.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)[1] \
        != driver.cuMemGetAllocationGranularity(_prop("posix_fd"), option.CU_MEM_ALLOC_GRANULARITY_MINIMUM)[1]
    assert Vmm(0, driver).granularity("posix_fd") == GRANULARITY


def test_r4_map_takes_a_whole_allocation_at_offset_zero():
    driver = _ready()
    handle = driver.cuMemCreate(2 * GRANULARITY, _prop("none"), 0)[1]
    base = driver.cuMemAddressReserve(4 * GRANULARITY, GRANULARITY, 0, 0)[1]
    assert driver.cuMemMap(base, GRANULARITY, GRANULARITY, handle, 0)[0] == real.CUresult.CUDA_ERROR_NOT_SUPPORTED
    assert driver.cuMemMap(base, GRANULARITY, 0, handle, 0)[0] == real.CUresult.CUDA_ERROR_INVALID_VALUE
    assert driver.cuMemMap(base, 2 * GRANULARITY, 0, handle, 0)[0] == real.CUresult.CUDA_SUCCESS
    assert driver.cuMemMap(base + 2 * GRANULARITY, 2 * GRANULARITY, 0, handle, 0)[0] == real.CUresult.CUDA_SUCCESS, \
        "one allocation may be mapped at several addresses"


def test_r5_reservations_take_a_power_of_two_alignment():
    driver = _ready()
    assert driver.cuMemAddressReserve(4 * GRANULARITY, 3 * GRANULARITY, 0, 0)[0] == real.CUresult.CUDA_ERROR_INVALID_VALUE
    assert driver.cuMemAddressReserve(4 * GRANULARITY, 0, 0, 0)[0] == real.CUresult.CUDA_SUCCESS
    with pytest.raises(ValueError, match="alignment 6291456 is not a power of two"):
        Vmm(0, driver).reserve(4 * GRANULARITY, 3 * GRANULARITY)


def test_r6_export_only_the_handle_type_the_allocation_requested():
    driver = _ready()
    private = driver.cuMemCreate(GRANULARITY, _prop("none"), 0)[1]
    assert driver.cuMemExportToShareableHandle(private, POSIX, 0)[0] == real.CUresult.CUDA_ERROR_INVALID_VALUE
    no_fabric = _ready(FakeDriver(supported=("posix_fd",)))
    shared = no_fabric.cuMemCreate(GRANULARITY, _prop("posix_fd"), 0)[1]
    fabric = real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
    assert no_fabric.cuMemExportToShareableHandle(shared, fabric, 0)[0] == real.CUresult.CUDA_ERROR_NOT_PERMITTED


def test_r7_a_fabric_import_can_be_refused_after_the_export():
    exporter, importer = _ready(), _ready()
    vmm = Vmm(0, exporter)
    raw = vmm.export(vmm.create(GRANULARITY, "fabric"), "fabric")
    assert Vmm(0, importer).import_(raw, "fabric")  # the same bytes, another "process"
    importer.refuse_fabric_import = True
    with pytest.raises(CudaError, match="CUDA_ERROR_NOT_PERMITTED"):
        Vmm(0, importer).import_(raw, "fabric")


# -- CudaCompositeViews ------------------------------------------------------------------------------------
def test_every_allocation_is_mapped_whole_at_offset_zero_with_one_set_access_per_layer_range():
    _, layouts = _group()
    layout = layouts[1]
    driver = FakeDriver()
    vmm, segment, views = _build(layout, driver)
    assert not driver.errors, driver.errors
    names = driver.names()
    maps = [args for name, args in driver.calls if name == "cuMemMap"]
    assert len(maps) == sum(len(layout.map_runs(layer)) for layer in range(layout.num_layers))
    assert all(offset == 0 and size == driver.memory[handle].numel() for _, size, offset, handle, _ in maps)
    assert names.count("cuMemCreate") == len(layout.segment_allocations) + len(layout.pool_allocations)
    assert names.count("cuMemSetAccess") == layout.num_layers, "one cuMemSetAccess per layer range"
    assert driver.access == [(views.layer_pointer(layer), layout.layer_nbytes) for layer in range(layout.num_layers)]
    for layer in range(layout.num_layers):  # each layer's set-access comes after all of its maps
        access = [i for i, n in enumerate(names) if n == "cuMemSetAccess"][layer]
        assert names[:access].count("cuMemMap") == sum(len(layout.map_runs(x)) for x in range(layer + 1))
    mark = len(driver.names())
    views.close()
    for handle in segment:
        vmm.release(handle)
    assert not driver.errors, driver.errors
    assert not driver.mapped and not driver.reserved and not driver.memory, "close left something behind"
    tail = driver.names()[mark:]
    assert tail == ["cuMemUnmap"] * len(maps) + ["cuMemAddressFree"] + \
        ["cuMemRelease"] * (len(layout.pool_allocations) + len(segment))


def test_layers_of_one_slot_map_the_same_pool_gap_allocations():
    _, layouts = _group(num_layers=4)
    driver = FakeDriver()
    _, _, views = _build(layouts[0], driver)
    by_layer = {}
    for ptr, size, _, handle, _ in (args for name, args in driver.calls if name == "cuMemMap"):
        layer = (ptr - views.base) // layouts[0].layer_nbytes
        by_layer.setdefault(layer, []).append(handle)
    pool = set(views._pool)
    assert [h for h in by_layer[0] if h in pool] == [h for h in by_layer[2] if h in pool]
    assert not {h for h in by_layer[0] if h in pool} & {h for h in by_layer[1] if h in pool}
    views.close()


def test_arguments_are_the_bindings_structs():
    _, layouts = _group()
    driver = FakeDriver()
    _build(layouts[0], driver)[2].close()
    creates = [args for name, args in driver.calls if name == "cuMemCreate"]
    assert all(isinstance(prop, real.CUmemAllocationProp) for _, prop, _ in creates)
    kinds = [prop.requestedHandleTypes for _, prop, _ in creates]
    assert kinds[:len(layouts[0].segment_allocations)] == [POSIX] * len(layouts[0].segment_allocations)
    assert set(kinds[len(layouts[0].segment_allocations):]) == {real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE}
    access = [args for name, args in driver.calls if name == "cuMemSetAccess"]
    for _, _, desc, count in access:
        assert count == 1 and isinstance(desc[0], real.CUmemAccessDesc)
        assert desc[0].location.type == real.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE


def test_views_hold_the_unwrapped_experts_through_the_mappings():
    placement, layouts = _group(E=7, G=3, L=3, num_layers=2)
    gen = torch.Generator().manual_seed(5)
    stacked = [[torch.randint(0, 256, (7 * nb,), dtype=torch.uint8, generator=gen) for nb in TENSOR_NBYTES]
               for _ in range(2)]
    driver = FakeDriver()
    built = [_build(lay, driver) for lay in layouts]

    def segment_bytes(r, offset, nbytes):  # the segment is its allocations back to back
        for alloc, handle in zip(layouts[r].segment_allocations, built[r][1]):
            if alloc.offset <= offset < alloc.offset + alloc.nbytes:
                assert offset + nbytes <= alloc.offset + alloc.nbytes, "an expert crosses two allocations"
                return driver.memory[handle][offset - alloc.offset:offset - alloc.offset + nbytes]
        raise AssertionError(f"offset {offset} is outside rank {r}'s segment")

    for r, lay in enumerate(layouts):  # loading: owned experts into the segment
        for layer in range(2):
            for t, nb in enumerate(TENSOR_NBYTES):
                for e in placement.owned[r]:
                    segment_bytes(r, lay.segment_offset(layer, e, t), nb).copy_(stacked[layer][t][e * nb:(e + 1) * nb])
    for r, lay in enumerate(layouts):
        views = built[r][2]
        for layer in range(2):
            for s in build_composite_plan(layouts, r, layer, 1 << 20).slices:
                driver.write(views.layer_pointer(layer) + s.dst_offset, segment_bytes(s.peer, s.src_offset, s.nbytes))
            for t, nb in enumerate(TENSOR_NBYTES):
                got = driver.read(views.layer_pointer(layer) + lay.view_start[t], 7 * nb)
                assert torch.equal(got, stacked[layer][t]), f"rank {r} layer {layer} tensor {t}"
    assert not driver.errors, driver.errors


def test_a_refused_map_unwinds_what_was_built():
    _, layouts = _group()
    driver = FakeDriver()
    vmm = Vmm(0, driver)
    segment = _segment(layouts[0], vmm)
    vmm.release(segment[-1])
    segment[-1] = vmm.create(GRANULARITY * 64, "posix_fd")  # not the size of its extent: R4 refuses the map
    with pytest.raises(CudaError, match="cuMemMap failed"):
        CudaCompositeViews(layouts[0], segment, vmm)
    assert not driver.mapped and not driver.reserved and set(driver.memory) == set(segment)


def test_segment_allocations_must_be_the_layouts():
    _, layouts = _group()
    vmm = Vmm(0, FakeDriver())
    with pytest.raises(ValueError, match=r"1 segment allocations given; the layout has \d+"):
        CudaCompositeViews(layouts[0], [vmm.create(GRANULARITY, "posix_fd")], vmm)


def test_granularity_must_divide_the_layout():
    placement = build_placement(8, 2, 4)
    layout = composite_layouts(placement, 1, (1000,), 4096)[0]
    with pytest.raises(ValueError, match="not a multiple of the device's 2097152"):
        CudaCompositeViews(layout, [1], Vmm(0, FakeDriver()))


# -- the mapping choice ------------------------------------------------------------------------------------
class _OldDriver(FakeDriver):
    """A driver that does not know the fabric attribute (it answers INVALID_VALUE)."""

    def cuDeviceGetAttribute(self, attrib, dev):
        if attrib == real.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED:
            self.calls.append(("cuDeviceGetAttribute", (attrib, dev)))
            return (real.CUresult.CUDA_ERROR_INVALID_VALUE,)
        return super().cuDeviceGetAttribute(attrib, dev)


@pytest.mark.parametrize("driver,imex,refuse,want", [
    (FakeDriver(), True, (), "vmm-fabric"),
    (FakeDriver(), False, (), "vmm-posix-fd"),                              # no IMEX channel
    (FakeDriver(imex=False), True, (), "vmm-posix-fd"),                     # listed, refused at create (H200)
    (FakeDriver(), True, ("fabric",), "vmm-posix-fd"),                      # fabric export refused (800)
    (_OldDriver(), True, (), "vmm-posix-fd"),                               # the attribute itself unknown
    (FakeDriver(supported=()), True, (), "ipc"),                            # no VMM export at all
    (FakeDriver(supported=("posix_fd",)), False, ("posix_fd",), "ipc"),
], ids=["fabric", "no-imex", "create-refused", "export-refused", "old-driver", "none", "posix-refused"])
def test_mapping_choice_and_its_one_log_line(caplog, driver, imex, refuse, want):
    vmm = Vmm(0, driver)
    for kind in refuse:
        driver.refuse_export(vmm.handle_type(kind))
    with caplog.at_level(logging.INFO, logger="dwdp"):
        assert choose_mapping(vmm, rank=3, imex=imex) == want
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rank 3:")]
    assert len(lines) == 1, lines
    assert ("CUDA IPC" in lines[0]) == (want == "ipc")
    if want != "vmm-fabric" and imex:
        assert "fabric:" in lines[0], f"the line does not say why fabric was refused: {lines[0]}"
    assert not driver.memory, "the probe allocation was not released"


# -- descriptors ---------------------------------------------------------------------------------------------
def _files(n, size=4096):
    fds = []
    for i in range(n):
        fd = os.memfd_create(f"dwdp-test-{i}")
        os.ftruncate(fd, size)
        os.pwrite(fd, i.to_bytes(4, "little"), 0)
        fds.append(fd)
    return fds


def _same_files(got, fds):
    return [os.pread(g, 4, 0) for g in got] == [os.pread(f, 4, 0) for f in fds]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_fds_pass_over_a_unix_socket():
    (fd,) = _files(1)
    a, b = socket.socketpair(socket.AF_UNIX)
    try:
        send_fds(a, [fd])
        (got,) = recv_fds(b, 1)
        assert got != fd and _same_files([got], [fd]), "the received fd is not the same file"
        os.close(got)
    finally:
        os.close(fd)
        a.close()
        b.close()


def test_more_fds_than_one_message_carries_come_in_order_over_the_fd_server():
    fds = _files(2 * SCM_MAX_FD + 7)
    before = _open_fds()
    server = FdServer(fds, f"dwdp-test-many-{os.getpid()}")
    try:
        got = fetch_fds(server.name, len(fds), timeout_s=10.0)
        assert len(got) == len(fds) and _same_files(got, fds)
        for fd in got:
            os.close(fd)
        with pytest.raises(ValueError, match=f"expected 3 file descriptors .* got {len(fds)}"):
            fetch_fds(server.name, 3, timeout_s=10.0)
    finally:
        server.close()
        for fd in fds:
            os.close(fd)
    assert _open_fds() <= before - len(fds), "a received descriptor was left open"


def _handle(fds, name, pid_ns=None):
    return {"pid": os.getpid(), "pid_ns": cuda_vmm.pid_namespace() if pid_ns is None else pid_ns, "fds": fds,
            "socket": name}


def test_take_fds_uses_pidfd_getfd_where_the_kernel_allows_it():
    fds = _files(3)
    got, how = take_fds(_handle(fds, "dwdp-test-unused"))
    assert how == "pidfd_getfd" and _same_files(got, fds)
    for fd in got + fds:
        os.close(fd)


def _taken_over_the_socket(count: int, getfd, pid_ns=None) -> str:
    """take_fds from a served set of `count` files with pidfd_getfd replaced by `getfd`; asserts the fds
    are the same files and returns how they came."""
    fds = _files(count)
    server = FdServer(fds, f"dwdp-test-socket-{os.getpid()}-{count}")
    try:
        got, how = take_fds(_handle(fds, server.name, pid_ns=pid_ns), getfd=getfd)
        assert _same_files(got, fds)
        for fd in got:
            os.close(fd)
        return how
    finally:
        server.close()
        for fd in fds:
            os.close(fd)


@pytest.mark.parametrize("err", [errno.EPERM, errno.ESRCH, errno.ENOSYS])
def test_take_fds_falls_back_to_the_socket_when_pidfd_getfd_is_refused(err):
    def refused(pid, fds):
        raise OSError(err, os.strerror(err))

    assert _taken_over_the_socket(4, refused) == f"socket (pidfd_getfd: {errno.errorcode[err]})"


def test_take_fds_never_reads_a_pid_from_another_pid_namespace():
    def forbidden(pid, fds):
        raise AssertionError("pidfd_getfd on a pid of another namespace would reach another process")

    assert _taken_over_the_socket(2, forbidden, pid_ns=1) == "socket (another PID namespace)"


def test_take_fds_raises_other_errors():
    def broken(pid, fds):
        raise OSError(errno.EBADF, "bad fd")

    with pytest.raises(OSError, match="bad fd"):
        take_fds(_handle([3], "dwdp-test-unused"), getfd=broken)


def test_fd_room_raises_the_soft_limit_and_refuses_past_the_hard_one(monkeypatch):
    limits = {"now": (64, 4096)}
    monkeypatch.setattr(resource, "getrlimit", lambda which: limits["now"])
    monkeypatch.setattr(resource, "setrlimit", lambda which, value: limits.update(now=value))
    ensure_fd_room(100)
    assert limits["now"] == (4096, 4096)
    limits["now"] = (1024, 1024)
    with pytest.raises(OSError, match=r"needed .* RLIMIT_NOFILE allows 1024 \(hard limit 1024\)"):
        ensure_fd_room(5000)


# -- tensors over mapped memory ---------------------------------------------------------------------------------
def test_a_tensor_over_mapped_memory_is_that_memory_on_the_named_device():
    backing = torch.randint(0, 256, (8192,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    view = tensor_over(backing.data_ptr() + 4096, 4096, "cpu")
    assert view.data_ptr() == backing.data_ptr() + 4096 and view.device == torch.device("cpu")
    view[:8] = 7
    assert torch.equal(backing[4096:4104], torch.full((8,), 7, dtype=torch.uint8)), "a copy, not the memory"
    with pytest.raises(ValueError, match="nbytes must be >= 1"):
        tensor_over(backing.data_ptr(), 0, "cpu")


def test_segment_offsets_are_the_extent_allocations_back_to_back():
    _, layouts = _group()
    for lay in layouts:
        at = 0
        for alloc in lay.segment_allocations:
            assert alloc.backing == SEGMENT and alloc.offset == at and alloc.nbytes % GRANULARITY == 0
            at += alloc.nbytes
        assert at == lay.segment_nbytes


def test_a_dlpack_capsule_has_strides_and_frees_itself_when_never_consumed():
    import gc

    from dwdp.runtime.transport import dlpack

    buffer = torch.arange(64, dtype=torch.uint8)

    def ours():
        return [key for key, value in dlpack._alive.items() if value[0].dl_tensor.data == buffer.data_ptr()]

    capsule = dlpack._Bytes(buffer.data_ptr(), 64, dlpack._KDL_CPU, 0).__dlpack__()
    (key,) = ours()
    strides = dlpack._alive[key][0].dl_tensor.strides
    assert strides and strides[0] == 1, "dlpack.h: strides can not be NULL if ndim != 0"
    del capsule, strides  # never handed to torch
    gc.collect()
    assert ours() == [], "an unconsumed capsule's structs stayed alive"
    tensor = tensor_over(buffer.data_ptr(), 64, "cpu")  # consumed: torch's deleter frees them with the tensor
    assert torch.equal(tensor, buffer) and len(ours()) == 1
    del tensor
    gc.collect()
    assert ours() == []


def test_vmm_makes_its_devices_context_current_where_another_devices_is():
    """A thread where another device's context is current (a forward on device 1 in this thread) gets this
    device's primary context for the cuMem calls, as cudaSetDevice would make it current."""
    driver = _ready()
    driver._thread.context = 0xBEEF  # another device's context, current on this thread
    vmm = Vmm(0, driver)
    vmm.release(vmm.create(GRANULARITY, "posix_fd"))
    assert not driver.errors and "cuCtxSetCurrent" in driver.names(), driver.errors
    vmm.close()
