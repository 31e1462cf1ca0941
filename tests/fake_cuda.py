"""A recording fake of dwdp.runtime.transport.cuda_api: a tiny device with streams, events and copies.

Memory is real: pointers are CPU addresses of torch tensors and a copy moves bytes with
ctypes.memmove, so tests check bytes bit-exactly. Time is the test's: enqueued work runs only
when `FakeDevice.run(policy)` runs it (or a host poll does), in an order the test picks, e.g.
"copies as early as their waits allow, compute as late as possible", the schedule that exposes a
missing write-after-read wait. Every call is logged as (rank, name, args).

One FakeDevice is shared by the ranks of a test (one process, like ranks on one GPU); each rank
has its own FakeCudaApi, whose current stream is that rank's compute stream (a test switches it with
`use_stream`). As in the runtime, the current device is per host thread (0 on a thread that never set
one); streams and events belong to the device current when they were made, an event recorded on
another device's stream is refused, and any call but get_device makes the current device's context
(`FakeDevice.contexts`): a transport call on a thread whose device was never set shows up as a context
on device 0. `device_synchronize` runs every stream and blocks while a stalled one still holds work.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from dwdp.runtime.placement import build_placement
from dwdp.runtime.plan import SegmentLayout, slot_layout
from dwdp.runtime.transport import cuda_api
from dwdp.runtime.transport.cuda import CudaTransport
from dwdp.runtime.transport.cuda_api import BatchCopyError, CudaError
from dwdp.runtime.transport.reference import execute_plan_reference

ILLEGAL_ADDRESS = (700, "cudaErrorIllegalAddress", "an illegal memory access was encountered")
INVALID_VALUE = (1, "cudaErrorInvalidValue", "invalid argument")
OWN_HANDLE = (201, "cudaErrorDeviceUninitialized", "invalid device context")
PAGE = 4096
TENSOR_NBYTES = (3000, 1700)


@dataclass
class _Event:
    recorded: int = 0   # generations recorded so far
    completed: int = 0  # generations whose record op has run
    gpu: int = 0        # the device current when it was created


@dataclass
class _Op:
    kind: str            # "copy", "record", "wait", "kernel"
    args: tuple
    rank: int


@dataclass
class FakeDevice:
    calls: list = field(default_factory=list)
    streams: dict = field(default_factory=dict)     # id -> deque of _Op
    stream_kind: dict = field(default_factory=dict)  # id -> "copy" or "compute"
    events: dict = field(default_factory=dict)
    stalled: set = field(default_factory=set)        # streams that make no progress
    faulty_ranges: list = field(default_factory=list)  # (lo, hi) source ranges whose reads fault
    sticky: CudaError | None = None
    queued_errors: dict = field(default_factory=dict)  # call name -> deque of errors to raise
    exported: dict = field(default_factory=dict)     # handle bytes -> (rank, base)
    stream_gpu: dict = field(default_factory=dict)   # stream id -> the device it was made on
    contexts: set = field(default_factory=set)        # devices some call made a context on
    sync_limit_s: float = 10.0                        # a device_synchronize blocked this long fails the test
    thread: threading.local = field(default_factory=threading.local)  # .gpu: this thread's current device
    opened: dict = field(default_factory=dict)       # base -> times opened and not closed
    closed: list = field(default_factory=list)
    _ids: itertools.count = field(default_factory=lambda: itertools.count(0x1000, 0x10))

    def new_id(self) -> int:
        return next(self._ids)

    def current_gpu(self) -> int:
        return getattr(self.thread, "gpu", 0)

    def stream(self, kind: str, gpu: int | None = None) -> int:
        sid = self.new_id()
        self.streams[sid] = deque()
        self.stream_kind[sid] = kind
        self.stream_gpu[sid] = self.current_gpu() if gpu is None else gpu
        return sid

    def pending(self) -> bool:
        return any(self.streams.values())

    def fail_next(self, name: str, error: CudaError) -> None:
        self.queued_errors.setdefault(name, deque()).append(error)

    def names(self, rank: int | None = None) -> list[str]:
        return [c[1] for c in self.calls if rank is None or c[0] == rank]

    # -- execution ---------------------------------------------------------------------------
    def _ready(self, op: _Op) -> bool:
        if op.kind == "wait":
            event, generation = op.args
            return self.events[event].completed >= generation
        return True

    def _execute(self, op: _Op) -> None:
        if op.kind == "copy":
            for dst, src, n in op.args:
                if any(lo <= src < hi for lo, hi in self.faulty_ranges):
                    self.sticky = CudaError("(asynchronous copy)", *ILLEGAL_ADDRESS)
                    return
                ctypes.memmove(dst, src, n)
        elif op.kind == "record":
            event, generation = op.args
            self.events[event].completed = max(self.events[event].completed, generation)
        elif op.kind == "kernel":
            op.args[0]()

    def step(self, sid: int) -> bool:
        """Run the head of stream `sid` if it can run; False when it cannot (or is empty)."""
        queue = self.streams[sid]
        if not queue or sid in self.stalled or self.sticky is not None or not self._ready(queue[0]):
            return False
        self._execute(queue.popleft())
        return True

    def run(self, policy: str = "fifo") -> None:
        """Run everything that can run. "fifo": one op of each stream in turn. "copies_only": copy
        streams alone, compute held back (it runs at a later `run`). "copies_first": a copy
        op whenever one can run, a compute op only when none can (compute lags the copies as far
        as the waits allow); "compute_first": the reverse."""
        while True:
            if policy == "fifo":
                moved = any([self.step(sid) for sid in list(self.streams)])
            elif policy == "copies_only":
                moved = self._step_kind("copy")
            else:
                lead, lag = ("copy", "compute") if policy == "copies_first" else ("compute", "copy")
                moved = self._step_kind(lead) or self._step_kind(lag)
            if not moved:
                return

    def _step_kind(self, kind: str) -> bool:
        return any(self.step(sid) for sid, k in list(self.stream_kind.items()) if k == kind)


class FakeCudaApi:
    """The cuda_api functions the transport uses, on a FakeDevice, for one rank."""

    CudaError = cuda_api.CudaError
    NoCudaDriverError = cuda_api.NoCudaDriverError
    BatchCopyError = cuda_api.BatchCopyError

    def __init__(self, device: FakeDevice, rank: int, has_batch: bool = True, poll_runs: bool = True, gpu: int = 0):
        self.device, self.rank, self.has_batch, self.poll_runs, self.gpu = device, rank, has_batch, poll_runs, gpu
        self.compute = device.stream("compute", gpu)
        self._current = threading.local()  # .stream: this thread's current stream when a test switched it

    def _call(self, name: str, *args):
        self.device.calls.append((self.rank, name, args))
        if name != "require":  # cudaGetDeviceCount makes no context
            self.device.contexts.add(self.device.current_gpu())
        if self.device.sticky is not None:
            raise self.device.sticky
        queued = self.device.queued_errors.get(name)
        if queued:
            raise queued.popleft()

    def _enqueue(self, stream: int, kind: str, *args) -> None:
        if stream not in self.device.streams:
            raise CudaError("enqueue", 400, "cudaErrorInvalidResourceHandle", f"no stream {stream:#x}")
        self.device.streams[stream].append(_Op(kind, args, self.rank))

    # -- device and streams -------------------------------------------------------------------
    def require(self):
        self._call("require")

    def set_device(self, device: int) -> None:
        self.device.thread.gpu = int(device)  # since CUDA 12, setting a device makes its primary context
        self._call("set_device", device)

    def get_device(self) -> int:
        self.device.calls.append((self.rank, "get_device", ()))
        return self.device.current_gpu()

    def device_synchronize(self) -> None:
        """Blocks, as the runtime's does, until every stream is empty: a stalled one keeps it waiting."""
        self._call("device_synchronize")
        deadline = time.monotonic() + self.device.sync_limit_s
        while True:
            self.device.run()
            if not self.device.pending():
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"device_synchronize blocked {self.device.sync_limit_s} s on stalled work")
            time.sleep(1e-3)

    def current_stream(self) -> int:
        return getattr(self._current, "stream", self.compute)

    @contextlib.contextmanager
    def use_stream(self, stream: int):
        """This thread's current stream is `stream` inside the block (torch.cuda.stream's job)."""
        before = getattr(self._current, "stream", None)
        self._current.stream = stream
        try:
            yield stream
        finally:
            if before is None:
                del self._current.stream
            else:
                self._current.stream = before

    def has_memcpy_batch(self) -> bool:
        return self.has_batch

    def stream_create(self) -> int:
        self._call("stream_create")
        return self.device.stream("copy")

    def side_stream(self) -> int:
        """A compute-side stream of this rank's device (a test's torch.cuda.Stream)."""
        return self.device.stream("compute", self.gpu)

    def stream_destroy(self, stream: int) -> None:
        self._call("stream_destroy", stream)

    def event_create(self, interprocess: bool = False) -> int:
        self._call("event_create", interprocess)
        eid = self.device.new_id()
        self.device.events[eid] = _Event(gpu=self.device.current_gpu())
        return eid

    def event_destroy(self, event: int) -> None:
        self._call("event_destroy", event)
        del self.device.events[event]

    def event_record(self, event: int, stream: int) -> None:
        self._call("event_record", event, stream)
        ev = self.device.events[event]
        if stream in self.device.stream_gpu and ev.gpu != self.device.stream_gpu[stream]:
            raise CudaError("cudaEventRecord", 400, "cudaErrorInvalidResourceHandle",
                            f"event of device {ev.gpu} recorded on a stream of device {self.device.stream_gpu[stream]}")
        ev.recorded += 1
        self._enqueue(stream, "record", event, ev.recorded)

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._call("stream_wait_event", stream, event)
        # CUDA semantics: the wait is for the event's latest record at the time of this call.
        self._enqueue(stream, "wait", event, self.device.events[event].recorded)

    def event_query(self, event: int) -> bool:
        self._call("event_query", event)
        if self.poll_runs:
            self.device.run()
        if self.device.sticky is not None:
            raise self.device.sticky
        ev = self.device.events[event]
        return ev.completed >= ev.recorded

    def event_wait(self, event: int, timeout_s: float) -> float:
        self._call("event_wait", event, timeout_s)
        start = time.perf_counter()
        while True:
            self.device.run()  # the host is blocked here: the device makes progress meanwhile
            if self.event_query(event):
                break
            if time.perf_counter() - start >= timeout_s:
                raise TimeoutError(f"event {event:#x} not done after {timeout_s:.3g} s")
            time.sleep(1e-3)
        return time.perf_counter() - start

    def launch(self, fn, stream: int | None = None) -> None:
        """A kernel on this thread's current stream, or `stream` (test code stands in for Triton)."""
        self.device.calls.append((self.rank, "launch", ()))
        self._enqueue(self.current_stream() if stream is None else stream, "kernel", fn)

    # -- copies -------------------------------------------------------------------------------
    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._call("memcpy_async", dst, src, nbytes, stream)
        self._enqueue(stream, "copy", (dst, src, nbytes))

    def prepare_batch(self, dsts, srcs, sizes, prefer_overlap=True):
        """The real cuda_api's prepared arguments (plain tuples and one attribute object: no driver)."""
        self._call("prepare_batch", list(dsts), list(srcs), list(sizes), prefer_overlap)
        return cuda_api.prepare_batch(dsts, srcs, sizes, prefer_overlap)

    def memcpy_prepared_batch(self, batch, stream) -> None:
        self._call("memcpy_prepared_batch", batch, stream)
        self._enqueue(stream, "copy", *zip(batch.dsts, batch.srcs, batch.sizes))

    def tensor_at(self, ptr: int, nbytes: int, device) -> torch.Tensor:
        """uint8 [nbytes] over host memory at `ptr` (the fake's device memory is host memory), built the
        way the real cuda_api builds it (DLPack with the device named, never a probe), on the CPU. A
        tensor that is not the memory at `ptr` (a copy) is an error."""
        from dwdp.runtime.transport.dlpack import tensor_over

        self._call("tensor_at", ptr, nbytes, device)
        tensor = tensor_over(ptr, nbytes, "cpu")
        if tensor.data_ptr() != ptr:
            raise AssertionError(f"tensor_at({ptr:#x}, {nbytes}) gave memory at {tensor.data_ptr():#x}: a copy")
        return tensor

    # -- peer memory --------------------------------------------------------------------------
    def ipc_export(self, ptr: int) -> tuple[bytes, int]:
        self._call("ipc_export", ptr)
        base = ptr - ptr % PAGE  # a nonzero offset whenever the segment does not start a page
        raw = (b"fake-ipc-%d-%x" % (self.rank, base)).ljust(cuda_api.IPC_HANDLE_BYTES, b"\0")
        self.device.exported[raw] = (self.rank, base)
        return raw, ptr - base

    def ipc_open(self, raw: bytes) -> int:
        self._call("ipc_open", raw)
        owner, base = self.device.exported[raw]
        if owner == self.rank:
            raise CudaError("cudaIpcOpenMemHandle", *OWN_HANDLE)
        self.device.opened[base] = self.device.opened.get(base, 0) + 1
        return base

    def ipc_close(self, base: int) -> None:
        self._call("ipc_close", base)
        if self.device.opened.get(base, 0) < 1:
            raise CudaError("cudaIpcCloseMemHandle", *INVALID_VALUE, "closed twice or never opened")
        self.device.opened[base] -= 1
        self.device.closed.append((self.rank, base))


