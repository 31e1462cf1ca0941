"""CUDA composite views with the virtual memory management API. Ran on one H200 with POSIX fds, two ranks
sharing it (bench/results/gpu_check_h200_quick.json, section i); fabric handles not yet run on a GPU.
bench/results/probe_vmm_h200_862d26c.json settled the driver's rules this module follows.

Legend: g = allocation granularity (cuMemGetAllocationGranularity MINIMUM, 2 MiB on H100/H200),
M = MoE layers, A = allocations of a rank's segment (one per local extent of each (layer, tensor)).

What it does, on `cuda.bindings.driver` (or a recording fake with the same functions and signatures):
- `Vmm`: the cuMem calls with the real bindings' structs (CUmemAllocationProp, CUmemAccessDesc,
  CUmemAllocationHandleType), each result checked like dwdp.runtime.transport.cuda_api does, each with
  the device's primary context current on the calling thread (retained here when nothing made one
  current), reservations aligned to a power of two.
- `choose_mapping`: fabric handles where the device supports them and a trial export succeeds, POSIX
  file descriptors where supported, else CUDA IPC (the multi-buffer path); one log line per rank
  that names why each better choice was refused.
- `CudaCompositeViews`: the page plan of dwdp.runtime.composite mapped with cuMemAddressReserve /
  cuMemMap, every allocation mapped whole at offset 0 (cuMemMap's offset "currently must be zero":
  CUDA_ERROR_NOT_SUPPORTED otherwise on an H200): local extents are the segment's own allocations,
  each pool gap an allocation of its own; ONE cuMemSetAccess per layer range; the reverse on close.
- POSIX fds between ranks: `take_fds` tries `pidfd_getfd` (no socket to set up) and, where it is
  refused (EPERM under Docker's or containerd's default seccomp profile or Yama, ESRCH in another PID
  namespace, ENOSYS on an old kernel), takes them from the exporter's `FdServer`: an abstract Unix
  socket (SCM_RIGHTS, same user only, so peers share this node's network namespace) that always
  runs beside an export, at most 253 fds (the kernel's SCM_MAX_FD) a message. `ensure_fd_room`
  keeps the descriptor count inside RLIMIT_NOFILE.

A dead exporter's memory: an imported VMM allocation keeps its physical pages alive until every
importer releases its handle (probe C8 on an H200: still readable after the exporter's os._exit), as a
mapped /dev/shm file does on the host backend.
"""
from __future__ import annotations

import ctypes
import errno
import glob
import logging
import math
import os
import resource
import secrets
import socket
import struct
import threading
from collections.abc import Sequence

from dwdp.runtime.composite import SEGMENT, CompositeLayout
from dwdp.runtime.transport.cuda_api import CudaError, _bindings, _check_driver

log = logging.getLogger("dwdp")

