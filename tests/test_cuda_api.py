"""cuda_api against the real cuda.bindings on a machine without a driver, and its version shims.

Every function is called with the argument types the transport really builds (recorded from a
full transport lifecycle on the fake device): without a driver each must answer with the one
clear NoCudaDriverError, never a TypeError or OverflowError, which is how a wrong signature or a
wrong argument type shows up without a GPU.
"""
import ctypes
import inspect

import pytest
import torch
from cuda.bindings import runtime as rt

from dwdp.runtime.plan import build_copy_plan
from dwdp.runtime.transport import cuda_api
from dwdp.runtime.transport.cuda_api import BatchCopyError, CudaError, NoCudaDriverError
from deadlines import VirtualClock
from fake_cuda import FakeGroup

pytestmark = pytest.mark.no_cuda_driver  # the no-driver answers of the real bindings

PUBLIC = sorted(name for name, fn in vars(cuda_api).items()
                if inspect.isfunction(fn) and fn.__module__ == cuda_api.__name__ and not name.startswith("_"))
NEVER_RAISE = {"probe", "error_text", "error_name_text", "has_memcpy_batch", "prepare_batch"}  # answer without a driver


def _recorded_calls() -> list[tuple[str, tuple]]:
    """Every cuda_api call of a transport lifecycle: open, batch and per-slice copies, waits, release,
    a host wait, close."""
    group = FakeGroup(8, 3).open()
    plan = build_copy_plan(group.placement, 0, 1, 1, group.layout, 1000)
    slot = torch.empty(group.slot_nbytes(0), dtype=torch.uint8)
    transport = group.transports[0]
    ticket = transport.submit(plan, slot)
    ticket.wait(1.0)
    ticket.wait_experts((plan.slices[0].expert,), 1.0)
    ticket.done()
    ticket.synchronize(1.0)
    transport.copy = "memcpy"
    transport.submit(plan, slot).wait(1.0)
    transport.release_slot(1)
    group.close()
    return [(name, args) for _, name, args in group.device.calls if name in PUBLIC]


def test_every_recorded_call_gets_the_no_driver_error_from_the_real_bindings():
    calls = _recorded_calls()
    names = {name for name, _ in calls}
    assert {"ipc_export", "ipc_open", "prepare_batch", "memcpy_prepared_batch", "memcpy_async", "event_record",
            "stream_wait_event",
            "event_query", "event_wait", "ipc_close", "stream_create", "event_create"} <= names, sorted(names)
    for name, args in calls:
        fn = getattr(cuda_api, name)
        if name in NEVER_RAISE:
            fn(*args)
            continue
        with pytest.raises(NoCudaDriverError, match="no usable CUDA device") as info:
            fn(*args)
        assert "backend='host'" in str(info.value), str(info.value)


# Functions the transport does not call in that lifecycle, with the argument types their callers use.
DIRECT = {
    "set_device": (0,), "get_device": (), "device_synchronize": (), "current_stream": (), "stream_destroy": (0x1234,),
    "event_destroy": (0x5678,), "allocation_base": (1 << 30,), "can_access_peer": (0, 1), "enable_peer_access": (1,),
    "require": (), "probe": (), "error_text": (35,), "error_name_text": (35,), "has_memcpy_batch": (),
    "ipc_export": (1 << 30,), "ipc_open": (bytes(64),), "ipc_close": (1 << 30,), "event_create": (True,),
    "memcpy_batch_async": ([1 << 30, 3 << 30], [2 << 30, 4 << 30], [4096, 100], 0x1234, False),
    "tensor_at": (1 << 30, 4096, torch.device("cuda", 0)),  # how CudaTransport calls it (VMM mappings)
}


def test_every_public_function_is_exercised():
    covered = {name for name, _ in _recorded_calls()} | set(DIRECT)
    assert set(PUBLIC) <= covered, f"cuda_api functions never called here: {sorted(set(PUBLIC) - covered)}"


@pytest.mark.parametrize("name", sorted(DIRECT))
def test_direct_calls_answer_without_type_errors(name):
    fn, args = getattr(cuda_api, name), DIRECT[name]
    if name in NEVER_RAISE:
        fn(*args)
    else:
        with pytest.raises(NoCudaDriverError):
            fn(*args)


def test_probe_reports_the_missing_driver():
    info = cuda_api.probe()
    assert not info.usable and info.device_count == 0
    assert "cudaErrorInsufficientDriver (35)" in info.error, info.error
    assert info.runtime_version > 0 and info.bindings_version != "missing"


# -- version shims -------------------------------------------------------------------------------
@pytest.mark.parametrize("result, fail_index", [
    ((rt.cudaError_t.cudaErrorInvalidValue,), None),           # 13.x: (err,)
    ((rt.cudaError_t.cudaErrorInvalidValue, 5), 5),            # 12.9: (err, failIdx)
    ((rt.cudaError_t.cudaErrorInvalidValue, 2**64 - 1), None),  # failIdx SIZE_MAX: not one copy's fault
])
def test_batch_errors_from_both_result_shapes(monkeypatch, result, fail_index):
    monkeypatch.setattr(rt, "cudaMemcpyBatchAsync", lambda *a: result)
    with pytest.raises(BatchCopyError) as info:
        cuda_api.memcpy_batch_async([1 << 20] * 8, [2 << 20] * 8, [64] * 8, 0x77)
    assert info.value.fail_index == fail_index
    assert info.value.name == "cudaErrorInvalidValue" and "cudaMemcpyBatchAsync" in str(info.value), str(info.value)


