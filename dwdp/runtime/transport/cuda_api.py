"""The one module that calls `cuda.bindings`: small functions over the CUDA runtime and driver.

Everything the cuda transport does to the device goes through here, so tests replace this module
with a recording fake (`tests/fake_cuda.py`) and drive the transport's control logic on a CPU.

Conventions: streams, events and device pointers are plain ints; every call's return code is
checked and a failure raises `CudaError` naming the call, the CUDA error name and its text.
Without a usable driver every call raises `NoCudaDriverError` (one clear line), never a TypeError.

Version notes (cuda-bindings 12.9 and 13.x both work):
- `cudaMemcpyBatchAsync` returns `(err,)` on 13.x and `(err, failIdx)` on 12.9;
- `cudaIpcMemHandle_t` is opaque on 13.4+ (no `.reserved`), so its 64 bytes are read and written
  through `getPtr()` with ctypes, which works on both;
- runtime calls return `cudaErrorInsufficientDriver` (35) without a driver; driver calls raise
  `DynamicLibNotFoundError` (libcuda loads lazily), so `probe()` runs before any `drv.*` call.
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass

IPC_HANDLE_BYTES = 64
_NO_DRIVER_CODES = (35, 100)  # cudaErrorInsufficientDriver, cudaErrorNoDevice
_NOT_READY = 600              # cudaErrorNotReady
_PEER_ALREADY_ENABLED = 704   # cudaErrorPeerAccessAlreadyEnabled
_NO_DRIVER_HINT = "the cuda backend needs an NVIDIA GPU and driver; on a CPU machine use backend='host'"


class CudaError(RuntimeError):
    """A CUDA call failed: `call` is the function, `code` / `name` / `text` the CUDA error."""

    def __init__(self, call: str, code: int, name: str, text: str, detail: str = ""):
        self.call, self.code, self.name, self.text = call, code, name, text
        suffix = f" ({detail})" if detail else ""
        super().__init__(self._message(suffix))

    def _message(self, suffix: str) -> str:
        return f"{self.call} failed: {self.name} ({self.code}): {self.text}{suffix}"


class NoCudaDriverError(CudaError):
    """There is no usable CUDA driver or device on this machine."""

    def __init__(self, call: str, code: int, name: str, text: str):
        super().__init__(call, code, name, text)

    def _message(self, suffix: str) -> str:
        return f"no usable CUDA device ({self.call}: {self.name} ({self.code}): {self.text}); {_NO_DRIVER_HINT}"


def _bindings():
    try:
        from cuda.bindings import driver, runtime
    except ImportError as exc:  # cuda-python is a core dependency; say so instead of a bare ImportError
        raise NoCudaDriverError("import cuda.bindings", -1, "ImportError", str(exc)) from exc
    return runtime, driver


def _decode(value) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def error_name_text(err) -> tuple[int, str, str]:
    """(code, name, text) of a runtime error value (enum or int)."""
    rt, _ = _bindings()
    code = int(err)
    try:
        name = _decode(rt.cudaGetErrorName(code)[1])
        text = _decode(rt.cudaGetErrorString(code)[1])
    except Exception:  # an unknown code: still name it
        name, text = f"cudaError_{code}", "unknown error"
    return code, name, text


def error_text(err) -> str:
    """'cudaErrorX (n): text' for a runtime error value."""
    code, name, text = error_name_text(err)
    return f"{name} ({code}): {text}"


def _raise(call: str, err, detail: str = "") -> None:
    code, name, text = error_name_text(err)
    if code in _NO_DRIVER_CODES:
        raise NoCudaDriverError(call, code, name, text)
    raise CudaError(call, code, name, text, detail)


def _check(call: str, result, detail: str = ""):
    """Raise on a failed runtime call; return its outputs (None, one value, or a tuple)."""
    err = result[0]
    if int(err) != 0:
        _raise(call, err, detail)
    outputs = result[1:]
    if not outputs:
        return None
    return outputs[0] if len(outputs) == 1 else outputs


def _check_driver(call: str, fn, *args):
    """Call a driver function; its CUresult and a missing libcuda both become our errors."""
    try:
        result = fn(*args)
    except RuntimeError as exc:  # DynamicLibNotFoundError: no driver library on this machine
        raise NoCudaDriverError(call, 35, "DynamicLibNotFoundError", str(exc)) from exc
    err = result[0]
    if int(err) != 0:
        _, drv = _bindings()
        try:
            name = _decode(drv.cuGetErrorName(err)[1])
            text = _decode(drv.cuGetErrorString(err)[1])
        except Exception:  # no libcuda to ask: the enum still names the code
            try:
                name, text = drv.CUresult(int(err)).name, "(no driver to describe it)"
            except ValueError:
                name, text = f"CUresult_{int(err)}", "unknown error"
        raise CudaError(call, int(err), name, text)
    outputs = result[1:]
    return outputs[0] if len(outputs) == 1 else outputs


# -- device --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CudaInfo:
    """What `probe` found; `error` is None when at least one device is usable."""

    device_count: int
    runtime_version: int
    driver_version: int
    bindings_version: str
    error: str | None

    @property
    def usable(self) -> bool:
        return self.error is None


def probe() -> CudaInfo:
    """Devices, driver, runtime and bindings versions; never raises."""
    try:
        rt, _ = _bindings()
        import cuda.bindings as bindings

        version = getattr(bindings, "__version__", "unknown")
    except NoCudaDriverError as exc:
        return CudaInfo(0, 0, 0, "missing", str(exc))
    runtime_version = rt.cudaRuntimeGetVersion()[1] or 0
    driver_version = rt.cudaDriverGetVersion()[1] or 0
    err, count = rt.cudaGetDeviceCount()
    if int(err) != 0:
        return CudaInfo(0, runtime_version, driver_version, version, f"cudaGetDeviceCount: {error_text(err)}")
    if not count:
        return CudaInfo(0, runtime_version, driver_version, version, "no CUDA device")
    return CudaInfo(int(count), runtime_version, driver_version, version, None)


def require() -> CudaInfo:
    """The probe's result, or NoCudaDriverError with one clear line."""
    info = probe()
    if not info.usable:
        rt, _ = _bindings()
        err, _count = rt.cudaGetDeviceCount()
        code, name, text = error_name_text(err) if int(err) else (100, "cudaErrorNoDevice", info.error or "")
        raise NoCudaDriverError("cudaGetDeviceCount", code, name, text)
    return info


