"""Experts paths: how a rank holds its experts and reads them in a forward. Resolved once per rank
(`resolve_experts_path`, with the reason for every fallback); the object owns what its path needs.

Legend: E = experts per MoE layer, L = local experts per rank, M = MoE layers, B = prefetch slots
(DWDPConfig.num_buffers).

- `CompositePath` ("composite"): each (layer, expert tensor) is one plain [E, ...] tensor, its local
  experts the rank's own segment pages mapped in place and its remote experts pool pages the prefetch
  fills (dwdp.runtime.composite; the transport maps them: host mmap, CUDA cuMem). The model's own
  experts implementation runs on the views.
- `TablesPath` ("triton", "triton_fp8", "reference"): the local experts are [L, ...] views of the
  segment, the remote ones land in B prefetch slots, and per-slot weight tables list where each expert
  lives; our multi-buffer kernel (or the plain-PyTorch reference) reads them.

Both have the same small interface, in setup order: `alloc_segment`, `offset_in_peer` (where a peer
keeps an expert: what a rejoining rank reads), `fill` (one layer's local experts into the segment, the
module pointed at them), `plans` / `slot_buffers` / `prefetch_kwargs` (what the Prefetcher runs),
`install` (tables and the experts function on every layer), `memory` and `describe` (what the log line
and /health report).
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from dwdp.models.adapters import ExpertsLayer, route_experts
from dwdp.runtime.composite import composite_layouts
from dwdp.runtime.composite_experts import CompositePlanCache, composite_experts_forward, own_experts_function
from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.experts import EXPERTS_IMPLEMENTATION, LayerRuntime, LayerTables, dwdp_experts_forward
from dwdp.runtime.experts_kernel import choose_experts_kernel, epilogue_of, kernel_weight_tables
from dwdp.runtime.placement import Placement
from dwdp.runtime.plan import PlanCache, SegmentLayout, arrival_order, slot_layout
from dwdp.runtime.transport.base import Transport

log = logging.getLogger("dwdp")

ExpertSource = Callable[[str, str, torch.Tensor], torch.Tensor]
"""(experts module name, expert tensor name, expert ids [n]) -> [n, *shape]: that tensor of those experts."""


def resolve_experts_path(config: DWDPConfig, layers: list[ExpertsLayer], placement: Placement, rank: int,
                         transport: Transport, device: torch.device) -> "ExpertsPath":
    """The experts path this rank runs: composite views where config.experts_kernel is "composite"
    (ValueError naming why where the transport cannot build them) or "auto" and the transport can (one
    log line naming why when it cannot); else the tables path with the kernel choose_experts_kernel picks
    ("auto" and "composite" ask it for its default)."""
    requested = config.experts_kernel
    if requested in ("auto", "composite"):
        reason = transport.composite_unavailable()
        if reason is None:
            return CompositePath(config, layers, placement, rank, transport)
        if requested == "composite":
            raise ValueError(f"experts_kernel='composite' cannot run here: {reason}")
        log.info("rank %d: composite views unavailable (%s); using the multi-buffer experts path", rank, reason)
    kernel = choose_experts_kernel("auto" if requested == "composite" else requested, device, layers)
    return TablesPath(config, layers, placement, rank, transport, kernel)


def _read_replicated(layer: ExpertsLayer, source: ExpertSource) -> None:
    """Tensors every rank keeps whole, read from the source where the module holds none yet (meta skeleton)."""
    spec = layer.spec
    for tensor in spec.replicated:
        if tensor.stored(layer.module).is_meta:
            full = source(layer.name, tensor.name, torch.arange(spec.num_experts))  # [E, *shape]
            tensor.replace(layer.module, full.reshape(tensor.stored_shape(spec.num_experts)).clone())


def _check_source_shape(layer: ExpertsLayer, tensor, src: torch.Tensor, want: tuple) -> None:
    if tuple(src.shape) != tuple(want):
        raise ValueError(f"{layer.name}: expert source gave {tensor.name} of shape {tuple(src.shape)}, "
                         f"expected {tuple(want)}")


class ExpertsPath(ABC):
    """One rank's way of holding and reading experts (see the module docstring)."""

    name: str     # "composite" or "tables"
    kernel: str   # what runs the experts: "composite", "triton", "triton_fp8" or "reference"

    def __init__(self, config: DWDPConfig, layers: list[ExpertsLayer], placement: Placement, rank: int,
                 transport: Transport):
        self.config, self.layers, self.placement, self.rank, self.transport = config, layers, placement, rank, transport
        self.moving = layers[0].spec.moving
        self.views = None  # composite views, where the path has them

    @abstractmethod
    def alloc_segment(self) -> torch.Tensor:
        """This rank's source segment (uint8), from the transport."""

    @abstractmethod
    def offset_in_peer(self, peer: int, layer: int, expert: int, tensor: int) -> int:
        """Byte offset of `expert`'s tensor `tensor` of MoE layer `layer` in rank `peer`'s segment."""

    @abstractmethod
    def fill(self, index: int, layer: ExpertsLayer, segment: torch.Tensor, local_ids: torch.Tensor,
             source: ExpertSource) -> None:
        """Copy this rank's experts of MoE layer `index` into the segment and point the module at them."""

    @abstractmethod
    def plans(self):
        """The plan cache the Prefetcher issues from (get(layer, slot) -> CopyPlan)."""

    @abstractmethod
    def slot_buffers(self) -> list[torch.Tensor]:
        """The B prefetch slot buffers the Prefetcher hands the transport (composite: empty tensors whose
        device places the routing table)."""

    def prefetch_kwargs(self) -> dict:
        """Extra Prefetcher arguments (composite: slots tied to layers, copies into the views)."""
        return {}

    def first_slot(self) -> int:
        return 0

    @abstractmethod
    def install(self, model: torch.nn.Module, prefetcher, position: torch.Tensor, table_order: list[int],
                buffers: list[torch.Tensor]) -> None:
        """Every layer's LayerRuntime (weight tables per slot, the kernel's tables) and the experts function."""

    @abstractmethod
    def memory(self) -> tuple[int, int]:
        """(bytes of this rank's local experts, bytes of its prefetch buffers)."""

    @abstractmethod
    def describe(self) -> str:
        """The path in the setup's log line."""


