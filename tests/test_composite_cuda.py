"""CUDA composite views (dwdp.runtime.transport.cuda_vmm) against a recording fake of the driver
bindings (tests/fake_cuda_vmm.py): call sequence, sizes, alignments, one cuMemSetAccess per layer
range, the real structs and signatures, bytes through the mappings, and the reverse on close. Not yet
run on a GPU: these check the calls as written, not a device.

Legend: g = granularity (2 MiB here), E = experts.
"""
from __future__ import annotations

import inspect
import logging
import os
import socket

import pytest
import torch
from cuda.bindings import driver as real

from dwdp.runtime.composite import build_composite_plan, composite_layouts
from dwdp.runtime.placement import build_placement
from dwdp.runtime.transport.cuda_vmm import CudaCompositeViews, Vmm, choose_mapping, recv_fds, send_fds
from fake_cuda_vmm import GRANULARITY, FakeDriver

FAKED = ["cuDeviceGetAttribute", "cuMemGetAllocationGranularity", "cuMemCreate", "cuMemExportToShareableHandle",
         "cuMemImportFromShareableHandle", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess", "cuMemUnmap",
         "cuMemAddressFree", "cuMemRelease"]
TENSOR_NBYTES = (3000 * 1000 + 17, 1500 * 1000 + 5)  # ~3 and ~1.5 MB per expert: not multiples of 2 MiB


@pytest.mark.parametrize("name", FAKED)
def test_fake_has_the_real_signatures(name):
    want = list(inspect.signature(getattr(real, name)).parameters)
    got = list(inspect.signature(getattr(FakeDriver, name)).parameters)[1:]  # less self
    assert got == want, f"{name}: fake takes {got}, the bindings take {want}"


def _group(E=8, G=3, L=4, num_layers=3):
    placement = build_placement(E, G, L)
    return placement, composite_layouts(placement, num_layers, TENSOR_NBYTES, GRANULARITY, num_slots=2)


def _build(layout, driver):
    vmm = Vmm(0, driver)
    segment = vmm.create(max(layout.segment_nbytes, GRANULARITY), "posix_fd")
    return vmm, segment, CudaCompositeViews(layout, segment, vmm)


def test_call_sequence_sizes_and_one_set_access_per_layer_range():
    _, layouts = _group()
    layout = layouts[1]
    driver = FakeDriver()
    vmm, segment, views = _build(layout, driver)
    assert not driver.errors, driver.errors
    names = driver.names()
    maps = sum(len(layout.map_runs(layer)) for layer in range(layout.num_layers))
    assert names.count("cuMemMap") == maps
    assert names.count("cuMemSetAccess") == layout.num_layers, "one cuMemSetAccess per layer range"
    assert driver.access == [(views.layer_pointer(layer), layout.layer_nbytes) for layer in range(layout.num_layers)]
    # Order: granularity, the segment and pool allocations, the reservation, then per layer its maps and
    # one set-access after them.
    first_map = names.index("cuMemMap")
    assert names.index("cuMemAddressReserve") < first_map
    assert names.count("cuMemCreate") == 2
    for layer in range(layout.num_layers):
        access = [i for i, n in enumerate(names) if n == "cuMemSetAccess"][layer]
        maps_before = names[:access].count("cuMemMap")
        assert maps_before == sum(len(layout.map_runs(x)) for x in range(layer + 1))
    views.close()
    vmm.release(segment)
    assert not driver.errors, driver.errors
    assert not driver.mapped and not driver.reserved and not driver.memory, "close left something behind"
    tail = driver.names()[len(names):]
    assert tail == ["cuMemUnmap"] * maps + ["cuMemAddressFree", "cuMemRelease", "cuMemRelease"]


