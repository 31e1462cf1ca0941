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
import time
import weakref
from dataclasses import dataclass

import torch

from dwdp import envs
from dwdp.models.adapters import ExpertsLayer, find_experts
from dwdp.models.expert_tensors import ExpertsSpec, place_biases
from dwdp.observe.nvtx_ranges import NvtxRanges
from dwdp.observe.tracing import TraceRecorder, attach_nvtx_hooks, attach_phase_hooks
from dwdp.runtime.board import Board
from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.cuda_mapping import settle_cuda_mapping
from dwdp.runtime.experts_kernel import TOP_K_FORMS, compiled_specialisations, routing_top_k
from dwdp.runtime.experts_paths import ExpertSource, position_table, resolve_experts_path, table_order
from dwdp.runtime.failover import Failover, FailoverStatus
from dwdp.runtime.group import DWDPGroup, connect_store, init_group
from dwdp.runtime.liveness import (LivenessRecord, PeerLiveness, close_records, exchange_records, heartbeat_period,
                                   remote_watch)
from dwdp.runtime.placement import build_placement
from dwdp.runtime.prefetch import Prefetcher
from dwdp.runtime.rejoin import PeerEntries, live_owner_of_each, peer_source
from dwdp.runtime.store_board import StoreBoard, find_board
from dwdp.runtime.transport import make_transport, resolve_backend, transport_class
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


def _module_source(layers: list[ExpertsLayer]) -> ExpertSource:
    by_name = {layer.name: layer for layer in layers}

    def read(name: str, tensor: str, ids: torch.Tensor) -> torch.Tensor:
        layer = by_name[name]
        return layer.spec.tensor(tensor).stacked(layer.module, layer.spec.num_experts).detach()[ids]

    return read



def _load_config(config: DWDPConfig | str | os.PathLike | None) -> DWDPConfig:
    if isinstance(config, (str, os.PathLike)):
        return DWDPConfig.from_json(config)  # e.g. written by `dwdp tune`
    return config or DWDPConfig()


def _experts_layers(model: torch.nn.Module, config: DWDPConfig) -> list[ExpertsLayer]:
    """The model's MoE layers with biases placed as the config says; ValueError unless every layer shares
    one segment layout."""
    layers = find_experts(model)
    layers = [dataclasses.replace(layer, spec=place_biases(layer.spec, config.expert_biases)) for layer in layers]
    first = layers[0]
    for layer in layers[1:]:
        if layer.spec.signature() != first.spec.signature():
            raise ValueError(
                f"{layer.name} has experts {layer.spec.signature()}; expected {first.spec.signature()} like "
                f"{first.name}: every MoE layer shares one segment layout"
            )
    return layers


def _join_group(config: DWDPConfig, group: DWDPGroup | None) -> DWDPGroup:
    """The group given, or the env:// world (torchrun), or a one-rank group; its size checked against the config."""
    group = group if group is not None else init_group(config.group_size)
    if config.group_size is not None and config.group_size != group.size:
        raise ValueError(f"config.group_size={config.group_size} but the DWDP group has {group.size} ranks")
    return group


def _bias_report(spec: ExpertsSpec) -> str | None:
    """"replicated" or "moved with experts" for a layer with biases, None without."""
    if not spec.math.biases:
        return None
    return "moved with experts" if spec.tensor(spec.math.biases[0]).moves else "replicated"


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


