"""`dwdp bench regimes` end to end on a tiny sweep: every derived figure follows from the per-rank
samples in the JSON, the copied bytes match sizes worked out by hand, and the table comes last."""
import json
import statistics

import pytest

from dwdp.benchmarks.regimes import forward_lengths
from dwdp.cli import main

# deepseek_v3, hidden 64, expert intermediate 64, 16 experts; 2 ranks: 8 local experts each, 8 pulled
# per MoE layer. One expert: gate_up [128, 64] + down [64, 64] fp32. 3 layers, the first dense.
EXPERT_BYTES = (128 * 64 + 64 * 64) * 4
PULLED_PER_LAYER = 8 * EXPERT_BYTES
MOE_LAYERS = 2
REL = 1e-12


def test_forward_lengths_cut_a_forward_into_requests_of_isl_tokens():
    assert forward_lengths(8, 128) == (8,)
    assert forward_lengths(256, 128) == (128, 128)
    assert forward_lengths(300, 128) == (128, 128, 44)
    assert sum(forward_lengths(2047, 128)) == 2047


@pytest.mark.timeout(200)
def test_regimes_figures_follow_from_the_per_rank_samples(tmp_path, capsys):
    code = main(["bench", "regimes", "--hiddens", "64", "--tokens", "8", "24", "--isl", "16", "--num-layers", "3",
                 "--repeats", "3", "--min-seconds", "0", "--out-dir", str(tmp_path)])
    assert code == 0
    printed = capsys.readouterr().out.strip().splitlines()
    report = json.loads((tmp_path / "regimes_cpu.json").read_text())
    assert (tmp_path / "regimes_cpu.png").stat().st_size > 0
    assert {"before", "after"} <= set(report["load_average_1min"]) and report["machine"]["cpu_count"] >= 1, report
    assert printed[-len(report["rows"]) - 2].split()[:3] == ["hidden", "expert", "MiB"], printed[-4:]
    rows = {(r["hidden"], r["tokens"]): r for r in report["rows"]}
    assert sorted(rows) == [(64, 8), (64, 24)], sorted(rows)
    for (hidden, tokens), row in rows.items():
        points = [p for p in report["points"] if (p["hidden"], p["tokens"]) == (hidden, tokens)]
        assert sorted(p["rank"] for p in points) == [0, 1], points
        assert row["requests"] == len(forward_lengths(tokens, 16)) and row["num_moe_layers"] == MOE_LAYERS, row
        assert row["copy_mib_per_layer"] * 2**20 == PULLED_PER_LAYER, row["copy_mib_per_layer"]
        for point, derived in zip(sorted(points, key=lambda p: p["rank"]), row["per_rank"]):
            s = point["samples_s"]
            assert [len(s[v]) for v in ("replicated", "copy", "serial", "dwdp")] == [3, 3, 3, 3], s
            assert point["serial_bytes_per_forward"] == MOE_LAYERS * PULLED_PER_LAYER, point["serial_bytes_per_forward"]
            replicated, dwdp, copy = (statistics.median(s[v]) for v in ("replicated", "dwdp", "copy"))
            efficiency = statistics.median([r / d for r, d in zip(s["replicated"], s["dwdp"])])
            gain = statistics.median([c / d for c, d in zip(s["serial"], s["dwdp"])])
            bound = replicated / (replicated + MOE_LAYERS * copy)
            assert derived["efficiency"] == pytest.approx(efficiency, rel=REL), (derived, efficiency)
            assert derived["serial_bound"] == pytest.approx(bound, rel=REL), (derived, bound)
            assert derived["copy_share"] == pytest.approx(MOE_LAYERS * copy / replicated, rel=REL), derived
            assert derived["dwdp_ms"] == pytest.approx(1e3 * dwdp, rel=REL), derived
            assert derived["gain_over_serial"] == pytest.approx(gain, rel=REL), (derived, gain)
        mean = statistics.mean(d["efficiency"] for d in row["per_rank"])
        assert row["efficiency"] == pytest.approx(mean, rel=REL), row
        assert row["meets_serial_bound"] == (row["efficiency"] >= row["serial_bound"]), row
        assert row["not_slower_than_serial"] == (row["gain_over_serial"] >= 1.0), row
        if row["copy_nearly_free"]:
            assert row["meets_free_target"] == (row["efficiency"] >= 0.95), row
