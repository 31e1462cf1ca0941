"""Which rank owns which expert, and where each rank pulls its missing experts from.

Legend: E = experts per MoE layer, G = ranks in the DWDP group, L = local experts per rank.

Rank r owns the L consecutive experts (mod E) starting at floor(r * E / G). Starts are spread as
evenly as integers allow, so every gap between two starts is at most ceil(E / G) <= L and every
expert has at least one owner. When G does not divide E, or L > ceil(E / G), ranges overlap and
the overlapping experts are redundant: they have several owners, and pulls of them are spread
over those owners so that no source serves more than it must.

When ranks are lost, `surviving_sources` chooses again among the owners still alive, with the same
balancing; every survivor computes it alone from the same inputs, so they agree without talking.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    """Expert ownership of one MoE layer for a DWDP group (the same for every layer).

    owned[r]: sorted expert ids rank r keeps locally.
    source[r][e]: the rank rank r reads expert e from (r itself when e is local).
    """

    num_experts: int
    group_size: int
    num_local_experts: int
    owned: tuple[tuple[int, ...], ...]
    source: tuple[tuple[int, ...], ...]

    def owners(self, expert: int) -> tuple[int, ...]:
        return tuple(r for r in range(self.group_size) if expert in self.owned[r])

    def local_experts(self, rank: int) -> tuple[int, ...]:
        return self.owned[rank]

    def missing_experts(self, rank: int) -> tuple[int, ...]:
        owned = set(self.owned[rank])
        return tuple(e for e in range(self.num_experts) if e not in owned)

    def pulls_from(self, rank: int, peer: int) -> tuple[int, ...]:
        """Sorted experts that `rank` pulls from `peer`."""
        return tuple(e for e in self.missing_experts(rank) if self.source[rank][e] == peer)

    def source_load(self) -> tuple[int, ...]:
        """Number of (destination, expert) pulls each rank serves."""
        load = [0] * self.group_size
        for r in range(self.group_size):
            for e in self.missing_experts(r):
                load[self.source[r][e]] += 1
        return tuple(load)

    @property
    def is_redundant(self) -> bool:
        return self.num_local_experts * self.group_size > self.num_experts

    @property
    def min_owners(self) -> int:
        """Owners of the least replicated expert: how many ranks can be lost before one goes."""
        return min(len(self.owners(e)) for e in range(self.num_experts))


def min_local_experts(num_experts: int, group_size: int) -> int:
    return math.ceil(num_experts / group_size)


def _starts(num_experts: int, group_size: int, ranks_per_node: int | None = None) -> list[int]:
    """Where each rank's window of consecutive experts starts. Over several nodes (`ranks_per_node`
    consecutive ranks a node), one node's ranks take every nodes-th start (node n's i-th rank the
    (i x nodes + n)-th), so each node's windows spread over the whole ring: a node lost leaves the
    others owners of as many experts as their windows can cover."""
    positions = list(range(group_size))
    if ranks_per_node is not None and 1 <= ranks_per_node < group_size and group_size % ranks_per_node == 0:
        nodes = group_size // ranks_per_node
        positions = [(r % ranks_per_node) * nodes + r // ranks_per_node for r in range(group_size)]
    return [p * num_experts // group_size for p in positions]


def local_experts_for_replicas(num_experts: int, group_size: int, replicas: int) -> int:
    """The fewest local experts per rank that give every expert at least `replicas` owners."""
    if not 1 <= replicas <= group_size:
        raise ValueError(f"expert_replicas={replicas!r} must be in [1, group_size={group_size}]: an expert cannot "
                         "have more owners than there are ranks")
    starts = _starts(num_experts, group_size)
    for local in range(min_local_experts(num_experts, group_size), num_experts + 1):
        owners = [sum((e - s) % num_experts < local for s in starts) for e in range(num_experts)]
        if min(owners) >= replicas:
            return local
    return num_experts


def build_placement(num_experts: int, group_size: int, num_local_experts: int | None = None,
                    replicas: int = 1, ranks_per_node: int | None = None) -> Placement:
    """Ownership and source choice for `group_size` ranks over `num_experts` experts; `replicas`:
    owners every expert must have (num_local_experts None picks the fewest that give them);
    ranks_per_node: consecutive ranks sharing a node, whose experts are spread over the ring (None: one
    node, or nodes not considered)."""
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r} must be an int >= 1")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or not 1 <= group_size <= num_experts:
        raise ValueError(
            f"group_size={group_size!r} must be an int in [1, num_experts={num_experts}]: "
            "every rank needs at least one expert of its own"
        )
    if ranks_per_node is not None and (isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int)
                                       or ranks_per_node < 1 or group_size % ranks_per_node):
        raise ValueError(f"ranks_per_node={ranks_per_node!r} must be an int >= 1 dividing group_size={group_size}")
    lowest = min_local_experts(num_experts, group_size)
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise ValueError(f"expert_replicas={replicas!r} must be an int in [1, group_size={group_size}]")
    wanted = local_experts_for_replicas(num_experts, group_size, replicas)
    if num_local_experts is None:
        num_local_experts = wanted
    is_int = isinstance(num_local_experts, int) and not isinstance(num_local_experts, bool)
    if not is_int or not lowest <= num_local_experts <= num_experts:
        raise ValueError(
            f"num_local_experts={num_local_experts!r} must be in [{lowest}, {num_experts}] for "
            f"{num_experts} experts over group_size={group_size} (fewer would leave experts with no owner)"
        )
    if num_local_experts < wanted:
        raise ValueError(f"num_local_experts={num_local_experts} gives some expert fewer than expert_replicas="
                         f"{replicas} owners over group_size={group_size}; it needs at least {wanted}")
    owned = tuple(
        tuple(sorted({(start + j) % num_experts for j in range(num_local_experts)}))
        for start in _starts(num_experts, group_size, ranks_per_node)
    )
    source = _choose_sources(num_experts, group_size, owned)
    return Placement(num_experts, group_size, num_local_experts, owned, source)


NO_SOURCE = -1  # in a source table: the expert is missing and no owner of it is left


def surviving_sources(placement: Placement, lost) -> tuple[tuple[int, ...], ...]:
    """source[r][e] once the ranks in `lost` are gone: pulls spread over the surviving owners as
    evenly as `build_placement` spreads them; NO_SOURCE where every owner of a missing expert is
    lost. Rows of lost ranks are left as they were (nobody runs them)."""
    lost = frozenset(lost)
    bad = sorted(r for r in lost if not 0 <= r < placement.group_size)
    if bad:
        raise ValueError(f"lost ranks {bad} are not in the group [0, {placement.group_size})")
    if not lost:
        return placement.source
    fresh = _choose_sources(placement.num_experts, placement.group_size, placement.owned, lost)
    return tuple(placement.source[r] if r in lost else fresh[r] for r in range(placement.group_size))


def _choose_sources(num_experts: int, group_size: int, owned, lost=frozenset()) -> tuple[tuple[int, ...], ...]:
    owner_sets = [set(o) for o in owned]
    owners = [[r for r in range(group_size) if e in owner_sets[r] and r not in lost] for e in range(num_experts)]
    load = [0] * group_size
    choice = [[r if e in owner_sets[r] else NO_SOURCE for e in range(num_experts)] for r in range(group_size)]
    # Greedy: the least-loaded owner, ties broken by the destination's own spread, then by
    # distance from (rank + 1) so that neighbouring ranks start on different sources.
    for r in range(group_size):
        if r in lost:
            choice[r] = [r if e in owner_sets[r] else NO_SOURCE for e in range(num_experts)]
            continue
        per_dest = [0] * group_size
        for e in range(num_experts):
            if choice[r][e] != NO_SOURCE or not owners[e]:
                continue
            best = min(owners[e], key=lambda o: (load[o], per_dest[o], (o - r - 1) % group_size))
            choice[r][e] = best
            load[best] += 1
            per_dest[best] += 1
    _shift_along_chains(choice, owners, load, group_size)
    return tuple(tuple(row) for row in choice)


def _shift_along_chains(choice, owners, load, group_size) -> None:
    """Lower the busiest sources until no source serves more than it must.

    A chain s0 -> s1 -> ... -> sk moves one pull of s0 to s1, one of s1 to s2, and so on (each pull
    to another owner of its expert): only s0 loses one and sk gains one. While some chain ends at a
    source with at least two pulls fewer than its start, shifting along it lowers the sum of squared
    loads; when none is left the largest load is the smallest any choice of owners can reach
    (the optimality condition of semi-matchings, Harvey et al. 2006). Single moves alone stop earlier.
    """
    while True:
        chain = _chain_to_lighter_source(choice, owners, load, group_size)
        if chain is None:
            return
        for dest, expert, new_source in chain:
            load[choice[dest][expert]] -= 1
            load[new_source] += 1
            choice[dest][expert] = new_source


def _chain_to_lighter_source(choice, owners, load, group_size):
    """[(destination, expert, new source)] moves of one improving chain, or None (breadth-first)."""
    served_by = [[] for _ in range(group_size)]  # (destination, expert) pulls each source serves
    for dest, row in enumerate(choice):
        for expert, src in enumerate(row):
            if src not in (dest, NO_SOURCE):
                served_by[src].append((dest, expert))
    for start in sorted(range(group_size), key=lambda s: -load[s]):
        parent = {start: None}  # source -> (previous source, destination, expert) that reaches it
        frontier = [start]
        while frontier:
            reached = []
            for src in frontier:
                for dest, expert in served_by[src]:
                    for alt in owners[expert]:
                        if alt == dest or alt in parent:
                            continue
                        parent[alt] = (src, dest, expert)
                        if load[alt] <= load[start] - 2:
                            chain, node = [], alt
                            while parent[node] is not None:
                                prev, d, e = parent[node]
                                chain.append((d, e, node))
                                node = prev
                            return chain[::-1]
                        reached.append(alt)
            frontier = reached
    return None
