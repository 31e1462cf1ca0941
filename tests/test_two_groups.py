"""Several DWDP groups in one world: 4 processes, DWDPConfig(group_size=2), groups {0, 1} and {2, 3}.

Each group wraps a model with different weights, so a rank that mapped a segment of the other
group would compute with foreign experts and its logits would not match its own unwrapped model.
"""
import pytest
import torch

from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.group import launch_local
from dwdp.runtime.model import DWDPModel
from dwdp.models.tiny import build_tiny_model
from logits_check import check_logits

# qwen3_moe tiny: 3 MoE layers of 8 experts, gate_up [96, 32] + down [32, 48] fp32 = 18432 bytes each.
# One forward with composite views (the default), 2 slots by layer parity: layer 0 at the start, layers 1
# and 2 at the visits before them; layer 0 of the next forward shares slot 0 with layer 2, so it waits
# for the next forward = 3 copies of the 4 experts a rank of a 2-rank group pulls.
EXPERT_BYTES = (96 * 32 + 32 * 48) * 4
COPIES_ONE_FORWARD = 3


def _rank(rank: int) -> dict:
    model = build_tiny_model("qwen3_moe", seed=30 + rank // 2)  # one set of weights per group
    ids = torch.randint(3, 128, (2, 7 + rank), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        reference = model(ids).logits
    with DWDPModel(model, DWDPConfig(group_size=2)) as wrapped, torch.no_grad():
        got = wrapped(ids).logits
        group = wrapped.group
        members = group.all_gather_object(group.global_rank)
        return dict(rank=group.rank, size=group.size, global_rank=group.global_rank, world_size=group.world_size,
                    members=members, owned=wrapped.placement.local_experts(group.rank),
                    diff=(got - reference).abs().max().item(), scale=reference.abs().max().item(),
                    bytes_copied=wrapped.stats.bytes_copied, plans_issued=wrapped.stats.plans_issued)


@pytest.mark.timeout(240)
def test_world_of_four_in_two_groups_of_two():
    results = launch_local(_rank, 4, timeout_s=220)
    for global_rank, r in enumerate(results):
        place = (r["rank"], r["size"], r["global_rank"], r["world_size"])
        assert place == (global_rank % 2, 2, global_rank, 4), f"global rank {global_rank}: (rank, size, global, world) {place}"
        first = global_rank - global_rank % 2
        assert r["members"] == [first, first + 1], f"global rank {global_rank} exchanged handles with {r['members']}"
        assert r["owned"] == ((0, 1, 2, 3), (4, 5, 6, 7))[global_rank % 2], r["owned"]
        check_logits(f"group {global_rank // 2}", r, global_rank)
        assert (r["plans_issued"], r["bytes_copied"]) == (COPIES_ONE_FORWARD, COPIES_ONE_FORWARD * 4 * EXPERT_BYTES), r
