import subprocess
import sys

import pytest


@pytest.mark.timeout(180)
def test_demo_runs_and_every_rank_matches(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dwdp", "demo", "--ranks", "2", "--prompts", "2", "--max-len", "12", "--repeats", "1"],
        capture_output=True, text=True, timeout=170, env={"DWDP_SHM_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2/2 ranks match the unwrapped model" in proc.stdout, proc.stdout
    table = [line for line in proc.stdout.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert len(table) == 2 and all(line.rstrip().endswith("yes") for line in table), proc.stdout
    assert list(tmp_path.iterdir()) == []


def test_cli_rejects_bad_rank_count():
    proc = subprocess.run([sys.executable, "-m", "dwdp", "demo", "--ranks", "0"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--ranks" in proc.stderr and "0 must be >= 1" in proc.stderr, proc.stderr


@pytest.mark.timeout(180)
def test_demo_on_another_family(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "dwdp", "demo", "--family", "gpt_oss", "--ranks", "2", "--prompts", "1", "--max-len", "8",
         "--repeats", "1"],
        capture_output=True, text=True, timeout=170, env={"DWDP_SHM_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tiny gpt_oss model" in proc.stdout and "2/2 ranks match the unwrapped model" in proc.stdout, proc.stdout


def test_demo_rejects_unknown_family():
    proc = subprocess.run([sys.executable, "-m", "dwdp", "demo", "--family", "llama"], capture_output=True, text=True)
    assert proc.returncode != 0 and "family='llama' is not an MoE family" in proc.stderr, proc.stderr
