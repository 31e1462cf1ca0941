"""Which mapping a cuda group uses for its peers' segments: settled once at setup by the group (one
all-gather, a second pair of rounds for a fabric trial), read from the board by a rank that rejoins.

Mappings (dwdp.runtime.transport.cuda, PEER_MAPPINGS): "vmm-fabric" and "vmm-posix-fd" (cuMem allocations, composite
views), "ipc" (CUDA IPC, the multi-buffer experts path), "symmetric_memory" (across hosts).
"""
from __future__ import annotations

import logging

import torch

from dwdp import envs
from dwdp.runtime.group import DWDPGroup
from dwdp.runtime.store_board import find_board

log = logging.getLogger("dwdp")


def settle_cuda_mapping(requested: str, experts_kernel: str, group: DWDPGroup, device: torch.device) -> str:
    """How the cuda backend maps peers' segments (POSIX fds ran on one H200; fabric not yet run on a GPU).

    "auto" or "vmm" with a composite-capable experts_kernel ("auto", "composite"): each rank probes
    what its device exports (cuda_vmm.choose_mapping: fabric with an IMEX channel, else POSIX fd,
    else CUDA IPC, one log line) and one all-gather settles the group on what every rank can do:
    fabric handles when all ranks have them and a trial import crosses every pair (one node or several
    NVL72 trays), POSIX fds when all ranks export and share this host, else CUDA IPC on one host and
    symmetric memory across hosts.
    """
    from dwdp.runtime.transport import cuda_vmm_peers

    if requested not in ("auto", "vmm"):
        return requested
    if group.rejoining:  # the group settled long ago, and a rejoining rank joins no all-gather
        return mapping_on_board(group)
    local = "ipc"
    if experts_kernel in ("auto", "composite"):
        local = cuda_vmm_peers.local_vmm_mapping(group.rank, device)
    answers = group.all_gather_object((envs.node_name(), local))
    hosts, choices = {h for h, _ in answers}, {c for _, c in answers}
    if choices == {"vmm-fabric"}:
        refusals = cuda_vmm_peers.fabric_import_refusals(group.rank, device, group.all_gather_object)
        if not refusals:
            return "vmm-fabric"
        log.warning("rank %d: fabric handles do not cross the group (%s); falling back to %s", group.rank,
                    "; ".join(refusals), "POSIX fds" if len(hosts) == 1 else "another mapping")
        choices = {"vmm-posix-fd"}
    if len(hosts) == 1:
        return "vmm-posix-fd" if "ipc" not in choices else "ipc"
    if requested == "vmm":
        raise ValueError(f"cuda_mapping='vmm' across {len(hosts)} hosts needs fabric handles on every rank; "
                         f"the ranks offer {sorted(choices)}")
    return "symmetric_memory"


def mapping_on_board(group: DWDPGroup) -> str:
    """The cuda mapping a running group settled on, as its live ranks' board entries name it."""
    board = find_board(group) if group.group_id else None
    entries = [board.read(r) for r in range(group.size) if r != group.rank] if board is not None else []
    mappings = sorted({e["segment"].get("mapping") for e in entries if e is not None})
    if len(mappings) != 1:
        raise ValueError(f"rank {group.rank} cannot rejoin on the cuda backend: the live entries on its group's board "
                         f"(group_id={group.group_id!r}) name the mappings {mappings}; expected the one its peers "
                         "share")
    return mappings[0]
