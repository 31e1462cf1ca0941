"""CUDA composite views with the virtual memory management API: not yet run on a GPU.

Legend: g = allocation granularity (cuMemGetAllocationGranularity, usually 2 MiB), M = MoE layers.

What it does, on `cuda.bindings.driver` (or a recording fake with the same functions and signatures):
- `Vmm`: the cuMem calls with the real bindings' structs (CUmemAllocationProp, CUmemAccessDesc,
  CUmemAllocationHandleType), each result checked like dwdp.runtime.transport.cuda_api does.
- `choose_mapping`: fabric handles where the device supports them and an IMEX channel exists, POSIX
  file descriptors where supported, else CUDA IPC (the multi-buffer path); one log line per rank.
- `CudaCompositeViews`: the page plan of dwdp.runtime.composite mapped with cuMemAddressReserve /
  cuMemMap (local extents from the rank's exportable segment allocation, the rest from a private pool
  allocation), ONE cuMemSetAccess per layer range, tensors through `__cuda_array_interface__`, and the
  reverse (unmap, free the range, release the pool) on close.
- `pidfd_getfd`: a peer's exported POSIX fd taken from its process by pid and fd number (what the
  cuda transport uses: the numbers travel in the setup's one all-gather).
- `FdServer` / `fetch_fd`: the same over an abstract Unix socket (SCM_RIGHTS, `send_fds` /
  `recv_fds`), where Yama refuses pidfd_getfd between sibling ranks; the socket's name travels in
  the all-gather instead of the fd number.

Used by dwdp.runtime.transport.cuda with mapping "vmm-posix-fd" / "vmm-fabric" (segment, imports and
views); DWDPModel picks those where every rank's device exports cuMem handles.
A dead exporter's memory: an imported VMM allocation keeps its physical pages alive until every
importer releases its handle (GPU_NOTES.md 6/7: still to be confirmed on a GPU), as a mapped /dev/shm
file does on the host backend.
"""
from __future__ import annotations

import ctypes
import glob
import logging
import os
import socket
import struct
import threading
from dataclasses import dataclass

from dwdp.runtime.composite import SEGMENT, CompositeLayout
from dwdp.runtime.transport.cuda_api import CudaError, _bindings, _check_driver

log = logging.getLogger("dwdp")

IMEX_CHANNELS = "/dev/nvidia-caps-imex-channels/channel*"
MAPPINGS = ("vmm-fabric", "vmm-posix-fd", "ipc")


class Vmm:
    """The cuMem calls for one device. driver: cuda.bindings.driver (default) or a fake of it."""

    def __init__(self, device: int, driver=None):
        self.drv = driver if driver is not None else _bindings()[1]
        self.device = device

    def handle_type(self, name: str):
        """CUmemAllocationHandleType for "posix_fd", "fabric" or "none"."""
        kinds = self.drv.CUmemAllocationHandleType
        table = {"posix_fd": kinds.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, "fabric": kinds.CU_MEM_HANDLE_TYPE_FABRIC,
                 "none": kinds.CU_MEM_HANDLE_TYPE_NONE}
        if name not in table:
            raise ValueError(f"handle type {name!r} is not one of {sorted(table)}")
        return table[name]

    def prop(self, handle_type: str):
        """CUmemAllocationProp: pinned device memory on this device, exportable as `handle_type`."""
        drv = self.drv
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device
        prop.requestedHandleTypes = self.handle_type(handle_type)
        return prop

    def supports(self, handle_type: str) -> bool:
        attrs = self.drv.CUdevice_attribute
        attr = {"posix_fd": attrs.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                "fabric": attrs.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED}[handle_type]
        return bool(_check_driver("cuDeviceGetAttribute", self.drv.cuDeviceGetAttribute, attr, self.device))

    def granularity(self, handle_type: str) -> int:
        flags = self.drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(_check_driver("cuMemGetAllocationGranularity", self.drv.cuMemGetAllocationGranularity,
                                 self.prop(handle_type), flags))

    def create(self, nbytes: int, handle_type: str):
        return _check_driver("cuMemCreate", self.drv.cuMemCreate, nbytes, self.prop(handle_type), 0)

    def export(self, handle, handle_type: str):
        """An fd (posix_fd) or the 64 handle bytes (fabric) that a peer imports."""
        out = _check_driver("cuMemExportToShareableHandle", self.drv.cuMemExportToShareableHandle, handle,
                            self.handle_type(handle_type), 0)
        return bytes(out.data) if handle_type == "fabric" else int(out)

    def import_(self, shareable, handle_type: str):
        return _check_driver("cuMemImportFromShareableHandle", self.drv.cuMemImportFromShareableHandle, shareable,
                             self.handle_type(handle_type))

    def reserve(self, nbytes: int, alignment: int) -> int:
        return int(_check_driver("cuMemAddressReserve", self.drv.cuMemAddressReserve, nbytes, alignment, 0, 0))

    def map(self, ptr: int, nbytes: int, offset: int, handle) -> None:
        _check_driver("cuMemMap", self.drv.cuMemMap, ptr, nbytes, offset, handle, 0)

    def set_access(self, ptr: int, nbytes: int) -> None:
        """Read-write access for this device over [ptr, ptr + nbytes): one call per whole range
        (NVL72's fabric routing table is small)."""
        drv = self.drv
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.device
        desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check_driver("cuMemSetAccess", drv.cuMemSetAccess, ptr, nbytes, [desc], 1)

    def unmap(self, ptr: int, nbytes: int) -> None:
        _check_driver("cuMemUnmap", self.drv.cuMemUnmap, ptr, nbytes)

    def address_free(self, ptr: int, nbytes: int) -> None:
        _check_driver("cuMemAddressFree", self.drv.cuMemAddressFree, ptr, nbytes)

    def release(self, handle) -> None:
        _check_driver("cuMemRelease", self.drv.cuMemRelease, handle)