IMEX_CHANNELS = "/dev/nvidia-caps-imex-channels/channel*"
MAPPINGS = ("vmm-fabric", "vmm-posix-fd", "ipc")
SCM_MAX_FD = 253  # most descriptors one SCM_RIGHTS message carries (Linux include/net/scm.h)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class Vmm:
    """The cuMem calls for one device. driver: cuda.bindings.driver (default) or a fake of it.

    Every call runs with a context current on the calling thread: the one torch made current, or
    else the device's primary context, retained here (cuDevicePrimaryCtxRetain + cuCtxSetCurrent)
    and released by `close`."""

    def __init__(self, device: int, driver=None):
        self.drv = driver if driver is not None else _bindings()[1]
        self.device = device
        self._context = None      # this device's primary context, retained once by this object
        self._lock = threading.Lock()

    def _primary_context(self):
        """This device's primary context (what the runtime's cudaSetDevice makes current), retained once for
        the life of this object, whichever threads call."""
        with self._lock:
            if self._context is None:
                drv = self.drv
                _check_driver("cuInit", drv.cuInit, 0)
                dev = _check_driver("cuDeviceGet", drv.cuDeviceGet, self.device)
                self._context = _check_driver("cuDevicePrimaryCtxRetain", drv.cuDevicePrimaryCtxRetain, dev)
            return self._context

    def _ensure_context(self) -> None:
        """The device's primary context current on the calling thread: a thread with none (or another
        device's) gets it, as cudaSetDevice would give it; one retain per object, not per thread."""
        ctx = self._primary_context()
        if int(_check_driver("cuCtxGetCurrent", self.drv.cuCtxGetCurrent)) != int(ctx):
            _check_driver("cuCtxSetCurrent", self.drv.cuCtxSetCurrent, ctx)

    def _call(self, name: str, *args):
        self._ensure_context()
        return _check_driver(name, getattr(self.drv, name), *args)

    def close(self) -> None:
        """Release the primary context this object retained (once)."""
        with self._lock:
            context, self._context = self._context, None
        if context is not None:
            dev = _check_driver("cuDeviceGet", self.drv.cuDeviceGet, self.device)
            _check_driver("cuDevicePrimaryCtxRelease", self.drv.cuDevicePrimaryCtxRelease, dev)

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
        """Whether the device lists `handle_type`; CudaError where the driver does not know the
        attribute (an older driver asked about fabric)."""
        attrs = self.drv.CUdevice_attribute
        attr = {"posix_fd": attrs.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
                "fabric": attrs.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED}[handle_type]
        return bool(self._call("cuDeviceGetAttribute", attr, self.device))

    def granularity(self, handle_type: str) -> int:
        """The MINIMUM granularity: every size, address and alignment here is a multiple of it."""
        flags = self.drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        return int(self._call("cuMemGetAllocationGranularity", self.prop(handle_type), flags))

    def create(self, nbytes: int, handle_type: str):
        return self._call("cuMemCreate", nbytes, self.prop(handle_type), 0)

    def export(self, handle, handle_type: str):
        """An fd (posix_fd) or the 64 handle bytes (fabric) that a peer imports."""
        out = self._call("cuMemExportToShareableHandle", handle, self.handle_type(handle_type), 0)
        return bytes(out.data) if handle_type == "fabric" else int(out)

    def import_(self, shareable, handle_type: str):
        return self._call("cuMemImportFromShareableHandle", shareable, self.handle_type(handle_type))

    def reserve(self, nbytes: int, alignment: int) -> int:
        """`nbytes` of address space aligned to `alignment` (a power of two, or 0 for the driver's)."""
        if alignment != 0 and not is_power_of_two(alignment):
            raise ValueError(f"cuMemAddressReserve alignment {alignment} is not a power of two")
        return int(self._call("cuMemAddressReserve", nbytes, alignment, 0, 0))

    def map(self, ptr: int, nbytes: int, handle) -> None:
        """Map allocation `handle` whole (`nbytes`, its size) at `ptr`, from offset 0: the only
        offset the driver takes."""
        self._call("cuMemMap", ptr, nbytes, 0, handle, 0)

    def set_access(self, ptr: int, nbytes: int) -> None:
        """Read-write access for this device over [ptr, ptr + nbytes): one call per whole range
        (NVL72's fabric routing table is small)."""
        drv = self.drv
        desc = drv.CUmemAccessDesc()
        desc.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.device
        desc.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._call("cuMemSetAccess", ptr, nbytes, [desc], 1)

    def unmap(self, ptr: int, nbytes: int) -> None:
        self._call("cuMemUnmap", ptr, nbytes)

    def address_free(self, ptr: int, nbytes: int) -> None:
        self._call("cuMemAddressFree", ptr, nbytes)

    def release(self, handle) -> None:
        self._call("cuMemRelease", handle)

    def map_back_to_back(self, handles: Sequence, sizes: Sequence[int], alignment: int) -> int:
        """Reserve one range for the allocations `handles` (of `sizes` bytes), map each whole, one after
        the other from the range's start, and set access once over all of it: how a rank sees its own
        segment and a peer's. Unwinds what it did on failure; the handles stay the caller's."""
        total = sum(sizes)
        ptr, mapped = None, []
        try:
            ptr = self.reserve(total, alignment)
            at = ptr
            for handle, nbytes in zip(handles, sizes):
                self.map(at, nbytes, handle)
                mapped.append((at, nbytes))
                at += nbytes
            self.set_access(ptr, total)
        except BaseException:
            for at, nbytes in reversed(mapped):
                self.unmap(at, nbytes)
            if ptr is not None:
                self.address_free(ptr, total)
            raise
        return ptr

    def unmap_back_to_back(self, ptr: int, sizes: Sequence[int]) -> None:
        """The reverse of map_back_to_back (the handles stay the caller's): every piece is unmapped whatever
        failed before it, the range freed once nothing is mapped in it, the first error raised at the end."""
        from dwdp.runtime.transport.teardown import Steps

        steps = Steps(f"unmapping the range at {ptr:#x}")
        ends = [ptr]
        for nbytes in sizes:
            ends.append(ends[-1] + nbytes)
        for at, nbytes in reversed(list(zip(ends, sizes))):
            steps.run(f"cuMemUnmap at {at:#x}", self.unmap, at, nbytes)
        if steps.ok:
            steps.run("cuMemAddressFree", self.address_free, ptr, sum(sizes))
        steps.raise_first()