def batch_error(fail_index: int | None, count: int) -> BatchCopyError:
    """The error cudaMemcpyBatchAsync raises through cuda_api (fail_index: 12.9 bindings)."""
    error = BatchCopyError.__new__(BatchCopyError)
    CudaError.__init__(error, "cudaMemcpyBatchAsync", *INVALID_VALUE,
                       f"copy {fail_index} of {count}" if fail_index is not None else f"one of {count} copies")
    error.fail_index = fail_index
    return error


def _seeded(rank: int, nbytes: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(77 + rank))


class FakeGroup:
    """G cuda transports in one process over one FakeDevice, segments filled with seeded bytes."""

    def __init__(self, num_experts=8, size=3, num_layers=3, *, copy="batch", copy_batches=3, has_batch=True,
                 poll_runs=True, num_local=None):
        self.device = FakeDevice()
        self.placement = build_placement(num_experts, size, num_local)
        self.layout = SegmentLayout(num_layers, self.placement.num_local_experts, TENSOR_NBYTES)
        self.apis = [FakeCudaApi(self.device, r, has_batch=has_batch, poll_runs=poll_runs) for r in range(size)]
        self.transports = [CudaTransport(r, "cpu", copy=copy, copy_batches=copy_batches, api=self.apis[r])
                           for r in range(size)]
        for r, t in enumerate(self.transports):
            t.alloc_segment(self.layout.total_nbytes).copy_(_seeded(r, self.layout.total_nbytes))
        self.handles = [t.register() for t in self.transports]

    def open(self):
        for t in self.transports:
            t.open(self.handles)
        return self

    def slot_nbytes(self, rank: int) -> int:
        return slot_layout(self.placement, rank, TENSOR_NBYTES).total_nbytes

    def expected(self, plan, nbytes: int, poison: torch.Tensor) -> torch.Tensor:
        """What the slot must hold: the plan executed on independently regenerated peer bytes."""
        peers = [_seeded(r, self.layout.total_nbytes) for r in range(len(self.transports))]
        return execute_plan_reference(plan, peers, poison.clone())

    def close(self):
        for t in self.transports:
            t.close()


class EagerFakeCudaApi(FakeCudaApi):
    """FakeCudaApi whose device runs work as soon as it is enqueued (stream order and waits kept):
    host code that reads memory right after making its stream wait (a CPU model standing in for the
    kernels a GPU would run after that wait) sees the copies landed. Used to run a DWDPModel on
    the cuda backend's control logic on a CPU."""

    def _enqueue(self, stream: int, kind: str, *args) -> None:
        super()._enqueue(stream, kind, *args)
        self.device.run()
