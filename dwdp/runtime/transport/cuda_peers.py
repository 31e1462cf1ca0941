"""How a CudaTransport's segment reaches its peers: one PeerMapping per mapping, chosen once by name.

A mapping owns the memory behind this rank's segment and what it opened of its peers' segments; the
transport (dwdp.runtime.transport.cuda) keeps the copy side and asks it, in the order of setup:
  alloc_segment(nbytes, allocations) -> uint8 [nbytes]  this rank's segment, on its device
  export(handle)                     adds to register()'s handle what a peer needs to open the segment
  open(handles) -> [ptr per rank]    device addresses at which this rank reads each segment (its own
                                     through its own pointer; 0 for a peer lost before it joined);
                                     per peer: open_peer(peer, handle) -> ptr
  seal()                             closes exports no peer needs any more
and once a peer is lost: retire_peer(peer) -> what `release` frees once no copy reads it; at close,
close(drained) releases everything it still holds (drained) or leaves it to process exit.

The mappings: "ipc" (cuda_ipc), "vmm-posix-fd" and "vmm-fabric" (cuda_vmm_peers: cuMem allocations,
composite views), "symmetric_memory" (cuda_symmetric, across nodes), "process" (cuda_process, every
rank in this process).
"""
from __future__ import annotations

import torch


def raw_bytes(value: bytes | str) -> bytes:
    """Handle bytes as exchanged at setup (bytes) or read from the board's JSON (hex)."""
    return bytes.fromhex(value) if isinstance(value, str) else bytes(value)


class PeerMapping:
    """One mapping of a CudaTransport (see the module docstring). mapping: its name in handles and
    logs; api: dwdp.runtime.transport.cuda_api or a fake; driver: cuda.bindings.driver or a fake (VMM
    only); process_group: the DWDP group's (symmetric memory only).

    This base is what every mapping shares: one torch allocation as the segment, no composite views,
    no rejoin, nothing to seal."""

    rejoinable = False  # a process started later can open the export (a rank rejoining through the board)

    def __init__(self, mapping: str, rank: int, device: torch.device, api, *, driver=None, process_group=None):
        self.mapping, self.rank, self.device, self.api = mapping, rank, device, api
        self.segment: torch.Tensor | None = None
        self.fd_paths: dict[int, str] = {}  # peer -> how its export came (POSIX fds only)
        self.views = None                   # composite views (VMM only)

    # -- setup ---------------------------------------------------------------------------------
    def alloc_segment(self, nbytes: int, allocations: tuple[int, ...] | None) -> torch.Tensor:
        if allocations is not None:
            raise ValueError(f"rank {self.rank}: mapping={self.mapping!r} makes one allocation per segment; "
                             "allocations= needs 'vmm-posix-fd' or 'vmm-fabric'")
        self.segment = self._empty(nbytes)
        return self.segment

    def _empty(self, nbytes: int) -> torch.Tensor:
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)[:nbytes]

    def export(self, handle: dict) -> None:
        """Add what a peer needs to open this rank's segment to register()'s `handle`."""

    def own_ptr(self) -> int:
        return self.segment.data_ptr()

    def open(self, handles: list[dict | None]) -> list[int]:
        """The address of every rank's segment as this rank reads it; on an error, what was opened
        stays for `close_peers`."""
        return [self.own_ptr() if r == self.rank else 0 if handle is None else self.open_peer(r, handle)
                for r, handle in enumerate(handles)]

    def open_peer(self, peer: int, handle: dict) -> int:
        """Map `peer`'s segment; its address here. Every mapping that opens peers one at a time
        (ipc, the VMM ones, process) overrides it; symmetric_memory maps all of them in one rendezvous
        in open() and cannot open one later (it is not rejoinable, so the transport never asks)."""
        raise NotImplementedError(f"rank {self.rank}: mapping {self.mapping!r} maps every peer in one rendezvous; "
                                  f"it cannot open peer {peer} alone")

    def seal(self) -> None:
        """Close exports no peer needs any more (every peer opened this rank's segment)."""

    def holds_exports(self) -> bool:
        """Whether `seal` still has something to close."""
        return False

    def keep_export_for_board(self) -> bool:
        """board_handle() was asked: whether the export must outlive seal, so a rank started later can
        still take it (POSIX fds); RuntimeError when seal already closed it."""
        return False

    # -- composite views -----------------------------------------------------------------------
    def composite_unavailable(self) -> str | None:
        return (f"the cuda backend maps peers with {self.mapping!r}; composite views need cuMem allocations "
                "(VMM export refused on some rank, or cuda_mapping set to another mapping)")

    def granularity(self) -> int:
        raise ValueError(f"rank {self.rank}: mapping={self.mapping!r} has no cuMem granularity; composite views "
                         "need mapping 'vmm-posix-fd' or 'vmm-fabric'")

    def composite_views(self, layout):
        raise RuntimeError(f"rank {self.rank}: composite_views() needs a VMM segment (mapping {self.mapping!r}; "
                           "alloc_segment first)")

    def describe(self) -> str:
        return f"peers through {self.mapping}"

    # -- lost peers and teardown ---------------------------------------------------------------
    def retire_peer(self, peer: int):
        """`peer` was lost: take its mapping out of use; returns what `release` frees once no copy in
        flight reads it (None: nothing to free)."""
        return None

    def release(self, retired) -> None:
        """Free what `retire_peer` returned (no copy reads it any more)."""

    def compute_reads_mapped_memory(self) -> bool:
        """Whether kernels read memory this mapping unmaps at close (then close waits for the compute
        stream too: unmapping under a running kernel faults the context)."""
        return False

    def close_peers(self) -> None:
        """Release every peer mapping still held (a failed open, or close), logging errors."""

    def close(self, drained: bool) -> None:
        """Release everything still held, in the reverse of setup, when `drained` (no copy or kernel
        reads any of it); otherwise forget it and leave it to process exit."""
        if drained:
            self.close_peers()
        self.segment = None
