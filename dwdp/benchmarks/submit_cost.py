"""What bench/submit_cost.py times, behind four names: the host cost of issuing one layer's copies on
the cuda backend, split between the transport's own Python work and the cuda.bindings call.

`no_device_submit(copies)`: CudaTransport.submit of a plan of about `copies` slices (4 batches), every
device call a no-op (NoDeviceApi). `bindings_calls(copies, slice_bytes, device)`: the cuda_api calls one
batch of copies goes through (prepare, call, both). `device_usable()`: whether a real device runs them;
`bindings_version()`: through which cuda.bindings release.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

from dwdp.runtime.placement import build_placement
from dwdp.runtime.plan import SegmentLayout, build_copy_plan, slot_layout
from dwdp.runtime.transport import cuda_api
from dwdp.runtime.transport.cuda import CudaTransport

FAKE_BASE = 0x7F00_0000_0000  # addresses the no-device calls never touch
# The NoDeviceApi calls that answer something; every other device call of cuda_api is a no-op.
_ANSWERS = {"has_memcpy_batch": True, "ipc_export": (bytes(64), 0), "ipc_open": FAKE_BASE, "event_wait": 0.0,
            "event_query": True}


def _answer(answer, *args, **kwargs):
    return answer


class NoDeviceApi:
    """cuda_api for a transport with no device: copies, events and streams are no-ops, so a submit
    costs exactly the transport's own host work. Handles (streams, events) are distinct integers."""

    prepare_batch = staticmethod(cuda_api.prepare_batch)  # the argument building a submit pays for
    CudaError, NoCudaDriverError = cuda_api.CudaError, cuda_api.NoCudaDriverError

    def __init__(self):
        self._next = 0x1000
        # Every other function of cuda_api: a no-op that answers what _ANSWERS says (None by default).
        # Set on the instance, not found through __getattr__, which would slow every attribute lookup.
        for name, fn in vars(cuda_api).items():
            if inspect.isfunction(fn) and not name.startswith("_") and not hasattr(type(self), name):
                setattr(self, name, functools.partial(_answer, _ANSWERS.get(name)))

    def _handle(self, *args, **kwargs) -> int:
        self._next += 0x10
        return self._next

    stream_create = event_create = _handle

    # The calls of a submit after its first, as plain methods: what a submit costs is not to grow by
    # the no-ops' own call overhead.
    def current_stream(self) -> int:
        return 0x7

    def event_record(self, event, stream):
        pass

    def stream_wait_event(self, stream, event):
        pass

    def memcpy_prepared_batch(self, batch, stream):
        pass


def no_device_submit(copies: int, copy_batches: int = 4) -> tuple[Callable[[], None], int]:
    """(a call that submits one plan of rank 0 of 2, about `copies` slices in `copy_batches` batches, to
    a no-device CudaTransport into the same slot each time; the plan's number of slices)."""
    placement = build_placement(16, 2)
    expert_bytes = 4096 * max(1, copies // 8)
    layout = SegmentLayout(1, placement.num_local_experts, (expert_bytes,))
    transport = CudaTransport(0, "cpu", copy_batches=copy_batches, api=NoDeviceApi())
    transport.alloc_segment(layout.total_nbytes)
    handle = transport.register()
    transport.open([handle, dict(handle, rank=1)])
    plan = build_copy_plan(placement, 0, 0, 0, layout, expert_bytes * 8 // copies)
    slot = torch.empty(slot_layout(placement, 0, layout.tensor_nbytes).total_nbytes, dtype=torch.uint8)
    return (lambda: transport.submit(plan, slot)), len(plan.slices)


def _no_driver(fn: Callable[[], None]) -> Callable[[], None]:
    def call():
        try:
            fn()
        except cuda_api.NoCudaDriverError:
            pass
    return call


def bindings_calls(copies: int, slice_bytes: int, device: bool) -> tuple[dict[str, Callable[[], None]], Callable[[], None]]:
    """The cuda_api calls of one batch of `copies` copies of `slice_bytes` each: "prepare"
    (cuda_api.prepare_batch, once per plan), "bindings_call" (memcpy_prepared_batch of the prepared
    batch), "prepare_and_call" (memcpy_batch_async: both on every call); and a close() for after.
    device: copies between two buffers of this GPU on a stream of their own; else addresses nothing
    reads and a missing driver accepted (the bindings have converted the arguments by then)."""
    buffers = []  # the GPU buffers copied between: alive until close()
    if device:
        buffers = [torch.empty(copies * slice_bytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
        base_dst, base_src, stream = buffers[0].data_ptr(), buffers[1].data_ptr(), cuda_api.stream_create()
    else:
        base_dst, base_src, stream = FAKE_BASE, FAKE_BASE + (1 << 36), 0x77
    dsts = [base_dst + i * slice_bytes for i in range(copies)]
    srcs = [base_src + i * slice_bytes for i in range(copies)]
    sizes = [slice_bytes] * copies
    batch = cuda_api.prepare_batch(dsts, srcs, sizes)
    calls = {"prepare": lambda: cuda_api.prepare_batch(dsts, srcs, sizes),
             "bindings_call": _no_driver(lambda: cuda_api.memcpy_prepared_batch(batch, stream)),
             "prepare_and_call": _no_driver(lambda: cuda_api.memcpy_batch_async(dsts, srcs, sizes, stream))}

    def close():
        if device:
            cuda_api.stream_destroy(stream)
        buffers.clear()
    return calls, close


def device_usable() -> bool:
    """Whether the bindings calls run on a real device here (a usable driver and CUDA torch)."""
    return cuda_api.probe().usable and torch.cuda.is_available()


def bindings_version() -> str | None:
    """The cuda.bindings release the calls go through (None where it is not installed)."""
    return cuda_api.probe().bindings_version
