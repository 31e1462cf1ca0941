"""Failover: a lost source is a plan change, never a collective.

Legend: E = experts per MoE layer, T = tokens, k = experts per token.

Each rank keeps its own view of which peers are lost, and why. A peer is declared lost when
- its liveness record says it exited without closing, or that its device is lost (read at the
  start of every forward, and whenever `poll` is called, e.g. by a serving worker's health loop);
- a copy from it fails (the transport names the peer): its memory is unreadable;
- a copy from it is still outstanding after `peer_timeout_s` and its record says it is gone.
A stalled peer (alive, heartbeat silent) is reported, not lost: copies read its memory without
its help, so it slows nobody.

A lost peer can come back: a new process of the same rank (dwdp.runtime.rejoin) publishes its new
segment and liveness record on the group's board (dwdp.runtime.board). Each survivor looks there for
its lost peers when it reads liveness; when it finds a new incarnation it maps that segment and
record and re-plans back towards the placement's balanced sources. The old incarnation's mapping was
dropped when it was declared lost, so its memory is never read again. A rejoin found while a
forward runs waits for the next forward to start: a forward runs on one plan from start to end.

On a loss the rank re-plans alone: `surviving_sources` picks new owners (every survivor computes
the same choice from the same lost set), every cached copy plan is dropped, the transport forgets
the peer (its mapping goes), and the prefetcher retries a failed slot from the new sources. An
expert no surviving owner holds becomes unservable: a forward routing a token to it fails at once
with ExpertsUnavailable, naming the experts and the lost ranks; other forwards still run.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from dwdp.runtime.liveness import PeerLiveness, entry_identity
from dwdp.runtime.placement import NO_SOURCE, Placement, surviving_sources

log = logging.getLogger("dwdp")


class RankDegraded(RuntimeError):
    """This rank cannot run a forward that needs what it lost; the message says what and why."""


class ExpertsUnavailable(RankDegraded):
    """Tokens were routed to experts whose every owner is lost. experts: their ids; lost: the lost
    ranks that owned them, with the reason each was declared lost."""

    def __init__(self, message: str, experts: tuple[int, ...], lost: dict[int, str]):
        super().__init__(message)
        self.experts, self.lost = experts, lost


class DeviceLost(RankDegraded):
    """This rank's own device is lost (reported by itself): it serves nothing any more."""


@dataclass(frozen=True)
class FailoverStatus:
    """What one rank knows about its peers: lost (rank -> reason), stalled (alive but silent),
    re-plans done, slices copied again after a failure, experts it can no longer get, and whether
    its own device is lost."""

    rank: int
    lost: dict[int, str]
    stalled: tuple[int, ...]
    replans: int
    retried_slices: int
    unservable_experts: tuple[int, ...]
    device_lost: str | None
    rejoins: dict[int, int] = dataclasses.field(default_factory=dict)  # peer -> times it rejoined
    redundancy: tuple[int, ...] = ()  # per expert: owners not lost, as this rank sees them
    rejoining: tuple[int, ...] = ()   # lost peers found back, taken into the plans at the next forward
    peers: dict[int, tuple] = dataclasses.field(default_factory=dict)  # peer -> (its node, its state here)

    @property
    def can_serve_all(self) -> bool:
        """True when every expert is still reachable: any forward can run here."""
        return self.device_lost is None and not self.unservable_experts


