"""The "symmetric_memory" mapping of the cuda backend (multi-node NVLink): the segment comes from torch's
symmetric memory and one rendezvous over the DWDP group's process group maps every rank's; peers are
read through the rendezvous handle's buffer pointers (no handle is exported or opened per peer)."""
from __future__ import annotations

import torch

from dwdp.runtime.transport.cuda_peers import PeerMapping


def _symmetric_memory_module():
    try:
        from torch.distributed import _symmetric_memory as symm
    except ImportError as exc:
        raise RuntimeError(
            f"cuda_mapping='symmetric_memory' (multi-node NVLink) needs torch.distributed._symmetric_memory, "
            f"which torch {torch.__version__} does not have; run the group on one node (cuda_mapping='ipc')"
        ) from exc
    if not hasattr(symm, "rendezvous") or not hasattr(symm, "empty"):
        raise RuntimeError(f"torch {torch.__version__}'s _symmetric_memory lacks empty/rendezvous; "
                           "use cuda_mapping='ipc' on one node")
    return symm


class SymmetricMapping(PeerMapping):
    def __init__(self, mapping, rank, device, api, *, process_group=None, **kwargs):
        super().__init__(mapping, rank, device, api, **kwargs)
        self.process_group = process_group
        self.handle = None  # the rendezvous handle: keeps every rank's buffer mapped

    def _empty(self, nbytes: int) -> torch.Tensor:
        return _symmetric_memory_module().empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)[:nbytes]

    def open(self, handles: list[dict]) -> list[int]:
        symm = _symmetric_memory_module()
        if self.process_group is None:
            raise ValueError(f"rank {self.rank}: mapping='symmetric_memory' needs the DWDP group's process group")
        self.handle = symm.rendezvous(self.segment, self.process_group)
        return [int(p) for p in self.handle.buffer_ptrs]

    def close(self, drained: bool) -> None:
        super().close(drained)
        self.handle = None
