"""The `dwdp` experts function: transformers calls it in place of its own experts forward.

Legend: T = tokens, k = experts per token, S = T * k token-expert pairs, H = hidden, I = expert
intermediate size, E = experts, L = local experts.

Experts are addressed through a per-layer weight table in "table order": the L local experts
first, then the remote experts slot-buffer by slot-buffer. Rows are sorted by table position, so
the local experts' rows come first and are computed before the prefetch of this layer is waited
on; the remote rows follow. Each expert's weights are read where they live, never concatenated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import phases
from .expert_math import combine, expert_mlp
from .tracing import now_us

EXPERTS_IMPLEMENTATION = "dwdp"


@dataclass
class LayerTables:
    """Per-expert weight views of one layer, in table order, for one prefetch slot."""

    gate_up: list[torch.Tensor]  # E views [2I, H]
    down: list[torch.Tensor]     # E views [H, I]


@dataclass
class LayerRuntime:
    """What the experts function of one MoE layer needs; attached to its experts module."""

    layer: int
    num_local: int
    position: torch.Tensor           # [E] int64: table position of each expert id
    table_order: tuple[int, ...]     # expert id at each table position (inverse of position)
    tables: list[LayerTables]        # one per prefetch slot
    prefetcher: object               # dwdp.prefetch.Prefetcher
    kernel_tables: list | None = None  # per slot (gate_up, down) ExpertWeightTable: the Triton path


def _run_experts(module, x_sorted: torch.Tensor, offsets: list[int], tables: LayerTables, lo: int, hi: int,
                 out: torch.Tensor) -> None:
    """out[rows of experts lo..hi) = down(gate(gate_up(x))) for table positions lo..hi."""
    r0, r1 = offsets[lo], offsets[hi]
    if r1 > r0:
        counts = [b - a for a, b in zip(offsets[lo:hi], offsets[lo + 1 : hi + 1])]
        out[r0:r1] = expert_mlp(module, x_sorted[r0:r1], counts, tables.gate_up[lo:hi], tables.down[lo:hi])


def dwdp_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k] -> [T, H]."""
    runtime: LayerRuntime | None = getattr(self, "_dwdp_runtime", None)
    if runtime is None:
        raise RuntimeError(
            f"{type(self).__name__} is set to the 'dwdp' experts implementation but was not wrapped by DWDPModel"
        )
    prefetcher = runtime.prefetcher
    recorder = prefetcher.recorder
    start = now_us() if recorder is not None else 0.0
    if prefetcher.nvtx is not None:
        prefetcher.nvtx.push(phases.MOE_COMPUTE, runtime.layer)
        try:
            return _experts_forward(self, runtime, hidden_states, top_k_index, top_k_weights, recorder, start)
        finally:
            prefetcher.nvtx.pop()
    return _experts_forward(self, runtime, hidden_states, top_k_index, top_k_weights, recorder, start)


def _experts_forward(self, runtime: LayerRuntime, hidden_states, top_k_index, top_k_weights, recorder,
                     start: float) -> torch.Tensor:
    top_k = top_k_index.shape[1]
    num_experts = runtime.position.numel()
    prefetcher = runtime.prefetcher
    # Issue this layer's copy (if not already in flight) and the next layer's, before any compute;
    # the routed ids let a rank that lost experts refuse the layer at once.
    slot = prefetcher.begin(runtime.layer, top_k_index)
    if runtime.kernel_tables is not None:
        try:
            result = _fused_experts(runtime, slot, hidden_states, top_k_index, top_k_weights)
        finally:
            prefetcher.release(slot)
        if recorder is not None:
            recorder.complete(phases.MOE_COMPUTE, start, now_us(), layer=runtime.layer, iteration=recorder.iteration)
        return result
    try:
        table_pos = runtime.position[top_k_index.reshape(-1)]                # [S]
        sorted_pos, perm = torch.sort(table_pos, stable=True)                # [S]
        counts = torch.bincount(sorted_pos, minlength=num_experts)           # [E]
        offsets = [0] + torch.cumsum(counts, 0).tolist()                     # E + 1 row offsets
        x_sorted = hidden_states[perm // top_k]                              # [S, H]
        out_sorted = hidden_states.new_empty(x_sorted.shape)                 # [S, H]
        tables = runtime.tables[slot]
        # Local experts never move: compute them while remote copies are still landing.
        _run_experts(self, x_sorted, offsets, tables, 0, runtime.num_local, out_sorted)
        # Then each remote expert as soon as its own slices have arrived.
        for pos in range(runtime.num_local, num_experts):
            if offsets[pos + 1] > offsets[pos]:
                prefetcher.wait(runtime.layer, slot, (runtime.table_order[pos],))
                _run_experts(self, x_sorted, offsets, tables, pos, pos + 1, out_sorted)
        # The slot may be refilled only after every copy into it has landed.
        prefetcher.wait(runtime.layer, slot)
    finally:
        prefetcher.release(slot)
    result = combine(out_sorted, perm, top_k_weights, hidden_states.dtype)   # [T, H]
    if recorder is not None:
        recorder.complete(phases.MOE_COMPUTE, start, now_us(), layer=runtime.layer, iteration=recorder.iteration)
    return result


def _fused_experts(runtime: LayerRuntime, slot: int, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """One layer through the Triton multi-buffer kernel: local experts' launch first, then the wait
    for this slot's copies, then the remote experts' launch."""
    from .kernels import moe_experts

    gate_up, down = runtime.kernel_tables[slot]

    def wait_for_remote() -> None:
        runtime.prefetcher.wait(runtime.layer, slot)

    out = moe_experts(hidden_states.contiguous(), runtime.position[top_k_index], top_k_weights, gate_up, down,
                      split_at=runtime.num_local, on_local_done=wait_for_remote)
    runtime.prefetcher.wait(runtime.layer, slot)  # no-op when the kernel already waited
    return out


def uses_default_swiglu(module: torch.nn.Module) -> bool:
    """True when the experts apply silu(gate) * up, the epilogue the fused kernel implements."""
    from transformers.integrations.moe import _default_apply_gate

    apply_gate = getattr(type(module), "_apply_gate", None)
    act = module.act_fn
    is_silu = isinstance(act, torch.nn.SiLU) or type(act).__name__ == "SiLUActivation"
    return apply_gate is _default_apply_gate and is_silu


def register_experts_implementation() -> None:
    """Make 'dwdp' a valid `experts_implementation` of transformers (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, dwdp_experts_forward)
