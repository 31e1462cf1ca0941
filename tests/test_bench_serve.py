"""`dwdp bench serve` on a tiny sweep: both modes answer every request (packed; padded refuses only
prompts past max-num-tokens), every stored figure follows from the stored per-request samples, and
packed forwards compute exactly the real tokens."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from dwdp.benchmarks.serving import compare, max_load_at_slo, parse_variants, summarise
from dwdp.predict.packing import RequestMix, arrival_plan
from procs import run


@pytest.mark.timeout(240)
def test_tiny_sweep_recomputes_from_its_samples(tmp_path):
    out = tmp_path / "serve_compare.json"
    cmd = [sys.executable, "-m", "dwdp", "bench", "serve", "--variants", "dwdp,dep,dwdp/padded", "--rates", "6",
           "--duration", "1.5", "--isl", "64", "--isl-ratios", "0.5", "--max-num-tokens", "128", "--isl-cv", "0",
           "--long-isl", "300", "--slo", "5", "--out", str(out)]
    done = run(cmd, timeout=230)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert set(data["meta"]["load_average_1min"]) == {"before", "after"}
    assert len(data["results"]) == 2, "a uniform and a long-prompt mix"
    for mix, by_variant in data["results"].items():
        assert sorted(by_variant) == ["dep", "dwdp", "dwdp/padded"], by_variant.keys()
        plans = {}
        for name, entry in by_variant.items():
            assert entry["forwards"] == ("padded" if name.endswith("/padded") else "packed"), (name, entry["forwards"])
            for row in entry["rows"]:
                samples = row["samples"]
                refused = [s for s in samples if not s["ok"]]
                if name.endswith("/padded"):  # padded forwards refuse what packed ones chunk, nothing else
                    assert all(s["tokens"] > 128 and s["error"] == "context_length_exceeded" for s in refused), refused
                    served = sum(s["tokens"] for s in samples if s["ok"])  # none, when every prompt was too long
                    assert row["computed_tokens"] >= row["real_tokens"] == served, row
                    assert row["computed_tokens"] > 0 or not served, row
                else:
                    assert not refused, refused
                    assert row["computed_tokens"] == row["real_tokens"] == sum(s["tokens"] for s in samples), row
                meta = data["meta"]
                again = summarise(samples, row["offered_rps"], meta["ranks"], meta["slo_p99_s"], meta["duration_s"])
                for key, value in again.items():  # NaN (no prompt served) equals NaN here
                    same = row[key] == value or (row[key] != row[key] and value != value)
                    assert same, (mix, name, row["offered_rps"], key, row[key], value)
                ttft = [s["ttft_s"] for s in samples if s["ok"]]
                if ttft:
                    assert row["ttft_p99_s"] == float(np.percentile(ttft, 99)) and row["ttft_p50_s"] <= row["ttft_p99_s"]
                plans.setdefault(row["offered_rps"], []).append(sorted(s["tokens"] for s in samples))
            assert entry["max_load_at_slo"] == max_load_at_slo(entry["rows"])
        for rate, lengths in plans.items():
            assert len(set(map(tuple, lengths))) == 1, f"the variants were sent different prompts at {rate}/s"
    assert data["comparison"] == compare(data["results"])


def _sample(sent, ttft, tokens=10, rank=0, ok=True):
    return {"sent_s": sent, "ttft_s": ttft, "ok": ok, "tokens": tokens, "rank": rank, "queue_s": 0.1 * ttft,
            "prefill_s": 0.5 * ttft, "wait_s": 0.0, "batch_size": 1}


@pytest.mark.timeout(10)
def test_summary_counts_failures_and_sustained_rates():
    samples = [_sample(0.0, 0.2), _sample(0.5, 0.4, rank=1), _sample(1.0, 1.0, ok=False)]
    row = summarise(samples, 1.0, 2, slo_s=0.5, duration_s=2.0)  # plan 1.5/s, achieved 1/s
    assert row["failed"] == 1 and row["ok"] == 2 and not row["sustained"] and not row["within_slo"], row
    assert row["makespan_s"] == pytest.approx(2.0) and row["achieved_rps"] == pytest.approx(1.0)
    assert row["plan_rps"] == pytest.approx(1.5)
    assert row["tokens_per_s_per_rank"] == pytest.approx(20 / 2.0 / 2) and row["tokens_per_rank"] == [10, 10]
    fine = summarise(samples[:2], 1.0, 2, slo_s=0.5, duration_s=1.0)  # plan 2/s, 2 answers by 0.9 s
    assert fine["sustained"] and fine["within_slo"], fine
    assert row["ttft_p50_s"] == pytest.approx(0.3), "failed requests must not enter the TTFT percentiles"
    assert row["other_mean_s"] == pytest.approx(0.4 * 0.3)


@pytest.mark.timeout(10)
def test_max_load_takes_the_best_point_within_the_slo():
    rows = [{"within_slo": True, "tokens_per_s_per_rank": 100, "offered_rps": 1, "achieved_rps": 1, "ttft_p99_s": .1},
            {"within_slo": True, "tokens_per_s_per_rank": 300, "offered_rps": 3, "achieved_rps": 3, "ttft_p99_s": .4},
            {"within_slo": False, "tokens_per_s_per_rank": 400, "offered_rps": 4, "achieved_rps": 3, "ttft_p99_s": 2}]
    assert max_load_at_slo(rows)["offered_rps"] == 3
    assert max_load_at_slo(rows[2:]) is None


@pytest.mark.timeout(10)
def test_same_seed_same_plan_and_lengths_within_the_mix():
    mix = RequestMix(100, 0.5)
    a, b = arrival_plan(mix, 5.0, 10.0, 128, seed=3), arrival_plan(mix, 5.0, 10.0, 128, seed=3)
    assert a == b and 20 < len(a) < 90, len(a)
    assert all(50 <= len(ids) <= 100 and 0 < t <= 10.0 for t, ids in a)
    assert [t for t, _ in a] == sorted(t for t, _ in a)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("text", ["dwdp,ep", "dwdp:lifo", "", "dwdp/packed"])
def test_bad_variants_are_named(text):
    with pytest.raises(ValueError, match="MODE"):
        parse_variants(text)