def set_device(device: int) -> None:
    rt, _ = _bindings()
    _check("cudaSetDevice", rt.cudaSetDevice(int(device)), f"device {device}")


def get_device() -> int:
    """The calling thread's current device (0 on a thread that never set one; makes no context)."""
    rt, _ = _bindings()
    return int(_check("cudaGetDevice", rt.cudaGetDevice()))


def device_synchronize() -> None:
    """Every queued operation of the current device finished, whatever stream it is on (setup and
    teardown only, never on the hot path; it has no deadline: see CudaTransport's drain)."""
    rt, _ = _bindings()
    _check("cudaDeviceSynchronize", rt.cudaDeviceSynchronize())


def current_stream() -> int:
    """The raw pointer of torch's current stream: where compute kernels (and Triton) are launched."""
    import torch

    if not torch.cuda.is_available():
        raise NoCudaDriverError("torch.cuda.current_stream", 35, "no CUDA in torch",
                                f"torch {torch.__version__} sees no CUDA device")
    return int(torch.cuda.current_stream().cuda_stream)


# -- streams and events --------------------------------------------------------------------------
def stream_create() -> int:
    """A non-blocking stream (never synchronises with the legacy default stream)."""
    rt, _ = _bindings()
    return int(_check("cudaStreamCreateWithFlags", rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking)))


def stream_destroy(stream: int) -> None:
    rt, _ = _bindings()
    _check("cudaStreamDestroy", rt.cudaStreamDestroy(stream))


def event_create(interprocess: bool = False) -> int:
    """An event without timing (cheaper to record and wait on)."""
    rt, _ = _bindings()
    flags = rt.cudaEventDisableTiming | (rt.cudaEventInterprocess if interprocess else 0)
    return int(_check("cudaEventCreateWithFlags", rt.cudaEventCreateWithFlags(flags)))


def event_destroy(event: int) -> None:
    rt, _ = _bindings()
    _check("cudaEventDestroy", rt.cudaEventDestroy(event))


def event_record(event: int, stream: int) -> None:
    rt, _ = _bindings()
    _check("cudaEventRecord", rt.cudaEventRecord(event, stream))


def stream_wait_event(stream: int, event: int) -> None:
    """Work enqueued on `stream` after this call waits for `event`; the host does not wait."""
    rt, _ = _bindings()
    _check("cudaStreamWaitEvent", rt.cudaStreamWaitEvent(stream, event, 0))


