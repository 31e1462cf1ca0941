import collections
import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dwdp.runtime.placement import build_placement


@st.composite
def placements(draw):
    num_experts = draw(st.integers(1, 40))
    group_size = draw(st.integers(1, num_experts))
    lowest = math.ceil(num_experts / group_size)
    local = draw(st.one_of(st.none(), st.integers(lowest, num_experts)))
    return build_placement(num_experts, group_size, local)


@settings(max_examples=300, deadline=None)
@given(placements())
def test_every_expert_owned_and_every_rank_complete(p):
    for e in range(p.num_experts):
        assert p.owners(e), f"expert {e} has no owner in {p.owned}"
    for r in range(p.group_size):
        assert len(p.owned[r]) == p.num_local_experts
        pulled = set()
        for e in p.missing_experts(r):
            src = p.source[r][e]
            assert src != r and e in p.owned[src], f"rank {r} pulls expert {e} from {src}, owners {p.owners(e)}"
            pulled.add(e)
        assert pulled | set(p.owned[r]) == set(range(p.num_experts))


def _fewest_pulls_on_busiest_source(p) -> int:
    """Brute force: the smallest largest source load over every choice of owners for every pull."""
    pulls = [(r, e) for r in range(p.group_size) for e in p.missing_experts(r)]
    choices = [[o for o in p.owners(e) if o != r] for r, e in pulls]
    best = len(pulls)
    for choice in itertools.product(*choices):
        best = min(best, max(collections.Counter(choice).values(), default=0))
    return best


def _small_redundant_cases():
    """Every redundant (E, G, L) with E <= 10 whose pulls have at most 50,000 choices of owners."""
    for num_experts in range(2, 11):
        for group_size in range(2, num_experts + 1):
            for local in range(math.ceil(num_experts / group_size), num_experts):
                p = build_placement(num_experts, group_size, local)
                choices = math.prod(len(p.owners(e)) for r in range(group_size) for e in p.missing_experts(r))
                if p.is_redundant and choices <= 50_000:
                    yield p


def test_busiest_source_is_as_light_as_any_choice_of_owners():
    cases = list(_small_redundant_cases())
    assert len(cases) > 50, f"only {len(cases)} cases: the oracle would check too little"
    for p in cases:
        got, best = max(p.source_load()), _fewest_pulls_on_busiest_source(p)
        assert got == best, (
            f"E={p.num_experts} G={p.group_size} L={p.num_local_experts}: busiest source serves {got} pulls, "
            f"{best} is possible; loads {p.source_load()}"
        )


@pytest.mark.parametrize("num_experts, group_size", [(8, 2), (8, 4), (16, 8), (256, 8), (12, 3)])
def test_disjoint_placement_when_group_divides(num_experts, group_size):
    p = build_placement(num_experts, group_size)
    assert not p.is_redundant
    assert sorted(e for r in range(group_size) for e in p.owned[r]) == list(range(num_experts))
    per_source = (group_size - 1) * num_experts // group_size
    assert p.source_load() == (per_source,) * group_size


# floor(r * E / G) by hand; each rank keeps L consecutive experts from its start, wrapping at E.
OWNED_BY_HAND = [
    ((8, 3, None), ((0, 1, 2), (2, 3, 4), (5, 6, 7))),                 # starts 0, 2, 5
    ((7, 3, None), ((0, 1, 2), (2, 3, 4), (4, 5, 6))),                 # starts 0, 2, 4
    ((5, 3, None), ((0, 1), (1, 2), (3, 4))),                          # starts 0, 1, 3
    ((6, 4, None), ((0, 1), (1, 2), (3, 4), (4, 5))),                  # starts 0, 1, 3, 4
    ((10, 4, None), ((0, 1, 2), (2, 3, 4), (5, 6, 7), (7, 8, 9))),     # starts 0, 2, 5, 7
    ((16, 6, None), ((0, 1, 2), (2, 3, 4), (5, 6, 7), (8, 9, 10), (10, 11, 12), (13, 14, 15))),
    ((8, 3, 4), ((0, 1, 2, 3), (2, 3, 4, 5), (0, 5, 6, 7))),           # rank 2 wraps: 5, 6, 7, 0
    ((9, 2, 6), ((0, 1, 2, 3, 4, 5), (0, 4, 5, 6, 7, 8))),            # starts 0, 4: rank 1 wraps to 0
]


