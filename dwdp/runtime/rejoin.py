"""A new process taking the place of a lost rank in a running DWDP group, with no collective.

Legend: L = local experts per rank, Eq = experts asked for.

The replacement reads its peers' entries from the group's board (dwdp.runtime.board), maps their
segments and liveness records, fills its own segment with its local experts, and publishes its
entry once it serves. Its local experts are copied from a live peer's segment when every one of
them has a live owner (a memory copy of L experts per layer), else read from the expert source
the caller gave (the checkpoint, or the model's own tensors). Peers missing from the board are lost
from the start. Nobody waits for anybody: survivors find the new entry when they next read
liveness (dwdp.runtime.failover).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dwdp.runtime.board import Board
from dwdp.runtime.placement import Placement


@dataclass(frozen=True)
class PeerEntries:
    """What the board says of every other rank: its entry, or None when it has none (lost)."""

    rank: int
    entries: tuple[dict | None, ...]

    @classmethod
    def read(cls, board: Board, rank: int, size: int) -> "PeerEntries":
        return cls(rank, tuple(None if r == rank else board.read(r) for r in range(size)))

    @property
    def live(self) -> tuple[int, ...]:
        return tuple(r for r, e in enumerate(self.entries) if e is not None)

    @property
    def missing(self) -> tuple[int, ...]:
        return tuple(r for r, e in enumerate(self.entries) if e is None and r != self.rank)

    def segments(self, own: dict) -> list[dict | None]:
        """Segment handles for `transport.open`, this rank's own (`own`) in its place."""
        return [own if r == self.rank else (e["segment"] if e else None) for r, e in enumerate(self.entries)]

    def records(self) -> list[dict | None]:
        return [e["record"] if e else None for e in self.entries]


def live_owner_of_each(placement: Placement, rank: int, live) -> dict[int, int] | None:
    """expert -> a live peer that owns it, for every local expert of `rank` (spread over the
    owners); None when some local expert has no live owner but `rank` itself."""
    chosen, load = {}, {p: 0 for p in live}
    for e in placement.local_experts(rank):
        owners = [o for o in placement.owners(e) if o in load]
        if not owners:
            return None
        best = min(owners, key=lambda o: (load[o], o))
        chosen[e], load[best] = best, load[best] + 1
    return chosen


def peer_source(layers, offset_in_peer, owner_of: dict[int, int], peer_segment, fallback):
    """An ExpertSource (dwdp.runtime.model) reading moving tensors from live peers' segments.

    offset_in_peer(peer, layer index, expert, tensor index) -> byte offset of that expert's tensor in
    the peer's segment (its tables or composite layout); owner_of: expert -> peer to read it from
    (`live_owner_of_each`); peer_segment(peer) -> that peer's mapped segment, uint8 [nbytes];
    fallback: the ExpertSource for tensors that stay on every rank (they are in no segment).
    """
    index_of = {layer.name: i for i, layer in enumerate(layers)}
    spec_of = {layer.name: layer.spec for layer in layers}

    def read(name: str, tensor_name: str, ids: torch.Tensor) -> torch.Tensor:
        spec = spec_of[name]
        moving = [t.name for t in spec.moving]
        if tensor_name not in moving:
            return fallback(name, tensor_name, ids)
        t_index = moving.index(tensor_name)
        tensor = spec.moving[t_index]
        rows = []
        for e in ids.tolist():
            peer = owner_of[e]
            start = offset_in_peer(peer, index_of[name], e, t_index)
            rows.append(tensor.views_in(peer_segment(peer), start, 1))  # [1, *shape]
        return torch.cat(rows)  # [Eq, *shape]

    return read
