"""gpu_check's serve section, run on the CPU with the tiny preset: the server starts, the open-loop load
through the openai client is answered, and the section's figures follow from its own samples."""
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from gpu_checks import h_serve  # noqa: E402


@pytest.mark.timeout(150)
def test_serve_section_on_cpu_measures_what_it_reports():
    r = h_serve.serve_check("cpu", "tiny", requests=12, rate_per_s=30.0, prompt_tokens=24)
    assert r["failed"] == 0 and r["requests"] == 12 and not r["failures"], r["failures"]
    ttfts = sorted(s["ttft_s"] for s in r["samples"])
    assert r["ttft_p50_ms"] == pytest.approx(1e3 * ttfts[round(0.5 * 11)]), (r["ttft_p50_ms"], ttfts)
    assert r["ttft_p99_ms"] == pytest.approx(1e3 * ttfts[-1]), (r["ttft_p99_ms"], ttfts)
    assert r["prompt_tokens_per_s"] == pytest.approx(12 * 24 / r["wall_s"])
    forwards = 0
    for w in r["workers"]:
        assert w["device"] == "cpu" and w["ready_s"] > w["warmup_s"] > 0, w
        first = w["first_forwards_ms"]
        forwards += len(first)
        if first:
            assert w["worst_over_median"] == pytest.approx(max(first) / statistics.median(first)), w
    assert forwards >= 1 and sum(sum(w["first_forwards_tokens"]) for w in r["workers"]) >= 12 * 24, r["workers"]
    rows = h_serve.summary(r)
    assert rows[3] == ("h serve: failed requests", "0 of 12", "0", "ok"), rows
