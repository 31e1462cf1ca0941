import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dwdp.placement import build_placement


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


@settings(max_examples=300, deadline=None)
@given(placements())
def test_sources_balanced(p):
    """No pull can move to another owner and lower the busier of the two sources."""
    load = p.source_load()
    assert sum(load) == sum(len(p.missing_experts(r)) for r in range(p.group_size))
    for r in range(p.group_size):
        for e in p.missing_experts(r):
            src = p.source[r][e]
            for alt in p.owners(e):
                assert alt == r or load[alt] + 1 >= load[src], (r, e, src, alt, load)


@pytest.mark.parametrize("num_experts, group_size", [(8, 2), (8, 4), (16, 8), (256, 8), (12, 3)])
def test_disjoint_placement_when_group_divides(num_experts, group_size):
    p = build_placement(num_experts, group_size)
    assert not p.is_redundant
    assert sorted(e for r in range(group_size) for e in p.owned[r]) == list(range(num_experts))
    per_source = (group_size - 1) * num_experts // group_size
    assert p.source_load() == (per_source,) * group_size


def test_redundancy_when_group_does_not_divide():
    p = build_placement(8, 3)
    assert p.num_local_experts == 3 and p.is_redundant
    assert any(len(p.owners(e)) > 1 for e in range(8))


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
