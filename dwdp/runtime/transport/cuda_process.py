"""The "process" mapping of the cuda backend: every rank of the group lives in this process (`dwdp
tune`, tests), so a peer's segment is read through its own pointer, with peer access enabled between
devices. A handle from another process is refused by name."""
from __future__ import annotations

import os

from dwdp.runtime.transport.cuda_peers import PeerMapping


class ProcessMapping(PeerMapping):
    def export(self, handle: dict) -> None:
        handle["ptr"], handle["pid"] = self.segment.data_ptr(), os.getpid()

    def open_peer(self, peer: int, handle: dict) -> int:
        if handle.get("pid") != os.getpid():
            raise ValueError(f"rank {self.rank}: peer {peer}'s segment belongs to process {handle.get('pid')}, "
                             f"not this one ({os.getpid()}); mapping='process' holds every rank in one process")
        own, device = self.device.index or 0, int(handle["device"])
        if self.device.type == "cuda" and device != own and self.api.can_access_peer(own, device):
            self.api.enable_peer_access(device)  # copies between the devices go over their link
        return int(handle["ptr"])
