"""The experts path in composite mode: each experts module's stacked tensors are its layer's composite
views (dwdp.runtime.composite; host backend: dwdp.runtime.transport.host_composite; cuda backend, not yet
run on a GPU: dwdp.runtime.transport.cuda_vmm through CudaTransport), so the model's own
experts implementation runs on them unchanged once the layer's copies have landed.

Legend: T = tokens, k = experts per token, H = hidden, E = experts.

Per layer: `begin` (issue this layer's copies if needed and the next layer's), wait for every copy of
this layer, run the experts implementation the model was set to before wrapping (transformers'
registry: "grouped_mm", "batched_mm", "eager", ...), release the slot. Layers the registry does not
drive (adapters' own interfaces, quantized experts classes with a registry of their own) run dwdp's
plain-PyTorch path (dwdp.runtime.experts) over per-expert views of the same composite tensors.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from functools import lru_cache

import torch

from dwdp.observe import phases
from dwdp.observe.tracing import now_us
from dwdp.runtime.composite import build_composite_plan
from dwdp.runtime.experts import dwdp_experts_forward
from dwdp.runtime.placement import Placement

log = logging.getLogger("dwdp")


class CompositePlanCache:
    """PlanCache for composite views: the plan of (layer, slot) writes into the layer's views, and
    the slot is always the layout's for that layer."""

    def __init__(self, layouts, rank: int, slice_bytes: int):
        self.layouts, self.rank, self.slice_bytes = layouts, rank, slice_bytes
        self.placement: Placement = layouts[rank].placement
        self.sources = self.placement.source[rank]
        self.get = lru_cache(maxsize=None)(self._build)

    def _build(self, layer: int, slot: int):
        want = self.layouts[self.rank].slot(layer)
        if slot != want:
            raise ValueError(f"composite layer {layer} is backed by pool slot {want}, not slot {slot}")
        return build_composite_plan(self.layouts, self.rank, layer, self.slice_bytes, self.sources)

    def set_sources(self, sources: tuple[int, ...]) -> None:
        """Read each expert from `sources[e]` from now on (NO_SOURCE: nowhere); drops every plan."""
        self.sources = tuple(sources)
        self.get.cache_clear()


def own_experts_function(module: torch.nn.Module, implementation: str | None) -> Callable | None:
    """What transformers' experts registry runs for `module` under `implementation` (the model's
    setting before wrapping), or None when the module's forward is not the registry's dispatch."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    original = getattr(type(module).forward, "__wrapped__", None)
    if original is None:
        return None
    if implementation in (None, "eager"):
        return original
    return ALL_EXPERTS_FUNCTIONS.get_interface(implementation, original)


def composite_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                              top_k_weights: torch.Tensor) -> torch.Tensor:
    """hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k] -> [T, H], through the model's own
    experts implementation on the composite views (or dwdp's reference path where it has none)."""
    own = getattr(self, "_dwdp_own_experts", None)
    if own is None:
        return dwdp_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    runtime = self._dwdp_runtime
    prefetcher = runtime.prefetcher
    recorder, nvtx = prefetcher.recorder, prefetcher.nvtx
    start = now_us() if recorder is not None else 0.0
    if nvtx is not None:
        nvtx.push(phases.MOE_COMPUTE, runtime.layer)
    try:
        slot = prefetcher.begin(runtime.layer, top_k_index)
        try:
            prefetcher.wait(runtime.layer, slot)
            out = own(self, hidden_states, top_k_index, top_k_weights)  # [T, H]
        finally:
            prefetcher.release(slot)
    finally:
        if nvtx is not None:
            nvtx.pop()
    if recorder is not None:
        recorder.complete(phases.MOE_COMPUTE, start, now_us(), layer=runtime.layer, iteration=recorder.iteration)
    return out
