"""Find a model's MoE experts modules by structure, and route their calls to an experts function.

Every module is offered to the adapters in turn: the few real models with an interface of their own
(Llama 4, DBRX, LongCat-Flash, and Aria in releases before its experts took the decorator) first, then
transformers' experts interface, which covers every decorated experts class (whatever its flags) and
undecorated ones with the standard signature.
Whole multimodal models are searched too, so their text model's experts are found. A module that
looks like experts (its class name says so) but that no adapter takes is refused by name, class and
the attribute that stops it, rather than silently left replicated.
"""
from __future__ import annotations

import re

import torch

from dwdp.models.adapters.aria import GroupedGemmExpertsAdapter
from dwdp.models.adapters.base import ExpertsAdapter, ExpertsFunction, ExpertsLayer, Unsupported
from dwdp.models.adapters.dbrx import FlattenedGLUAdapter
from dwdp.models.adapters.interface import ExpertsInterfaceAdapter, forward_args, STANDARD_ARGS
from dwdp.models.adapters.llama4 import Llama4Adapter
from dwdp.models.adapters.longcat import IdentityExpertsAdapter

ADAPTERS: tuple[ExpertsAdapter, ...] = (
    Llama4Adapter(), FlattenedGLUAdapter(), IdentityExpertsAdapter(), GroupedGemmExpertsAdapter(),
    ExpertsInterfaceAdapter(),
)
_LOOKS_LIKE_EXPERTS = re.compile(r"(Experts|MoE|Moe|MoA)$")


def find_experts(model: torch.nn.Module) -> list[ExpertsLayer]:
    """Every experts module of `model` in layer order, with its spec.

    Raises Unsupported for an experts module no adapter handles, and ValueError when there is none.
    """
    layers: list[ExpertsLayer] = []
    for name, module in model.named_modules():
        if any(name.startswith(layer.name + ".") for layer in layers):
            continue  # inside an experts module already taken
        for adapter in ADAPTERS:
            spec = adapter.spec(name, module, model)
            if spec is not None:
                layers.append(ExpertsLayer(name, module, adapter, spec))
                break
    _refuse_lookalikes(model, layers)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no MoE experts modules: DWDP distributes MoE experts and has nothing to "
            "do for a dense model"
        )
    return layers


def _refuse_lookalikes(model: torch.nn.Module, layers: list[ExpertsLayer]) -> None:
    """Raise Unsupported for the first module named like experts that sits in no MoE block dwdp took."""
    taken = [layer.name for layer in layers]

    def near_taken(name: str) -> bool:
        # Taken itself, around or inside taken experts, or in the MoE block that holds them (shared
        # experts next to the routed ones).
        return any(t == name or t.startswith(name + ".") or name.startswith(t + ".")
                   or (t.rpartition(".")[0] and name.startswith(t.rpartition(".")[0] + ".")) for t in taken)

    lookalikes = [
        (name, module) for name, module in model.named_modules()
        if name and _LOOKS_LIKE_EXPERTS.search(type(module).__name__) and not near_taken(name)
        and any(True for _ in module.parameters())
    ]
    outermost = [(n, m) for n, m in lookalikes if not any(n.startswith(o + ".") for o, _ in lookalikes)]
    if outermost:
        name, module = outermost[0]
        error = _diagnose(name, module)
        others = sorted({type(m).__name__ for _, m in outermost[1:]} - {error.class_name})
        if others:
            error.args = (f"{error.args[0]}; also not wrapped: {', '.join(others)}",)
        raise error


def _diagnose(name: str, module: torch.nn.Module) -> Unsupported:
    """Why an experts-like module cannot be wrapped: its stacked weights' interface, or no stacked weights."""
    for sub_name, sub in module.named_modules():
        stacked = [(n, p) for n, p in sub.named_parameters(recurse=False) if p.dim() == 3]
        if stacked:
            where = f"{sub_name}.{stacked[0][0]}" if sub_name else stacked[0][0]
            args = ", ".join(forward_args(sub))
            return Unsupported(
                name, module, where,
                f"{list(stacked[0][1].shape)} is driven by {type(sub).__name__}.forward({args}), not by the experts "
                f"interface ({', '.join(STANDARD_ARGS)})",
            )
    # Prefer a tensor with one row per expert: that is where the experts' weights are.
    matrices = [(n, p) for n, p in module.named_parameters() if p.dim() == 2]
    per_expert = [(n, p) for n, p in matrices if p.shape[0] == getattr(module, "num_experts", None)]
    flat = (per_expert or matrices or [None])[0]
    what = f"{flat[0]} is {list(flat[1].shape)}" if flat else "no parameter is"
    return Unsupported(name, module, flat[0] if flat else "parameters",
                       f"({what}): its experts are not stacked [num_experts, out, in] weights")


def route_experts(model: torch.nn.Module, layers: list[ExpertsLayer], name: str, fn: ExpertsFunction) -> None:
    """Make every experts module of `layers` run `fn`: decorated ones through transformers' experts
    registry (`name` becomes a valid experts implementation), the others on the instance."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    registry = {id(layer) for layer in layers if layer.adapter.routes_through_registry(layer)}
    if registry:
        ALL_EXPERTS_FUNCTIONS.register(name, fn)
        model.set_experts_implementation(name)
    for layer in layers:
        config = getattr(layer.module, "config", None)
        if id(layer) in registry and getattr(config, "_experts_implementation", None) == name:
            continue
        layer.adapter.install(layer, model, fn)


__all__ = ["ADAPTERS", "ExpertsAdapter", "ExpertsLayer", "Unsupported", "find_experts", "route_experts"]
