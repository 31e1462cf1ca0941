"""Contention: the analytic table and the discrete-event simulation of asynchronous pulls."""
import dataclasses
import math
from fractions import Fraction

import numpy as np
import pytest

from dwdp.predict.contention import PullConfig, build_transfers, contention_pmf, contention_table, simulate_pulls


def test_table_rows_sum_to_one():
    table = contention_table(range(3, 17))
    assert sorted(table) == list(range(3, 17))
    for n, row in table.items():
        assert len(row) == n - 1, (n, len(row))
        assert abs(row.sum() - 1.0) < 1e-12, f"N={n}: row sums to {row.sum()}"


@pytest.mark.parametrize("n", [3, 4, 8, 16])
def test_table_matches_exact_binomial(n):
    # P(C = x + 1) = C(N-2, x) (N-2)^(N-2-x) / (N-1)^(N-2), exactly.
    exact = [Fraction(math.comb(n - 2, x) * (n - 2) ** (n - 2 - x), (n - 1) ** (n - 2)) for x in range(n - 1)]
    got = contention_pmf(n)
    for c, (p, q) in enumerate(zip(got, exact), start=1):
        assert abs(p - float(q)) < 1e-14, f"N={n} C={c}: {p} != {float(q)}"
    mean = float((np.arange(1, n) * got).sum())
    assert abs(mean - (1 + (n - 2) / (n - 1))) < 1e-12, f"N={n}: mean C {mean}"


def test_single_peer_has_no_table():
    with pytest.raises(ValueError, match="group_size=1"):
        contention_pmf(1)


@pytest.mark.parametrize("n", [4, 6])
def test_simulated_histogram_matches_table(n):
    # The table's premise: every rank always pulling, each pull from a uniformly random peer, sources
    # that do not slow anyone down. Snapshots are ~1.4 pulls apart; the N ranks of one snapshot are
    # correlated, so the standard error uses the snapshot count only (conservative).
    cfg = PullConfig(group_size=n, num_experts=8 * n, expert_nbytes=(1,), link_bytes_per_s=1.0, mode="random",
                     inflight=1, serialise=False, window_s=0.0, num_layers=120, num_samples=3000, seed=7)
    result = simulate_pulls(cfg)
    hist, pmf = result.contention_hist, contention_pmf(n)
    assert result.contention_counts.sum() >= cfg.num_samples * n * 0.99, result.contention_counts.sum()
    se = np.sqrt(pmf * (1 - pmf) / cfg.num_samples)
    worst = np.max(np.abs(hist - pmf) - 4 * se - 1e-3)
    assert worst <= 0, f"N={n}: simulated {hist.round(4)} vs analytic {pmf.round(4)} (4 SE = {(4 * se).round(4)})"


def test_no_contention_when_sources_do_not_serialise():
    cfg = PullConfig(4, 32, (3 << 20, 1 << 20), 1e9, mode="tdm", serialise=False, num_layers=3, seed=1)
    result = simulate_pulls(cfg)
    assert np.allclose(result.prefetch_s, result.uncontended_s, rtol=1e-9), (result.prefetch_s, result.uncontended_s)
    assert result.exposed_s.max() > 0  # window 0: every prefetch is exposed in full


def test_tdm_slices_cut_prefetch_time_against_monolithic_pulls():
    # Prefetch-bound group of 4; averaged over offsets drawn by 4 seeds, since a single draw can
    # fall into a collision-free rotation for either plan.
    base = PullConfig(4, 32, (6 << 20, 3 << 20), 1e9, num_layers=10, window_s=0.0)
    mono, tdm = [], []
    for seed in range(4):
        cfg = dataclasses.replace(base, seed=seed)
        m = simulate_pulls(dataclasses.replace(cfg, mode="monolithic", inflight=1))
        t = simulate_pulls(dataclasses.replace(cfg, mode="tdm", slice_bytes=1 << 20, inflight=2))
        assert math.isclose(m.uncontended_s, t.uncontended_s, rel_tol=1e-12), (m.uncontended_s, t.uncontended_s)
        mono.append(m.prefetch_s[:, 1:].mean() / m.uncontended_s)
        tdm.append(t.prefetch_s[:, 1:].mean() / t.uncontended_s)
    assert min(mono + tdm) >= 1 - 1e-9, (mono, tdm)
    assert np.mean(tdm) < np.mean(mono) - 0.1, f"TDM {np.round(tdm, 3)} not clearly below monolithic {np.round(mono, 3)}"


def test_tdm_plan_interleaves_peers_from_rank_plus_one():
    cfg = PullConfig(4, 8, (3 << 20,), 1.0, mode="tdm", slice_bytes=1 << 20)
    transfers = build_transfers(cfg, 2, np.random.default_rng(0))
    assert [s for s, _ in transfers[:6]] == [3, 0, 1, 3, 0, 1], transfers[:6]
    assert sum(b for _, b in transfers) == 6 * (3 << 20), sum(b for _, b in transfers)
    mono = build_transfers(dataclasses.replace(cfg, mode="monolithic"), 2, np.random.default_rng(0))
    assert mono == [(3, 3 << 20), (3, 3 << 20), (0, 3 << 20), (0, 3 << 20), (1, 3 << 20), (1, 3 << 20)], mono