def imex_channel_present(pattern: str = IMEX_CHANNELS) -> bool:
    return bool(glob.glob(pattern))


def choose_mapping(vmm: Vmm, rank: int, imex: bool | None = None) -> str:
    """"vmm-fabric", "vmm-posix-fd" or "ipc" for this rank, trying an export of one granule (a device
    may list a handle type and still refuse it: an H200 with no IMEX channel lists fabric and refuses
    cuMemCreate with NOT_PERMITTED). Any driver error while probing a kind refuses that kind only.
    One log line names the choice and why each better one was refused."""
    imex = imex_channel_present() if imex is None else imex
    refused = []
    for kind, mapping in (("fabric", "vmm-fabric"), ("posix_fd", "vmm-posix-fd")):
        if kind == "fabric" and not imex:
            refused.append("fabric: no IMEX channel")
            continue
        handle = None
        try:
            if not vmm.supports(kind):
                refused.append(f"{kind}: not supported by device {vmm.device}")
                continue
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


class CudaCompositeViews:
    """One rank's composite views on CUDA (see the module docstring).

    layout: the rank's CompositeLayout, granularity a multiple of the device's.
    segment: the rank's segment allocations (cuMemCreate, exportable; peers import them), one per
        `layout.segment_allocations`, in that order.
    tensor_at: (ptr, nbytes) -> a uint8 tensor over that device memory (cuda_api.tensor_at on the
        rank's device); needed by `range` / `layer_range` / `view`, not by the mapping itself.
    """

    def __init__(self, layout: CompositeLayout, segment: Sequence, vmm: Vmm, handle_type: str = "posix_fd",
                 tensor_at=None):
        # The segment's allocations are of `handle_type`, the pool's of none: both granularities must divide.
        g = math.lcm(vmm.granularity(handle_type), vmm.granularity("none"))
        if layout.granularity % g:
            raise ValueError(f"layout granularity {layout.granularity} is not a multiple of the device's {g} "
                             f"(for {handle_type!r} and for the pool's 'none' allocations)")
        if len(segment) != len(layout.segment_allocations):
            raise ValueError(f"{len(segment)} segment allocations given; the layout has "
                             f"{len(layout.segment_allocations)} (one per local extent of each layer and tensor)")
        self.layout, self.vmm, self._segment = layout, vmm, tuple(segment)
        self.total = layout.num_layers * layout.layer_nbytes
        self._mapped: list[tuple[int, int]] = []  # (ptr, nbytes) of every cuMemMap, in order
        self._pool: list = []                     # one allocation per pool gap
        self.base = None
        self._tensor_at, self._range = tensor_at, None
        try:
            # Private: nobody imports the pool, so it asks for no shareable handle type.
            for alloc in layout.pool_allocations:
                self._pool.append(vmm.create(alloc.nbytes, "none"))
            self.base = vmm.reserve(self.total, g)
            for layer in range(layout.num_layers):
                at = self.base + layer * layout.layer_nbytes
                for run in layout.map_runs(layer):
                    handle = self._segment[run.allocation] if run.backing == SEGMENT else self._pool[run.allocation]
                    vmm.map(at + run.view_offset, run.nbytes, handle)
                    self._mapped.append((at + run.view_offset, run.nbytes))
                vmm.set_access(at, layout.layer_nbytes)  # one per layer range, after every piece is mapped
        except BaseException:
            self.close()
            raise

    def layer_pointer(self, layer: int) -> int:
        """Device address of `layer`'s range: the copy plan's destination base."""
        return self.base + layer * self.layout.layer_nbytes

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
        """Unmap every piece, free the range, release the pool (the reverse of construction), each step
        whatever failed before it, the first error raised at the end. The caller synchronises the streams
        that read the views first (cuMemUnmap waits for nothing)."""
        from dwdp.runtime.transport.teardown import Steps

        steps = Steps("closing composite views")
        mapped, self._mapped, self._range = self._mapped, [], None
        for ptr, nbytes in reversed(mapped):
            steps.run(f"cuMemUnmap at {ptr:#x}", self.vmm.unmap, ptr, nbytes)
        if self.base is not None and steps.ok:
            steps.run("cuMemAddressFree", self.vmm.address_free, self.base, self.total)
        self.base = None
        while self._pool:
            steps.run("cuMemRelease of a pool allocation", self.vmm.release, self._pool.pop())
        steps.raise_first()


