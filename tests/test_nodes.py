"""A DWDP group over two nodes emulated on one machine: 4 ranks, 2 a node (DWDP_NODE), each node's
node-local files (liveness records) in a directory of its own, the host backend's segments in a shared
"fabric" directory (DWDP_FABRIC_DIR), the world's store hosted by the launcher (it outlives any rank).
Every rank's logits equal the unwrapped model's; a rank of node 1 is killed: its node-mate sees it
exit (pidfd), node 0's ranks see its beats stop and declare it lost after the remote bound, and all
three keep matching the unwrapped model."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from dwdp.models.tiny import build_tiny_model
from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.group import init_group, launch_local
from dwdp.runtime.model import DWDPModel
from deadlines import LOADED_SLACK_S
from logits_check import ATOL, RTOL

VICTIM = 3
STALL_S, LOST_S = 0.25, 1.0
MODEL = dict(num_experts=8, top_k=2, num_layers=2, seed=5)


def _inputs(rank: int, step: int) -> dict:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return {"input_ids": torch.randint(3, 128, (2, 6 + step), generator=gen)}


def _within(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    return float((got - want).abs().max()), ATOL + RTOL * float(want.abs().max())


def _two_nodes(rank: int, root: str) -> dict | None:
    node = f"node{rank // 2}"
    os.environ.update({"DWDP_NODE": node, "DWDP_SHM_DIR": str(Path(root) / node),
                       "DWDP_FABRIC_DIR": str(Path(root) / "fabric")})
    model = build_tiny_model("mixtral", seed=MODEL["seed"], **{k: v for k, v in MODEL.items() if k != "seed"})
    with torch.no_grad():
        reference = [model(**_inputs(rank, step)).logits for step in range(3)]
    config = DWDPConfig(slice_bytes=2048, expert_replicas=2, peer_timeout_s=STALL_S, remote_lost_after_s=LOST_S,
                        wait_timeout_s=30)
    wrapped = DWDPModel(model, config, init_group())
    survivors = dist.new_group([0, 1, 2])
    out = {"node": node, "node_files": sorted(p.name for p in (Path(root) / node).iterdir())}
    with torch.no_grad():
        out["before"] = _within(wrapped(**_inputs(rank, 0)).logits, reference[0])
    liveness = wrapped.failover.liveness
    out["watch"] = {peer: (liveness.status(peer).state, liveness.status(peer).remote) for peer in liveness.peers}
    out["pulled_from_victim"] = wrapped.stats.bytes_from_peer.get(VICTIM, 0)
    dist.barrier()
    if rank == VICTIM:
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + LOST_S + LOADED_SLACK_S
    while VICTIM not in wrapped.check_peers().lost:
        if time.monotonic() > deadline:
            raise AssertionError(f"rank {rank}: rank {VICTIM} not declared lost within {LOST_S + LOADED_SLACK_S} s: "
                                 f"{liveness.status(VICTIM) if VICTIM in liveness.peers else 'not watched'}")
        time.sleep(0.05)
    out["lost"] = dict(wrapped.check_peers().lost)
    with torch.no_grad():
        out["after"] = [_within(wrapped(**_inputs(rank, step)).logits, reference[step]) for step in (1, 2)]
    status = wrapped.check_peers()
    out["status"] = (status.replans, status.unservable_experts, status.can_serve_all)
    dist.barrier(survivors)
    wrapped.close()
    return out


@pytest.mark.timeout(240)
def test_a_group_over_two_emulated_nodes_serves_and_declares_a_remote_rank_lost_by_its_beats(tmp_path):
    for name in ("node0", "node1", "fabric"):
        (tmp_path / name).mkdir()
    results = launch_local(_two_nodes, 4, args=(str(tmp_path),), timeout_s=200, may_die=(VICTIM,))
    assert results[VICTIM] is None
    for rank in (0, 1, 2):
        r = results[rank]
        assert r["node"] == f"node{rank // 2}"
        for name, (diff, bound) in [("before", r["before"]), *[(f"after {i}", x) for i, x in enumerate(r["after"])]]:
            assert diff <= bound, f"rank {rank} {name}: max|diff|={diff:.3e} > {bound:.3e}"
        mate = rank ^ 1
        others = [p for p in range(4) if p // 2 != rank // 2]
        assert r["watch"][mate] == ("alive", False), (rank, r["watch"])  # its node-mate: shared memory
        assert [r["watch"][p] for p in others] == [("alive", True)] * 2, (rank, r["watch"])  # the other node: beats
        why = r["lost"][VICTIM]
        if rank // 2 == VICTIM // 2:
            assert "exited without closing" in why, (rank, why)  # its pidfd
        else:
            assert "another node" in why and "has not beaten" in why, (rank, why)
        assert list(r["lost"]) == [VICTIM] and r["status"] == (1, (), True), (rank, r)
    assert any(results[r]["pulled_from_victim"] > 0 for r in (0, 1, 2)), "nobody pulled from the victim"
    # Node-local files are in their node's directory only (none of them is named after a rank of the other).
    assert all(not name.startswith("dwdp-board-") for r in (0, 1, 2) for name in results[r]["node_files"])
    assert list((tmp_path / "fabric").iterdir()) == [], list((tmp_path / "fabric").iterdir())
