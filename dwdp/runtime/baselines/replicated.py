"""Replicated baseline: every rank keeps every expert and never communicates.

This is the upper bound DWDP approaches: the same math with no prefetch and no barrier, at the
price of holding all experts on every rank (`ReplicatedModel.memory` against `DWDPModel.memory`).

Legend: T = tokens, k = experts per token, S = T * k token-expert pairs, H = hidden, E = experts.
"""
from __future__ import annotations

import torch

from dwdp.models.adapters import find_experts, route_experts
from dwdp.runtime.expert_math import combine, expert_mlp, plain_routing_layers, sort_by_expert
from dwdp.runtime.model import MemoryReport
from dwdp.runtime.wrapping import ModelWrapper, dense_bytes, tensor_bytes

REPLICATED_IMPLEMENTATION = "dwdp_replicated"


def replicated_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k] -> [T, H], all experts local."""
    spec = self._replicated_spec
    top_k = top_k_index.shape[1]
    perm, counts = sort_by_expert(top_k_index, spec.num_experts)            # [S], [E]
    x_sorted = hidden_states[perm // top_k]                                  # [S, H]
    views = {t.name: t.stacked(self, spec.num_experts).unbind(0) for t in spec.tensors}
    y_sorted = expert_mlp(spec.math, x_sorted, counts.tolist(), views)       # [S, H]
    return combine(y_sorted, perm, top_k_weights, hidden_states.dtype)


class ReplicatedModel(ModelWrapper):
    """`model` with its experts run by the same grouped path as DWDP and DEP, all experts local.

    model: a transformers 5 MoE model of a supported family; called exactly like it.
    `memory` reports what this rank holds (local = every expert, no prefetch buffers).
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        layers = plain_routing_layers(find_experts(model), "ReplicatedModel")
        expert_tensors = [t.stored(layer.module) for layer in layers for t in layer.spec.tensors]
        full = tensor_bytes(expert_tensors)
        self.model = model
        self.experts_modules = [layer.module for layer in layers]
        for layer in layers:
            layer.module._replicated_spec = layer.spec
        route_experts(model, layers, REPLICATED_IMPLEMENTATION, replicated_experts_forward)
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
