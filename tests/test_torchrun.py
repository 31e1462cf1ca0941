import sys
from pathlib import Path

import pytest

from dwdp.runtime.group import free_port
from procs import run

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torchrun_tiny.py"


@pytest.mark.timeout(180)
def test_ranks_join_through_torchrun_env(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), str(EXAMPLE), "--family", "mixtral"]
    proc = run(cmd, timeout=170,
                          env={"PATH": "/usr/bin:/bin", "DWDP_SHM_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = sorted(line for line in proc.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == 2 and all(line.endswith(" ok") for line in lines), proc.stdout
    assert lines[0].startswith("rank 0/2") and lines[1].startswith("rank 1/2")
    assert list(tmp_path.iterdir()) == []
