"""A recording fake of `cuda.bindings.driver`'s cuMem calls: same function names and parameters as the
real bindings (tests compare inspect.signature), the real structs and enums (anything else is taken
from the real module), and host memory behind every allocation so tests check bytes.

It is as strict as the documentation and as the H200 run of shared/gpu/probe_vmm.py
(bench/results/probe_vmm_h200_862d26c.json), and counts every call. The rules, each with what it
stands for (CUDA Driver API reference, "Virtual Memory Management"; "probe Cn" is that run's check):

  R1 context   Every cuMem call needs cuInit and a current context on the calling thread
               (CUDA_ERROR_NOT_INITIALIZED / CUDA_ERROR_INVALID_CONTEXT). cuCtxGetCurrent answers a
               NULL context until cuCtxSetCurrent; contexts are per thread, as in the driver.
  R2 create    cuMemCreate: `size` a positive multiple of the MINIMUM granularity; `prop` a
               CUmemAllocationProp of type PINNED; FABRIC requested where the node has no IMEX channel
               is CUDA_ERROR_NOT_PERMITTED at create (probe C10: on a single H200 that lists
               HANDLE_TYPE_FABRIC_SUPPORTED = 1, cuMemCreate refused with NOT_PERMITTED).
  R3 granules  cuMemGetAllocationGranularity: RECOMMENDED is larger than MINIMUM here (the docs allow
               it; code that mixes the two maps misaligned sizes and is refused by R2/R4/R5).
  R4 map       cuMemMap maps a whole allocation at offset 0: `offset` "currently must be zero"
               (cuMemMap parameter docs; probe C4: CUDA_ERROR_NOT_SUPPORTED at offsets g and 2g) and
               `size` must be the allocation's size (TensorRT-LLM and PyTorch's expandable segments map
               every handle whole; a piece is refused here with CUDA_ERROR_INVALID_VALUE); `ptr` a
               multiple of the granularity inside one reservation, over no existing mapping.
  R5 reserve   cuMemAddressReserve: `size` a multiple of the granularity, `alignment` 0 or a power of
               two (probe C11: alignment 3g is CUDA_ERROR_INVALID_VALUE).
  R6 export    cuMemExportToShareableHandle of a type the allocation did not request in
               `requestedHandleTypes` is CUDA_ERROR_INVALID_VALUE (probe C12: a NONE allocation
               exported as a POSIX fd); a device without fabric support refuses a FABRIC export with
               CUDA_ERROR_NOT_PERMITTED.
  R7 import    a FABRIC import can be refused with CUDA_ERROR_NOT_PERMITTED after the export
               succeeded (another IMEX channel): `refuse_fabric_import`.
  R8 access    cuMemSetAccess over a range that is not wholly mapped is CUDA_ERROR_INVALID_VALUE.
  R9 teardown  cuMemUnmap of exactly one mapping; cuMemAddressFree of exactly one reservation with
               nothing mapped in it; cuMemRelease of a live handle.
Any argument that is not the bindings' struct or enum is CUDA_ERROR_INVALID_VALUE (the real calls
raise TypeError on most of these; refusing keeps the fake's own checks in one place).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import threading

import torch
from cuda.bindings import driver as real

GRANULARITY = 2 << 20
_OK = real.CUresult.CUDA_SUCCESS
_INVALID = real.CUresult.CUDA_ERROR_INVALID_VALUE
_NOT_PERMITTED = real.CUresult.CUDA_ERROR_NOT_PERMITTED
_NOT_SUPPORTED = real.CUresult.CUDA_ERROR_NOT_SUPPORTED
_INVALID_CONTEXT = real.CUresult.CUDA_ERROR_INVALID_CONTEXT
_NOT_INITIALIZED = real.CUresult.CUDA_ERROR_NOT_INITIALIZED
_POSIX = real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_FABRIC = real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
_PRIMARY_CONTEXT = 0x5C0DE  # the fake device's primary context (one device per driver object)

# Fabric handles are valid across processes of one NVLink domain: every fake driver of a test
# process resolves every other's (handle bytes -> (driver, handle)).
_FABRIC_EXPORTS: dict[bytes, tuple["FakeDriver", int]] = {}


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class FakeDriver:
    """granularity: the MINIMUM granularity (RECOMMENDED is twice it, R3). supported: the handle types
    the device lists ("posix_fd", "fabric"). imex: whether the node has an IMEX channel (R2)."""

    def __init__(self, granularity: int = GRANULARITY, supported=("posix_fd", "fabric"), imex: bool = True,
                 none_granularity: int | None = None):
        self.granularity, self.supported, self.imex = granularity, set(supported), imex
        # The MINIMUM granularity of allocations that request no handle type (the driver may answer per type).
        self.none_granularity = granularity if none_granularity is None else none_granularity
        self.calls: list[tuple] = []          # (name, args)
        self.errors: list[str] = []           # why each refused call was refused
        self.memory: dict[int, torch.Tensor] = {}   # handle -> its bytes
        self.handle_types: dict[int, int] = {}      # handle -> requestedHandleTypes it was created with
        self.reserved: dict[int, int] = {}    # base -> size
        self.mapped: dict[int, tuple[int, int]] = {}  # ptr -> (size, handle)
        self.access: list[tuple[int, int]] = []  # (ptr, size) of each set-access
        self.refused_exports: set[int] = set()
        self.refuse_fabric_import = False
        self.initialized = False
        self.retained = 0                     # primary-context references taken
        self._thread = threading.local()      # .context: this thread's current context (R1)
        self._next_handle, self._next_va = 1, 1 << 40

    def __getattr__(self, name):  # structs, enums and anything not faked: the real bindings'
        return getattr(real, name)

    def fail_once(self, name: str, code=_INVALID, skip: int = 0) -> None:
        """Call `skip` + 1 of driver function `name` from now fails with `code` (recorded, changing
        nothing); the calls before and after it work."""
        working = getattr(self, name)
        left = [skip]

        def failing(*args):
            if left[0] > 0:
                left[0] -= 1
                return working(*args)
            del self.__dict__[name]  # back to the working method
            self.calls.append((name, args))
            return self._refuse(f"{name} failed once, on demand", code)

        setattr(self, name, failing)

    def refuse_export(self, handle_type) -> None:
        self.refused_exports.add(int(handle_type))

    def _refuse(self, why: str, code=_INVALID):
        self.errors.append(why)
        return (code,)

    def names(self, queries: bool = False) -> list[str]:
        """The calls made, in order; without `queries`, less cuCtxGetCurrent (a question Vmm asks before
        each call, which changes nothing)."""
        return [name for name, _ in self.calls if queries or name != "cuCtxGetCurrent"]

    def _context_error(self, name: str):
        """R1: None when a cuMem call may run on this thread, else the driver's answer."""
        if not self.initialized:
            return self._refuse(f"{name} before cuInit", _NOT_INITIALIZED)
        if getattr(self._thread, "context", 0) != _PRIMARY_CONTEXT:
            return self._refuse(f"{name} with no current context on thread {threading.current_thread().name}",
                                _INVALID_CONTEXT)
        return None

    # -- context (R1) ---------------------------------------------------------------------------------
    def cuInit(self, Flags):
        self.calls.append(("cuInit", (Flags,)))
        self.initialized = True
        return (_OK,)

    def cuDeviceGet(self, ordinal):
        self.calls.append(("cuDeviceGet", (ordinal,)))
        if not self.initialized:
            return self._refuse("cuDeviceGet before cuInit", _NOT_INITIALIZED)
        return (_OK, real.CUdevice(ordinal))

    def cuCtxGetCurrent(self):
        self.calls.append(("cuCtxGetCurrent", ()))
        return (_OK, real.CUcontext(getattr(self._thread, "context", 0)))

    def cuDevicePrimaryCtxRetain(self, dev):
        self.calls.append(("cuDevicePrimaryCtxRetain", (dev,)))
        if not self.initialized:
            return self._refuse("cuDevicePrimaryCtxRetain before cuInit", _NOT_INITIALIZED)
        if not isinstance(dev, real.CUdevice):
            return self._refuse(f"dev {dev!r} is not a CUdevice")
        self.retained += 1
        return (_OK, real.CUcontext(_PRIMARY_CONTEXT))

    def cuDevicePrimaryCtxRelease(self, dev):
        self.calls.append(("cuDevicePrimaryCtxRelease", (dev,)))
        if self.retained < 1:
            return self._refuse("cuDevicePrimaryCtxRelease without a retain")
        self.retained -= 1
        return (_OK,)

    def cuCtxSetCurrent(self, ctx):
        self.calls.append(("cuCtxSetCurrent", (ctx,)))
        if not isinstance(ctx, real.CUcontext):
            return self._refuse(f"ctx {ctx!r} is not a CUcontext")
        self._thread.context = int(ctx)
        return (_OK,)

    def make_current(self) -> None:
        """What a process that already runs CUDA work (torch) has: an initialised driver and the primary
        context current on this thread."""
        self.initialized, self._thread.context = True, _PRIMARY_CONTEXT

    # -- the cuMem calls, with the real parameter names ---------------------------------------------
    def cuDeviceGetAttribute(self, attrib, dev):
        self.calls.append(("cuDeviceGetAttribute", (attrib, dev)))
        if not self.initialized:
            return self._refuse("cuDeviceGetAttribute before cuInit", _NOT_INITIALIZED)
        if not isinstance(attrib, real.CUdevice_attribute):
            return self._refuse(f"attrib {attrib!r} is not a CUdevice_attribute")
        kind = {real.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: "posix_fd",
                real.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: "fabric"}.get(attrib)
        return (_OK, int(kind in self.supported))

    def cuMemGetAllocationGranularity(self, prop, option):
        self.calls.append(("cuMemGetAllocationGranularity", (prop, option)))
        if (err := self._context_error("cuMemGetAllocationGranularity")) is not None:
            return err
        if not isinstance(prop, real.CUmemAllocationProp):
            return self._refuse(f"prop {type(prop).__name__} is not a CUmemAllocationProp")
        if not isinstance(option, real.CUmemAllocationGranularity_flags):
            return self._refuse(f"option {option!r} is not a CUmemAllocationGranularity_flags")
        recommended = option == real.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        minimum = self._minimum(prop.requestedHandleTypes)
        return (_OK, 2 * minimum if recommended else minimum)  # R3

    def _minimum(self, handle_types) -> int:
        none = real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        return self.none_granularity if int(handle_types) == int(none) else self.granularity

    def cuMemCreate(self, size, prop, flags):
        self.calls.append(("cuMemCreate", (size, prop, flags)))
        if (err := self._context_error("cuMemCreate")) is not None:
            return err
        if not isinstance(prop, real.CUmemAllocationProp):
            return self._refuse(f"prop {type(prop).__name__} is not a CUmemAllocationProp")
        if not isinstance(prop.requestedHandleTypes, real.CUmemAllocationHandleType):
            return self._refuse("requestedHandleTypes is not a CUmemAllocationHandleType")
        if prop.type != real.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED:
            return self._refuse(f"allocation type {prop.type!r} is not PINNED")
        minimum = self._minimum(prop.requestedHandleTypes)
        if size <= 0 or size % minimum:
            return self._refuse(f"cuMemCreate size {size} is not a positive multiple of {minimum}")
        if int(prop.requestedHandleTypes) & int(_FABRIC) and not (self.imex and "fabric" in self.supported):
            return self._refuse("cuMemCreate with FABRIC handles on a node without an IMEX channel", _NOT_PERMITTED)
        handle = self._next_handle
        self._next_handle += 1
        self.memory[handle] = torch.zeros(size, dtype=torch.uint8)
        self.handle_types[handle] = int(prop.requestedHandleTypes)
        return (_OK, handle)

    def _export_error(self, handle, handleType):
        """R6: None when `handle` may be exported as `handleType`, else the driver's answer."""
        if (err := self._context_error("cuMemExportToShareableHandle")) is not None:
            return err
        if not isinstance(handleType, real.CUmemAllocationHandleType):
            return self._refuse(f"handleType {handleType!r} is not a CUmemAllocationHandleType")
        if int(handleType) in self.refused_exports:
            return self._refuse(f"export as {handleType.name} refused (test)", _NOT_PERMITTED)
        if handleType == _FABRIC and not (self.imex and "fabric" in self.supported):
            return self._refuse("FABRIC export on a device without fabric support", _NOT_PERMITTED)
        if handle not in self.memory:
            return self._refuse(f"export of unknown handle {handle}")
        if not self.handle_types[handle] & int(handleType):
            return self._refuse(f"export of handle {handle} as {handleType.name}: it was created requesting "
                                f"{real.CUmemAllocationHandleType(self.handle_types[handle]).name}")
        return None

    def cuMemExportToShareableHandle(self, handle, handleType, flags):
        self.calls.append(("cuMemExportToShareableHandle", (handle, handleType, flags)))
        if (err := self._export_error(handle, handleType)) is not None:
            return err
        if handleType == _FABRIC:
            shareable = real.CUmemFabricHandle()
            raw = (b"fake-fabric-%d-%d" % (id(self), handle)).ljust(64, b"\0")
            ctypes.memmove(shareable.getPtr(), raw, 64)
            _FABRIC_EXPORTS[raw] = (self, handle)
            return (_OK, shareable)
        return (_OK, os.memfd_create(f"fake-cumem-{handle}"))  # a real fd: the caller must close it

    def cuMemImportFromShareableHandle(self, osHandle, shHandleType):
        self.calls.append(("cuMemImportFromShareableHandle", (osHandle, shHandleType)))
        if (err := self._context_error("cuMemImportFromShareableHandle")) is not None:
            return err
        if not isinstance(shHandleType, real.CUmemAllocationHandleType):
            return self._refuse(f"shHandleType {shHandleType!r} is not a CUmemAllocationHandleType")
        if shHandleType == _FABRIC:
            if self.refuse_fabric_import:
                return self._refuse("FABRIC import refused (another IMEX channel)", _NOT_PERMITTED)  # R7
            exporter = _FABRIC_EXPORTS.get(bytes(osHandle))
            if exporter is None or exporter[1] not in exporter[0].memory:
                return self._refuse("FABRIC import of unknown handle bytes")
            handle = self._next_handle
            self._next_handle += 1
            self.memory[handle] = exporter[0].memory[exporter[1]]  # the same physical bytes
            self.handle_types[handle] = int(_FABRIC)
            return (_OK, handle)
        return (_OK, osHandle)

    def cuMemAddressReserve(self, size, alignment, addr, flags):
        self.calls.append(("cuMemAddressReserve", (size, alignment, addr, flags)))
        if (err := self._reserve_error(size, alignment)) is not None:
            return err
        base = self._next_va
        self._next_va += size + self.granularity
        self.reserved[base] = size
        return (_OK, base)

    def _reserve_error(self, size, alignment):
        """R5: None when the reservation is valid, else the driver's answer."""
        if (err := self._context_error("cuMemAddressReserve")) is not None:
            return err
        if size <= 0 or size % self.granularity:
            return self._refuse(f"reserve size {size} is not a positive multiple of {self.granularity}")
        if alignment != 0 and not _is_power_of_two(alignment):
            return self._refuse(f"reserve alignment {alignment} is not 0 or a power of two")
        return None

    def _map_error(self, ptr, size, offset, handle):
        """R4: None when the mapping is valid, else the driver's answer."""
        if (err := self._context_error("cuMemMap")) is not None:
            return err
        g = self.granularity
        if offset != 0:
            return self._refuse(f"cuMemMap at offset {offset}: the offset must be zero", _NOT_SUPPORTED)
        if handle not in self.memory:
            return self._refuse(f"cuMemMap of unknown handle {handle}")
        if size != self.memory[handle].numel():
            return self._refuse(f"cuMemMap of {size} bytes of handle {handle}: an allocation is mapped whole "
                                f"({self.memory[handle].numel()} bytes)")
        if ptr % g or size <= 0:
            return self._refuse(f"cuMemMap(ptr={ptr:#x}, size={size}) not multiples of {g}")
        if not any(b <= ptr and ptr + size <= b + n for b, n in self.reserved.items()):
            return self._refuse(f"cuMemMap at {ptr:#x} of {size} bytes outside every reservation")
        if any(p < ptr + size and ptr < p + n for p, (n, _) in self.mapped.items()):
            return self._refuse(f"cuMemMap at {ptr:#x} over an existing mapping")
        return None

    def cuMemMap(self, ptr, size, offset, handle, flags):
        self.calls.append(("cuMemMap", (ptr, size, offset, handle, flags)))
        if (err := self._map_error(ptr, size, offset, handle)) is not None:
            return err
        self.mapped[ptr] = (size, handle)
        return (_OK,)

    def cuMemSetAccess(self, ptr, size, desc, count):
        self.calls.append(("cuMemSetAccess", (ptr, size, desc, count)))
        if (err := self._context_error("cuMemSetAccess")) is not None:
            return err
        if count != len(desc) or not all(isinstance(d, real.CUmemAccessDesc) for d in desc):
            return self._refuse("desc must be a list of `count` CUmemAccessDesc")
        if any(d.flags != real.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE for d in desc):
            return self._refuse("access flags are not PROT_READWRITE")
        covered = sum(min(p + n, ptr + size) - max(p, ptr) for p, (n, _) in self.mapped.items()
                      if p < ptr + size and ptr < p + n)
        if covered != size:
            return self._refuse(f"cuMemSetAccess over [{ptr:#x}, +{size}) that is not wholly mapped")
        self.access.append((ptr, size))
        return (_OK,)

    def cuMemUnmap(self, ptr, size):
        self.calls.append(("cuMemUnmap", (ptr, size)))
        if (err := self._context_error("cuMemUnmap")) is not None:
            return err
        if ptr not in self.mapped or self.mapped[ptr][0] != size:
            return self._refuse(f"cuMemUnmap({ptr:#x}, {size}) is not one mapping")
        del self.mapped[ptr]
        return (_OK,)

    def cuMemAddressFree(self, ptr, size):
        self.calls.append(("cuMemAddressFree", (ptr, size)))
        if (err := self._context_error("cuMemAddressFree")) is not None:
            return err
        if self.reserved.get(ptr) != size:
            return self._refuse(f"cuMemAddressFree({ptr:#x}, {size}) is not one reservation")
        if any(ptr <= p < ptr + size for p in self.mapped):
            return self._refuse("cuMemAddressFree of a range that is still mapped")
        del self.reserved[ptr]
        return (_OK,)

    def cuMemRelease(self, handle):
        self.calls.append(("cuMemRelease", (handle,)))
        if (err := self._context_error("cuMemRelease")) is not None:
            return err
        if handle not in self.memory:
            return self._refuse(f"cuMemRelease of unknown handle {handle}")
        del self.memory[handle]
        self.handle_types.pop(handle, None)
        return (_OK,)

    # -- test helpers: bytes through the mappings (what a kernel would read) -------------------------
    def _resolve(self, ptr: int, nbytes: int):
        for p, (n, handle) in self.mapped.items():
            if p <= ptr and ptr + nbytes <= p + n:
                return self.memory[handle][ptr - p:ptr - p + nbytes]
        raise AssertionError(f"[{ptr:#x}, +{nbytes}) is not inside one mapping")

    def read(self, ptr: int, nbytes: int) -> torch.Tensor:
        out, at = torch.empty(nbytes, dtype=torch.uint8), 0
        while at < nbytes:
            n = min(nbytes - at, self.granularity - (ptr + at) % self.granularity)
            out[at:at + n] = self._resolve(ptr + at, n)
            at += n
        return out

    def write(self, ptr: int, data: torch.Tensor) -> None:
        at = 0
        while at < data.numel():
            n = min(data.numel() - at, self.granularity - (ptr + at) % self.granularity)
            self._resolve(ptr + at, n).copy_(data[at:at + n])
            at += n


