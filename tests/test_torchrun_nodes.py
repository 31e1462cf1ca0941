"""One DWDP group of 4 ranks over two nodes emulated on one machine, launched as on two real nodes: two
torchrun agents (`--nnodes 2`, c10d rendezvous on loopback), each with its node's name (DWDP_NODE) and
its own node-local directory (DWDP_SHM_DIR), the host backend's segments in a shared "fabric" directory.
Every rank's logits equal the unwrapped model's; each rank watches the other node's two ranks through
their beats in torchrun's store and publishes on the board there; nothing is left in any directory."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from dwdp.runtime.group import free_port
from procs import end_group

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "torchrun_tiny.py"
TIMEOUT_S = 200


@pytest.mark.timeout(TIMEOUT_S + 40)
def test_two_torchrun_agents_make_one_group_over_two_emulated_nodes(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    for name in ("node0", "node1", "fabric"):
        (tmp_path / name).mkdir()
    agents = []
    try:
        for node in (0, 1):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                   "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                   "--rdzv-id", "dwdp-two-nodes", str(EXAMPLE), "--family", "mixtral"]
            env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "DWDP_NODE": f"node{node}",
                   "DWDP_SHM_DIR": str(tmp_path / f"node{node}"), "DWDP_FABRIC_DIR": str(tmp_path / "fabric"),
                   "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
            agents.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                           start_new_session=True))
        outputs = []
        for agent in agents:
            out, err = agent.communicate(timeout=TIMEOUT_S)
            outputs.append((agent.returncode, out, err))
    finally:
        for agent in agents:
            end_group(agent)
    for code, out, err in outputs:
        assert code == 0, out + err
    lines = sorted(line for _, out, _ in outputs for line in out.splitlines() if line.startswith("rank "))
    assert [line.split(" on ")[0] for line in lines] == [f"rank {r}/4" for r in range(4)], lines
    assert all(line.endswith(" ok") for line in lines), lines
    by_node = {}
    for line in lines:
        rank = int(line.split()[1].split("/")[0])
        node = line.split(" on ")[1].split()[0]
        by_node.setdefault(node, []).append(rank)
        assert "StoreBoard" in line, line
    assert sorted(map(sorted, by_node.values())) == [[0, 1], [2, 3]], lines  # two ranks a node, by rendezvous
    for line in lines:
        rank = int(line.split()[1].split("/")[0])
        others = [r for r in range(4) if r not in next(v for v in by_node.values() if rank in v)]
        assert f"peers on other nodes {others}" in line, line
    for name in ("node0", "node1", "fabric"):
        assert list((tmp_path / name).iterdir()) == [], (name, list((tmp_path / name).iterdir()))