# -- POSIX fds between ranks ---------------------------------------------------------------------
# pidfd_getfd(2) (Linux 5.6): the same number on x86_64 and aarch64 (both use the generic table here).
_SYS_PIDFD_GETFD = 438
# pidfd_getfd refusals that the socket gets around: seccomp or Yama (EPERM), another PID namespace
# (ESRCH), a kernel or sandbox without the call (ENOSYS).
FD_FALLBACK_ERRNOS = (errno.EPERM, errno.EACCES, errno.ESRCH, errno.ENOSYS)


def fd_socket_name(rank: int) -> str:
    """The abstract socket name of one export's fd server: unique per process and export. Abstract names
    are per network namespace and pids per PID namespace: two groups in host-network containers can
    share a pid, so the name carries the PID namespace and a random token too."""
    return f"dwdp-vmm-{pid_namespace()}-{os.getpid()}-{rank}-{secrets.token_hex(8)}"


def pid_namespace() -> int:
    """This process's PID namespace (its inode): a pid in a handle means the same process only inside it."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def pidfd_getfd(pid: int, fd: int) -> int:
    """A descriptor of this process for descriptor `fd` of process `pid` (on this node): how a rank
    takes a peer's exported POSIX-fd handle with no socket. The kernel allows it where this process
    may ptrace `pid` (same user, Yama's ptrace_scope and the seccomp profile permitting)."""
    return pidfd_getfds(pid, [fd])[0]


def pidfd_getfds(pid: int, fds: Sequence[int]) -> list[int]:
    """pidfd_getfd for each of `fds` of process `pid`: new descriptors of this process, in order. On an
    OSError none is left open."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    pidfd = os.pidfd_open(pid)
    got: list[int] = []
    try:
        for fd in fds:
            new = libc.syscall(ctypes.c_long(_SYS_PIDFD_GETFD), ctypes.c_long(pidfd), ctypes.c_long(fd),
                               ctypes.c_long(0))
            if new < 0:
                err = ctypes.get_errno()
                raise OSError(err, f"pidfd_getfd(pid={pid}, fd={fd}) failed: {os.strerror(err)} (it needs ptrace "
                                   "permission over the exporting process: same user, Yama ptrace_scope 0, a "
                                   "seccomp profile that allows it)")
            got.append(int(new))
    except BaseException:
        for fd in got:
            os.close(fd)
        raise
    finally:
        os.close(pidfd)
    return got


def take_fds(handle: dict, timeout_s: float = 30.0, getfd=None) -> tuple[list[int], str]:
    """The exporter's fds that `handle` names ({"pid", "pid_ns", "fds", "socket"}), as new descriptors
    of this process, and how they came: pidfd_getfd where the kernel allows it, else over the
    exporter's socket (the reason in the answer). getfd: pidfd_getfds, or a stand-in in tests."""
    getfd = pidfd_getfds if getfd is None else getfd
    fds = [int(fd) for fd in handle["fds"]]
    if int(handle.get("pid_ns", 0)) != pid_namespace():
        why = "another PID namespace"
    else:
        try:
            return getfd(int(handle["pid"]), fds), "pidfd_getfd"
        except OSError as exc:
            if exc.errno not in FD_FALLBACK_ERRNOS:
                raise
            why = f"pidfd_getfd: {errno.errorcode.get(exc.errno, exc.errno)}"
    return fetch_fds(handle["socket"], len(fds), timeout_s), f"socket ({why})"


def ensure_fd_room(extra: int) -> None:
    """Make room for `extra` more open descriptors: raise RLIMIT_NOFILE's soft limit up to the hard
    one when needed; OSError in one line naming both numbers when even the hard limit is too small."""
    open_now = len(os.listdir("/proc/self/fd"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = open_now + extra
    if need <= soft:
        return
    if hard != resource.RLIM_INFINITY and need > hard:
        raise OSError(errno.EMFILE, f"{need} open descriptors needed ({open_now} open + {extra} cuMem handles) but "
                                    f"RLIMIT_NOFILE allows {soft} (hard limit {hard}): raise the hard limit "
                                    f"(ulimit -Hn, or the container's nofile setting)")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    log.info("raised RLIMIT_NOFILE's soft limit from %d to %s for %d cuMem handles", soft, hard, extra)


class FdServer:
    """Hands descriptors `fds` to every process of this user that connects to the abstract Unix
    socket `name` (SCM_RIGHTS over SOCK_SEQPACKET, at most SCM_MAX_FD a message, each message
    headed by (first index, total)), until `close`: how ranks pass POSIX-fd handles where
    pidfd_getfd is refused. Abstract names live in the network namespace: peers must share it."""

    def __init__(self, fds: int | Sequence[int], name: str):
        self.fds, self.name = [fds] if isinstance(fds, int) else [int(fd) for fd in fds], name
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
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
                    for start in range(0, max(len(self.fds), 1), SCM_MAX_FD):  # one header even for none
                        chunk = self.fds[start:start + SCM_MAX_FD]
                        socket.send_fds(conn, [struct.pack("!II", start, len(self.fds))], chunk)
                except OSError as exc:  # the peer went away: others may still come
                    log.warning("fd server %s: sending the fds failed: %s", self.name, exc)

    def close(self) -> None:
        """Stop serving (shutdown wakes the blocked accept) and wait for the thread."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=10.0)


def fetch_fds(name: str, count: int | None = None, timeout_s: float = 30.0) -> list[int]:
    """The descriptors an FdServer named `name` serves, as new fds of this process (`count`: how many
    the caller expects; ValueError otherwise). On an error none is left open."""
    got: list[int] = []
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
            sock.settimeout(timeout_s)
            try:
                sock.connect("\0" + name)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot reach the fd socket {name!r} ({exc.strerror}): the exporting rank "
                                         "has sealed it or is in another network namespace") from exc
            total = None
            while total is None or len(got) < total:
                msg, fds, flags, _ = socket.recv_fds(sock, 64, SCM_MAX_FD)
                got.extend(fds)
                if flags & socket.MSG_CTRUNC:
                    raise OSError(errno.EMFILE, f"fds from socket {name!r} were cut short (RLIMIT_NOFILE "
                                                f"{resource.getrlimit(resource.RLIMIT_NOFILE)})")
                if len(msg) != 8:
                    raise ValueError(f"fd socket {name!r} closed after {len(got)} descriptors")
                start, total = struct.unpack("!II", msg)
                if start + len(fds) != len(got):
                    raise ValueError(f"fd socket {name!r} sent descriptors from {start}, expected {len(got) - len(fds)}")
        if count is not None and len(got) != count:
            raise ValueError(f"expected {count} file descriptors from socket {name!r}, got {len(got)}")
        return got
    except BaseException:
        for fd in got:
            os.close(fd)
        raise


def fetch_fd(name: str, timeout_s: float = 30.0) -> int:
    """The one descriptor an FdServer named `name` serves."""
    (fd,) = fetch_fds(name, 1, timeout_s)
    return fd


def send_fds(sock: socket.socket, fds: list[int], payload: bytes = b"dwdp") -> None:
    """Pass `fds` to the process at the other end of Unix socket `sock` (SCM_RIGHTS)."""
    socket.send_fds(sock, [payload], fds)


def recv_fds(sock: socket.socket, count: int) -> list[int]:
    """Receive `count` descriptors sent with send_fds: new fds of this process for the same objects."""
    _msg, fds, _flags, _addr = socket.recv_fds(sock, 1024, count)
    if len(fds) != count:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected {count} file descriptors over the socket, got {len(fds)}")
    return list(fds)


__all__ = ["CudaCompositeViews", "FdServer", "MAPPINGS", "SCM_MAX_FD", "Vmm", "choose_mapping", "ensure_fd_room",
           "fetch_fd", "fetch_fds", "imex_channel_present", "pid_namespace", "pidfd_getfd", "pidfd_getfds",
           "recv_fds", "send_fds", "take_fds"]
