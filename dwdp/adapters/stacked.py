"""Adapter for transformers 5 stacked experts: `gate_up_proj [E, 2I, H]` ([gate; up]) and
`down_proj [E, H, I]`, no bias, not transposed, gated activation (Mixtral, Qwen2/3-MoE,
DeepSeek-V3, OLMoE)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

TENSOR_NAMES = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class StackedExpertsAdapter:
    family: str
    experts_class: str  # class name transformers uses for this family's experts module

    def matches(self, module: torch.nn.Module) -> bool:
        return type(module).__name__ == self.experts_class

    def check(self, name: str, module: torch.nn.Module) -> None:
        """Raise ValueError if `module` has a quirk this adapter does not handle."""
        quirks = {
            "has_bias": (getattr(module, "has_bias", False), False),
            "is_transposed": (getattr(module, "is_transposed", False), False),
            "is_concatenated": (getattr(module, "is_concatenated", True), True),
            "has_gate": (getattr(module, "has_gate", True), True),
            "has_post_expert_norm": (getattr(module, "has_post_expert_norm", False), False),
        }
        for quirk, (value, expected) in quirks.items():
            if value != expected:
                raise ValueError(
                    f"{name}: {self.family} experts with {quirk}={value} are not supported (expected {expected})"
                )
        for t in TENSOR_NAMES:
            p = getattr(module, t, None)
            if not isinstance(p, torch.Tensor) or p.dim() != 3 or p.shape[0] != module.num_experts:
                shape = None if p is None else tuple(p.shape)
                raise ValueError(f"{name}.{t} has shape {shape}, expected [num_experts={module.num_experts}, ., .]")
        e, two_i, h = module.gate_up_proj.shape
        if two_i % 2 or tuple(module.down_proj.shape) != (e, h, two_i // 2):
            raise ValueError(
                f"{name}: gate_up_proj {tuple(module.gate_up_proj.shape)} and down_proj "
                f"{tuple(module.down_proj.shape)} are not [E, 2I, H] and [E, H, I]"
            )

    def expert_tensors(self, module: torch.nn.Module) -> tuple[torch.Tensor, ...]:
        """The stacked [E, ...] tensors, in the order the copy plan moves them."""
        return tuple(getattr(module, t) for t in TENSOR_NAMES)

    def replace_tensors(self, module: torch.nn.Module, local: tuple[torch.Tensor, ...]) -> None:
        """Swap the stacked [E, ...] parameters for this rank's [L, ...] local experts."""
        for t, tensor in zip(TENSOR_NAMES, local):
            setattr(module, t, torch.nn.Parameter(tensor, requires_grad=False))
