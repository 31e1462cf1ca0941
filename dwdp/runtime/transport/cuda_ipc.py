"""The "ipc" mapping of the cuda backend: CUDA IPC on one node (the multi-buffer experts path).

The segment is one torch allocation; `export` puts its IPC handle (and the segment's offset inside
the allocation the handle names) in the register() handle; a peer opens it with cudaIpcOpenMemHandle.
A rank reads its own segment through its own pointer (opening one's own IPC handle fails). An IPC
handle stays valid for as long as its exporter holds the memory, so a rank started later can open it.
"""
from __future__ import annotations

import logging

from dwdp.runtime.transport import cuda_api
from dwdp.runtime.transport.base import PrefetchError
from dwdp.runtime.transport.cuda_peers import PeerMapping, raw_bytes

log = logging.getLogger("dwdp")


class IpcMapping(PeerMapping):
    rejoinable = True

    def __init__(self, mapping, rank, device, api, **kwargs):
        super().__init__(mapping, rank, device, api, **kwargs)
        self.opened: list[int] = []           # IPC bases this rank opened, closed exactly once
        self.peer_bases: dict[int, int] = {}  # peer -> the IPC base opened for it (kept once retired: it names it)

    def export(self, handle: dict) -> None:
        handle["ipc"], handle["offset"] = self.api.ipc_export(self.segment.data_ptr())

    def open_peer(self, peer: int, handle: dict) -> int:
        try:
            base = self.api.ipc_open(raw_bytes(handle["ipc"]))
        except (cuda_api.CudaError, ValueError) as exc:
            raise PrefetchError(
                f"rank {self.rank}: cannot map the segment of peer {peer} (host {handle.get('host')}, device "
                f"{handle.get('device')}): {exc}"
            ) from exc
        self.opened.append(base)
        self.peer_bases[peer] = base
        return base + int(handle["offset"])

    def retire_peer(self, peer: int) -> int | None:
        return self.peer_bases.get(peer)

    def release(self, base: int) -> None:
        self.api.ipc_close(base)
        self.opened.remove(base)  # forgotten only once closed: a failed close is tried again at close

    def close_peers(self) -> None:
        opened, self.opened = self.opened, []
        for base in opened:
            try:
                self.api.ipc_close(base)
            except cuda_api.CudaError as exc:
                log.error("rank %d: closing a peer mapping at %#x failed: %s", self.rank, base, exc)

    def close(self, drained: bool) -> None:
        super().close(drained)
        self.opened = []