def park_expert_tensors(layers) -> None:
    """Every moving tensor of every experts layer becomes a meta tensor of its shape and dtype.

    They were views of this rank's segment or of its composite views: shared or device memory the
    transport unmaps at close (or when setup fails). A view kept over unmapped memory faults on its
    first read (SIGSEGV on the host, an illegal address on CUDA, sticky for the whole process); a meta
    tensor keeps the shape and dtype (a print, a state_dict's keys) and raises a Python error on any read
    of its data (`.cpu()`, a kernel). Mapping the memory for as long as a tensor holds it would keep every
    segment, import and pool alive past close, which is what close is for."""
    for layer in layers:
        for tensor in layer.spec.moving:
            current = tensor.stored(layer.module)
            if current.device.type != "meta":
                tensor.replace(layer.module, torch.empty(current.shape, dtype=current.dtype, device="meta"))


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
        config = _load_config(config)
        layers = _experts_layers(model, config)  # validates the model before any collective
        group = _join_group(config, group)
        first = layers[0]
        placement = build_placement(first.spec.num_experts, group.size, config.num_local_experts,
                                    config.expert_replicas, config.ranks_per_node)
        device = first.spec.moving[0].stored(first.module).device
        backend = resolve_backend(config.backend, torch.device("cpu") if device.type == "meta" else device)

        self.model, self.dwdp_config, self.group, self.placement, self.backend = model, config, group, placement, backend
        self.experts_layers = layers
        self.experts_modules = [layer.module for layer in layers]
        self.expert_biases = _bias_report(first.spec)

        self.transport = self._open_transport(backend, config, group, device)
        try:
            board = self._board()
            self.path = resolve_experts_path(config, layers, placement, group.rank, self.transport, device)
            record, liveness, lost_at_start, board = self._share_experts(board, expert_source)
            self.views, self.experts_kernel = self.path.views, self.path.kernel
            self._prefetch(record, liveness, board, lost_at_start, device)
            self._attach_hooks(trace or envs.trace_dir())
            self.memory = self._memory_report()
        except BaseException:
            # The model's experts may already be views of memory the transport unmaps: park them first.
            park_expert_tensors(layers)
            self.transport.close()
            raise
        log.info("rank %d/%d: %s backend, %s, biases %s, %s", group.rank, group.size, backend, self.path.describe(),
                 self.expert_biases, self.memory)

    # -- setup, in the order __init__ runs it (docs/design.md walks it) -----------------------------
    def _open_transport(self, backend: str, config: DWDPConfig, group: DWDPGroup, device: torch.device):
        """This rank's transport; on cuda, with the peer mapping its group settles on."""
        mapping = settle_cuda_mapping(config.cuda_mapping, config.experts_kernel, group, device) \
            if transport_class(backend).settles_cuda_mapping else None
        transport = make_transport(backend, group.rank, config, device=device, mapping=mapping,
                                   process_group=group.process_group)
        self._finalizer = weakref.finalize(self, transport.close)
        return transport

    def _board(self) -> Board | None:
        """The group's board (where a restarted rank and its peers find each other), where the transport's
        segments can be opened by a process started later."""
        group, transport = self.group, self.transport
        board = None
        if group.group_id and group.size > 1 and transport.can_rejoin:
            board = find_board(group) if group.rejoining else Board(group.group_id)
        if group.rejoining and board is None:
            transport.close()
            raise ValueError(f"rank {group.rank} cannot rejoin: the {self.backend} backend ({transport.describe_mapping()}) "
                             f"has no board (group_id={group.group_id!r}, size {group.size})")
        return board

    def _share_experts(self, board: Board | None, expert_source: ExpertSource | None):
        """Fill this rank's segment with its local experts, exchange handles (or read them from the board
        when rejoining), map every peer's segment, seal, publish on the board. Returns (liveness record,
        peers' liveness, peers lost before this rank joined, the board: in the world's store when the group
        spans nodes)."""
        group, transport, path, layers = self.group, self.transport, self.path, self.experts_layers
        record = liveness = None
        lost_at_start: dict[int, str] = {}
        self.expert_source_used = "model" if expert_source is None else "given"  # "peers" when rejoining
        try:
            local_ids = torch.tensor(self.placement.local_experts(group.rank))
            source = expert_source or _module_source(layers)
            checksum = dense_checksum(self.model, self.experts_modules)
            segment = path.alloc_segment()
            if group.rejoining:
                record, liveness, lost_at_start, source = self._rejoin(board, checksum, source)
            for index, layer in enumerate(layers):
                path.fill(index, layer, segment, local_ids, source)
            # On a device the fill runs asynchronously: it must have landed before any peer may read the
            # segment (register() waits for it too; a rejoining rank registered before its fill).
            transport.fill_landed()
            if not group.rejoining:
                # The one setup exchange also carries a checksum of the dense weights: ranks that loaded
                # different models (another seed, another checkpoint) would compute wrong logits silently.
                exchanged = group.all_gather_object((transport.register(), checksum))
                check_same_dense([c for _, c in exchanged])
                transport.open([handle for handle, _ in exchanged])
                record, liveness = exchange_records(group, envs.shm_dir(), self.dwdp_config.peer_timeout_s,
                                                    self.dwdp_config.remote_lost_after_s)
                group.barrier()  # every peer has mapped our segment and record: their names can go
                if board is not None and liveness is not None and liveness.remote is not None:
                    board = StoreBoard(board.group_id, connect_store())  # reachable from every node
            board_entry = transport.board_handle() if board is not None else None  # before seal: exports it keeps
            transport.seal()
            if record is not None:
                record.seal()
                record.start()
            if board is not None:
                board.publish(group.rank, board_entry, record.board_handle(), checksum)
        except BaseException:
            transport.close()  # __init__ parks the experts' tensors
            close_records(record, liveness)
            raise
        self._liveness_finalizer = weakref.finalize(self, close_records, record, liveness)
        self._board_finalizer = weakref.finalize(self, board.withdraw, group.rank) if board is not None else None
        return record, liveness, lost_at_start, board

    def _rejoin(self, board: Board | StoreBoard, checksum: int, source: ExpertSource):
        """A rank that rejoins a running group: its peers' handles from the board, their segments mapped,
        its local experts copied out of a live owner's segment where one holds them (a memory copy beats
        reading the checkpoint: dwdp.runtime.rejoin). Returns (record, liveness, lost_at_start, source)."""
        group, transport, config = self.group, self.transport, self.dwdp_config
        peers = PeerEntries.read(board, group.rank, group.size)
        check_same_dense_as_peers(group.rank, checksum, peers)
        transport.open(peers.segments(transport.register()))
        node = envs.node_name()
        spans_nodes = any(r is not None and r.get("host") != node for r in peers.records())
        beat, remote = remote_watch(group, config.peer_timeout_s, config.remote_lost_after_s, spans_nodes)
        record = LivenessRecord(envs.shm_dir(), heartbeat_period(config.peer_timeout_s), beat)
        liveness = PeerLiveness(group.rank, peers.records(), config.peer_timeout_s, remote)
        if remote is not None:
            remote.start()
        lost_at_start = {r: f"rank {r} had no live entry on the board when rank {group.rank} rejoined"
                         for r in peers.missing}
        owner_of = live_owner_of_each(self.placement, group.rank, peers.live)
        if owner_of is not None:
            source = peer_source(self.experts_layers, self.path.offset_in_peer, owner_of, transport.peer_segment,
                                 source)
            self.expert_source_used = "peers"
        return record, liveness, lost_at_start, source

    def _prefetch(self, record, liveness, board: Board | None, lost_at_start: dict[int, str],
                  device: torch.device) -> None:
        """The plan cache, the failover around it, the Prefetcher, and every layer's tables and experts
        function (the experts path installs them)."""
        config, group, path = self.dwdp_config, self.group, self.path
        plans = path.plans()
        buffers = path.slot_buffers()
        # A lost peer is a plan change made here, from this rank's own view: never a collective.
        self.failover = Failover(self.placement, group.rank, plans, self.transport, liveness, config.peer_timeout_s,
                                 record, board)
        self.failover.declare_lost(lost_at_start)
        self.prefetcher = Prefetcher(self.transport, plans, buffers, len(self.experts_layers),
                                     envs.wait_timeout_s(config.wait_timeout_s), self.failover, **path.prefetch_kwargs())
        order = table_order(path, plans)
        path.install(self.model, self.prefetcher, position_table(path, order, buffers[0].device), order, buffers)

    def _attach_hooks(self, trace: str | None) -> None:
        """Forward hooks: the prefetcher's forward start and end, NVTX ranges where the transport asks for
        them (cuda), and, with a trace directory, this rank's trace recorder."""
        model, layers = self.model, self.experts_layers
        self._hooks = [model.register_forward_pre_hook(lambda *_: self.prefetcher.start_forward()),
                       model.register_forward_hook(lambda *_: self.prefetcher.end_forward())]
        if self.transport.nvtx_ranges:
            self.prefetcher.nvtx = NvtxRanges()
            self._hooks += attach_nvtx_hooks(model, self.prefetcher.nvtx, [layer.name for layer in layers])
        self.recorder = None
        if trace:
            plans = self.prefetcher.plans
            plan_bytes = {layer: plans.get(layer, self.prefetcher.slot_of_visit(layer, layer)).nbytes
                          for layer in range(len(layers))}
            self.recorder = TraceRecorder(trace, self.group.rank, self.group.size, len(layers), plan_bytes)
            self.prefetcher.recorder = self.transport.recorder = self.recorder
            self._hooks.append(model.register_forward_pre_hook(lambda *_: self.recorder.begin_forward()))
            self._hooks.append(model.register_forward_hook(lambda *_: self.recorder.end_forward()))
            self._hooks += attach_phase_hooks(model, self.recorder, [layer.name for layer in layers])

    def _memory_report(self) -> "MemoryReport":
        first = self.experts_layers[0]
        local_bytes, buffer_bytes = self.path.memory()
        local_tensors = [t.stored(layer.module) for layer in self.experts_layers for t in first.spec.moving]
        return MemoryReport(
            full_expert_bytes=len(self.experts_layers) * first.spec.num_experts * sum(t.nbytes for t in first.spec.tensors),
            local_expert_bytes=local_bytes,
            prefetch_buffer_bytes=buffer_bytes,
            dense_bytes=dense_bytes(self.model, local_tensors),
        )

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
            park_expert_tensors(self.experts_layers)
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
