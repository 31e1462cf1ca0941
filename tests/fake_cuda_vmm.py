"""A recording fake of `cuda.bindings.driver`'s cuMem calls: same function names and parameters as the
real bindings (tests compare inspect.signature), the real structs and enums (anything else is taken
from the real module), and host memory behind every allocation so tests check bytes.

It refuses, as a driver would (CUDA_ERROR_INVALID_VALUE), what the real calls refuse: sizes, offsets
and addresses that are not multiples of the granularity, a mapping outside its allocation or its
reservation or over another mapping, set-access over a range that is not wholly mapped, arguments
that are not the bindings' structs and enums; and it counts every call (a test asserts one
cuMemSetAccess per range). Handle exports are refused per type with `refuse_export`.
"""
from __future__ import annotations

import ctypes
import mmap
import os

import torch
from cuda.bindings import driver as real

GRANULARITY = 2 << 20
_OK = real.CUresult.CUDA_SUCCESS
_INVALID = real.CUresult.CUDA_ERROR_INVALID_VALUE
_NOT_PERMITTED = real.CUresult.CUDA_ERROR_NOT_PERMITTED


class FakeDriver:
    def __init__(self, granularity: int = GRANULARITY, supported=("posix_fd", "fabric")):
        self.granularity, self.supported = granularity, set(supported)
        self.calls: list[tuple] = []          # (name, args)
        self.errors: list[str] = []           # why each refused call was refused
        self.memory: dict[int, torch.Tensor] = {}   # handle -> its bytes
        self.reserved: dict[int, int] = {}    # base -> size
        self.mapped: dict[int, tuple[int, int, int]] = {}  # ptr -> (size, handle, offset)
        self.access: list[tuple[int, int]] = []  # (ptr, size) of each set-access
        self.refused_exports: set[int] = set()
        self._next_handle, self._next_va = 1, 1 << 40

    def __getattr__(self, name):  # structs, enums and anything not faked: the real bindings'
        return getattr(real, name)

    def refuse_export(self, handle_type) -> None:
        self.refused_exports.add(int(handle_type))

    def _refuse(self, why: str):
        self.errors.append(why)
        return (_INVALID,)

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    # -- the calls, with the real parameter names ---------------------------------------------------
    def cuDeviceGetAttribute(self, attrib, dev):
        self.calls.append(("cuDeviceGetAttribute", (attrib, dev)))
        if not isinstance(attrib, real.CUdevice_attribute):
            return self._refuse(f"attrib {attrib!r} is not a CUdevice_attribute")
        kind = {real.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: "posix_fd",
                real.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: "fabric"}.get(attrib)
        return (_OK, int(kind in self.supported))

    def cuMemGetAllocationGranularity(self, prop, option):
        self.calls.append(("cuMemGetAllocationGranularity", (prop, option)))
        if not isinstance(prop, real.CUmemAllocationProp):
            return self._refuse(f"prop {type(prop).__name__} is not a CUmemAllocationProp")
        if not isinstance(option, real.CUmemAllocationGranularity_flags):
            return self._refuse(f"option {option!r} is not a CUmemAllocationGranularity_flags")
        return (_OK, self.granularity)

    def cuMemCreate(self, size, prop, flags):
        self.calls.append(("cuMemCreate", (size, prop, flags)))
        if not isinstance(prop, real.CUmemAllocationProp):
            return self._refuse(f"prop {type(prop).__name__} is not a CUmemAllocationProp")
        if not isinstance(prop.requestedHandleTypes, real.CUmemAllocationHandleType):
            return self._refuse("requestedHandleTypes is not a CUmemAllocationHandleType")
        if prop.type != real.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED:
            return self._refuse(f"allocation type {prop.type!r} is not PINNED")
        if size <= 0 or size % self.granularity:
            return self._refuse(f"cuMemCreate size {size} is not a positive multiple of {self.granularity}")
        handle = self._next_handle
        self._next_handle += 1
        self.memory[handle] = torch.zeros(size, dtype=torch.uint8)
        return (_OK, handle)

    def cuMemExportToShareableHandle(self, handle, handleType, flags):
        self.calls.append(("cuMemExportToShareableHandle", (handle, handleType, flags)))
        if not isinstance(handleType, real.CUmemAllocationHandleType):
            return self._refuse(f"handleType {handleType!r} is not a CUmemAllocationHandleType")
        if int(handleType) in self.refused_exports:
            return (_NOT_PERMITTED,)
        if handle not in self.memory:
            return self._refuse(f"export of unknown handle {handle}")
        if handleType == real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC:
            shareable = real.CUmemFabricHandle()
            return (_OK, shareable)
        return (_OK, os.memfd_create(f"fake-cumem-{handle}"))  # a real fd: the caller must close it

    def cuMemImportFromShareableHandle(self, osHandle, shHandleType):
        self.calls.append(("cuMemImportFromShareableHandle", (osHandle, shHandleType)))
        if not isinstance(shHandleType, real.CUmemAllocationHandleType):
            return self._refuse(f"shHandleType {shHandleType!r} is not a CUmemAllocationHandleType")
        return (_OK, osHandle)

    def cuMemAddressReserve(self, size, alignment, addr, flags):
        self.calls.append(("cuMemAddressReserve", (size, alignment, addr, flags)))
        if size <= 0 or size % self.granularity or alignment % self.granularity:
            return self._refuse(f"reserve size {size} / alignment {alignment} not multiples of {self.granularity}")
        base = self._next_va
        self._next_va += size + self.granularity
        self.reserved[base] = size
        return (_OK, base)

    def cuMemMap(self, ptr, size, offset, handle, flags):
        self.calls.append(("cuMemMap", (ptr, size, offset, handle, flags)))
        g = self.granularity
        if ptr % g or size % g or offset % g or size <= 0:
            return self._refuse(f"cuMemMap(ptr={ptr:#x}, size={size}, offset={offset}) not multiples of {g}")
        if handle not in self.memory or offset + size > self.memory[handle].numel():
            return self._refuse(f"cuMemMap of {size} bytes at offset {offset} outside handle {handle}")
        if not any(b <= ptr and ptr + size <= b + n for b, n in self.reserved.items()):
            return self._refuse(f"cuMemMap at {ptr:#x} of {size} bytes outside every reservation")
        if any(p < ptr + size and ptr < p + n for p, (n, _, _) in self.mapped.items()):
            return self._refuse(f"cuMemMap at {ptr:#x} over an existing mapping")
        self.mapped[ptr] = (size, handle, offset)
        return (_OK,)

    def cuMemSetAccess(self, ptr, size, desc, count):
        self.calls.append(("cuMemSetAccess", (ptr, size, desc, count)))
        if count != len(desc) or not all(isinstance(d, real.CUmemAccessDesc) for d in desc):
            return self._refuse("desc must be a list of `count` CUmemAccessDesc")
        if any(d.flags != real.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE for d in desc):
            return self._refuse("access flags are not PROT_READWRITE")
        covered = sum(min(p + n, ptr + size) - max(p, ptr) for p, (n, _, _) in self.mapped.items()
                      if p < ptr + size and ptr < p + n)
        if covered != size:
            return self._refuse(f"cuMemSetAccess over [{ptr:#x}, +{size}) that is not wholly mapped")
        self.access.append((ptr, size))
        return (_OK,)

    def cuMemUnmap(self, ptr, size):
        self.calls.append(("cuMemUnmap", (ptr, size)))
        if ptr not in self.mapped or self.mapped[ptr][0] != size:
            return self._refuse(f"cuMemUnmap({ptr:#x}, {size}) is not one mapping")
        del self.mapped[ptr]
        return (_OK,)

    def cuMemAddressFree(self, ptr, size):
        self.calls.append(("cuMemAddressFree", (ptr, size)))
        if self.reserved.get(ptr) != size:
            return self._refuse(f"cuMemAddressFree({ptr:#x}, {size}) is not one reservation")
        if any(ptr <= p < ptr + size for p in self.mapped):
            return self._refuse("cuMemAddressFree of a range that is still mapped")
        del self.reserved[ptr]
        return (_OK,)

    def cuMemRelease(self, handle):
        self.calls.append(("cuMemRelease", (handle,)))
        if handle not in self.memory:
            return self._refuse(f"cuMemRelease of unknown handle {handle}")
        del self.memory[handle]
        return (_OK,)

    # -- test helpers: bytes through the mappings (what a kernel would read) -------------------------
    def _resolve(self, ptr: int, nbytes: int):
        for p, (n, handle, offset) in self.mapped.items():
            if p <= ptr and ptr + nbytes <= p + n:
                return self.memory[handle][offset + ptr - p:offset + ptr - p + nbytes]
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
    processes do) and still see its peers' bytes."""

    def __init__(self, granularity: int = GRANULARITY, supported=("posix_fd",)):
        super().__init__(granularity, supported)
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
        if handleType == real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR \
                and handle in self.files and int(handleType) not in self.refused_exports:
            self.calls.append(("cuMemExportToShareableHandle", (handle, handleType, flags)))
            return (_OK, os.dup(self.files[handle]))
        return super().cuMemExportToShareableHandle(handle, handleType, flags)

    def cuMemImportFromShareableHandle(self, osHandle, shHandleType):
        self.calls.append(("cuMemImportFromShareableHandle", (osHandle, shHandleType)))
        if shHandleType != real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR:
            return self._refuse(f"the host-backed fake imports POSIX fds only, not {shHandleType!r}")
        fd = os.dup(osHandle)  # the caller closes its copy after the import, as with a driver
        view = mmap.mmap(fd, os.fstat(fd).st_size)
        self._maps.append(view)
        handle = self._next_handle
        self._next_handle += 1
        self.memory[handle], self.files[handle] = torch.frombuffer(view, dtype=torch.uint8), fd
        self.imports.add(handle)
        return (_OK, handle)

    def cuMemAddressReserve(self, size, alignment, addr, flags):
        from dwdp.runtime.transport.host_composite import Reservation

        self.calls.append(("cuMemAddressReserve", (size, alignment, addr, flags)))
        g = self.granularity
        if size <= 0 or size % g or alignment % g:
            return self._refuse(f"reserve size {size} / alignment {alignment} not multiples of {g}")
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
            reservation.map_fixed(ptr - reservation.addr, size, self.files[handle], offset)
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