@pytest.mark.parametrize("args, owned", OWNED_BY_HAND, ids=lambda x: str(x))
def test_owned_ranges_start_at_floor_r_e_over_g(args, owned):
    p = build_placement(*args)
    assert p.owned == owned, f"build_placement{args}.owned = {p.owned}, expected {owned}"


def test_redundant_experts_have_every_overlapping_owner():
    p = build_placement(8, 3)
    owners = {e: p.owners(e) for e in range(8)}
    assert owners == {0: (0,), 1: (0,), 2: (0, 1), 3: (1,), 4: (1,), 5: (2,), 6: (2,), 7: (2,)}, owners


def test_redundant_pulls_balance_three_sources_by_hand():
    """E=8, G=3, L=4 owns {0-3}, {2-5}, {5-7, 0}. Forced pulls: rank 2 serves 6 and 7 to ranks 0 and 1
    (4), rank 1 serves 4 to ranks 0 and 2 (2), rank 0 serves 1 to ranks 1 and 2 (2). The free ones
    (5 to rank 0, 0 to rank 1, 2 and 3 to rank 2) must avoid rank 2 and split 2 + 2: loads 4, 4, 4."""
    p = build_placement(8, 3, 4)
    assert p.source_load() == (4, 4, 4), p.source
    assert p.source[0][5] == 1 and p.source[1][0] == 0, p.source
    assert sorted((p.source[2][2], p.source[2][3])) == [0, 1], p.source


def test_more_local_experts_cut_pulls():
    assert len(build_placement(16, 4, 8).missing_experts(0)) == 8
    assert len(build_placement(16, 4).missing_experts(0)) == 12


def test_one_rank_owns_everything():
    p = build_placement(5, 1)
    assert p.owned == ((0, 1, 2, 3, 4),) and p.missing_experts(0) == ()


@pytest.mark.parametrize(
    "args, words",
    [
        ((8, 9, None), "group_size=9"),
        ((8, 0, None), "group_size=0"),
        ((0, 1, None), "num_experts=0"),
        ((8, 4, 1), "num_local_experts=1"),
        ((8, 4, 9), "num_local_experts=9"),
    ],
)
def test_bad_arguments(args, words):
    with pytest.raises(ValueError) as err:
        build_placement(*args)
    assert words in str(err.value), str(err.value)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4), st.integers(2, 4), st.integers(1, 4), st.integers(1, 8))
def test_a_node_lost_leaves_every_expert_when_replicas_reach_the_nodes_count(per_node, nodes, extra, factor):
    """Spread over nodes, the ranks of any one node own every expert once expert_replicas >= nodes; the
    ownership is a permutation of the node-blind one (the same windows, dealt to other ranks)."""
    group = per_node * nodes
    num_experts = group * factor + extra - 1
    if num_experts < group:
        return
    replicas = nodes
    spread = build_placement(num_experts, group, replicas=replicas, ranks_per_node=per_node)
    blind = build_placement(num_experts, group, replicas=replicas)
    assert sorted(spread.owned) == sorted(blind.owned)
    for node in range(nodes):
        held = {e for r in range(node * per_node, (node + 1) * per_node) for e in spread.owned[r]}
        assert held == set(range(num_experts)), (node, spread.owned)


def test_spread_over_two_nodes_by_hand():
    """16 experts, 2 nodes of 2 ranks, 2 owners an expert: node 0 (ranks 0, 1) holds 0-7 and 8-15, node 1
    4-11 and 12-3; node-blind, ranks 2 and 3 alone would hold 12-15."""
    spread = build_placement(16, 4, replicas=2, ranks_per_node=2)
    assert spread.owned == (tuple(range(8)), tuple(range(8, 16)), tuple(range(4, 12)), (0, 1, 2, 3, 12, 13, 14, 15))
    assert build_placement(16, 4, replicas=2, ranks_per_node=4).owned == build_placement(16, 4, replicas=2).owned


@pytest.mark.parametrize("per_node", [0, 3, True, 2.0])
def test_ranks_per_node_must_divide_the_group(per_node):
    with pytest.raises(ValueError, match=rf"ranks_per_node={per_node!r} must be an int >= 1 dividing group_size=4"):
        build_placement(16, 4, replicas=2, ranks_per_node=per_node)
