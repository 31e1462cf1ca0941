"""Experts modules with transformers' experts interface: `forward(hidden_states [T, H], top_k_index [T, k],
top_k_weights [T, k]) -> [T, H]` over stacked `[E, ...]` weights.

Decorated classes (`@use_experts_implementation`) declare their layout with the decorator's flags and
dispatch to a registered experts function; dwdp reads the same flags transformers' own grouped path
does. Undecorated classes with the same interface (Step-3.7) are read with the default flags, and
dwdp's function is installed on the instance: their own forward would index the shrunk [L, ...]
tensors with global expert ids.
"""
from __future__ import annotations

import inspect

import torch

from dwdp.models.expert_tensors import ExpertsMath, ExpertsSpec, ExpertTensor, glu
from dwdp.models.adapters.base import ExpertsAdapter, ExpertsLayer, Unsupported
from dwdp.models.adapters.quantized import read_projection

FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated")
# Flags the decorator gained in later releases, with the value an older release's classes behave as.
LATER_FLAGS = {"has_post_expert_norm": False}
STANDARD_ARGS = ("hidden_states", "top_k_index", "top_k_weights")


def is_decorated(module: torch.nn.Module) -> bool:
    """True for an instance of a class decorated with transformers' experts-implementation decorator."""
    return all(isinstance(getattr(module, f, None), bool) for f in FLAGS) and hasattr(type(module), "_apply_gate")


def decorator_flags(module: torch.nn.Module) -> dict[str, bool]:
    """The decorator's flags on a decorated instance; a flag its release does not set takes the value
    that release's classes behave as (no post-expert norm before the decorator could declare one)."""
    return {**LATER_FLAGS, **{f: getattr(module, f) for f in (*FLAGS, *LATER_FLAGS) if hasattr(module, f)}}


def forward_args(module: torch.nn.Module) -> tuple[str, ...]:
    """Names of the positional arguments of the module's own forward (after self)."""
    forward = inspect.unwrap(type(module).forward)
    params = list(inspect.signature(forward).parameters.values())[1:]
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def has_standard_interface(module: torch.nn.Module) -> bool:
    return forward_args(module) == STANDARD_ARGS


