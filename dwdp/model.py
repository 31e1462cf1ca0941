"""DWDPModel: turn a finished transformers MoE model into one rank of a DWDP group.

Legend: E = experts per MoE layer, L = local experts per rank, M = MoE layers, B = prefetch slots.

Each rank keeps the dense weights and L experts per layer (in its shared source segment), frees
the other experts, and runs every MoE layer through the `dwdp` experts function, which reads
local experts in place and remote ones from a prefetch slot filled by copies from peers.
"""
from __future__ import annotations

import logging
import os
import socket
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import envs
from .adapters import find_experts
from .config import DWDPConfig
from .experts import EXPERTS_IMPLEMENTATION, LayerRuntime, LayerTables, register_experts_implementation
from .failover import Failover, FailoverStatus
from .group import DWDPGroup, init_group
from .liveness import close_records, exchange_records
from .placement import build_placement
from .plan import PlanCache, SegmentLayout, slot_layout
from .prefetch import Prefetcher
from .nvtx_ranges import NvtxRanges
from .tracing import TraceRecorder, attach_nvtx_hooks, attach_phase_hooks
from .transport import make_transport, resolve_backend
from .wrapping import ModelWrapper, dense_bytes

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


ExpertSource = Callable[[str, int, torch.Tensor], torch.Tensor]
"""(experts module name, tensor index (0 gate_up, 1 down), local expert ids [L]) -> [L, ...] weights."""


def _stacked_source(adapter, modules: dict) -> ExpertSource:
    def read(name: str, tensor: int, local_ids: torch.Tensor) -> torch.Tensor:
        return adapter.expert_tensors(modules[name])[tensor].detach()[local_ids]

    return read


def _choose_experts_kernel(requested: str, device: torch.device, experts) -> str:
    """"triton" for CUDA models whose experts are plain SwiGLU, "reference" otherwise; an explicit
    "triton" that cannot work is an error, not a silent fallback."""
    from .experts import uses_default_swiglu

    plain = all(uses_default_swiglu(m) for _, m in experts)
    if requested == "triton":
        if not plain:
            raise ValueError("experts_kernel='triton' needs silu(gate) * up experts; this model's differ")
        return "triton"
    if requested == "auto" and device.type == "cuda" and plain:
        return "triton"
    return "reference"


def _cuda_mapping(requested: str, group: DWDPGroup) -> str:
    """CUDA IPC when every rank of the group is on this host, symmetric memory otherwise."""
    if requested != "auto":
        return requested
    hosts = group.all_gather_object(socket.gethostname())
    return "ipc" if len(set(hosts)) == 1 else "symmetric_memory"


