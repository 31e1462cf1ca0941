"""DWDPConfig: the knobs of one DWDP group, validated once at construction."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from dwdp.runtime.transport.registry import TRANSPORTS, backend_names, transport_class

EXPERTS_KERNELS = ("auto", "composite", "reference", "triton", "triton_fp8")
CUDA_COPIES = ("batch", "memcpy")
CUDA_MAPPINGS = ("auto", "vmm", "ipc", "symmetric_memory")
EXPERT_BIASES = ("auto", "replicate", "move")
# The backends ("auto" and the registered ones) and their default slice sizes:
# dwdp.runtime.transport.registry.


def _check_int(name: str, value, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an int in [{low}, {high if high is not None else 'inf'}]")
    if value < low or (high is not None and value > high):
        upper = high if high is not None else "inf"
        raise ValueError(f"{name}={value} is out of range: expected {low} <= {name} <= {upper}")


@dataclass(frozen=True)
class DWDPConfig:
    """Settings of a DWDP group.

    group_size: ranks that share one copy of the experts (None = all ranks of the process group).
    num_local_experts: experts each rank keeps per MoE layer (None = ceil(num_experts / group_size),
        or what `expert_replicas` needs); more than that adds redundant copies and cuts prefetch volume.
    expert_replicas: ranks that must own every expert (1 = no redundancy); 2 lets the group lose
        any one rank and keep serving every expert (dwdp.runtime.failover).
    slice_bytes: size of one copy slice; transfers are cut into slices issued round-robin over peers
        (None: the backend's default_slice_bytes, see `slice_bytes_for`).
    num_buffers: prefetch slots (double buffering = 2); at least 2 so copy and compute overlap.
    backend: transport backend, a name of dwdp.runtime.transport.registry ("host", "cuda"), or "auto":
        the backend registered for the model's device type (cuda for CUDA models, host otherwise).
    wait_timeout_s: longest a rank waits for one layer's prefetch before raising.
    peer_timeout_s: a copy from a peer still outstanding after this long makes the rank read that
        peer's liveness record (a lost peer is planned around, the copy retried elsewhere); a peer
        whose heartbeat is older than this is reported stalled.
    remote_lost_after_s: a peer on another node (no pidfd there) whose beat in the store has not moved
        for this long is lost (dwdp.runtime.store_liveness); at least peer_timeout_s.
    ranks_per_node: consecutive ranks of the group that share a node (torchrun's LOCAL_WORLD_SIZE; `dwdp
        serve --nnodes` sets its --ranks): each node's ranks own windows spread over all experts, so a
        node lost leaves the others every expert their windows cover: all of them when expert_replicas
        is at least the number of nodes. None: placement ignores nodes.
    inflight: slices a copier keeps outstanding at once (host: number of copier threads).
    experts_kernel: "reference" (plain PyTorch: local experts first, then the remote ones in at most
        two calls as they land), "triton" (fused multi-buffer grouped GEMM, local experts first),
        "triton_fp8" (triton with fp8 x fp8 dots: fp8 experts only, tokens quantized per row and
        weight block of K), "composite" (each layer's experts are one [E, ...] tensor whose local
        experts are this rank's segment pages mapped in place and whose remote ones are pool pages the
        prefetch fills; the model's own experts implementation runs on it: dwdp.runtime.composite_experts),
        or "auto": composite where the backend builds composite views (host on Linux; cuda where the group
        settles on a VMM mapping, not yet run on a GPU), else triton for
        CUDA models (triton_fp8 for fp8 experts: the dequantizing path is too slow to be chosen for
        you), reference otherwise; a fallback from composite says why in one log line.
    cuda_copy: how the cuda backend issues a layer's slices: "batch" (one cudaMemcpyBatchAsync per
        batch; per-slice copies where the runtime lacks it) or "memcpy" (one cudaMemcpyAsync per slice).
    copy_batches: most batches one layer's copy is cut into; each ends where experts complete. cuda:
        one copy call each, whose event tells compute that they have landed; host: one copier task
        each (and none under 1 MiB: dwdp.runtime.transport.host).
    cuda_mapping: how the cuda backend maps peers' segments: "vmm" (cuMem allocations exported as
        POSIX fds on one node or fabric handles across NVL72 trays: what composite views need; not
        yet run on a GPU), "ipc" (CUDA IPC, one node), "symmetric_memory"
        (torch.distributed._symmetric_memory, multi-node NVLink) or "auto": vmm where every rank's
        device exports cuMem handles and experts_kernel can use composite views, else ipc when every
        rank of the group is on this host, else symmetric_memory.
    expert_biases: where experts' biases live: "replicate" (every rank keeps all of them, nothing to
        copy), "move" (with their expert, like its weights), or "auto": replicate when a layer's biases
        of all experts take no more bytes than one expert's weights (dwdp.models.expert_tensors.place_biases).
    """

    group_size: int | None = None
    num_local_experts: int | None = None
    expert_replicas: int = 1
    slice_bytes: int | None = None
    num_buffers: int = 2
    backend: str = "auto"
    wait_timeout_s: float = 60.0
    peer_timeout_s: float = 2.0
    remote_lost_after_s: float = 10.0
    ranks_per_node: int | None = None
    inflight: int = 2
    experts_kernel: str = "auto"
    cuda_copy: str = "batch"
    copy_batches: int = 4
    cuda_mapping: str = "auto"
    expert_biases: str = "auto"

    def __post_init__(self):
        if self.group_size is not None:
            _check_int("group_size", self.group_size, 1)
        if self.num_local_experts is not None:
            _check_int("num_local_experts", self.num_local_experts, 1)
        _check_int("expert_replicas", self.expert_replicas, 1)
        if self.group_size is not None and self.expert_replicas > self.group_size:
            raise ValueError(f"expert_replicas={self.expert_replicas} is more than group_size={self.group_size}: "
                             "an expert cannot have more owners than there are ranks")
        if self.slice_bytes is not None:
            _check_int("slice_bytes", self.slice_bytes, 1, 1 << 34)
        _check_int("num_buffers", self.num_buffers, 2, 64)
        _check_int("inflight", self.inflight, 1, 64)
        if self.backend != "auto" and self.backend not in TRANSPORTS:
            raise ValueError(f"backend={self.backend!r} is not one of {('auto', *backend_names())}")
        if self.experts_kernel not in EXPERTS_KERNELS:
            raise ValueError(f"experts_kernel={self.experts_kernel!r} is not one of {EXPERTS_KERNELS}")
        if self.cuda_copy not in CUDA_COPIES:
            raise ValueError(f"cuda_copy={self.cuda_copy!r} is not one of {CUDA_COPIES}")
        _check_int("copy_batches", self.copy_batches, 1, 1024)
        if self.cuda_mapping not in CUDA_MAPPINGS:
            raise ValueError(f"cuda_mapping={self.cuda_mapping!r} is not one of {CUDA_MAPPINGS}")
        if self.expert_biases not in EXPERT_BIASES:
            raise ValueError(f"expert_biases={self.expert_biases!r} is not one of {EXPERT_BIASES}")
        for name in ("wait_timeout_s", "peer_timeout_s", "remote_lost_after_s"):
            timeout = getattr(self, name)
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (0 < timeout < float("inf")):
                raise ValueError(f"{name}={timeout!r} must be a finite number of seconds > 0")
        if self.ranks_per_node is not None:
            _check_int("ranks_per_node", self.ranks_per_node, 1, 1 << 20)
        if self.remote_lost_after_s < self.peer_timeout_s:
            raise ValueError(f"remote_lost_after_s={self.remote_lost_after_s} must be >= peer_timeout_s="
                             f"{self.peer_timeout_s}: a remote peer is stalled before it is lost")

    def slice_bytes_for(self, backend: str) -> int:
        """The slice size a group on `backend` (a registered backend, not 'auto') copies with."""
        if self.slice_bytes is not None:
            return self.slice_bytes
        if backend not in TRANSPORTS:
            raise ValueError(f"backend={backend!r} has no default slice size; expected one of {backend_names()}")
        return transport_class(backend).default_slice_bytes

    def replace(self, **changes) -> "DWDPConfig":
        return dataclasses.replace(self, **changes)

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> "DWDPConfig":
        data = json.loads(Path(path).read_text())
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{path}: unknown DWDPConfig fields {unknown}; expected a subset of {sorted(known)}")
        return cls(**data)