def event_query(event: int) -> bool:
    """True when done, False while pending; any other status (a sticky error) raises."""
    rt, _ = _bindings()
    (err,) = rt.cudaEventQuery(event)
    if int(err) == 0:
        return True
    if int(err) == _NOT_READY:
        return False
    _raise("cudaEventQuery", err)


def event_wait(event: int, timeout_s: float) -> float:
    """Block the host until `event` is done, polling with back-off (cudaEventSynchronize has no
    timeout). Returns the seconds waited; raises TimeoutError after `timeout_s`."""
    start = time.perf_counter()
    deadline = start + timeout_s
    pause = 50e-6
    while not event_query(event):
        if time.perf_counter() >= deadline:
            raise TimeoutError(f"event {event:#x} not done after {timeout_s:.3g} s")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    return time.perf_counter() - start


# -- copies --------------------------------------------------------------------------------------
def tensor_at(ptr: int, nbytes: int, device) -> "torch.Tensor":
    """uint8 [nbytes] over device memory this process mapped itself (cuMemMap), on `device` exactly:
    built through DLPack with the device id (dwdp.runtime.transport.dlpack), so torch never probes the
    pointer (a probe copies memory that lives on another GPU). torch does not own it: it stays valid
    only until the mapping is unmapped. Ran on one H200 (segment, views, peer segments: data_ptr is the mapping)."""
    from dwdp.runtime.transport.dlpack import tensor_over

    if nbytes < 1:
        raise ValueError(f"tensor_at(ptr={ptr:#x}, nbytes={nbytes}): nbytes must be >= 1")
    require()  # without a driver: the one clear error, not torch's "Cannot initialize CUDA"
    return tensor_over(ptr, nbytes, device)


def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    rt, _ = _bindings()
    _check("cudaMemcpyAsync", rt.cudaMemcpyAsync(dst, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyDefault, stream),
           f"{nbytes} bytes {src:#x} -> {dst:#x}")


def has_memcpy_batch() -> bool:
    """cudaMemcpyBatchAsync exists in these bindings and the runtime (CUDA >= 12.8)."""
    rt, _ = _bindings()
    return hasattr(rt, "cudaMemcpyBatchAsync") and (rt.cudaRuntimeGetVersion()[1] or 0) >= 12080


class BatchCopyError(CudaError):
    """cudaMemcpyBatchAsync failed; `fail_index` is the failing copy when the bindings report it (12.9)."""

    def __init__(self, err, fail_index: int | None, count: int):
        code, name, text = error_name_text(err)
        self.fail_index = fail_index
        where = f"copy {fail_index} of {count}" if fail_index is not None else f"one of {count} copies"
        super().__init__("cudaMemcpyBatchAsync", code, name, text, where)


@dataclass(frozen=True, eq=False)
class PreparedBatch:
    """Every argument of one cudaMemcpyBatchAsync call, built once and passed as is on each issue.

    dsts / srcs / sizes: one entry per copy (tuples, so a cached batch cannot be changed under a
    later issue); attrs / attr_indices: one stream-ordered attribute for the whole batch.
    """

    dsts: tuple[int, ...]
    srcs: tuple[int, ...]
    sizes: tuple[int, ...]
    attrs: list
    attr_indices: list

    @property
    def count(self) -> int:
        return len(self.sizes)


_BATCH_ATTRS: dict[bool, list] = {}  # prefer_overlap -> [cudaMemcpyAttributes]: one object, shared


def _batch_attrs(prefer_overlap: bool) -> list:
    """The one attribute of every batch: source read in stream order (a copy issued after a wait
    reads what the awaited work wrote), with or without the PreferOverlapWithCompute hint."""
    attrs = _BATCH_ATTRS.get(prefer_overlap)
    if attrs is None:
        rt, _ = _bindings()
        attr = rt.cudaMemcpyAttributes()
        attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        if prefer_overlap:
            attr.flags = rt.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
        attrs = _BATCH_ATTRS[prefer_overlap] = [attr]
    return attrs


def prepare_batch(dsts, srcs, sizes, prefer_overlap: bool = True) -> PreparedBatch:
    """The arguments of one batch of copies `sizes[i]` bytes `srcs[i]` -> `dsts[i]`, ready to issue
    any number of times with `memcpy_prepared_batch` (no per-issue conversion on our side)."""
    dsts, srcs, sizes = tuple(int(d) for d in dsts), tuple(int(s) for s in srcs), tuple(int(n) for n in sizes)
    if not len(dsts) == len(srcs) == len(sizes):
        raise ValueError(f"a batch needs one dst, src and size per copy, got {len(dsts)} dsts, {len(srcs)} srcs "
                         f"and {len(sizes)} sizes")
    if not sizes:
        raise ValueError("an empty batch of copies: issue nothing instead")
    if min(sizes) < 1:
        raise ValueError(f"copy sizes must be >= 1 byte, got {min(sizes)}")
    return PreparedBatch(dsts, srcs, sizes, _batch_attrs(bool(prefer_overlap)), [0])