def imex_channel_present(pattern: str = IMEX_CHANNELS) -> bool:
    return bool(glob.glob(pattern))


def pidfd_getfd_refused(path: str = "/proc/sys/kernel/yama/ptrace_scope") -> str | None:
    """Why pidfd_getfd between two ranks (sibling processes) would be refused here, or None: Yama's
    ptrace_scope >= 1 lets a process take fds only from its descendants, and DWDP ranks are siblings
    (the cuda transport then serves the fd over a socket: FdServer)."""
    try:
        with open(path) as f:
            scope = int(f.read().strip())
    except (OSError, ValueError):
        return None  # no Yama: same-user ptrace rules only
    return None if scope == 0 else f"Yama ptrace_scope={scope} refuses pidfd_getfd between sibling ranks"


def choose_mapping(vmm: Vmm, rank: int, imex: bool | None = None) -> str:
    """"vmm-fabric", "vmm-posix-fd" or "ipc" for this rank, trying an export of one granule (a device
    may list a handle type and still refuse to export it, e.g. fabric outside an IMEX domain);
    One log line names the choice and why."""
    imex = imex_channel_present() if imex is None else imex
    refused = []
    for kind, mapping in (("fabric", "vmm-fabric"), ("posix_fd", "vmm-posix-fd")):
        if kind == "fabric" and not imex:
            refused.append("fabric: no IMEX channel")
            continue
        if not vmm.supports(kind):
            refused.append(f"{kind}: not supported by device {vmm.device}")
            continue
        handle = None
        try:
            handle = vmm.create(vmm.granularity(kind), kind)
            shareable = vmm.export(handle, kind)
        except CudaError as exc:
            refused.append(f"{kind}: {exc}")
            continue
        finally:
            if handle is not None:
                vmm.release(handle)
        if kind == "posix_fd":
            os.close(shareable)
        log.info("rank %d: composite views over CUDA VMM with %s handles%s", rank, kind,
                 f" ({'; '.join(refused)})" if refused else "")
        return mapping
    log.info("rank %d: CUDA IPC mapping, multi-buffer experts path (VMM export refused: %s)", rank,
             "; ".join(refused))
    return "ipc"


@dataclass(frozen=True)
class _Mapped:
    ptr: int
    nbytes: int


class _CudaArray:
    """Something torch.as_tensor(..., device="cuda") reads as a uint8 vector at a device pointer."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = dict(shape=(nbytes,), typestr="|u1", data=(ptr, False), version=3,
                                             strides=None)


class CudaCompositeViews:
    """One rank's composite views on CUDA (see the module docstring).

    layout: the rank's CompositeLayout, granularity a multiple of the device's.
    segment: the rank's segment allocation handle (cuMemCreate, exportable; peers import it).

    tensor_at: (ptr, nbytes) -> a uint8 tensor over that device memory (cuda_api.tensor_at on a
    device); needed by `range` / `layer_range` / `view`, not by the mapping itself.
    """

    def __init__(self, layout: CompositeLayout, segment, vmm: Vmm, handle_type: str = "posix_fd", tensor_at=None):
        g = vmm.granularity(handle_type)
        if layout.granularity % g:
            raise ValueError(f"layout granularity {layout.granularity} is not a multiple of the device's {g}")
        self.layout, self.vmm = layout, vmm
        self.total = layout.num_layers * layout.layer_nbytes
        self._mapped: list[_Mapped] = []
        self.base = self._pool = None
        self._tensor_at, self._range = tensor_at, None
        try:
            # Private: nobody imports the pool, so it asks for no shareable handle type.
            self._pool = vmm.create(max(layout.pool_nbytes, layout.granularity), "none")
            self.base = vmm.reserve(self.total, layout.granularity)
            for layer in range(layout.num_layers):
                at = self.base + layer * layout.layer_nbytes
                for run in layout.map_runs(layer):
                    vmm.map(at + run.view_offset, run.nbytes, run.file_offset,
                            segment if run.backing == SEGMENT else self._pool)
                    self._mapped.append(_Mapped(at + run.view_offset, run.nbytes))
                vmm.set_access(at, layout.layer_nbytes)  # one per layer range, after every piece is mapped
        except BaseException:
            self.close()
            raise

    def layer_pointer(self, layer: int) -> int:
        """Device address of `layer`'s range: the copy plan's destination base."""
        return self.base + layer * self.layout.layer_nbytes

    def array(self, layer: int) -> _CudaArray:
        """`layer`'s range as a `__cuda_array_interface__` object (torch.as_tensor(obj, device="cuda"))."""
        return _CudaArray(self.layer_pointer(layer), self.layout.layer_nbytes)

    @property
    def range(self):
        """uint8 [num_layers * layer_nbytes] over the whole reservation (valid until close)."""
        if self.base is None:
            raise RuntimeError("the composite views are closed")
        if self._range is None:
            if self._tensor_at is None:
                raise ValueError("CudaCompositeViews was built without tensor_at: it has no tensors")
            self._range = self._tensor_at(self.base, self.total)
        return self._range

    def layer_range(self, layer: int):
        """uint8 [layer_nbytes]: the destination buffer of `layer`'s composite copy plan."""
        n = self.layout.layer_nbytes
        return self.range[layer * n:(layer + 1) * n]

    def view(self, layer: int, tensor: int, dtype, shape):
        """The [E, ...] tensor `tensor` of `layer` (shape: the stacked tensor's, e.g. [E, 2I, H])."""
        start, nbytes = self.layout.view_span(layer, tensor, dtype, shape)
        return self.range[start:start + nbytes].view(dtype).view(*shape)

    def close(self) -> None:
        """Unmap every piece, free the range, release the pool (the reverse of construction)."""
        for piece in reversed(self._mapped):
            self.vmm.unmap(piece.ptr, piece.nbytes)
        self._mapped, self._range = [], None
        if self.base is not None:
            self.vmm.address_free(self.base, self.total)
            self.base = None
        if self._pool is not None:
            self.vmm.release(self._pool)
            self._pool = None


