"""One DWDP rank per process under torchrun, on a tiny random model; each rank checks itself.

    torchrun --nproc-per-node 2 examples/torchrun_tiny.py [--family mixtral]

Over two nodes (the same command on each, HOST the first node's address; docs/multi-node.md):

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \
        examples/torchrun_tiny.py
"""
import argparse
import os

import torch

from dwdp import DWDPConfig, DWDPModel, envs
from dwdp.models.tiny import FAMILIES, build_tiny_model


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=FAMILIES, default="deepseek_v3")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = build_tiny_model(args.family, seed=0)  # same weights on every rank
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or None  # each node's experts spread over the ring
    with DWDPModel(model, DWDPConfig(slice_bytes=8192, ranks_per_node=per_node)) as wrapped:  # joins torchrun's world
        rank = wrapped.group.rank
        ids = torch.randint(3, 128, (2, 5 + rank), generator=torch.Generator().manual_seed(rank))  # own batch
        reference = build_tiny_model(args.family, seed=0)
        with torch.no_grad():
            diff = (wrapped(ids).logits - reference(ids).logits).abs().max().item()
        memory = wrapped.memory
        liveness = wrapped.failover.liveness
        remote = sorted(p for p in liveness.peers if liveness.status(p).remote) if liveness is not None else []
        board = type(wrapped.failover.board).__name__
    ok = diff <= 1e-5
    line = (f"rank {rank}/{wrapped.group.size} on {envs.node_name()} (peers on other nodes {remote}, {board}): "
            f"max|dlogits|={diff:.2e} local experts {memory.local_expert_bytes} of {memory.full_expert_bytes} bytes "
            f"{'ok' if ok else 'MISMATCH'}\n")
    os.write(1, line.encode())  # one write: the ranks share the output pipe, and lines must not interleave
    torch.distributed.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