def memcpy_prepared_batch(batch: PreparedBatch, stream: int) -> None:
    """One cudaMemcpyBatchAsync of a prepared batch: unordered copies, stream-ordered as a whole.

    The bindings still turn the three tuples into C arrays on every call (0.13 us per copy on a
    2-core CPU VM: bench/submit_cost.py); the runtime's and the driver's work per copy comes after."""
    rt, _ = _bindings()
    result = rt.cudaMemcpyBatchAsync(batch.dsts, batch.srcs, batch.sizes, batch.count, batch.attrs,
                                     batch.attr_indices, 1, stream)
    err = result[0]
    if int(err) != 0:
        code = int(err)
        if code in _NO_DRIVER_CODES:
            _raise("cudaMemcpyBatchAsync", err)
        fail_index = int(result[1]) if len(result) > 1 and result[1] is not None else None
        if fail_index is not None and fail_index >= batch.count:  # SIZE_MAX: not tied to one copy
            fail_index = None
        raise BatchCopyError(err, fail_index, batch.count)


def memcpy_batch_async(dsts: list[int], srcs: list[int], sizes: list[int], stream: int,
                       prefer_overlap: bool = True) -> None:
    """One batch of unordered copies, stream-ordered as a whole, prepared for this one call (a batch
    issued again and again: `prepare_batch` once, then `memcpy_prepared_batch`). An empty batch
    issues nothing."""
    if not sizes:
        return
    memcpy_prepared_batch(prepare_batch(dsts, srcs, sizes, prefer_overlap), stream)


# -- peer memory ---------------------------------------------------------------------------------
def allocation_base(ptr: int) -> int:
    """Start of the cudaMalloc block that holds `ptr` (IPC handles name whole blocks)."""
    _, drv = _bindings()
    base, _size = _check_driver("cuMemGetAddressRange", drv.cuMemGetAddressRange, ptr)
    return int(base)


def ipc_export(ptr: int) -> tuple[bytes, int]:
    """(64 handle bytes of the block holding `ptr`, offset of `ptr` in that block)."""
    rt, _ = _bindings()
    handle = _check("cudaIpcGetMemHandle", rt.cudaIpcGetMemHandle(ptr), f"pointer {ptr:#x}")
    raw = ctypes.string_at(handle.getPtr(), IPC_HANDLE_BYTES)
    return raw, ptr - allocation_base(ptr)


def ipc_open(raw: bytes) -> int:
    """Map another process's block from its 64 handle bytes; returns the block's base here."""
    if not isinstance(raw, (bytes, bytearray)) or len(raw) != IPC_HANDLE_BYTES:
        raise ValueError(f"an IPC handle is {IPC_HANDLE_BYTES} bytes, got {type(raw).__name__} "
                         f"of length {len(raw) if hasattr(raw, '__len__') else '?'}")
    rt, _ = _bindings()
    handle = rt.cudaIpcMemHandle_t()
    ctypes.memmove(handle.getPtr(), bytes(raw), IPC_HANDLE_BYTES)
    return int(_check("cudaIpcOpenMemHandle", rt.cudaIpcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess)))


def ipc_close(base: int) -> None:
    rt, _ = _bindings()
    _check("cudaIpcCloseMemHandle", rt.cudaIpcCloseMemHandle(base), f"base {base:#x}")


def can_access_peer(device: int, peer: int) -> bool:
    rt, _ = _bindings()
    return bool(_check("cudaDeviceCanAccessPeer", rt.cudaDeviceCanAccessPeer(device, peer)))


def enable_peer_access(peer: int) -> None:
    """Let the current device read `peer`'s memory directly; already enabled counts as success."""
    rt, _ = _bindings()
    (err,) = rt.cudaDeviceEnablePeerAccess(peer, 0)
    if int(err) not in (0, _PEER_ALREADY_ENABLED):
        _raise("cudaDeviceEnablePeerAccess", err, f"peer device {peer}")
    if int(err) == _PEER_ALREADY_ENABLED:
        rt.cudaGetLastError()  # the runtime keeps the last error; clear it so it is not reported later
