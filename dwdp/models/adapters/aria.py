"""Aria's experts before they took transformers' experts decorator (transformers 5.17 among those releases):
the experts module routes its own tokens, `forward(hidden_states [T, H], router_logits [T, E])`, and holds
two grouped-GEMM projections driven by `forward(input, tokens_per_expert)`: `fc1.weight [E, H, 2I]` and
`fc2.weight [E, I, H]`, stored [in, out]. out = (silu(h[:, :I]) * h[:, I:]) @ fc2_e with h = x @ fc1_e:
the same math as the later decorated `AriaExperts` (transposed `gate_up_proj` / `down_proj`). dwdp
installs a forward that keeps the module's own routing (`route_tokens_to_experts`: top-k of the logits,
softmax over them) and runs dwdp's experts function on its result."""
from __future__ import annotations

import types

import torch

from dwdp.models.expert_tensors import ExpertsMath, ExpertsSpec, ExpertTensor, glu
from dwdp.models.adapters.base import ExpertsAdapter, ExpertsFunction, ExpertsLayer, Unsupported
from dwdp.models.adapters.interface import forward_args, is_decorated

ROUTES_ITS_OWN = ("hidden_states", "router_logits")
GROUPED_GEMM_ARGS = ("input", "tokens_per_expert")
PROJECTIONS = ("fc1", "fc2")


def _grouped_gemm_weight(module: torch.nn.Module, attr: str) -> torch.Tensor | None:
    """The [E, in, out] weight of a grouped-GEMM child, or None when `attr` is not one."""
    child = getattr(module, attr, None)
    weight = getattr(child, "weight", None)
    if not isinstance(child, torch.nn.Module) or forward_args(child) != GROUPED_GEMM_ARGS:
        return None
    return weight if isinstance(weight, torch.Tensor) and weight.dim() == 3 else None


class GroupedGemmExpertsAdapter(ExpertsAdapter):
    kind = "Aria (grouped-GEMM fc1 / fc2, routes its own tokens)"

    def spec(self, name: str, module: torch.nn.Module, model: torch.nn.Module) -> ExpertsSpec | None:
        if is_decorated(module) or forward_args(module) != ROUTES_ITS_OWN:
            return None
        if not callable(getattr(module, "route_tokens_to_experts", None)):
            return None
        fc1, fc2 = (_grouped_gemm_weight(module, p) for p in PROJECTIONS)
        if fc1 is None or fc2 is None:
            return None
        num_experts, hidden, two_i = fc1.shape
        if two_i % 2 or tuple(fc2.shape) != (num_experts, two_i // 2, hidden):
            raise Unsupported(name, module, "fc2.weight", f"has shape {list(fc2.shape)} next to fc1.weight "
                                                          f"{list(fc1.shape)}; expected [E, I, H] and [E, H, 2I]")
        tensors = (ExpertTensor("fc1", "fc1.weight", (hidden, two_i), fc1.dtype),
                   ExpertTensor("fc2", "fc2.weight", (two_i // 2, hidden), fc2.dtype))
        math = ExpertsMath(first=("fc1",), first_bias=(None,), down="fc2", down_bias=None,
                           gate=glu(torch.nn.functional.silu), transposed=frozenset(PROJECTIONS),
                           gate_label="silu(gate) * up")
        return ExpertsSpec(num_experts, tensors, math, extras=dict(has_gate=True, interleaved=False))

    def install(self, layer: ExpertsLayer, model: torch.nn.Module, fn: ExpertsFunction) -> None:
        def forward(self, hidden_states, router_logits):
            """hidden_states [T, H], router_logits [T, E] -> [T, H], routed as the module routes."""
            top_k_index, top_k_weights = self.route_tokens_to_experts(router_logits)  # [T, k] each
            return fn(self, hidden_states, top_k_index, top_k_weights)

        layer.module.forward = types.MethodType(forward, layer.module)
