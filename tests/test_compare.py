"""`dwdp bench compare` end to end on a tiny configuration: every ratio docs/dwdp-or-dep.md quotes follows from
the per-rank figures in the JSON, and the bytes held and copied match sizes worked out by hand."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dwdp.cli import main

ROOT = Path(__file__).resolve().parents[1]
# --quick model: deepseek_v3, hidden 64, expert intermediate 64, 8 experts, 4 layers of which the
# first is dense: 3 MoE layers. One expert: gate_up [128, 64] + down [64, 64] fp32.
EXPERT_BYTES = (128 * 64 + 64 * 64) * 4
MOE_LAYERS, EXPERTS, LOCAL = 3, 8, 4  # 2 ranks: 4 local experts each, 4 pulled per layer
EXPERT_BYTES_PER_RANK = {
    "dwdp": (MOE_LAYERS * LOCAL + 2 * (EXPERTS - LOCAL)) * EXPERT_BYTES,  # local + two prefetch slots
    "dep": MOE_LAYERS * LOCAL * EXPERT_BYTES,
    "replicated": MOE_LAYERS * EXPERTS * EXPERT_BYTES,
}
REL = 1e-12


@pytest.mark.timeout(150)
def test_compare_ratios_follow_from_the_per_rank_figures(tmp_path, capsys):
    code = main(["bench", "compare", "--quick", "--cvs", "0", "0.3", "--out-dir", str(tmp_path), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "compare_cpu_quick.json").read_text())
    assert (tmp_path / "compare_cpu_quick.png").stat().st_size > 0
    assert report["options"]["rounds"] == 1  # medians over rounds are the single round's figures
    assert {"before", "after"} <= set(report["load_average_1min"]) and report["machine"]["cpu_count"] >= 1, report
    rows = {(r["cv"], r["mode"]): r for r in report["results"]}
    assert sorted(rows) == sorted((cv, m) for cv in (0.0, 0.3) for m in ("dwdp", "dep", "replicated")), sorted(rows)
    for (cv, mode), r in rows.items():
        workload = report["workloads"][[0.0, 0.3].index(cv)]
        assert r["tokens_per_rank"] == workload["tokens_per_rank"], (cv, mode, r["tokens_per_rank"])
        assert r["forwards_per_rank"] == workload["forwards_per_rank"], (cv, mode, r["forwards_per_rank"])
        per_rank = [t / b for t, b in zip(r["tokens_per_rank"], r["busy_s_per_rank"])]
        assert r["tokens_per_s_per_rank"] == pytest.approx(per_rank, rel=REL), (cv, mode, r, per_rank)
        assert r["total_tokens_per_s"] == pytest.approx(sum(per_rank), rel=REL), (cv, mode, r)
        assert r["total_tokens_per_s_rounds"] == pytest.approx([sum(per_rank)], rel=REL), (cv, mode, r)
        share = sum(w / b for w, b in zip(r["wait_s_per_rank"], r["busy_s_per_rank"])) / 2
        assert r["wait_share"] == pytest.approx(share, rel=REL), (cv, mode, r)
        assert r["expert_bytes_per_rank"] == [EXPERT_BYTES_PER_RANK[mode]] * 2, (cv, mode, r["expert_bytes_per_rank"])
        assert r["step_p50_ms"] <= r["step_p99_ms"], (cv, mode, r)
    # Dense weights are the same in every mode: resident bytes differ by expert bytes only.
    dense = {m: rows[0.0, m]["resident_bytes_per_rank"][0] - EXPERT_BYTES_PER_RANK[m] for m in EXPERT_BYTES_PER_RANK}
    assert len(set(dense.values())) == 1 and min(dense.values()) > 0, dense
    memory = report["resident_bytes_per_rank"]
    assert memory["replicated_over_dwdp"] == pytest.approx(memory["replicated"] / memory["dwdp"], rel=REL), memory
    for ratio in report["ratios"]:
        dwdp = rows[ratio["cv"], "dwdp"]["total_tokens_per_s"]
        for other in ("dep", "replicated"):
            expected = dwdp / rows[ratio["cv"], other]["total_tokens_per_s"]
            assert ratio[f"dwdp_over_{other}"] == pytest.approx(expected, rel=REL), (ratio, other, expected)
    # Composite views (the default) tie slots to layer parity: with 3 MoE layers, layer 1 keeps slot 1
    # across forwards, so after the warm-up forward each forward refills layers 0 and 2 only.
    for cv in (0.0, 0.3):
        r = rows[cv, "dwdp"]
        expected = [n * 2 * (EXPERTS - LOCAL) * EXPERT_BYTES for n in r["forwards_per_rank"]]
        assert r["bytes_prefetched_per_rank"] == expected, (cv, r["bytes_prefetched_per_rank"], expected)
        assert min(rows[cv, "dep"]["comm_s_per_rank"]) > 0, rows[cv, "dep"]
        assert rows[cv, "replicated"]["wait_s_per_rank"] == [0.0, 0.0], rows[cv, "replicated"]
    assert report["regime"]["remote_bytes_per_layer"] == (EXPERTS - LOCAL) * EXPERT_BYTES, report["regime"]
    # The table comes last, its dwdp/this column holding the ratio of the JSON.
    last = printed.rstrip().splitlines()[-1].split()
    assert last[:2] == ["0.30", "replicated"], printed[-400:]
    assert float(last[-1]) == pytest.approx(report["ratios"][1]["dwdp_over_replicated"], abs=5e-4), last


def test_compare_refuses_bad_options(capsys):
    assert main(["bench", "compare", "--quick", "--max-num-tokens", "8", "--isl", "9"]) == 2
    assert "max_num_tokens" in capsys.readouterr().err
    assert main(["bench", "compare", "--quick", "--rounds", "0"]) == 2


def test_the_cli_owns_the_driver_and_no_bench_script_repeats_it():
    out = subprocess.run([sys.executable, "-m", "dwdp", "bench", "compare", "--help"], capture_output=True, text=True,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--cvs" in out.stdout and "--quick" in out.stdout and "--experts-paths" in out.stdout
    wrappers = [p.name for p in (ROOT / "bench").glob("*.py") if "from dwdp.benchmarks" in p.read_text()
                and len(p.read_text().splitlines()) < 40]
    assert not wrappers, f"bench scripts that only wrap a `dwdp bench` driver: {wrappers}"
