"""The VMM mappings of the cuda backend: "vmm-posix-fd" (ran on one H200, 2026-11-27) and "vmm-fabric" (not
yet run on a GPU). What composite views need.

The segment is a list of cuMemCreate allocations (one per local extent of each layer and tensor in
composite mode, else one), exportable as POSIX fds or fabric handles, mapped whole and back to back into
one range with one cuMemSetAccess. `export` exports every allocation (POSIX fds: the exporter's pid, PID
namespace and fd numbers travel in the handle, beside the name of an abstract Unix socket that always
serves the same fds until seal; fabric: the 64 bytes of each handle). `open_peer` takes the peer's fds
(pidfd_getfd, or the socket where seccomp, Yama or another PID namespace refuses it: `fd_paths` says which
per peer), imports each allocation, closes its fd, and maps the imports back to back into one range, so a
plan reads a peer's segment at the same offsets as the peer itself. `composite_views` builds the rank's
views (dwdp.runtime.transport.cuda_vmm) over the segment's allocations. `seal` closes the exported fds
(every peer holds its own import by then, unless the board keeps them for a rank started later); `close`
unmaps and releases the retired imports, the peers' imports, the views and the segment, in the reverse of
setup (the transport waited for its copy stream and the compute stream first). The driver calls go
through `driver` (cuda.bindings.driver by default, tests/fake_cuda_vmm.py in tests).
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from dwdp import envs
from dwdp.runtime.transport import cuda_api
from dwdp.runtime.transport.base import PrefetchError
from dwdp.runtime.transport.cuda_peers import PeerMapping, raw_bytes
from dwdp.runtime.transport.cuda_vmm import (SCM_MAX_FD, CudaCompositeViews, FdServer, Vmm, choose_mapping,
                                              ensure_fd_room, fd_socket_name, is_power_of_two, pid_namespace,
                                              take_fds)
from dwdp.runtime.transport.teardown import Steps

log = logging.getLogger("dwdp")

# Mapping -> the cuMem handle type its segments are exported as.
VMM_MAPPINGS = MappingProxyType({"vmm-posix-fd": "posix_fd", "vmm-fabric": "fabric"})


@dataclass(eq=False)
class _VmmRange:
    """cuMem allocations `handles` (of `sizes` bytes) mapped whole, back to back, into one range of
    their own at [ptr, ptr + nbytes): a rank's segment, or a peer's as imported here. `mapped` and `held`
    say which pieces are still mapped and which handles still held, so a release that failed half way is
    finished, not repeated, by the next one."""

    handles: tuple
    sizes: tuple[int, ...]
    ptr: int
    mapped: list[bool] = field(default_factory=list)
    held: list[bool] = field(default_factory=list)
    reserved: bool = True

    def __post_init__(self):
        self.mapped = self.mapped or [True] * len(self.sizes)
        self.held = self.held or [True] * len(self.handles)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    @property
    def released(self) -> bool:
        return not (any(self.mapped) or any(self.held) or self.reserved)


class VmmMapping(PeerMapping):
    """See the module docstring. handle type: VMM_MAPPINGS[mapping]."""

    rejoinable = True

    def __init__(self, mapping, rank, device, api, *, driver=None, **kwargs):
        super().__init__(mapping, rank, device, api, **kwargs)
        self.handle_type = VMM_MAPPINGS[mapping]
        self.vmm = Vmm(device.index or 0, driver)
        self.own_range: _VmmRange | None = None       # the segment's allocations, mapped for this rank
        self.peer_ranges: dict[int, _VmmRange] = {}   # peer -> its imported allocations, mapped
        self.retired: list[_VmmRange] = []            # imports of lost peers, released once no copy reads them
        self.exported_fds: list[int] = []             # the segment's POSIX fds, open until seal
        self.fd_server: FdServer | None = None        # serves them over SCM_RIGHTS where pidfd_getfd is refused
        self._granularity: int | None = None

    # -- the segment ---------------------------------------------------------------------------
    def granularity(self) -> int:
        """The granularity every size and address of the segment, the views and the pool is a multiple of:
        the least common multiple of this device's for the segment's handle type and for the pool's
        (no handle type: nobody imports it); the driver may answer differently for each."""
        if self._granularity is None:
            self._granularity = math.lcm(self.vmm.granularity(self.handle_type), self.vmm.granularity("none"))
        return self._granularity

    def _alignment(self) -> int:
        """Reservation alignment: the granularity where it is a power of two (the driver's rule), else
        the driver's default."""
        g = self.granularity()
        return g if is_power_of_two(g) else 0

    def alloc_segment(self, nbytes: int, allocations: tuple[int, ...] | None) -> torch.Tensor:
        """allocations: the sizes of the cuMem allocations that make the segment up, back to back
        (CompositeLayout.segment_allocations), each a multiple of the granularity; None: one allocation
        of nbytes rounded up to the granularity."""
        g = self.granularity()
        sizes = (-(-max(nbytes, 1) // g) * g,) if allocations is None else tuple(int(n) for n in allocations)
        if not sizes or any(n < 1 or n % g for n in sizes) or sum(sizes) < nbytes:
            raise ValueError(f"rank {self.rank}: segment allocations {sizes} must be positive multiples of the "
                             f"granularity {g} covering {nbytes} bytes")
        handles = []
        try:
            for size in sizes:
                handles.append(self.vmm.create(size, self.handle_type))
            ptr = self.vmm.map_back_to_back(handles, sizes, self._alignment())
        except BaseException:
            for handle in reversed(handles):
                self.vmm.release(handle)
            raise
        self.own_range = _VmmRange(tuple(handles), sizes, ptr)
        self.segment = self.api.tensor_at(ptr, sum(sizes), self.device)[:nbytes]
        return self.segment

    def own_ptr(self) -> int:
        return self.own_range.ptr  # this rank's own mapping: nothing to import

    def composite_unavailable(self) -> str | None:
        return None

    def describe(self) -> str:
        return f"cuMemCreate segment + pool, peers through {self.mapping}, {self.granularity()} B granules"

    def composite_views(self, layout) -> CudaCompositeViews:
        if self.own_range is None:
            return super().composite_views(layout)
        if self.views is not None:
            raise RuntimeError(f"rank {self.rank}: composite views already built")
        want = tuple(a.nbytes for a in layout.segment_allocations)
        if self.own_range.sizes != want:
            raise ValueError(f"rank {self.rank}: the segment's allocations {self.own_range.sizes} are not the "
                             f"layout's {want}: alloc_segment(layout.segment_nbytes, allocations=...) first")
        self.views = CudaCompositeViews(layout, self.own_range.handles, self.vmm, self.handle_type,
                                        tensor_at=lambda ptr, n: self.api.tensor_at(ptr, n, self.device))
        return self.views

    # -- export and import ---------------------------------------------------------------------
    def export(self, handle: dict) -> None:
        """Every segment allocation into `handle`: fabric bytes, or POSIX fds (open until seal, served
        beside the export over a socket, for peers that pidfd_getfd cannot reach)."""
        handle["allocations"], handle["granularity"] = list(self.own_range.sizes), self.granularity()
        if self.handle_type == "fabric":
            handle["fabric"] = [self.vmm.export(h, "fabric") for h in self.own_range.handles]
            return
        # Room for our exports, and for one socket message of a peer's while we import it.
        ensure_fd_room(len(self.own_range.handles) + SCM_MAX_FD)
        try:
            for h in self.own_range.handles:
                self.exported_fds.append(self.vmm.export(h, "posix_fd"))
            name = fd_socket_name(self.rank)
            self.fd_server = FdServer(self.exported_fds, name)
        except BaseException:
            self.seal()
            raise
        handle.update(pid=os.getpid(), pid_ns=pid_namespace(), fds=list(self.exported_fds), socket=name)

    def open_peer(self, peer: int, handle: dict) -> int:
        sizes = tuple(int(n) for n in handle["allocations"])
        if int(handle["granularity"]) != self.granularity():
            # Every rank computed every layout with its own granularity: they must agree.
            raise ValueError(f"rank {self.rank}: peer {peer}'s cuMem granularity is {handle['granularity']}, this "
                             f"rank's {self.granularity()}; composite layouts need one granularity")
        imported = []
        try:
            imported = self._import(peer, handle)
            if len(imported) != len(sizes):
                raise ValueError(f"{len(imported)} handles for {len(sizes)} allocations")
            ptr = self.vmm.map_back_to_back(imported, sizes, self._alignment())
        except (cuda_api.CudaError, OSError, ValueError) as exc:
            for h in reversed(imported):
                self.vmm.release(h)
            raise PrefetchError(
                f"rank {self.rank}: cannot import the segment of peer {peer} (host {handle.get('host')}, device "
                f"{handle.get('device')}, {self.mapping}): {exc}"
            ) from exc
        except BaseException:
            for h in reversed(imported):
                self.vmm.release(h)
            raise
        self.peer_ranges[peer] = _VmmRange(tuple(imported), sizes, ptr)
        return ptr

    def _import(self, peer: int, handle: dict) -> list:
        """The peer's allocations imported as handles of this process (every fd closed once imported);
        on an error, the ones imported so far are released."""
        imported = []
        try:
            if self.handle_type == "fabric":
                for raw in handle["fabric"]:
                    imported.append(self.vmm.import_(raw_bytes(raw), "fabric"))
                self.fd_paths[peer] = "fabric handles"
                return imported
            if handle.get("host") != envs.node_name():
                raise ValueError(f"POSIX fds do not cross hosts: the peer runs on {handle.get('host')!r}, this rank "
                                 f"on {envs.node_name()!r}; a group over several hosts needs fabric handles "
                                 "(vmm-fabric: an IMEX channel on every node)")
            ensure_fd_room(min(len(handle["allocations"]), SCM_MAX_FD))
            fds, self.fd_paths[peer] = take_fds(handle)
            try:
                for i, fd in enumerate(fds):
                    imported.append(self.vmm.import_(fd, "posix_fd"))
                    os.close(fd)  # the imported handle keeps the allocation
                    fds[i] = -1
            finally:
                for fd in fds:
                    if fd >= 0:
                        os.close(fd)
            return imported
        except BaseException:
            for h in reversed(imported):
                self.vmm.release(h)
            raise

    def seal(self) -> None:
        if self.fd_server is not None:
            self.fd_server.close()
            self.fd_server = None
        while self.exported_fds:
            os.close(self.exported_fds.pop())

    def holds_exports(self) -> bool:
        return bool(self.exported_fds) or self.fd_server is not None

    def keep_export_for_board(self) -> bool:
        if self.handle_type != "posix_fd":
            return False  # a fabric handle is valid for as long as this process holds the allocation
        if not self.exported_fds:
            raise RuntimeError(f"rank {self.rank}: board_handle() after seal closed the exported fds")
        return True

    # -- lost peers and teardown ---------------------------------------------------------------
    def _release_range(self, mapped: _VmmRange) -> None:
        """Unmap every piece still mapped (the reverse of map_back_to_back), free the range once none is,
        release every handle still held (even one whose unmap failed: the driver frees the memory with its
        last mapping), each step whatever failed before it; the first error raised at the end. What
        succeeded is recorded, so calling it again finishes the release."""
        steps = Steps(f"rank {self.rank}: releasing a cuMem range at {mapped.ptr:#x}")
        starts = [mapped.ptr + sum(mapped.sizes[:i]) for i in range(len(mapped.sizes))]
        for i in reversed(range(len(mapped.sizes))):
            if mapped.mapped[i] and steps.attempt(f"cuMemUnmap at {starts[i]:#x}", self.vmm.unmap, starts[i],
                                                  mapped.sizes[i]):
                mapped.mapped[i] = False
        if mapped.reserved and not any(mapped.mapped) and steps.attempt(
                "cuMemAddressFree", self.vmm.address_free, mapped.ptr, mapped.nbytes):
            mapped.reserved = False
        for i in reversed(range(len(mapped.handles))):
            if mapped.held[i] and steps.attempt("cuMemRelease", self.vmm.release, mapped.handles[i]):
                mapped.held[i] = False
        steps.raise_first()

    def retire_peer(self, peer: int) -> _VmmRange | None:
        mapped = self.peer_ranges.pop(peer, None)
        if mapped is not None:
            self.retired.append(mapped)
        return mapped

    def release(self, mapped: _VmmRange) -> None:
        """A peer's imported allocations go with the last importer's release. Forgotten only once released
        (a failed release stays retired: close tries it again)."""
        self._release_range(mapped)
        self.retired.remove(mapped)

    def compute_reads_mapped_memory(self) -> bool:
        return self.own_range is not None or self.views is not None

    def close_peers(self) -> None:
        imported, self.peer_ranges = self.peer_ranges, {}
        for peer in reversed(list(imported)):
            try:
                self._release_range(imported[peer])
            except cuda_api.CudaError as exc:
                log.error("rank %d: releasing the import of peer %d failed: %s", self.rank, peer, exc)

    def close(self, drained: bool) -> None:
        """Release every retired import, every peer's import, the views, the segment and the primary
        context, each whatever failed before it; the first error raised at the end. Not drained: nothing
        is unmapped (the mappings stay until the process exits)."""
        retired, self.retired = self.retired, []
        if not drained:
            self.peer_ranges, self.segment = {}, None
            return
        steps = Steps(f"rank {self.rank}: closing the {self.mapping} mapping")
        for mapped in retired:
            steps.run("releasing a lost peer's import", self._release_range, mapped)
        imported, self.peer_ranges, self.segment = self.peer_ranges, {}, None
        for peer in reversed(list(imported)):  # the reverse of setup
            steps.run(f"releasing the import of peer {peer}", self._release_range, imported[peer])
        if self.views is not None:
            steps.run("closing the composite views", self.views.close)
        self.views = None
        if self.own_range is not None:
            steps.run("releasing the segment", self._release_range, self.own_range)
        self.own_range = None
        steps.run("releasing the primary context", self.vmm.close)
        steps.raise_first()


def local_vmm_mapping(rank: int, device, driver=None) -> str:
    """What this rank's device can export: "vmm-fabric", "vmm-posix-fd" or "ipc" (one log line,
    dwdp.runtime.transport.cuda_vmm.choose_mapping). driver: cuda.bindings.driver or a fake of it.
    Ran on one H200 (it answered "vmm-posix-fd": fabric create refused with no IMEX channel)."""
    vmm = Vmm(torch.device(device).index or 0, driver)
    try:
        # POSIX fds reach peers either way: pidfd_getfd, or the SCM_RIGHTS socket where it is refused.
        return choose_mapping(vmm, rank)
    finally:
        vmm.close()


def fabric_import_refusals(rank: int, device, all_gather, driver=None) -> list[str]:
    """Whether fabric handles really cross between the ranks of a group that all export them: each rank
    exports one granule, every rank imports every peer's (an import can be refused with NOT_PERMITTED
    after the export succeeded, e.g. ranks in different IMEX channels). all_gather: the group's
    all_gather_object (two rounds, every rank calls this). Returns every rank's refusals, "rank r: why";
    empty when every import worked. Not yet run on a GPU (a single GPU has no IMEX channel)."""
    vmm = Vmm(torch.device(device).index or 0, driver)
    handle, raw, refusals = None, None, []
    try:
        try:
            handle = vmm.create(vmm.granularity("fabric"), "fabric")
            raw = vmm.export(handle, "fabric")
        except cuda_api.CudaError as exc:
            refusals.append(f"rank {rank}: export: {exc}")
        raws = all_gather(raw)
        for peer, peer_raw in enumerate(raws):
            if peer == rank or peer_raw is None:
                continue
            try:
                vmm.release(vmm.import_(peer_raw, "fabric"))
            except cuda_api.CudaError as exc:
                refusals.append(f"rank {rank}: import from rank {peer}: {exc}")
        return [why for answer in all_gather(refusals) for why in answer]
    finally:
        if handle is not None:
            vmm.release(handle)
        vmm.close()
