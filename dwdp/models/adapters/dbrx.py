"""DBRX: three flattened tensors per layer, `mlp.w1`, `mlp.v1`, `mlp.w2`, each [E * I, H]; expert e is rows
[e * I, (e + 1) * I). gate = x @ w1_e^T, up = x @ v1_e^T, out = (act(gate) * up) @ w2_e, so w2 is read
transposed. The experts module has the standard interface; dwdp's function is installed on it."""
from __future__ import annotations

import torch

from dwdp.models.expert_tensors import ExpertsMath, ExpertsSpec, ExpertTensor, glu
from dwdp.models.adapters.base import ExpertsAdapter, Unsupported
from dwdp.models.adapters.interface import has_standard_interface, is_decorated

TENSORS = ("w1", "v1", "w2")


class FlattenedGLUAdapter(ExpertsAdapter):
    kind = "DBRX (flattened w1 / v1 / w2)"

    def spec(self, name: str, module: torch.nn.Module, model: torch.nn.Module) -> ExpertsSpec | None:
        mlp = getattr(module, "mlp", None)
        num_experts = getattr(module, "num_experts", None)
        if is_decorated(module) or not has_standard_interface(module) or not isinstance(num_experts, int):
            return None
        if mlp is None or not all(isinstance(getattr(mlp, t, None), torch.Tensor) for t in TENSORS):
            return None
        w1 = mlp.w1
        if w1.dim() != 2 or w1.shape[0] % num_experts:
            raise Unsupported(name, module, "mlp.w1", f"has shape {list(w1.shape)}, expected [num_experts * I, H] "
                                                      f"with num_experts={num_experts}")
        inter, hidden = w1.shape[0] // num_experts, w1.shape[1]
        for t in TENSORS:
            if tuple(getattr(mlp, t).shape) != tuple(w1.shape):
                raise Unsupported(name, module, f"mlp.{t}", f"has shape {list(getattr(mlp, t).shape)}, expected "
                                                            f"{list(w1.shape)} like mlp.w1")
        act = getattr(mlp, "activation_fn", None)
        if not callable(act):
            raise Unsupported(name, module, "mlp.activation_fn", "is missing")
        tensors = tuple(ExpertTensor(t, f"mlp.{t}", (inter, hidden), w1.dtype, rows=inter) for t in TENSORS)
        math = ExpertsMath(first=("w1", "v1"), first_bias=(None, None), down="w2", down_bias=None, gate=glu(act),
                           transposed=frozenset({"w2"}), gate_label=f"{type(act).__name__}(gate) * up")
        return ExpertsSpec(num_experts, tensors, math, extras=dict(has_gate=True, interleaved=False))