@pytest.mark.parametrize("result", [(rt.cudaError_t.cudaSuccess,), (rt.cudaError_t.cudaSuccess, 0)])
def test_batch_success_from_both_result_shapes_and_its_arguments(monkeypatch, result):
    seen = []
    monkeypatch.setattr(rt, "cudaMemcpyBatchAsync", lambda *a: seen.append(a) or result)
    cuda_api.memcpy_batch_async([1 << 20, 3 << 20], [2 << 20, 4 << 20], [64, 128], 0x77, prefer_overlap=True)
    cuda_api.memcpy_batch_async([], [], [], 0x77)  # empty: nothing issued
    (dsts, srcs, sizes, count, attrs, idxs, num_attrs, stream), = seen
    assert (dsts, srcs, sizes, count, idxs, num_attrs, stream) == ((1 << 20, 3 << 20), (2 << 20, 4 << 20), (64, 128),
                                                                    2, [0], 1, 0x77)
    assert attrs[0].srcAccessOrder == rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
    assert attrs[0].flags == rt.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute


def test_ipc_handle_bytes_round_trip_with_nuls(monkeypatch):
    raw = bytes(range(1, 33)) + b"\0" * 8 + bytes(range(200, 224))  # 64 bytes with NULs inside
    assert len(raw) == cuda_api.IPC_HANDLE_BYTES

    def get_handle(ptr):
        handle = rt.cudaIpcMemHandle_t()
        ctypes.memmove(handle.getPtr(), raw, 64)
        return rt.cudaError_t.cudaSuccess, handle

    monkeypatch.setattr(rt, "cudaIpcGetMemHandle", get_handle)
    monkeypatch.setattr(cuda_api, "allocation_base", lambda ptr: ptr - 4160)
    exported, offset = cuda_api.ipc_export(1 << 30)
    assert exported == raw and offset == 4160
    opened = []

    def open_handle(handle, flags):
        opened.append((ctypes.string_at(handle.getPtr(), 64), flags))
        return rt.cudaError_t.cudaSuccess, 0xABC000

    monkeypatch.setattr(rt, "cudaIpcOpenMemHandle", open_handle)
    assert cuda_api.ipc_open(exported) == 0xABC000
    assert opened == [(raw, rt.cudaIpcMemLazyEnablePeerAccess)]
    with pytest.raises(ValueError, match="64 bytes"):
        cuda_api.ipc_open(raw[:63])


def test_peer_access_already_enabled_counts_as_success(monkeypatch):
    cleared = []
    monkeypatch.setattr(rt, "cudaDeviceEnablePeerAccess",
                        lambda peer, flags: (rt.cudaError_t.cudaErrorPeerAccessAlreadyEnabled,))
    monkeypatch.setattr(rt, "cudaGetLastError", lambda: cleared.append(1) or (rt.cudaError_t.cudaSuccess,))
    cuda_api.enable_peer_access(1)
    assert cleared == [1]


@pytest.mark.parametrize("code, answer", [(0, True), (600, False)])
def test_event_query_pending_and_done(monkeypatch, code, answer):
    monkeypatch.setattr(rt, "cudaEventQuery", lambda ev: (rt.cudaError_t(code),))
    assert cuda_api.event_query(0x10) is answer


def test_event_query_sticky_error_names_it(monkeypatch):
    monkeypatch.setattr(rt, "cudaEventQuery", lambda ev: (rt.cudaError_t.cudaErrorIllegalAddress,))
    with pytest.raises(CudaError, match=r"cudaEventQuery failed: cudaErrorIllegalAddress \(700\)"):
        cuda_api.event_query(0x10)


def test_event_wait_gives_up_at_its_deadline_without_event_synchronize(monkeypatch):
    monkeypatch.setattr(rt, "cudaEventQuery", lambda ev: (rt.cudaError_t.cudaErrorNotReady,))
    monkeypatch.setattr(rt, "cudaEventSynchronize", lambda ev: pytest.fail("cudaEventSynchronize has no deadline"))
    clock = VirtualClock()
    monkeypatch.setattr(cuda_api, "time", clock)
    with pytest.raises(TimeoutError, match="not done after 0.2 s"):
        cuda_api.event_wait(0x10, 0.2)
    # It polled until the deadline, backing off to at most 1 ms a pause, and gave up at the first poll past it.
    assert max(clock.sleeps) <= 1e-3 and clock.sleeps[0] < clock.sleeps[-1], clock.sleeps[:3]
    waited = clock.now - 1000.0
    assert 0.2 <= waited < 0.2 + max(clock.sleeps), f"gave up after {waited:.4f} s of polling, deadline 0.2 s"
