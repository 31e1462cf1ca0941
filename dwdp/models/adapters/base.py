"""What an adapter is: it recognises one kind of experts module, describes its tensors and math
(`ExpertsSpec`), and routes the module's calls to dwdp's experts function."""
from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dwdp.models.expert_tensors import ExpertsSpec

ExpertsFunction = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""fn(experts module, hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]."""


class Unsupported(ValueError):
    """An experts module dwdp cannot wrap; the message names the module, its class and the attribute."""

    def __init__(self, name: str, module: torch.nn.Module, attribute: str, why: str):
        self.module_name, self.class_name, self.attribute = name, type(module).__name__, attribute
        super().__init__(f"{name} ({self.class_name}) cannot be wrapped: {attribute} {why}")


@dataclass
class ExpertsLayer:
    """One MoE layer's experts module as dwdp sees it."""

    name: str
    module: torch.nn.Module
    adapter: "ExpertsAdapter"
    spec: ExpertsSpec

    @property
    def label(self) -> str:
        return self.adapter.label(self.spec)


class ExpertsAdapter:
    """Base class: `spec` recognises a module (None: not this adapter's), `install` routes its calls."""

    kind = "experts"

    def spec(self, name: str, module: torch.nn.Module, model: torch.nn.Module) -> ExpertsSpec | None:
        raise NotImplementedError

    def label(self, spec: ExpertsSpec) -> str:
        return self.kind

    def routes_through_registry(self, layer: ExpertsLayer) -> bool:
        """True when transformers' experts-function registry already calls the chosen function."""
        return bool(layer.spec.extras.get("decorated"))

    def install(self, layer: ExpertsLayer, model: torch.nn.Module, fn: ExpertsFunction) -> None:
        """Make calls of the experts module run `fn` (default: on the instance, standard interface).

        Inputs may carry leading batch dims ([P, T, H] and [P * T, k]); the result has hidden's shape.
        """

        def forward(self, hidden_states, top_k_index, top_k_weights):
            shape = hidden_states.shape
            flat = hidden_states.reshape(-1, shape[-1])                                    # [T, H]
            k = top_k_index.shape[-1]
            out = fn(self, flat, top_k_index.reshape(-1, k), top_k_weights.reshape(-1, k))  # [T, H]
            return out.view(shape)

        layer.module.forward = types.MethodType(forward, layer.module)