class Failover:
    """One rank's lost-peer state and re-planning. Mutating calls run under the prefetcher's lock.

    plans: the PlanCache to re-point; transport: forgets lost peers; liveness: peers' records
    (None: losses are only learnt from copy errors); peer_timeout_s: how long a copy may be
    outstanding before its peer's liveness is checked; record: this rank's own LivenessRecord;
    board: the group's Board, where lost peers that come back are found (None: they never do).
    """

    def __init__(self, placement: Placement, rank: int, plans, transport, liveness: PeerLiveness | None,
                 peer_timeout_s: float, record=None, board=None):
        self.placement, self.rank, self.plans, self.transport = placement, rank, plans, transport
        self.liveness, self.peer_timeout_s = liveness, peer_timeout_s
        self.lost: dict[int, str] = {}
        self.replans = 0
        self.retried_slices = 0
        self.unservable: frozenset[int] = frozenset()
        self._unservable_ids: torch.Tensor | None = None  # [U] int64, on the router's device
        self.device_lost: str | None = None
        self._record = record  # this rank's LivenessRecord, marked failed with its device
        self.board = board
        self.rejoins: dict[int, int] = {}
        self._lost_identity: dict[int, tuple] = {}  # the process each lost peer was when it was lost
        self.pending: dict[int, dict] = {}   # peer -> board entry: rejoined, applied at the next forward

    # -- learning about losses -----------------------------------------------------------------
    def poll(self, rejoin_now: bool = True) -> dict[int, str]:
        """Read every watched peer's record; declare the exited and failed ones lost; look for lost
        peers that came back and take them back (now, or at the next forward when `rejoin_now` is
        False). Returns the newly lost peers with their reasons."""
        if self.liveness is None:
            return {}
        found = {}
        for peer in self.liveness.peers:
            status = self.liveness.status(peer)
            if status.is_lost:
                found[peer] = status.describe(peer)
        self.declare_lost(found)
        self.pending = self.find_rejoined()  # read afresh: an entry whose process died since is gone
        if rejoin_now and self.pending:
            self.take_back(self.pending)
            self.pending = {}
        return found

    def find_rejoined(self) -> dict[int, dict]:
        """Lost peers whose board entry names a new, living process: peer -> that entry."""
        if self.board is None:
            return {}
        found = {}
        for peer in self.lost:
            entry = self.board.read(peer)
            if entry is not None and entry_identity(entry) != self._lost_identity.get(peer):
                found[peer] = entry
        return found

    def take_back(self, rejoined: dict[int, dict]) -> list[int]:
        """Map each rejoined peer's new segment and record and re-plan with it; returns the peers
        taken back (one whose new process is already gone again stays lost)."""
        back = []
        for peer, entry in sorted(rejoined.items()):
            if peer not in self.lost:
                continue
            try:
                self.transport.open_peer(peer, entry["segment"])
                if self.liveness is not None:
                    self.liveness.watch(peer, entry["record"])
            except FileNotFoundError as exc:  # its /proc/<pid>/fd paths died with it
                log.warning("rank %d: peer %d (pid %s) rejoined and went again (%s)", self.rank, peer, entry["pid"],
                            exc)
                self.transport.forget_peer(peer)
                continue
            del self.lost[peer]
            self.rejoins[peer] = self.rejoins.get(peer, 0) + 1
            back.append(peer)
        if back:
            self._replan()
            log.warning("rank %d: peers %s rejoined (new pids %s); re-planned, %d expert(s) without an owner",
                        self.rank, back, [rejoined[p]["pid"] for p in back], len(self.unservable))
        return back

    def copy_failed(self, peer: int, error: BaseException) -> dict[int, str]:
        """The reason to record for `peer` after a copy from it failed with `error`."""
        alive = ""
        if self.liveness is not None and peer in self.liveness.peers:
            status = self.liveness.status(peer)
            alive = f"; {status.describe(peer)}" if status.is_lost else "; its process is alive: memory unreadable"
        return {peer: f"a copy from rank {peer} failed ({error.__cause__ or error}){alive}"}

    def exited_among(self, peers) -> dict[int, str]:
        """Of `peers` (sources of copies outstanding past the bound), those whose record says lost."""
        if self.liveness is None:
            return {}
        found = {}
        for peer in peers:
            if peer in self.lost or peer not in self.liveness.peers:
                continue
            status = self.liveness.status(peer)
            if status.is_lost:
                found[peer] = f"{status.describe(peer)} (copies from it outstanding past {self.peer_timeout_s:g} s)"
        return found

    # -- re-planning ---------------------------------------------------------------------------
    def declare_lost(self, lost: dict[int, str]) -> bool:
        """Add `lost` (rank -> reason) to the lost set and re-plan; False when nothing was new."""
        new = {p: why for p, why in lost.items() if p not in self.lost and p != self.rank}
        if not new:
            return False
        self.lost.update(new)
        for peer in new:
            if self.liveness is not None and peer in self.liveness.peers:
                self._lost_identity[peer] = self.liveness.identity(peer)
        self._replan()
        for peer in new:
            self.transport.forget_peer(peer)
            if self.liveness is not None:
                self.liveness.forget(peer)
            if self.board is not None:
                self.board.sweep(peer)
        for peer, why in sorted(new.items()):
            log.warning("rank %d: peer %d lost (%s); re-planned, %d expert(s) without an owner: %s", self.rank, peer,
                        why, len(self.unservable), sorted(self.unservable))
        return True

    def _replan(self) -> None:
        """Point the plans at the sources the lost set leaves (the placement's own when none is lost)."""
        sources = surviving_sources(self.placement, self.lost)[self.rank]
        self.plans.set_sources(sources)
        unservable = sorted(e for e in self.placement.missing_experts(self.rank) if sources[e] == NO_SOURCE)
        # Ids first: check_routed reads `unservable` without the lock and then uses the ids.
        self._unservable_ids = torch.tensor(unservable, dtype=torch.long)
        self.unservable = frozenset(unservable)
        self.replans += 1

    def redundancy(self) -> tuple[int, ...]:
        """Per expert, how many of its owners are not lost (this rank's view)."""
        return tuple(sum(o not in self.lost for o in self.placement.owners(e))
                     for e in range(self.placement.num_experts))

    def inject_fault(self, rank: int, reason: str) -> None:
        """Treat `rank`'s memory as unreadable from now on: copies from it fail (the transport's
        fault hook) and are retried elsewhere; if `rank` is this rank, its own device is lost."""
        if rank == self.rank:
            self.lose_own_device(reason)
        else:
            self.transport.fail_copies_from(rank, reason)

    def lose_own_device(self, reason: str) -> None:
        """This rank's device is lost: fail every forward from now on and tell the peers."""
        self.device_lost = reason
        if self._record is not None:
            self._record.mark_failed()

    # -- the forward's side --------------------------------------------------------------------
    def check_device(self) -> None:
        if self.device_lost is not None:
            raise DeviceLost(f"rank {self.rank}: its device is lost ({self.device_lost}); it serves nothing")

    def check_routed(self, layer: int, routed: torch.Tensor | None) -> None:
        """Raise DeviceLost or ExpertsUnavailable when this layer cannot run here. routed: [T, k]
        expert ids of the layer's tokens (None: unknown, so any unservable expert counts)."""
        self.check_device()
        if not self.unservable:
            return
        if routed is None:
            hit = tuple(sorted(self.unservable))
        else:
            ids = self._unservable_ids.to(routed.device)
            hit = tuple(int(e) for e in ids[torch.isin(ids, routed.reshape(-1))].tolist())
        if hit:
            owners = sorted({o for e in hit for o in self.placement.owners(e)})
            lost = {o: self.lost[o] for o in owners}
            why = "; ".join(f"rank {o}: {lost[o]}" for o in owners)
            raise ExpertsUnavailable(
                f"rank {self.rank}: MoE layer {layer} routes tokens to experts {list(hit)}, which no surviving rank "
                f"owns (lost ranks {owners}: {why})", hit, lost)

    def status(self) -> FailoverStatus:
        stalled, peers = (), {}
        if self.liveness is not None:
            states = {p: self.liveness.status(p).state for p in self.liveness.peers}
            stalled = tuple(p for p, state in states.items() if state == "stalled")
            peers = {p: (self.liveness.node_of(p), "lost" if p in self.lost else states.get(p, "unknown"))
                     for p in sorted({*states, *self.lost})}
        return FailoverStatus(self.rank, dict(self.lost), stalled, self.replans, self.retried_slices,
                              tuple(sorted(self.unservable)), self.device_lost, dict(self.rejoins),
                              self.redundancy(), tuple(sorted(self.pending)), peers)
