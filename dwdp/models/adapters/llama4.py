"""Llama 4: the MoE block multiplies each token by its router score before the experts, and the experts
module (transposed `gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`) runs every expert on every token
(`forward(hidden_states [E * T, H])`). dwdp replaces the block's forward on the instance: the same
router, top-k, then dwdp's experts function with the routing weight applied to the input."""
from __future__ import annotations

import types

import torch

from dwdp.models.expert_tensors import ExpertsMath, ExpertsSpec, ExpertTensor, glu
from dwdp.models.adapters.base import ExpertsAdapter, ExpertsFunction, ExpertsLayer, Unsupported
from dwdp.models.adapters.interface import forward_args, is_decorated


def _parent(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    owner, _, _ = name.rpartition(".")
    return model.get_submodule(owner) if owner else None


class Llama4Adapter(ExpertsAdapter):
    kind = "Llama 4 (router score on the input)"

    def spec(self, name: str, module: torch.nn.Module, model: torch.nn.Module) -> ExpertsSpec | None:
        block = _parent(model, name)
        weights = [getattr(module, a, None) for a in ("gate_up_proj", "down_proj")]
        looks = (
            not is_decorated(module) and forward_args(module) == ("hidden_states",)
            and all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights)
            and block is not None and all(hasattr(block, a) for a in ("router", "shared_expert", "top_k"))
        )
        if not looks:
            return None
        gate_up, down = weights
        num_experts, hidden, two_i = gate_up.shape
        if two_i % 2 or tuple(down.shape) != (num_experts, two_i // 2, hidden):
            raise Unsupported(name, module, "down_proj", f"has shape {list(down.shape)} next to gate_up_proj "
                                                        f"{list(gate_up.shape)}; expected [E, I, H] and [E, H, 2I]")
        if not callable(getattr(module, "act_fn", None)):
            raise Unsupported(name, module, "act_fn", "is missing")
        tensors = (ExpertTensor("gate_up_proj", "gate_up_proj", (hidden, two_i), gate_up.dtype),
                   ExpertTensor("down_proj", "down_proj", (two_i // 2, hidden), down.dtype))
        math = ExpertsMath(
            first=("gate_up_proj",), first_bias=(None,), down="down_proj", down_bias=None, gate=glu(module.act_fn),
            transposed=frozenset({"gate_up_proj", "down_proj"}), weights_on_input=True,
            gate_label=f"{type(module.act_fn).__name__}(gate) * up",
        )
        return ExpertsSpec(num_experts, tensors, math, extras=dict(has_gate=True, interleaved=False))

    def install(self, layer: ExpertsLayer, model: torch.nn.Module, fn: ExpertsFunction) -> None:
        block = _parent(model, layer.name)

        def forward(self, hidden_states):
            """hidden_states [..., H] -> ([T, H], router_logits [T, E]), like Llama4TextMoe.forward."""
            hidden_states = hidden_states.reshape(-1, hidden_states.shape[-1])     # [T, H]
            router_scores, router_logits = self.router(hidden_states)              # [T, E], [T, E]
            top_k_index = torch.topk(router_logits, self.top_k, dim=1).indices     # [T, k]
            top_k_weights = router_scores.gather(1, top_k_index)                   # [T, k] sigmoid scores
            out = self.shared_expert(hidden_states)                                # [T, H]
            out.add_(fn(self.experts, hidden_states, top_k_index, top_k_weights))
            return out, router_logits

        block.forward = types.MethodType(forward, block)
