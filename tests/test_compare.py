"""`dwdp bench compare` end to end on a tiny configuration: the JSON holds every field (not the numbers)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dwdp.cli import main

ROOT = Path(__file__).resolve().parents[1]
RESULT_FIELDS = {
    "cv", "mode", "total_tokens_per_s", "total_tokens_per_s_rounds", "tokens_per_s_per_rank", "tokens_per_rank",
    "forwards_per_rank", "busy_s_per_rank", "cpu_s_per_rank", "step_p50_ms", "step_p99_ms", "wait_s_per_rank",
    "wait_share", "comm_s_per_rank", "bytes_prefetched_per_rank", "resident_bytes_per_rank", "expert_bytes_per_rank",
}
TOP_FIELDS = {"argv", "device", "machine", "options", "load_average_1min", "workloads", "elapsed_s", "results",
              "ratios", "resident_bytes_per_rank", "regime"}


@pytest.mark.timeout(150)
def test_compare_runs_end_to_end(tmp_path, capsys):
    code = main(["bench", "compare", "--quick", "--cvs", "0", "0.3", "--out-dir", str(tmp_path), "--no-progress"])
    assert code == 0
    printed = capsys.readouterr().out
    report = json.loads((tmp_path / "compare_cpu_quick.json").read_text())
    assert (tmp_path / "compare_cpu_quick.png").stat().st_size > 0
    assert TOP_FIELDS <= set(report), sorted(TOP_FIELDS - set(report))
    assert [(r["cv"], r["mode"]) for r in report["results"]] == [
        (cv, mode) for cv in (0.0, 0.3) for mode in ("dwdp", "dep", "replicated")]
    for r in report["results"]:
        assert RESULT_FIELDS <= set(r), (r["mode"], sorted(RESULT_FIELDS - set(r)))
        assert len(r["tokens_per_s_per_rank"]) == 2 and all(x > 0 for x in r["tokens_per_s_per_rank"]), r
        assert r["tokens_per_rank"] == report["workloads"][[0.0, 0.3].index(r["cv"])]["tokens_per_rank"]
    for row in report["ratios"]:
        assert {"cv", "dwdp_over_dep", "dwdp_over_replicated"} <= set(row), row
    dwdp, dep, replicated = (report["resident_bytes_per_rank"][m] for m in ("dwdp", "dep", "replicated"))
    assert dep < replicated and dwdp <= replicated, report["resident_bytes_per_rank"]
    assert {"t_compute_layer_ms", "t_prefetch_layer_ms", "remote_bytes_per_layer"} <= set(report["regime"])
    # DWDP copies remote experts, DEP talks through collectives, replicated does neither.
    by_mode = {r["mode"]: r for r in report["results"] if r["cv"] == 0.3}
    assert min(by_mode["dwdp"]["bytes_prefetched_per_rank"]) > 0
    assert min(by_mode["dep"]["comm_s_per_rank"]) > 0
    assert by_mode["replicated"]["wait_s_per_rank"] == [0.0, 0.0]
    # The table comes last.
    assert printed.rstrip().splitlines()[-1].startswith("0.30  replicated"), printed[-400:]


def test_compare_refuses_bad_options(capsys):
    assert main(["bench", "compare", "--quick", "--max-num-tokens", "8", "--isl", "9"]) == 2
    assert "max_num_tokens" in capsys.readouterr().err
    assert main(["bench", "compare", "--quick", "--rounds", "0"]) == 2


def test_bench_script_is_a_thin_entry_point():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "compare.py"), "--help"], capture_output=True, text=True,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--cvs" in out.stdout and "--quick" in out.stdout