def _stacked(name: str, module: torch.nn.Module, attr: str, dims: int) -> torch.Tensor:
    t = getattr(module, attr, None)
    if not isinstance(t, torch.Tensor) or t.dim() != dims:
        got = None if t is None else (f"shape {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__)
        raise Unsupported(name, module, attr, f"is {got}, expected a {dims}-D tensor [num_experts, ...]")
    return t


def gate_of(name: str, module: torch.nn.Module, has_gate: bool):
    """(gate function [R, N1] -> [R, I], label): the module's own `_apply_gate` when it has one, else
    act_fn(gate) * up; without a gate, act_fn alone."""
    from transformers.integrations.moe import _default_apply_gate

    act = getattr(module, "act_fn", None)
    own = getattr(type(module), "_apply_gate", None)
    if has_gate and own is not None and own is not _default_apply_gate:
        return module._apply_gate, f"{type(module).__name__}._apply_gate"
    if not callable(act):
        what = "act_fn(gate) * up" if has_gate else "act_fn(up)"
        raise Unsupported(name, module, "act_fn", f"is missing: the experts apply {what} and have no gate of their own")
    act_name = type(act).__name__ if isinstance(act, torch.nn.Module) else getattr(act, "__name__", "act_fn")
    if has_gate:
        return glu(act), f"{act_name}(gate) * up"
    return act, f"{act_name}(up)"


def interface_spec(name: str, module: torch.nn.Module, *, has_gate: bool = True, has_bias: bool = False,
                   is_transposed: bool = False, has_post_expert_norm: bool = False, is_concatenated: bool = True,
                   decorated: bool = False, num_experts: int | None = None,
                   num_identity_experts: int = 0) -> ExpertsSpec:
    """The spec of a stacked-experts module laid out as the decorator's flags say.

    Weights [E, N1, H] / [E, H, I] ([E, H, N1] / [E, I, H] when transposed), N1 = 2I with a gate
    (`gate_up_proj`) and I without (`up_proj`); biases `<weight>_bias` [E, out]. Either projection may
    be quantized (fp8 with block scales, MXFP4 blocks: dwdp.models.adapters.quantized). num_experts: the
    real experts when the stacked tensors hold more rows (identity experts beyond them).
    is_concatenated and decorated are recorded for reports and kernel choice: the module's own gate
    function already reads its gate / up layout.
    """
    first = "gate_up_proj" if has_gate else "up_proj"
    up = read_projection(name, module, first, fused_gate=has_gate, transposed=is_transposed)
    down = read_projection(name, module, "down_proj", fused_gate=False, transposed=is_transposed)
    if up.quantized or down.quantized:
        is_transposed = False  # quantized values are [out, in] (read_projection refuses anything else)
    num_experts = num_experts or down.shape[0]
    declared = getattr(module, "num_experts", None)
    if isinstance(declared, int) and not num_identity_experts and declared != num_experts:
        raise Unsupported(name, module, "num_experts", f"is {declared} but down_proj holds {down.shape[0]} experts")
    if up.shape[0] < num_experts or down.shape[0] != num_experts:
        raise Unsupported(name, module, up.weight, f"holds {up.shape[0]} experts and {down.weight} {down.shape[0]}; "
                                                   f"expected {num_experts} in each")
    up_shape, down_shape = up.shape[1:], down.shape[1:]
    n1, hidden = (up_shape[1], up_shape[0]) if is_transposed else up_shape
    inter = n1 // 2 if has_gate else n1
    expected_down = (inter, hidden) if is_transposed else (hidden, inter)
    if (has_gate and n1 % 2) or down_shape != expected_down:
        layout = "[E, H, N1] / [E, I, H]" if is_transposed else "[E, N1, H] / [E, H, I]"
        raise Unsupported(name, module, down.weight, f"has shape {list(down.shape)} next to {up.weight} "
                                                     f"{list(up.shape)}; expected {layout} with N1 = "
                                                     f"{'2I' if has_gate else 'I'}")
    tensors = [*up.tensors, *down.tensors]
    biases: tuple[str | None, str | None] = (None, None)
    if has_bias:
        for attr, size in ((f"{first}_bias", n1), ("down_proj_bias", hidden)):
            b = _stacked(name, module, attr, 2)
            if tuple(b.shape) != (up.shape[0] if attr.startswith(first) else num_experts, size):
                raise Unsupported(name, module, attr, f"has shape {list(b.shape)}, expected [{num_experts}, {size}]")
            tensors.append(ExpertTensor(attr, attr, (size,), b.dtype))
        biases = (f"{first}_bias", "down_proj_bias")
    gate, label = gate_of(name, module, has_gate)
    post_norm = None
    if has_post_expert_norm:
        post_norm = getattr(module, "post_expert_norm", None)
        if not callable(post_norm):
            raise Unsupported(name, module, "post_expert_norm", "is missing though has_post_expert_norm=True")
    math = ExpertsMath(
        first=(up.weight,), first_bias=(biases[0],), down=down.weight, down_bias=biases[1], gate=gate,
        transposed=frozenset({first, "down_proj"}) if is_transposed else frozenset(), post_norm=post_norm,
        num_identity_experts=num_identity_experts, gate_label=label,
        quantized=tuple(p.quantized for p in (up, down) if p.quantized is not None),
    )
    extras = dict(has_gate=has_gate, interleaved=not is_concatenated, decorated=decorated)
    return ExpertsSpec(num_experts, tuple(tensors), math, extras=extras)


class ExpertsInterfaceAdapter(ExpertsAdapter):
    """Decorated experts (any flags), and undecorated ones with the standard interface."""

    kind = "experts interface"

    def spec(self, name: str, module: torch.nn.Module, model: torch.nn.Module) -> ExpertsSpec | None:
        if is_decorated(module):
            return interface_spec(name, module, **decorator_flags(module), decorated=True)
        if has_standard_interface(module) and isinstance(getattr(module, "down_proj", None), torch.Tensor):
            return interface_spec(name, module)
        return None

    def label(self, spec: ExpertsSpec) -> str:
        return "experts interface" if spec.extras.get("decorated") else "experts interface (undecorated)"

    def routes_through_registry(self, layer: ExpertsLayer) -> bool:
        # Quantized experts classes (FP8Experts) dispatch through a registry of their own: dwdp's
        # function is installed on the instance instead.
        return super().routes_through_registry(layer) and not layer.spec.math.quantized