def test_arguments_are_the_bindings_structs():
    _, layouts = _group()
    driver = FakeDriver()
    _build(layouts[0], driver)[2].close()
    creates = [args for name, args in driver.calls if name == "cuMemCreate"]
    assert all(isinstance(prop, real.CUmemAllocationProp) for _, prop, _ in creates)
    assert creates[0][1].requestedHandleTypes == real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    assert creates[1][1].requestedHandleTypes == real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE  # the pool
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
    for r, (lay, (_, segment, _)) in enumerate(zip(layouts, built)):  # loading: owned experts into the segment
        for layer in range(2):
            for t, nb in enumerate(TENSOR_NBYTES):
                for e in placement.owned[r]:
                    at = lay.segment_offset(layer, e, t)
                    driver.memory[segment][at:at + nb] = stacked[layer][t][e * nb:(e + 1) * nb]
    for r, lay in enumerate(layouts):
        views = built[r][2]
        for layer in range(2):
            for s in build_composite_plan(layouts, r, layer, 1 << 20).slices:
                src = driver.memory[built[s.peer][1]][s.src_offset:s.src_offset + s.nbytes]
                driver.write(views.layer_pointer(layer) + s.dst_offset, src)
            for t, nb in enumerate(TENSOR_NBYTES):
                got = driver.read(views.layer_pointer(layer) + lay.view_start[t], 7 * nb)
                assert torch.equal(got, stacked[layer][t]), f"rank {r} layer {layer} tensor {t}"
    assert not driver.errors, driver.errors


def test_array_interface_points_at_the_layer_range():
    _, layouts = _group()
    _, _, views = _build(layouts[0], FakeDriver())
    iface = views.array(1).__cuda_array_interface__
    assert iface == dict(shape=(layouts[0].layer_nbytes,), typestr="|u1", data=(views.layer_pointer(1), False),
                         version=3, strides=None)
    views.close()


def test_a_refused_map_unwinds_what_was_built():
    _, layouts = _group()
    driver = FakeDriver()
    vmm = Vmm(0, driver)
    too_small = vmm.create(GRANULARITY, "posix_fd")  # the segment is smaller than the layout's extents
    with pytest.raises(Exception, match="cuMemMap failed"):
        CudaCompositeViews(layouts[0], too_small, vmm)
    assert not driver.mapped and not driver.reserved and set(driver.memory) == {too_small}


def test_granularity_must_divide_the_layout():
    placement = build_placement(8, 2, 4)
    layout = composite_layouts(placement, 1, (1000,), 4096)[0]
    with pytest.raises(ValueError, match="not a multiple of the device's 2097152"):
        CudaCompositeViews(layout, 1, Vmm(0, FakeDriver()))


@pytest.mark.parametrize("supported,imex,refuse,want", [
    (("posix_fd", "fabric"), True, (), "vmm-fabric"),
    (("posix_fd", "fabric"), False, (), "vmm-posix-fd"),                      # no IMEX channel
    (("posix_fd", "fabric"), True, ("fabric",), "vmm-posix-fd"),              # x86: fabric export refused (800)
    ((), True, (), "ipc"),                                                    # no VMM export at all
    (("posix_fd",), False, ("posix_fd",), "ipc"),
])
def test_mapping_choice_and_its_one_log_line(caplog, supported, imex, refuse, want):
    driver = FakeDriver(supported=supported)
    vmm = Vmm(0, driver)
    for kind in refuse:
        driver.refuse_export(vmm.handle_type(kind))
    with caplog.at_level(logging.INFO, logger="dwdp"):
        assert choose_mapping(vmm, rank=3, imex=imex) == want
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rank 3:")]
    assert len(lines) == 1, lines
    assert ("CUDA IPC" in lines[0]) == (want == "ipc")
    assert not driver.memory, "the probe allocation was not released"


def test_fds_pass_over_a_unix_socket():
    fd = os.memfd_create("dwdp-test-fd")
    os.ftruncate(fd, 4096)
    a, b = socket.socketpair(socket.AF_UNIX)
    try:
        send_fds(a, [fd])
        (got,) = recv_fds(b, 1)
        assert got != fd
        data = os.urandom(64)
        os.pwrite(fd, data, 100)
        assert os.pread(got, 64, 100) == data, "the received fd is not the same file"
        os.close(got)
    finally:
        os.close(fd)
        a.close()
        b.close()


def test_yama_ptrace_scope_says_whether_pidfd_getfd_reaches_sibling_ranks(tmp_path):
    from dwdp.runtime.transport.cuda_vmm import pidfd_getfd_refused

    scope = tmp_path / "ptrace_scope"
    scope.write_text("1\n")
    assert pidfd_getfd_refused(str(scope)) == "Yama ptrace_scope=1 refuses pidfd_getfd between sibling ranks"
    scope.write_text("0\n")
    assert pidfd_getfd_refused(str(scope)) is None and pidfd_getfd_refused(str(tmp_path / "absent")) is None
