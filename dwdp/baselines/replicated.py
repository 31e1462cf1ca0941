"""Replicated baseline: every rank keeps every expert and never communicates.

This is the upper bound DWDP approaches: the same math with no prefetch and no barrier, at the
price of holding all experts on every rank (`ReplicatedModel.memory` against `DWDPModel.memory`).

Legend: T = tokens, k = experts per token, S = T * k, H = hidden, E = experts.
"""
from __future__ import annotations

import torch

from ..adapters import find_experts
from ..model import MemoryReport
from ..wrapping import ModelWrapper, dense_bytes, tensor_bytes
from ..expert_math import combine, expert_mlp, sort_by_expert

REPLICATED_IMPLEMENTATION = "dwdp_replicated"


def replicated_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k] -> [T, H], all experts local."""
    top_k = top_k_index.shape[1]
    perm, counts = sort_by_expert(top_k_index, self.gate_up_proj.shape[0])  # [S], [E]
    x_sorted = hidden_states[perm // top_k]                                  # [S, H]
    y_sorted = expert_mlp(self, x_sorted, counts.tolist(), self.gate_up_proj.unbind(0), self.down_proj.unbind(0))
    return combine(y_sorted, perm, top_k_weights, hidden_states.dtype)


def register_replicated_implementation() -> None:
    """Make 'dwdp_replicated' a valid `experts_implementation` of transformers (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(REPLICATED_IMPLEMENTATION, replicated_experts_forward)


class ReplicatedModel(ModelWrapper):
    """`model` with its experts run by the same grouped path as DWDP and DEP, all experts local.

    model: a transformers 5 MoE model of a supported family; called exactly like it.
    `memory` reports what this rank holds (local = every expert, no prefetch buffers).
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        adapter, experts = find_experts(model)
        expert_tensors = [t for _, m in experts for t in adapter.expert_tensors(m)]
        full = tensor_bytes(expert_tensors)
        self.model = model
        self.experts_modules = [m for _, m in experts]
        register_replicated_implementation()
        model.set_experts_implementation(REPLICATED_IMPLEMENTATION)
        self.memory = MemoryReport(
            full_expert_bytes=full, local_expert_bytes=full, prefetch_buffer_bytes=0,
            dense_bytes=dense_bytes(model, expert_tensors),
        )

    def close(self) -> None:
        """Nothing to release; present so the three modes are driven the same way."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