class CompositePath(ExpertsPath):
    """Composite views (the model's own experts implementation on plain [E, ...] tensors)."""

    name = kernel = "composite"

    def __init__(self, config, layers, placement, rank, transport):
        super().__init__(config, layers, placement, rank, transport)
        # Natural sizes, no padding: each view is the unwrapped model's contiguous [E, ...] tensor; pages of
        # the transport's granularity (peers check theirs match at open).
        self.layouts = composite_layouts(placement, len(layers), tuple(t.nbytes for t in self.moving),
                                         transport.granularity(), config.num_buffers)
        self.layout = self.layouts[rank]

    def alloc_segment(self) -> torch.Tensor:
        segment = self.transport.alloc_segment(self.layout.segment_nbytes,
                                               tuple(a.nbytes for a in self.layout.segment_allocations))
        self.views = self.transport.composite_views(self.layout)  # closed with the transport
        return segment

    def offset_in_peer(self, peer: int, layer: int, expert: int, tensor: int) -> int:
        return self.layouts[peer].segment_offset(layer, expert, tensor)

    def fill(self, index, layer, segment, local_ids, source) -> None:
        """The local experts at their composite offsets; the module's [E, ...] tensors become the views
        (local experts in place, the rest filled by the prefetch)."""
        spec = layer.spec
        for t_index, tensor in enumerate(spec.moving):
            src = source(layer.name, tensor.name, local_ids)  # [L, *shape]
            _check_source_shape(layer, tensor, src, (len(local_ids), *tensor.shape))
            for i, expert in enumerate(local_ids.tolist()):
                at = self.layout.segment_offset(index, expert, t_index)
                segment[at:at + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(src[i])
            full = self.views.view(index, t_index, tensor.dtype, tensor.stored_shape(spec.num_experts))
            tensor.replace(layer.module, full)  # dropping the stacked tensor frees the non-local experts
        _read_replicated(layer, source)

    def plans(self):
        return CompositePlanCache(self.layouts, self.rank, self.config.slice_bytes_for(self.transport.name))

    def slot_buffers(self) -> list[torch.Tensor]:
        # Empty: only their device matters (the routing's position table goes there). A meta skeleton
        # (from_pretrained) runs on the CPU, where the host backend's memory is.
        device = self.moving[0].stored(self.layers[0].module).device
        where = torch.device("cpu") if device.type == "meta" else device
        return [torch.empty(0, dtype=torch.uint8, device=where) for _ in range(self.config.num_buffers)]

    def prefetch_kwargs(self) -> dict:
        # The copies write into each layer's views; the slot only tells which pool pages they use.
        views = self.views
        return dict(slot_of_layer=self.layout.slot, buffer_of=lambda layer, slot: views.layer_range(layer))

    def first_slot(self) -> int:
        return self.layout.slot(0)

    def install(self, model, prefetcher, position, table_order, buffers) -> None:
        implementation = getattr(getattr(model, "config", None), "_experts_implementation", None)
        for index, layer in enumerate(self.layers):
            # Every slot reads the same views: the layer's pages are fixed, the slot is the pool's.
            E = layer.spec.num_experts
            tables: LayerTables = {t.name: [t.stacked(layer.module, E)[e] for e in table_order]
                                   for t in layer.spec.tensors}
            if layer.adapter.routes_through_registry(layer):
                layer.module._dwdp_own_experts = own_experts_function(layer.module, implementation)
            layer.module._dwdp_runtime = LayerRuntime(
                index, self.placement.num_local_experts, position, tuple(table_order), [tables] * len(buffers),
                layer.spec.math, prefetcher, None, None)
        route_experts(model, self.layers, EXPERTS_IMPLEMENTATION, composite_experts_forward)

    def memory(self) -> tuple[int, int]:
        # The views span every expert (not dense bytes); only the local ones are this rank's segment.
        return self.layout.segment_nbytes, self.layout.pool_nbytes

    def describe(self) -> str:
        return f"composite views ({self.transport.name}: {self.transport.describe_mapping()})"


class TablesPath(ExpertsPath):
    """Local experts as [L, ...] segment views, remote ones in prefetch slots, per-slot weight tables for
    the multi-buffer kernel (or the reference)."""

    name = "tables"

    def __init__(self, config, layers, placement, rank, transport, kernel: str):
        super().__init__(config, layers, placement, rank, transport)
        self.kernel = kernel
        tensor_nbytes = tuple(t.stride_bytes for t in self.moving)  # one expert's block of each moving tensor
        self.segment_layout = SegmentLayout(len(layers), placement.num_local_experts, tensor_nbytes)
        self.slots = slot_layout(placement, rank, tensor_nbytes)

    def alloc_segment(self) -> torch.Tensor:
        return self.transport.alloc_segment(self.segment_layout.total_nbytes)

    def offset_in_peer(self, peer: int, layer: int, expert: int, tensor: int) -> int:
        return self.segment_layout.offset(layer, self.placement.local_experts(peer).index(expert), tensor)

    def fill(self, index, layer, segment, local_ids, source) -> None:
        """The local experts into their [L, ...] block of the segment; the module points at it."""
        for t_index, tensor in enumerate(layer.spec.moving):
            view = tensor.views_in(segment, self.segment_layout.tensor_offset(index, t_index), len(local_ids))
            src = source(layer.name, tensor.name, local_ids)  # [L, *shape]
            _check_source_shape(layer, tensor, src, view.shape)
            view.copy_(src)
            tensor.replace(layer.module, view)  # dropping the stacked [E, ...] tensor frees the non-local experts
        _read_replicated(layer, source)

    def plans(self):
        return PlanCache(self.placement, self.rank, self.segment_layout, self.config.slice_bytes_for(self.transport.name))

    def slot_buffers(self) -> list[torch.Tensor]:
        return [self.transport.alloc_slot(self.slots.total_nbytes) for _ in range(self.config.num_buffers)]

    def _layer_tables(self, layer: ExpertsLayer, buffer: torch.Tensor, table_order: list[int]) -> LayerTables:
        """Each tensor's E per-expert views in table order for one prefetch slot `buffer`: local experts
        (the module's [L, ...] segment views), then the remote ones from their peer's block in the slot;
        tensors that stay on every rank are read from the module's full [E, ...] tensor."""
        spec, slots = layer.spec, self.slots
        num_local = len(table_order) - sum(len(x) for x in slots.experts_by_peer)
        tables: LayerTables = {}
        for t_index, tensor in enumerate(spec.moving):
            views = list(tensor.stored(layer.module).unbind(0))  # L local views
            remote = {}
            for p_index, experts_of_peer in enumerate(slots.experts_by_peer):
                block = tensor.views_in(buffer, slots.tensor_offset(p_index, t_index), len(experts_of_peer))
                remote.update(zip(experts_of_peer, block.unbind(0)))
            views.extend(remote[e] for e in table_order[num_local:])
            tables[tensor.name] = views
        for tensor in spec.replicated:
            full = tensor.stacked(layer.module, spec.num_experts)  # [E, *shape]
            tables[tensor.name] = [full[e] for e in table_order]
        return tables

    def install(self, model, prefetcher, position, table_order, buffers) -> None:
        for index, layer in enumerate(self.layers):
            tables = [self._layer_tables(layer, buf, table_order) for buf in buffers]
            kernel_tables, epilogue = None, None
            if self.kernel in ("triton", "triton_fp8"):
                kernel_tables = [kernel_weight_tables(layer.spec, t, self.kernel == "triton_fp8") for t in tables]
                epilogue = epilogue_of(layer)
            layer.module._dwdp_runtime = LayerRuntime(
                index, self.placement.num_local_experts, position, tuple(table_order), tables, layer.spec.math,
                prefetcher, kernel_tables, epilogue)
        route_experts(model, self.layers, EXPERTS_IMPLEMENTATION, dwdp_experts_forward)

    def memory(self) -> tuple[int, int]:
        return self.segment_layout.total_nbytes, self.config.num_buffers * self.slots.total_nbytes

    def describe(self) -> str:
        return f"{self.kernel} kernel"


def table_order(path: ExpertsPath, plans) -> list[int]:
    """Local experts, then the remote ones in the order their copies complete, so the experts landed at
    any moment are mostly a prefix of the table (exactly one on CUDA, where batches complete in order)."""
    remote_order = list(arrival_order(plans.get(0, path.first_slot())))
    return list(path.placement.local_experts(path.rank)) + remote_order


def position_table(path: ExpertsPath, order: list[int], device: torch.device) -> torch.Tensor:
    """[E + identity experts] long: expert id -> its place in `order` (identity experts last), on `device`."""
    spec = path.layers[0].spec
    num_experts, num_identity = spec.num_experts, spec.math.num_identity_experts
    position = torch.empty(num_experts + num_identity, dtype=torch.long)
    position[torch.tensor(order)] = torch.arange(num_experts)
    position[num_experts:] = torch.arange(num_experts, num_experts + num_identity)
    return position.to(device)  # indexed by the router's ids, on their device


__all__ = ["CompositePath", "ExpertSource", "ExpertsPath", "TablesPath", "position_table", "resolve_experts_path",
           "table_order"]
