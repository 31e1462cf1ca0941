"""DWDPModel: turn a finished transformers MoE model into one rank of a DWDP group.

Legend: E = experts per MoE layer, L = local experts per rank, M = MoE layers, B = prefetch slots.

Each rank keeps the dense weights and L experts per layer (in its shared source segment), frees
the other experts, and runs every MoE layer through the `dwdp` experts function, which reads
local experts in place and remote ones from a prefetch slot filled by copies from peers.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dwdp import envs
from dwdp.models.adapters import ExpertsLayer, find_experts, route_experts
from dwdp.runtime.config import DWDPConfig
from dwdp.models.expert_tensors import ExpertsSpec, place_biases
from dwdp.runtime.composite import CompositeLayout, composite_layouts
from dwdp.runtime.composite_experts import CompositePlanCache, composite_experts_forward, own_experts_function
from dwdp.runtime.experts import EXPERTS_IMPLEMENTATION, LayerRuntime, LayerTables, dwdp_experts_forward
from dwdp.runtime.experts_kernel import (TOP_K_FORMS, choose_experts_kernel, compiled_specialisations, epilogue_of,
                             kernel_weight_tables, routing_top_k)
from dwdp.runtime.failover import Failover, FailoverStatus
from dwdp.runtime.group import DWDPGroup, init_group
from dwdp.runtime.board import Board
from dwdp.runtime.liveness import LivenessRecord, PeerLiveness, close_records, exchange_records, heartbeat_period
from dwdp.runtime.placement import build_placement
from dwdp.runtime.plan import PlanCache, SegmentLayout, arrival_order, slot_layout
from dwdp.runtime.prefetch import Prefetcher
from dwdp.runtime.rejoin import PeerEntries, live_owner_of_each, peer_source
from dwdp.observe.nvtx_ranges import NvtxRanges
from dwdp.observe.tracing import TraceRecorder, attach_nvtx_hooks, attach_phase_hooks
from dwdp.runtime.transport import make_transport, resolve_backend
from dwdp.runtime.transport.host_composite import HostCompositeViews, composite_unsupported_reason, page_size
from dwdp.runtime.wrapping import ModelWrapper, dense_bytes, dense_checksum

log = logging.getLogger("dwdp")


@dataclass(frozen=True)
class MemoryReport:
    """Bytes this rank holds, against what the unwrapped model needed."""

    full_expert_bytes: int      # every expert of every MoE layer
    local_expert_bytes: int     # this rank's local experts (its source segment)
    prefetch_buffer_bytes: int  # all prefetch slots
    dense_bytes: int            # every other parameter and buffer

    @property
    def resident_expert_bytes(self) -> int:
        return self.local_expert_bytes + self.prefetch_buffer_bytes

    @property
    def saved_bytes(self) -> int:
        return self.full_expert_bytes - self.resident_expert_bytes


ExpertSource = Callable[[str, str, torch.Tensor], torch.Tensor]
"""(experts module name, expert tensor name, expert ids [n]) -> [n, *shape]: that tensor of those experts."""


def _module_source(layers: list[ExpertsLayer]) -> ExpertSource:
    by_name = {layer.name: layer for layer in layers}

    def read(name: str, tensor: str, ids: torch.Tensor) -> torch.Tensor:
        layer = by_name[name]
        return layer.spec.tensor(tensor).stacked(layer.module, layer.spec.num_experts).detach()[ids]

    return read



def _bias_report(spec: ExpertsSpec) -> str | None:
    """"replicated" or "moved with experts" for a layer with biases, None without."""
    if not spec.math.biases:
        return None
    return "moved with experts" if spec.tensor(spec.math.biases[0]).moves else "replicated"


def _layer_tables(layer: ExpertsLayer, slots, buffer: torch.Tensor, table_order: list[int]) -> LayerTables:
    """Each tensor's E per-expert views in table order for one prefetch slot `buffer`: local experts
    (the module's [L, ...] segment views), then the remote ones from their peer's block in the slot;
    tensors that stay on every rank are read from the module's full [E, ...] tensor."""
    spec = layer.spec
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


def check_same_dense_as_peers(rank: int, checksum: int, peers: "PeerEntries") -> None:
    """ValueError when a rejoining rank's dense-weight checksum differs from its live peers'."""
    differ = {r: e["dense_checksum"] for r, e in enumerate(peers.entries)
              if e is not None and e["dense_checksum"] != checksum}
    if differ:
        raise ValueError(f"rank {rank} rejoins with dense (non-expert) weights of checksum {checksum:#018x}, but ranks "
                         f"{sorted(differ)} hold {sorted({f'{c:#018x}' for c in differ.values()})}: a replacement must "
                         "load the same model as its group (same checkpoint, same seed)")


def check_same_dense(checksums: list[int]) -> None:
    """ValueError naming the ranks whose dense-weight checksum differs from the most common one."""
    by_value: dict[int, list[int]] = {}
    for rank, checksum in enumerate(checksums):
        by_value.setdefault(checksum, []).append(rank)
    if len(by_value) == 1:
        return
    groups = sorted(by_value.values(), key=lambda ranks: (-len(ranks), ranks))
    odd = sorted(r for ranks in groups[1:] for r in ranks)
    where = "; ".join(f"ranks {ranks}: {value:#018x}" for value, ranks in
                      sorted(by_value.items(), key=lambda item: (-len(item[1]), item[1])))
    raise ValueError(f"ranks {odd} hold different dense (non-expert) weights from ranks {groups[0]} (checksums "
                     f"{where}): every rank of a DWDP group must load the same model (same checkpoint, same seed)")


def composite_unavailable(backend: str, mapping: str | None = None) -> str | None:
    """Why composite views cannot be built on `backend` (cuda: with peer `mapping`) here, or None
    when they can."""
    if backend == "cuda":
        if mapping in ("vmm-posix-fd", "vmm-fabric"):
            return None
        return (f"the cuda backend maps peers with {mapping!r}; composite views need cuMem allocations "
                "(VMM export refused on some rank, or cuda_mapping set to another mapping)")
    if backend != "host":
        return f"composite views are built on the host and cuda backends only, not {backend!r}"
    return composite_unsupported_reason()


def _choose_composite(requested: str, backend: str, rank: int, mapping: str | None = None) -> bool:
    """Whether this rank runs in composite mode: always for "composite" (an error where it cannot),
    under "auto" where the backend builds composite views (one log line when it falls back)."""
    if requested not in ("auto", "composite"):
        return False
    reason = composite_unavailable(backend, mapping)
    if reason is None:
        return True
    if requested == "composite":
        raise ValueError(f"experts_kernel='composite' cannot run here: {reason}")
    log.info("rank %d: composite views unavailable (%s); using the multi-buffer experts path", rank, reason)
    return False


def _composite_tables(layer: ExpertsLayer, table_order: list[int]) -> LayerTables:
    """Each tensor's E per-expert views in table order, all read from the module's [E, ...] tensors
    (composite views for the moving ones)."""
    E = layer.spec.num_experts
    return {t.name: [t.stacked(layer.module, E)[e] for e in table_order] for t in layer.spec.tensors}


def _cuda_mapping(requested: str, experts_kernel: str, group: DWDPGroup, device: torch.device) -> str:
    """How the cuda backend maps peers' segments (POSIX fds ran on one H200; fabric not yet run on a GPU).

    "auto" or "vmm" with a composite-capable experts_kernel ("auto", "composite"): each rank probes
    what its device exports (cuda_vmm.choose_mapping: fabric with an IMEX channel, else POSIX fd,
    else CUDA IPC, one log line) and one all-gather settles the group on what every rank can do:
    fabric handles when all ranks have them and a trial import crosses every pair (one node or several
    NVL72 trays), POSIX fds when all ranks export and share this host, else CUDA IPC on one host and
    symmetric memory across hosts.
    """
    from dwdp.runtime.transport import cuda as cuda_transport

    if requested not in ("auto", "vmm"):
        return requested
    if group.rejoining:  # the group settled long ago, and a rejoining rank joins no all-gather
        return _mapping_on_board(group)
    local = "ipc"
    if experts_kernel in ("auto", "composite"):
        local = cuda_transport.local_vmm_mapping(group.rank, device)
    answers = group.all_gather_object((socket.gethostname(), local))
    hosts, choices = {h for h, _ in answers}, {c for _, c in answers}
    if choices == {"vmm-fabric"}:
        refusals = cuda_transport.fabric_import_refusals(group.rank, device, group.all_gather_object)
        if not refusals:
            return "vmm-fabric"
        log.warning("rank %d: fabric handles do not cross the group (%s); falling back to %s", group.rank,
                    "; ".join(refusals), "POSIX fds" if len(hosts) == 1 else "another mapping")
        choices = {"vmm-posix-fd"}
    if len(hosts) == 1:
        return "vmm-posix-fd" if "ipc" not in choices else "ipc"
    if requested == "vmm":
        raise ValueError(f"cuda_mapping='vmm' across {len(hosts)} hosts needs fabric handles on every rank; "
                         f"the ranks offer {sorted(choices)}")
    return "symmetric_memory"


def _mapping_on_board(group: DWDPGroup) -> str:
    """The cuda mapping a running group settled on, as its live ranks' board entries name it."""
    board = Board(group.group_id) if group.group_id else None
    entries = [board.read(r) for r in range(group.size) if r != group.rank] if board is not None else []
    mappings = sorted({e["segment"].get("mapping") for e in entries if e is not None})
    if len(mappings) != 1:
        raise ValueError(f"rank {group.rank} cannot rejoin on the cuda backend: the live entries on its group's board "
                         f"(group_id={group.group_id!r}) name the mappings {mappings}; expected the one its peers "
                         "share")
    return mappings[0]


class DWDPModel(ModelWrapper):
    """One rank of a DWDP group around `model`, called exactly like `model`.

    model: a transformers 5 MoE model (any family whose experts dwdp.models.adapters finds: see the family
        table of docs/models.md), on the CPU (host backend) or on this rank's CUDA device (cuda backend); it is
        modified in place (its non-local experts are freed).
    config: DWDPConfig, or the path of one saved as JSON (`dwdp tune` writes one); group_size None
        means the whole DWDP group passed in `group`.
    group: DWDPGroup; None joins the env:// world (torchrun) or, without one, a one-rank group.
    expert_source: where this rank's local experts come from (see ExpertSource); None reads them from
        the model's stacked parameters. A loader passes one that reads only local experts from a checkpoint,
        so a model whose experts are still on the meta device never materialises the others.
    trace: directory for this rank's `trace_rank{r}.json` (written on `close`); default
        DWDP_TRACE_DIR, and no recording at all when neither is set.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: DWDPConfig | str | os.PathLike | None = None,
        group: DWDPGroup | None = None,
        *,
        expert_source: ExpertSource | None = None,
        trace: str | None = None,
    ):
        super().__init__()
        if isinstance(config, (str, os.PathLike)):
            config = DWDPConfig.from_json(config)  # e.g. written by `dwdp tune`
        config = config or DWDPConfig()
        layers = find_experts(model)  # validates the model before any collective
        layers = [dataclasses.replace(layer, spec=place_biases(layer.spec, config.expert_biases)) for layer in layers]
        if group is None:
            group = init_group(config.group_size)
        if config.group_size is not None and config.group_size != group.size:
            raise ValueError(f"config.group_size={config.group_size} but the DWDP group has {group.size} ranks")
        first = layers[0]
        for layer in layers[1:]:
            if layer.spec.signature() != first.spec.signature():
                raise ValueError(
                    f"{layer.name} has experts {layer.spec.signature()}; expected {first.spec.signature()} like "
                    f"{first.name}: every MoE layer shares one segment layout"
                )
        num_experts = first.spec.num_experts
        moving = first.spec.moving
        placement = build_placement(num_experts, group.size, config.num_local_experts, config.expert_replicas)
        device = moving[0].stored(first.module).device
        backend = resolve_backend(config.backend, torch.device("cpu") if device.type == "meta" else device)
        timeout_s = envs.wait_timeout_s(config.wait_timeout_s)

        self.model = model
        self.dwdp_config = config
        self.group = group
        self.placement = placement
        self.backend = backend
        self.experts_layers = layers
        self.experts_modules = [layer.module for layer in layers]
        self.expert_biases = _bias_report(first.spec)
        mapping = _cuda_mapping(config.cuda_mapping, config.experts_kernel, group, device) \
            if backend == "cuda" else None
        use_composite = _choose_composite(config.experts_kernel, backend, group.rank, mapping)
        self.views = layouts = None

        tensor_nbytes = tuple(t.stride_bytes for t in moving)  # one expert's block of each moving tensor
        segment_layout = SegmentLayout(len(layers), placement.num_local_experts, tensor_nbytes)
        slots = slot_layout(placement, group.rank, tensor_nbytes)
        full_bytes = len(layers) * num_experts * sum(t.nbytes for t in first.spec.tensors)

        transport = make_transport(backend, group.rank, config, device=device, mapping=mapping or "ipc",
                                   process_group=group.process_group)
        self.transport = transport
        self._finalizer = weakref.finalize(self, transport.close)
        # The board is where a restarted rank and its peers find each other (segments a process started
        # later can open: the host's, CUDA IPC and cuMem exports).
        board = Board(group.group_id) if group.group_id and group.size > 1 and transport.can_rejoin else None
        if group.rejoining and board is None:
            transport.close()
            raise ValueError(f"rank {group.rank} cannot rejoin: the {backend} backend"
                             f"{f' with mapping {mapping!r}' if mapping else ''} has no board "
                             f"(group_id={group.group_id!r}, size {group.size})")
        if use_composite:
            # Natural sizes, no padding: each view is the unwrapped model's contiguous [E, ...] tensor.
            # Pages: the host's, or the device's cuMem granularity (peers check theirs match at open).
            granularity = page_size() if backend == "host" else transport.granularity()
            layouts = composite_layouts(placement, len(layers), tuple(t.nbytes for t in moving), granularity,
                                        config.num_buffers)
        record = liveness = None
        lost_at_start: dict[int, str] = {}
        self.expert_source_used = "model" if expert_source is None else "given"  # "peers" when rejoining
        try:
            local_ids = torch.tensor(placement.local_experts(group.rank))
            source = expert_source or _module_source(layers)
            checksum = dense_checksum(model, self.experts_modules)
            if use_composite:
                layout = layouts[group.rank]
                if backend == "cuda":
                    # One cuMem allocation per local extent: the driver maps allocations whole, at offset 0.
                    segment = transport.alloc_segment(layout.segment_nbytes,
                                                      tuple(a.nbytes for a in layout.segment_allocations))
                    self.views = transport.composite_views(layout)  # closed with the transport
                else:
                    segment = transport.alloc_segment(layout.segment_nbytes)
                    fd = transport.segment_fd()
                    try:
                        self.views = HostCompositeViews(layout, fd)
                    finally:
                        os.close(fd)

                def offset_in_peer(peer: int, layer: int, expert: int, tensor: int) -> int:
                    return layouts[peer].segment_offset(layer, expert, tensor)
            else:
                segment = transport.alloc_segment(segment_layout.total_nbytes)

                def offset_in_peer(peer: int, layer: int, expert: int, tensor: int) -> int:
                    return segment_layout.offset(layer, placement.local_experts(peer).index(expert), tensor)
            if group.rejoining:
                peers = PeerEntries.read(board, group.rank, group.size)
                check_same_dense_as_peers(group.rank, checksum, peers)
                transport.open(peers.segments(transport.register()))
                record = LivenessRecord(envs.shm_dir(), heartbeat_period(config.peer_timeout_s))
                liveness = PeerLiveness(group.rank, peers.records(), config.peer_timeout_s)
                lost_at_start = {r: f"rank {r} had no live entry on the board when rank {group.rank} rejoined"
                                 for r in peers.missing}
                owner_of = live_owner_of_each(placement, group.rank, peers.live)
                if owner_of is not None:  # a memory copy beats reading the checkpoint: see dwdp.runtime.rejoin
                    source = peer_source(layers, offset_in_peer, owner_of, transport.peer_segment, source)
                    self.expert_source_used = "peers"
            for index, layer in enumerate(layers):
                if use_composite:
                    self._fill_composite(index, layer, segment, layout, self.views, local_ids, source)
                else:
                    self._fill_local(index, layer, segment, segment_layout, local_ids, source)
            if not group.rejoining:
                # The one setup exchange also carries a checksum of the dense weights: ranks that loaded
                # different models (another seed, another checkpoint) would compute wrong logits silently.
                exchanged = group.all_gather_object((transport.register(), checksum))
                check_same_dense([c for _, c in exchanged])
                transport.open([handle for handle, _ in exchanged])
                record, liveness = exchange_records(group, envs.shm_dir(), config.peer_timeout_s)
                group.barrier()  # every peer has mapped our segment and record: their names can go
            board_entry = transport.board_handle() if board is not None else None  # before seal: exports it keeps
            transport.seal()
            if record is not None:
                record.seal()
                record.start()
            if board is not None:
                board.publish(group.rank, board_entry, record.board_handle(), checksum)
        except BaseException:
            transport.close()
            close_records(record, liveness)
            raise
        self._liveness_finalizer = weakref.finalize(self, close_records, record, liveness)
        self._board_finalizer = weakref.finalize(self, board.withdraw, group.rank) if board is not None else None

        if use_composite:
            # The copies write into each layer's views; the slot only tells which pool pages they use.
            views = self.views
            # Empty: only their device matters (the routing's position table goes there).
            # A meta skeleton (from_pretrained) runs on the CPU, where the host backend's memory is.
            where = torch.device("cpu") if device.type == "meta" else device
            slot_buffers = [torch.empty(0, dtype=torch.uint8, device=where) for _ in range(config.num_buffers)]
            plans = CompositePlanCache(layouts, group.rank, config.slice_bytes_for(backend))
            prefetch_kwargs = dict(slot_of_layer=layouts[group.rank].slot,
                                   buffer_of=lambda layer, slot: views.layer_range(layer))
        else:
            slot_buffers = [transport.alloc_slot(slots.total_nbytes) for _ in range(config.num_buffers)]
            plans = PlanCache(placement, group.rank, segment_layout, config.slice_bytes_for(backend))
            prefetch_kwargs = {}
        # A lost peer is a plan change made here, from this rank's own view: never a collective.
        self.failover = Failover(placement, group.rank, plans, transport, liveness, config.peer_timeout_s, record,
                                 board)
        self.failover.declare_lost(lost_at_start)
        self.prefetcher = Prefetcher(transport, plans, slot_buffers, len(layers), timeout_s, self.failover,
                                     **prefetch_kwargs)
        slot0 = layouts[group.rank].slot(0) if use_composite else 0

        # Remote experts in the order their copies complete, so the ones landed at any moment are
        # mostly a prefix of the table (exactly one on CUDA, where batches complete in order).
        remote_order = list(arrival_order(plans.get(0, slot0)))
        table_order = list(placement.local_experts(group.rank)) + remote_order
        num_identity = first.spec.math.num_identity_experts
        position = torch.empty(num_experts + num_identity, dtype=torch.long)
        position[torch.tensor(table_order)] = torch.arange(num_experts)
        position[num_experts:] = torch.arange(num_experts, num_experts + num_identity)  # identity experts last
        position = position.to(slot_buffers[0].device)  # indexed by the router's ids, on their device
        if use_composite:
            self.experts_kernel = "composite"
            implementation = getattr(getattr(model, "config", None), "_experts_implementation", None)
        else:
            self.experts_kernel = choose_experts_kernel(
                "auto" if config.experts_kernel == "composite" else config.experts_kernel, device, layers)
        for index, layer in enumerate(layers):
            if use_composite:
                # Every slot reads the same views: the layer's pages are fixed, the slot is the pool's.
                tables = [_composite_tables(layer, table_order)] * len(slot_buffers)
                if layer.adapter.routes_through_registry(layer):
                    layer.module._dwdp_own_experts = own_experts_function(layer.module, implementation)
            else:
                tables = [_layer_tables(layer, slots, buf, table_order) for buf in slot_buffers]
            kernel_tables, epilogue = None, None
            if self.experts_kernel in ("triton", "triton_fp8"):
                fp8_dots = self.experts_kernel == "triton_fp8"
                kernel_tables = [kernel_weight_tables(layer.spec, t, fp8_dots) for t in tables]
                epilogue = epilogue_of(layer)
            layer.module._dwdp_runtime = LayerRuntime(
                index, placement.num_local_experts, position, tuple(table_order), tables, layer.spec.math,
                self.prefetcher, kernel_tables, epilogue,
            )

        route_experts(model, layers, EXPERTS_IMPLEMENTATION,
                      composite_experts_forward if use_composite else dwdp_experts_forward)
        self._hooks = [model.register_forward_pre_hook(lambda *_: self.prefetcher.start_forward()),
                       model.register_forward_hook(lambda *_: self.prefetcher.end_forward())]
        if backend == "cuda":
            self.prefetcher.nvtx = NvtxRanges()
            self._hooks += attach_nvtx_hooks(model, self.prefetcher.nvtx, [layer.name for layer in layers])
        self.recorder = None
        trace = trace or envs.trace_dir()
        if trace:
            plan_bytes = {layer: plans.get(layer, self.prefetcher.slot_of_visit(layer, layer)).nbytes
                          for layer in range(len(layers))}
            self.recorder = TraceRecorder(trace, group.rank, group.size, len(layers), plan_bytes)
            self.prefetcher.recorder = transport.recorder = self.recorder
            self._hooks.append(model.register_forward_pre_hook(lambda *_: self.recorder.begin_forward()))
            self._hooks.append(model.register_forward_hook(lambda *_: self.recorder.end_forward()))
            self._hooks += attach_phase_hooks(model, self.recorder, [layer.name for layer in layers])

        local_tensors = [t.stored(layer.module) for layer in layers for t in moving]
        if use_composite:
            # The views span every expert (not dense bytes); only the local ones are this rank's segment.
            local_bytes, buffer_bytes = layouts[group.rank].segment_nbytes, layouts[group.rank].pool_nbytes
        else:
            local_bytes, buffer_bytes = segment_layout.total_nbytes, config.num_buffers * slots.total_nbytes
        self.memory = MemoryReport(
            full_expert_bytes=full_bytes,
            local_expert_bytes=local_bytes,
            prefetch_buffer_bytes=buffer_bytes,
            dense_bytes=dense_bytes(model, local_tensors),
        )
        if not use_composite:
            mapping_line = f"{self.experts_kernel} kernel"
        elif backend == "cuda":
            mapping_line = (f"composite views (cuda: cuMemCreate segment + pool, peers through {mapping}, "
                            f"{layouts[group.rank].granularity} B granules)")
        else:
            mapping_line = (f"composite views ({backend}: /dev/shm segment + memfd pool, mmap MAP_FIXED, "
                            f"{page_size()} B pages)")
        log.info("rank %d/%d: %s backend, %s, biases %s, %s", group.rank, group.size, backend,
                 mapping_line, self.expert_biases, self.memory)

    @staticmethod
    def _fill_composite(index: int, layer: ExpertsLayer, segment: torch.Tensor, layout: CompositeLayout,
                        views, local_ids: torch.Tensor, source: ExpertSource) -> None:
        """Copy this rank's experts of `layer` into its segment at their composite offsets and point the
        module at the layer's [E, ...] views (local experts in place, the rest filled by the prefetch)."""
        spec = layer.spec
        for t_index, tensor in enumerate(spec.moving):
            src = source(layer.name, tensor.name, local_ids)  # [L, *shape]
            want = (len(local_ids), *tensor.shape)
            if tuple(src.shape) != want:
                raise ValueError(f"{layer.name}: expert source gave {tensor.name} of shape {tuple(src.shape)}, "
                                 f"expected {want}")
            for i, expert in enumerate(local_ids.tolist()):
                at = layout.segment_offset(index, expert, t_index)
                segment[at:at + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(src[i])
            full = views.view(index, t_index, tensor.dtype, tensor.stored_shape(spec.num_experts))
            tensor.replace(layer.module, full)  # dropping the stacked tensor frees the non-local experts
        for tensor in spec.replicated:
            if tensor.stored(layer.module).is_meta:
                full = source(layer.name, tensor.name, torch.arange(spec.num_experts))  # [E, *shape]
                tensor.replace(layer.module, full.reshape(tensor.stored_shape(spec.num_experts)).clone())

    @staticmethod
    def _fill_local(index: int, layer: ExpertsLayer, segment: torch.Tensor, layout: SegmentLayout,
                    local_ids: torch.Tensor, source: ExpertSource) -> None:
        """Copy this rank's experts of `layer` into its segment and point the module at them; read the
        tensors that stay on every rank too when the module does not hold them yet (meta skeleton)."""
        spec = layer.spec
        for t_index, tensor in enumerate(spec.moving):
            view = tensor.views_in(segment, layout.tensor_offset(index, t_index), len(local_ids))  # [L, *shape]
            src = source(layer.name, tensor.name, local_ids)
            if tuple(src.shape) != tuple(view.shape):
                raise ValueError(
                    f"{layer.name}: expert source gave {tensor.name} of shape {tuple(src.shape)}, "
                    f"expected {tuple(view.shape)}"
                )
            view.copy_(src)
            # Dropping the stacked [E, ...] tensor frees the non-local experts.
            tensor.replace(layer.module, view)
        for tensor in spec.replicated:
            if tensor.stored(layer.module).is_meta:
                full = source(layer.name, tensor.name, torch.arange(spec.num_experts))  # [E, *shape]
                tensor.replace(layer.module, full.reshape(tensor.stored_shape(spec.num_experts)).clone())

    @property
    def stats(self):
        return self.prefetcher.stats

    @property
    def compiles_after_warmup(self) -> int | None:
        """Experts-kernel specialisations compiled since `warmup()` (None before it): 0 while serving."""
        at_warmup = getattr(self, "compiled_at_warmup", None)
        return None if at_warmup is None else compiled_specialisations() - at_warmup

    def warmup(self, forward: bool = True) -> float:
        """Pay every first-call cost before serving; returns the seconds it took (also `warmup_s`).

        The Triton experts kernel compiles a specialisation the first time a launch meets it, which
        would stall whichever request met it first: every layer launches here in each form a forward
        can launch it (all experts at once, and local experts first then the rest) with the routing's
        top-k (or each form Triton distinguishes for it when the config does not say). forward: also run
        one forward of a short random prompt (the model's own first-call costs: library handles, caches).
        """
        from dwdp.runtime.experts import warm_kernel

        start = time.perf_counter()
        embeddings = self.model.get_input_embeddings().weight  # [V, H]: the activations' dtype and device
        calls = 0
        if self.experts_kernel in ("triton", "triton_fp8"):
            top_k = routing_top_k(self.model)
            for layer in self.experts_layers:
                for k in (top_k,) if top_k else TOP_K_FORMS:
                    calls += warm_kernel(layer.module._dwdp_runtime, embeddings.dtype, k)
        if forward:
            ids = torch.randint(3, embeddings.shape[0], (1, 16), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                self(input_ids=ids.to(embeddings.device))
        if embeddings.device.type == "cuda":
            torch.cuda.synchronize()
        self.compiled_at_warmup = compiled_specialisations()
        self.warmup_s = time.perf_counter() - start
        log.info("rank %d: warm in %.2f s (%d experts-kernel calls%s)", self.group.rank, self.warmup_s, calls,
                 ", one forward" if forward else "")
        return self.warmup_s

    def check_peers(self) -> FailoverStatus:
        """Read the peers' liveness now (forwards also do, as they start), re-plan around any loss,
        take back lost peers that rejoined as new processes (at once between forwards; at the next
        forward's start while one runs), and return what this rank knows: lost and stalled peers,
        rejoined peers (`rejoins`: peer -> times) and those found but not yet in the plans
        (`rejoining`), re-plans, unservable experts, and owners left per expert (`redundancy`)."""
        return self.prefetcher.poll_peers()

    def inject_fault(self, rank: int, reason: str = "injected fault") -> None:
        """Chaos testing: treat `rank`'s memory as unreadable from now on. On a peer, every copy from
        `rank` fails (the transport's fault hook) and is retried elsewhere; on `rank` itself, its
        device counts as lost, so its forwards fail and peers read that from its liveness record."""
        if not 0 <= rank < self.group.size:
            raise ValueError(f"rank={rank} is not in the DWDP group [0, {self.group.size})")
        self.failover.inject_fault(rank, reason)

    def close(self) -> None:
        """Wait for copies in flight and release shared memory; the model is unusable afterwards."""
        for hook in getattr(self, "_hooks", ()):
            hook.remove()
        self._hooks = []
        # A forward (or generate) after this reaches a MoE layer with no shared memory behind it.
        self.prefetcher.closed_reason = (f"rank {self.group.rank}: this DWDPModel was closed (close() released its "
                                         "experts' shared memory); build the model and wrap it again to run forwards")
        try:
            self.prefetcher.drain()
        finally:
            # Off the board before the transport closes its exports: a rank rejoining in between would
            # take fd numbers that are closed or already reused.
            if self._board_finalizer is not None:
                self._board_finalizer()
            self._finalizer()
            self._liveness_finalizer()
            if self.recorder is not None:
                self.trace_path = self.recorder.write()
                self.recorder = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @classmethod
    def from_pretrained(cls, path, config: DWDPConfig | None = None, group: DWDPGroup | None = None, *,
                        dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> "DWDPModel":
        """One rank built from the safetensors checkpoint directory `path` (config.json + shards),
        reading only the dense weights and this rank's local experts (dwdp.models.loading.CheckpointLoad).

        config, group: as for DWDPModel (group None joins the torchrun world or a one-rank group).
        dtype: the model's dtype (None: the checkpoint config's); tensors are cast on read.
        The result has a `load_report` (dwdp.models.loading.LoadReport) besides `memory`.
        """
        from dwdp.models.loading import CheckpointLoad

        load = CheckpointLoad(path, dtype, device)
        try:
            load.load_dense()
            wrapped = cls(load.model, config, group, expert_source=load.expert_source)
        finally:
            load.close()
        wrapped.load_report = load.report(wrapped.memory, wrapped.group.rank, wrapped.group.size)
        return wrapped