class DWDPModel(ModelWrapper):
    """One rank of a DWDP group around `model`, called exactly like `model`.

    model: a transformers 5 MoE model (Mixtral, Qwen3-MoE, Qwen2-MoE, DeepSeek-V3, OLMoE), on the
        CPU (host backend) or on this rank's CUDA device (cuda backend); it is modified in place
        (its non-local experts are freed).
    config: DWDPConfig, or the path of one saved as JSON (`dwdp tune` writes one); group_size None
        means the whole DWDP group passed in `group`.
    group: DWDPGroup; None joins the env:// world (torchrun) or, without one, a one-rank group.
    expert_source: where this rank's local experts come from; None reads them from the model's
        stacked parameters. A loader passes one that reads only local experts from a checkpoint,
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
        adapter, experts = find_experts(model)  # validates the model before any collective
        if group is None:
            group = init_group(config.group_size)
        if config.group_size is not None and config.group_size != group.size:
            raise ValueError(f"config.group_size={config.group_size} but the DWDP group has {group.size} ranks")
        first = experts[0][1]
        num_experts = first.num_experts
        shapes = [tuple(t.shape[1:]) for t in adapter.expert_tensors(first)]
        dtype = first.gate_up_proj.dtype
        for name, module in experts:
            got = [tuple(t.shape[1:]) for t in adapter.expert_tensors(module)]
            if module.num_experts != num_experts or got != shapes or module.gate_up_proj.dtype != dtype:
                raise ValueError(
                    f"{name} has {module.num_experts} experts of shapes {got} ({module.gate_up_proj.dtype}); "
                    f"expected {num_experts} of {shapes} ({dtype}) like {experts[0][0]}"
                )
        placement = build_placement(num_experts, group.size, config.num_local_experts, config.expert_replicas)
        device = first.gate_up_proj.device
        backend = resolve_backend(config.backend, torch.device("cpu") if device.type == "meta" else device)
        timeout_s = envs.wait_timeout_s(config.wait_timeout_s)

        self.model = model
        self.dwdp_config = config
        self.group = group
        self.placement = placement
        self.backend = backend
        self.experts_modules = [m for _, m in experts]

        elem = torch.tensor([], dtype=dtype).element_size()
        tensor_nbytes = tuple(int(torch.Size(s).numel()) * elem for s in shapes)
        segment_layout = SegmentLayout(len(experts), placement.num_local_experts, tensor_nbytes)
        slots = slot_layout(placement, group.rank, tensor_nbytes)
        full_bytes = len(experts) * num_experts * sum(tensor_nbytes)

        mapping = _cuda_mapping(config.cuda_mapping, group) if backend == "cuda" else "ipc"
        transport = make_transport(backend, group.rank, config, device=device, mapping=mapping,
                                   process_group=group.process_group)
        self.transport = transport
        self._finalizer = weakref.finalize(self, transport.close)
        record = liveness = None
        try:
            segment = transport.alloc_segment(segment_layout.total_nbytes)
            local_ids = torch.tensor(placement.local_experts(group.rank))
            source = expert_source or _stacked_source(adapter, dict(experts))
            for layer, (name, module) in enumerate(experts):
                local = []
                for t, shape in enumerate(shapes):
                    start = segment_layout.tensor_offset(layer, t)
                    view = segment[start : start + placement.num_local_experts * tensor_nbytes[t]]
                    view = view.view(dtype).view(placement.num_local_experts, *shape)  # [L, ...]
                    src = source(name, t, local_ids)
                    if tuple(src.shape) != tuple(view.shape):
                        raise ValueError(
                            f"{name}: expert source gave tensor {t} of shape {tuple(src.shape)}, "
                            f"expected {tuple(view.shape)}"
                        )
                    view.copy_(src)
                    local.append(view)
                # Dropping the stacked [E, ...] parameters frees the non-local experts.
                adapter.replace_tensors(module, tuple(local))
            handles = group.all_gather_object(transport.register())
            transport.open(handles)
            record, liveness = exchange_records(group, envs.shm_dir(), config.peer_timeout_s)
            group.barrier()  # every peer has mapped our segment and record: their names can go
            transport.seal()
            if record is not None:
                record.seal()
                record.start()
        except BaseException:
            transport.close()
            close_records(record, liveness)
            raise
        self._liveness_finalizer = weakref.finalize(self, close_records, record, liveness)

        slot_buffers = [transport.alloc_slot(slots.total_nbytes) for _ in range(config.num_buffers)]
        plans = PlanCache(placement, group.rank, segment_layout, config.slice_bytes)
        # A lost peer is a plan change made here, from this rank's own view: never a collective.
        self.failover = Failover(placement, group.rank, plans, transport, liveness, config.peer_timeout_s, record)
        self.prefetcher = Prefetcher(transport, plans, slot_buffers, len(experts), timeout_s, self.failover)

        remote_order = [e for experts_of_peer in slots.experts_by_peer for e in experts_of_peer]
        table_order = list(placement.local_experts(group.rank)) + remote_order
        position = torch.empty(num_experts, dtype=torch.long)
        position[torch.tensor(table_order)] = torch.arange(num_experts)
        position = position.to(slot_buffers[0].device)  # indexed by the router's ids, on their device
        self.experts_kernel = _choose_experts_kernel(config.experts_kernel, device, experts)
        for layer, module in enumerate(self.experts_modules):
            tables = [self._layer_tables(module, slots, buf, shapes, dtype) for buf in slot_buffers]
            kernel_tables = None
            if self.experts_kernel == "triton":
                from .kernels import expert_weight_table

                kernel_tables = [(expert_weight_table(t.gate_up, name="gate_up"),
                                  expert_weight_table(t.down, name="down")) for t in tables]
            module._dwdp_runtime = LayerRuntime(
                layer, placement.num_local_experts, position, tuple(table_order), tables, self.prefetcher,
                kernel_tables,
            )

        register_experts_implementation()
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
        self._hooks = [model.register_forward_pre_hook(lambda *_: self.prefetcher.start_forward())]
        if backend == "cuda":
            self.prefetcher.nvtx = NvtxRanges()
            self._hooks += attach_nvtx_hooks(model, self.prefetcher.nvtx, [name for name, _ in experts])
        self.recorder = None
        trace = trace or envs.trace_dir()
        if trace:
            plan_bytes = {layer: plans.get(layer, 0).nbytes for layer in range(len(experts))}
            self.recorder = TraceRecorder(trace, group.rank, group.size, len(experts), plan_bytes)
            self.prefetcher.recorder = transport.recorder = self.recorder
            self._hooks.append(model.register_forward_pre_hook(lambda *_: self.recorder.begin_forward()))
            self._hooks.append(model.register_forward_hook(lambda *_: self.recorder.end_forward()))
            self._hooks += attach_phase_hooks(model, self.recorder, [name for name, _ in experts])

        local_tensors = [t for m in self.experts_modules for t in adapter.expert_tensors(m)]
        self.memory = MemoryReport(
            full_expert_bytes=full_bytes,
            local_expert_bytes=segment_layout.total_nbytes,
            prefetch_buffer_bytes=config.num_buffers * slots.total_nbytes,
            dense_bytes=dense_bytes(model, local_tensors),
        )
        log.info("rank %d/%d: %s backend, %s", group.rank, group.size, backend, self.memory)

    @staticmethod
    def _layer_tables(module, slots, buffer: torch.Tensor, shapes, dtype) -> LayerTables:
        gate_up = list(module.gate_up_proj.unbind(0))  # local experts first: L views [2I, H]
        down = list(module.down_proj.unbind(0))        # L views [H, I]
        for p_index, experts_of_peer in enumerate(slots.experts_by_peer):
            n = len(experts_of_peer)
            for t, (shape, dst) in enumerate(zip(shapes, (gate_up, down))):
                start = slots.tensor_offset(p_index, t)
                nbytes = n * slots.tensor_nbytes[t]
                block = buffer[start : start + nbytes].view(dtype).view(n, *shape)  # [n_p, ...]
                dst.extend(block.unbind(0))
        return LayerTables(gate_up, down)

    @property
    def stats(self):
        return self.prefetcher.stats

    def check_peers(self) -> FailoverStatus:
        """Read the peers' liveness now (forwards also do, as they start), re-plan around any loss,
        and return what this rank knows: lost and stalled peers, re-plans, unservable experts."""
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
        try:
            self.prefetcher.drain()
        finally:
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
        """One rank built from the safetensors checkpoint directory `path`, reading only the dense
        weights and this rank's local experts; see dwdp.loading.load_dwdp_model. The result has a
        `load_report` (dwdp.loading.LoadReport) besides `memory`."""
        from .loading import load_dwdp_model

        return load_dwdp_model(path, config=config, group=group, dtype=dtype, device=device)
