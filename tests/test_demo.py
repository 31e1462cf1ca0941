import json
import mmap
import sys

import pytest

from dwdp.cli import main
from procs import run


# Demo model: 16 experts of gate_up [512, 256] + down [256, 256] fp32 in each of 4 MoE layers; a rank
# of 2 keeps 8 and pulls 8 per layer. With 2 slots and 4 MoE layers every layer visit refills a slot.
DEMO_EXPERT_BYTES = (512 * 256 + 256 * 256) * 4
DEMO_BYTES_PER_FORWARD = 4 * 8 * DEMO_EXPERT_BYTES


@pytest.mark.timeout(180)
def test_demo_runs_and_every_rank_matches(tmp_path):
    shm, out = tmp_path / "shm", tmp_path / "demo.json"
    shm.mkdir()
    proc = run(
        [sys.executable, "-m", "dwdp", "demo", "--ranks", "2", "--prompts", "2", "--max-len", "12", "--repeats", "1",
         "--json", str(out)],
        timeout=170, env={"DWDP_SHM_DIR": str(shm), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2/2 ranks match the unwrapped model" in proc.stdout, proc.stdout
    table = [line for line in proc.stdout.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert len(table) == 2 and all(line.rstrip().endswith("yes") for line in table), proc.stdout
    assert list(shm.iterdir()) == []
    report = json.loads(out.read_text())
    assert set(report["load_average_1min"]) == {"before", "after"} and report["machine"]["cpu_count"] >= 1, report
    rows = report["rows"]
    assert [r["bytes_prefetched"] for r in rows] == [DEMO_BYTES_PER_FORWARD] * 2, rows
    assert [r["local_expert_bytes"] for r in rows] == [4 * 8 * DEMO_EXPERT_BYTES] * 2, rows
    for line, r in zip(table, rows):
        assert line.split()[:4] == [str(r["rank"]), "cpu", str(r["tokens"]), f"{r['tokens_per_s']:.0f}"], (line, r)


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    """`dwdp <argv>` in this process (the refusals below come before any rank starts): (exit code, stderr)."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    return code, capsys.readouterr().err


def test_cli_rejects_bad_rank_count(capsys):
    code, err = _cli(["demo", "--ranks", "0"], capsys)
    assert code == 2 and "--ranks" in err and "0 must be >= 1" in err, err


@pytest.mark.timeout(180)
def test_demo_on_another_family(tmp_path):
    proc = run(
        [sys.executable, "-m", "dwdp", "demo", "--family", "gpt_oss", "--ranks", "2", "--prompts", "1", "--max-len", "8",
         "--repeats", "1"],
        timeout=170, env={"DWDP_SHM_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "tiny gpt_oss model" in proc.stdout and "2/2 ranks match the unwrapped model" in proc.stdout, proc.stdout


def test_demo_rejects_unknown_family(capsys):
    code, err = _cli(["demo", "--family", "llama"], capsys)
    assert code != 0 and "family='llama' is not an MoE family" in err, err


# fp8 demo: the same experts as fp8 bytes + 128 x 128 fp32 block scales: gate_up [512, 256] -> 4 x 2 scales,
# down [256, 256] -> 2 x 2 (each expert's scale tensor padded to 16 bytes in segments and slots).
DEMO_FP8_EXPERT_BYTES = (512 * 256 + 256 * 256) + (4 * 2 * 4) + (2 * 2 * 4)


@pytest.mark.timeout(180)
def test_demo_fp8_matches_and_moves_fp8_bytes(tmp_path):
    out = tmp_path / "demo.json"
    proc = run(
        [sys.executable, "-m", "dwdp", "demo", "--dtype", "fp8", "--ranks", "2", "--prompts", "1", "--max-len", "8",
         "--repeats", "1", "--json", str(out)],
        timeout=170, env={"DWDP_SHM_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fp8 (128 x 128 block scales) experts" in proc.stdout and "2/2 ranks match" in proc.stdout, proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["bytes_prefetched"] for r in rows] == [4 * 8 * DEMO_FP8_EXPERT_BYTES] * 2, rows
    # Composite views (the default): each layer's local experts of a tensor are page-aligned extents, so
    # each scale tensor's 8 local experts (256 and 128 bytes) take one page.
    page = mmap.PAGESIZE
    per_layer = 8 * (512 * 256 + 256 * 256) + 2 * page
    assert [r["experts_kernel"] for r in rows] == ["composite"] * 2, rows
    assert [r["local_expert_bytes"] for r in rows] == [4 * per_layer] * 2, rows