class HostBackedDriver(FakeDriver):
    """FakeDriver whose device memory is host memory at the addresses it hands out, so the recording
    runtime fake (tests/fake_cuda.py, which copies with memmove) and torch tensors can use them:
    every allocation is a memfd, a reservation is a PROT_NONE range (aligned to the granularity), a
    cuMemMap is mmap(MAP_SHARED | MAP_FIXED) of the allocation's file, and a POSIX-fd export is a real
    descriptor of that file, so an importer that receives it (pidfd_getfd, SCM_RIGHTS) maps the same
    bytes. An import maps the received file itself, so each rank may have a driver of its own (as
    processes do) and still see its peers' bytes. Fabric handles are not backed (FakeDriver's are)."""

    def __init__(self, granularity: int = GRANULARITY, supported=("posix_fd",), imex: bool = False):
        super().__init__(granularity, supported, imex)
        self.files: dict[int, int] = {}         # handle -> memfd (imports share their exporter's)
        self.imports: set[int] = set()          # handles made by cuMemImportFromShareableHandle
        self._reservations: dict[int, object] = {}  # base -> Reservation
        self._maps: list = []                   # python mmap objects behind `memory` (kept open)

    def cuMemCreate(self, size, prop, flags):
        result = super().cuMemCreate(size, prop, flags)
        if result[0] != _OK:
            return result
        handle = result[1]
        fd = os.memfd_create(f"fake-cumem-{handle}")
        os.ftruncate(fd, size)
        view = mmap.mmap(fd, size)
        self._maps.append(view)
        self.memory[handle] = torch.frombuffer(view, dtype=torch.uint8)
        self.files[handle] = fd
        return result

    def cuMemExportToShareableHandle(self, handle, handleType, flags):
        if handleType != _POSIX:
            return super().cuMemExportToShareableHandle(handle, handleType, flags)
        self.calls.append(("cuMemExportToShareableHandle", (handle, handleType, flags)))
        if (err := self._export_error(handle, handleType)) is not None:
            return err
        return (_OK, os.dup(self.files[handle]))

    def cuMemImportFromShareableHandle(self, osHandle, shHandleType):
        self.calls.append(("cuMemImportFromShareableHandle", (osHandle, shHandleType)))
        if (err := self._context_error("cuMemImportFromShareableHandle")) is not None:
            return err
        if shHandleType != _POSIX:
            return self._refuse(f"the host-backed fake imports POSIX fds only, not {shHandleType!r}")
        fd = os.dup(osHandle)  # the caller closes its copy after the import, as with a driver
        size = os.fstat(fd).st_size
        view = mmap.mmap(fd, size)
        self._maps.append(view)
        handle = self._next_handle
        self._next_handle += 1
        self.memory[handle], self.files[handle] = torch.frombuffer(view, dtype=torch.uint8), fd
        self.handle_types[handle] = int(_POSIX)
        self.imports.add(handle)
        return (_OK, handle)

    def cuMemAddressReserve(self, size, alignment, addr, flags):
        from dwdp.runtime.transport.host_composite import Reservation

        self.calls.append(("cuMemAddressReserve", (size, alignment, addr, flags)))
        if (err := self._reserve_error(size, alignment)) is not None:
            return err
        g = self.granularity
        reservation = Reservation(size + g)  # room to align the base to the granularity
        base = -(-reservation.addr // g) * g
        self._reservations[base] = reservation
        self.reserved[base] = size
        return (_OK, base)

    def cuMemMap(self, ptr, size, offset, handle, flags):
        result = super().cuMemMap(ptr, size, offset, handle, flags)
        if result[0] == _OK:
            base = next(b for b, n in self.reserved.items() if b <= ptr < b + n)
            reservation = self._reservations[base]
            reservation.map_fixed(ptr - reservation.addr, size, self.files[handle], 0)
        return result

    def cuMemUnmap(self, ptr, size):
        result = super().cuMemUnmap(ptr, size)
        if result[0] == _OK:  # back to reserved, inaccessible address space
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_long]
            got = libc.mmap(ptr, size, 0, 0x02 | 0x20 | 0x10 | 0x4000, -1, 0)  # PRIVATE|ANON|FIXED|NORESERVE
            assert got == ptr, "re-reserving an unmapped range failed"
        return result

    def cuMemAddressFree(self, ptr, size):
        result = super().cuMemAddressFree(ptr, size)
        if result[0] == _OK:
            self._reservations.pop(ptr)._finalizer()  # munmap the whole reservation now
        return result

    def cuMemRelease(self, handle):
        result = super().cuMemRelease(handle)
        if result[0] == _OK:
            self.imports.discard(handle)
            os.close(self.files.pop(handle))  # mappings and other handles keep the file's pages
        return result
