"""Host composite views: one reserved address range per rank in which every (layer, expert tensor)
is a plain `[E, ...]` tensor, its local experts the rank's own segment pages mapped in place and its
remote experts' pages those of a private pool slot (dwdp.runtime.composite plans which page goes where).

Mechanics (Linux): the range is reserved with `mmap(PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS |
MAP_NORESERVE)`; each MapRun is then mapped over it with `mmap(MAP_SHARED | MAP_FIXED)` from the
segment file (the same /dev/shm file peers copy from) or from the pool (a memfd). `torch.frombuffer`
over the range gives the tensor. Since every mapping is MAP_SHARED of one file, a write through the
segment tensor is visible through the view at once and vice versa: the local experts are never
copied. The copy plans of dwdp.runtime.composite write straight into the layer's part of the range.

Lifetime: the range is unmapped when the last tensor over it is freed (a finalizer on the buffer),
never while a view is alive. A peer's segment file stays readable after its owner dies for as long as
some rank maps it (the name is unlinked at seal, the pages go with the last mapping), so failover may
keep reading a dead exporter's bytes on this backend; it re-plans anyway so that behaviour matches CUDA.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
import weakref

import torch

from dwdp.runtime.composite import SEGMENT, CompositeLayout

_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_SHARED, _MAP_PRIVATE = 0x01, 0x02
_MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE = 0x10, 0x20, 0x4000  # Linux values (all architectures we run)


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def composite_unsupported_reason() -> str | None:
    """Why host composite views cannot be built here (None when they can): MAP_FIXED over a file
    and memfd are the Linux calls this module relies on."""
    if not sys.platform.startswith("linux"):
        return f"host composite views need Linux mmap(MAP_FIXED); this is {sys.platform}"
    if not hasattr(os, "memfd_create"):
        return "host composite views need os.memfd_create"
    return None


def page_size() -> int:
    return mmap.PAGESIZE


def _errno_message(what: str) -> str:
    err = ctypes.get_errno()
    return f"{what} failed: {os.strerror(err)} (errno {err})"


class Reservation:
    """`nbytes` of reserved address space (PROT_NONE) that files are mapped into with MAP_FIXED.
    Unmapped by a finalizer once this object and every tensor over it are gone."""

    def __init__(self, nbytes: int):
        if nbytes < 1 or nbytes % page_size():
            raise ValueError(f"nbytes={nbytes} must be a positive multiple of the page size {page_size()}")
        self._libc = _libc()
        addr = self._libc.mmap(None, nbytes, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(_errno_message(f"reserving {nbytes} bytes"))
        self.addr, self.nbytes = addr, nbytes
        self._finalizer = weakref.finalize(self, self._libc.munmap, addr, nbytes)

    def map_fixed(self, offset: int, nbytes: int, fd: int, file_offset: int) -> None:
        """Map bytes [file_offset, file_offset + nbytes) of `fd` at byte `offset` of the range, shared."""
        page = page_size()
        if offset % page or nbytes % page or file_offset % page:
            raise ValueError(f"map_fixed(offset={offset}, nbytes={nbytes}, file_offset={file_offset}): each must be "
                             f"a multiple of the page size {page}")
        if offset < 0 or nbytes < 1 or offset + nbytes > self.nbytes:
            raise ValueError(f"map_fixed(offset={offset}, nbytes={nbytes}) is outside the range of {self.nbytes} bytes")
        want = self.addr + offset
        got = self._libc.mmap(want, nbytes, _PROT_RW, _MAP_SHARED | _MAP_FIXED, fd, file_offset)
        if got != want:
            raise OSError(_errno_message(f"mmap(MAP_FIXED) of {nbytes} bytes at offset {offset}"))

    def tensor(self) -> torch.Tensor:
        """uint8 [nbytes] over the whole range; it keeps the reservation alive."""
        buffer = (ctypes.c_uint8 * self.nbytes).from_address(self.addr)
        buffer._dwdp_reservation = self  # the mapping outlives every tensor that reads it
        return torch.frombuffer(buffer, dtype=torch.uint8)


class HostCompositeViews:
    """One rank's composite views over all MoE layers.

    layout: the rank's CompositeLayout (granularity a multiple of the page size).
    segment_fd: a read-write descriptor of the rank's segment file (HostTransport.segment_fd()).
    """

    def __init__(self, layout: CompositeLayout, segment_fd: int):
        reason = composite_unsupported_reason()
        if reason is not None:
            raise OSError(reason)
        if layout.granularity % page_size():
            raise ValueError(f"granularity={layout.granularity} must be a multiple of the page size {page_size()}")
        if os.fstat(segment_fd).st_size < layout.segment_nbytes:
            raise ValueError(f"segment file of {os.fstat(segment_fd).st_size} bytes is smaller than the layout's "
                             f"{layout.segment_nbytes}")
        self.layout = layout
        pool_fd = os.memfd_create(f"dwdp-pool-{layout.rank}")
        try:
            os.ftruncate(pool_fd, max(layout.pool_nbytes, 1))
            self._reservation = Reservation(layout.num_layers * layout.layer_nbytes)
            for layer in range(layout.num_layers):
                base = layer * layout.layer_nbytes
                for run in layout.map_runs(layer):
                    fd = segment_fd if run.backing == SEGMENT else pool_fd
                    self._reservation.map_fixed(base + run.view_offset, run.nbytes, fd, run.file_offset)
        finally:
            os.close(pool_fd)  # the mappings keep the pool's pages
        self.range = self._reservation.tensor()  # [num_layers * layer_nbytes]
        del self._reservation  # the tensor holds it now: the range lives exactly as long as its views

    def layer_range(self, layer: int) -> torch.Tensor:
        """uint8 [layer_nbytes]: the destination buffer of `layer`'s composite copy plan."""
        n = self.layout.layer_nbytes
        return self.range[layer * n:(layer + 1) * n]

    def view(self, layer: int, tensor: int, dtype: torch.dtype, shape) -> torch.Tensor:
        """The [E, ...] tensor `tensor` of `layer` (shape: the stacked tensor's, e.g. [E, 2I, H])."""
        start, nbytes = self.layout.view_span(layer, tensor, dtype, shape)
        return self.range[start:start + nbytes].view(dtype).view(*shape)
