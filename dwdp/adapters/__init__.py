"""Model-family adapters: find a model's MoE experts modules and map their weights.

Every family transformers 5 stores as stacked, gated, bias-free experts shares one adapter;
families with other layouts (biases, interleaved gate/up, transposed weights) need their own.
"""
from __future__ import annotations

import torch

from .stacked import TENSOR_NAMES, StackedExpertsAdapter

ADAPTERS = {
    "mixtral": StackedExpertsAdapter("mixtral", "MixtralExperts"),
    "qwen3_moe": StackedExpertsAdapter("qwen3_moe", "Qwen3MoeExperts"),
    "qwen2_moe": StackedExpertsAdapter("qwen2_moe", "Qwen2MoeExperts"),
    "deepseek_v3": StackedExpertsAdapter("deepseek_v3", "DeepseekV3Experts"),
    "olmoe": StackedExpertsAdapter("olmoe", "OlmoeExperts"),
}


def adapter_for(model: torch.nn.Module) -> StackedExpertsAdapter:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in ADAPTERS:
        raise ValueError(
            f"model_type={model_type!r} is not supported; supported families: {sorted(ADAPTERS)}"
        )
    return ADAPTERS[model_type]


def find_experts(model: torch.nn.Module) -> tuple[StackedExpertsAdapter, list[tuple[str, torch.nn.Module]]]:
    """The adapter and every experts module of `model`, in layer order; ValueError if there is none."""
    adapter = adapter_for(model)
    found = [(name, m) for name, m in model.named_modules() if adapter.matches(m)]
    if not found:
        raise ValueError(
            f"{type(model).__name__} ({adapter.family}) has no MoE layers ({adapter.experts_class} modules): "
            "DWDP distributes MoE experts and has nothing to do for a dense model"
        )
    for name, module in found:
        adapter.check(name, module)
    return adapter, found


__all__ = ["ADAPTERS", "TENSOR_NAMES", "StackedExpertsAdapter", "adapter_for", "find_experts"]
