"""The workload generator: requested imbalance, request lengths, token budget, determinism."""
import pytest
import torch

from dwdp.predict.workload import (
    Forward,
    WorkloadConfig,
    coefficient_of_variation,
    forward_inputs,
    make_workload,
    rank_factors,
)


@pytest.mark.parametrize("cv", [0.1, 0.2, 0.4])
def test_hits_requested_cv_on_a_large_draw(cv):
    w = make_workload(WorkloadConfig(num_ranks=256, tokens_per_rank=20_000, isl=256, cv=cv, seed=11))
    assert abs(w.realized_cv - cv) <= 0.05 * cv, f"realized CV {w.realized_cv:.4f} vs requested {cv}"
    mean = sum(s.num_tokens for s in w.streams) / len(w.streams)
    assert abs(mean - 20_000) <= 0.01 * 20_000, f"mean tokens per rank {mean:.0f}, expected 20000"


@pytest.mark.parametrize("ranks", [2, 3])
def test_few_ranks_still_see_the_requested_cv(ranks):
    w = make_workload(WorkloadConfig(num_ranks=ranks, tokens_per_rank=16_384, isl=512, cv=0.2, seed=4))
    assert abs(w.realized_cv - 0.2) <= 0.01, f"{ranks} ranks: realized CV {w.realized_cv:.4f}"


def test_zero_cv_and_one_rank_are_balanced():
    w = make_workload(WorkloadConfig(num_ranks=4, tokens_per_rank=5000, isl=100, cv=0.0))
    assert [s.num_tokens for s in w.streams] == [5000] * 4
    assert rank_factors(1, 0.3, seed=0) == (1.0,)


def test_deterministic_for_a_seed_and_different_across_seeds():
    config = WorkloadConfig(num_ranks=3, tokens_per_rank=4000, isl=300, isl_ratio=0.5, cv=0.2, seed=7)
    a, b = make_workload(config), make_workload(config)
    assert a == b
    c = make_workload(WorkloadConfig(num_ranks=3, tokens_per_rank=4000, isl=300, isl_ratio=0.5, cv=0.2, seed=8))
    assert [s.requests for s in a.streams] != [s.requests for s in c.streams]
    f = a.streams[0].forwards[0]
    assert torch.equal(forward_inputs(f, 128, 5)["input_ids"], forward_inputs(f, 128, 5)["input_ids"])


@pytest.mark.parametrize("isl,ratio,mnt", [(1, 1.0, 1), (64, 0.8, 64), (300, 0.5, 1000), (512, 0.25, 4096)])
def test_lengths_in_range_and_forwards_within_budget(isl, ratio, mnt):
    w = make_workload(WorkloadConfig(num_ranks=2, tokens_per_rank=3 * mnt + 17, isl=isl, isl_ratio=ratio, cv=0.1,
                                     max_num_tokens=mnt, seed=1))
    shortest = -(-int(ratio * isl * 1e6) // 10**6)
    for s in w.streams:
        assert sum(s.requests) == s.target_tokens == s.num_tokens, (s.rank, s.target_tokens, s.num_tokens)
        # Every request but the last (cut to land on the total) is in [ceil(ratio * isl), isl].
        bad = [n for n in s.requests[:-1] if not shortest <= n <= isl]
        assert not bad, f"rank {s.rank}: lengths {bad} outside [{shortest}, {isl}]"
        assert 1 <= s.requests[-1] <= isl
        assert [n for f in s.forwards for n in f.lengths] == list(s.requests), "forwards must keep arrival order"
        over = [f.padded_tokens for f in s.forwards if f.padded_tokens > mnt]
        assert not over, f"rank {s.rank}: forwards of {over} padded tokens exceed max_num_tokens={mnt}"
    assert w.num_steps == max(len(s.forwards) for s in w.streams)


def test_forward_inputs_are_right_padded():
    inputs = forward_inputs(Forward((3, 5, 1)), vocab=50, seed=0)
    assert inputs["input_ids"].shape == (3, 5)
    assert inputs["attention_mask"].sum(1).tolist() == [3, 5, 1]
    assert ((inputs["input_ids"] >= 3) == inputs["attention_mask"].bool()).all()


def test_coefficient_of_variation():
    assert coefficient_of_variation([2, 2, 2]) == 0.0
    assert coefficient_of_variation([1, 3]) == pytest.approx(0.5)
    assert coefficient_of_variation([7]) == 0.0


@pytest.mark.parametrize("bad", [dict(isl=0), dict(cv=1.0), dict(cv=-0.1), dict(isl_ratio=0.0), dict(isl_ratio=1.5),
                                 dict(max_num_tokens=10, isl=11), dict(num_ranks=0), dict(tokens_per_rank=True)])
def test_bad_config_is_refused(bad):
    kwargs = dict(num_ranks=2, tokens_per_rank=100, isl=10) | bad
    with pytest.raises(ValueError):
        WorkloadConfig(**kwargs)