# pidfd_getfd(2) (Linux 5.6): the same number on x86_64 and aarch64 (both use the generic table here).
_SYS_PIDFD_GETFD = 438


def pidfd_getfd(pid: int, fd: int) -> int:
    """A descriptor of this process for descriptor `fd` of process `pid` (on this node): how a rank
    takes a peer's exported POSIX-fd handle with no socket to set up. The kernel allows it where
    this process may ptrace `pid` (same user, and Yama's ptrace_scope permitting: pidfd_getfd_refused)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    pidfd = os.pidfd_open(pid)
    try:
        got = libc.syscall(ctypes.c_long(_SYS_PIDFD_GETFD), ctypes.c_long(pidfd), ctypes.c_long(fd), ctypes.c_long(0))
        if got < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"pidfd_getfd(pid={pid}, fd={fd}) failed: {os.strerror(err)} (it needs ptrace "
                               "permission over the exporting process: same user, Yama ptrace_scope 0)")
        return int(got)
    finally:
        os.close(pidfd)


class FdServer:
    """Hands descriptor `fd` to every process of this user that connects to the abstract Unix socket
    `name` (SCM_RIGHTS), until `close`: how ranks pass a POSIX-fd handle where pidfd_getfd is refused
    (Yama). Abstract names live in the network namespace, so peers must share this node's."""

    def __init__(self, fd: int, name: str):
        self.fd, self.name = fd, name
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind("\0" + name)
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self._thread = threading.Thread(target=self._serve, name=f"dwdp-fd-{name}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        creds = struct.calcsize("3i")
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, creds))
                if uid != os.getuid():
                    log.warning("fd server %s: refused a connection from uid %d", self.name, uid)
                    continue
                try:
                    send_fds(conn, [self.fd])
                except OSError as exc:  # the peer went away: others may still come
                    log.warning("fd server %s: sending the fd failed: %s", self.name, exc)

    def close(self) -> None:
        """Stop serving (shutdown wakes the blocked accept) and wait for the thread."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=10.0)


def fetch_fd(name: str, timeout_s: float = 30.0) -> int:
    """The descriptor an FdServer named `name` serves: a new fd of this process."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect("\0" + name)
        (fd,) = recv_fds(sock, 1)
        return fd


def send_fds(sock: socket.socket, fds: list[int], payload: bytes = b"dwdp") -> None:
    """Pass `fds` to the process at the other end of Unix socket `sock` (SCM_RIGHTS)."""
    socket.send_fds(sock, [payload], fds)


def recv_fds(sock: socket.socket, count: int) -> list[int]:
    """Receive `count` descriptors sent with send_fds: new fds of this process for the same objects."""
    _msg, fds, _flags, _addr = socket.recv_fds(sock, 1024, count)
    if len(fds) != count:
        raise ValueError(f"expected {count} file descriptors over the socket, got {len(fds)}")
    return list(fds)


__all__ = ["CudaCompositeViews", "FdServer", "MAPPINGS", "fetch_fd", "Vmm", "choose_mapping", "imex_channel_present", "pidfd_getfd",
           "pidfd_getfd_refused", "recv_fds",
           "send_fds"]
