"""The `dwdp` experts function: transformers calls it in place of its own experts forward.

Legend: T = tokens, k = experts per token, S = T * k token-expert pairs, H = hidden, I = expert
intermediate size, E = experts, Z = identity experts, L = local experts.

Experts are addressed through a per-layer weight table in "table order": the L local experts
first, then the remote experts in the order their copies complete. The table holds, for each named
tensor of an expert (weights, biases, ...), one view per expert wherever it lives. Rows are sorted by
table position, so the local experts' rows come first; each expert's tensors are read where they
live, never concatenated. Identity experts (LongCat-Flash) sit after the real ones and return their
input.

Experts run in groups of consecutive table positions, at most three calls per layer whatever the
number of experts (`_ready_groups`): one call for all of them when the layer's copies have already
landed; otherwise the local experts first (before any wait on this layer's copies), then the
remote experts that have landed by then, then the rest once they land.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dwdp.kernels import launch as kernel_launch  # the module: tests stand in for its device_info
from dwdp.kernels import moe_experts
from dwdp.kernels.moe import moe_tile_pairs
from dwdp.models.expert_tensors import ExpertsMath
from dwdp.observe import phases
from dwdp.observe.tracing import now_us
from dwdp.runtime.expert_math import combine, expert_mlp

EXPERTS_IMPLEMENTATION = "dwdp"

LayerTables = dict[str, list[torch.Tensor]]
"""Tensor name -> E per-expert views in table order, for one prefetch slot."""


@dataclass(frozen=True)
class KernelTables:
    """One slot's weight tables for the Triton path (dwdp.kernels.ExpertWeightTable each)."""

    first: object                 # E views [N1, H] (gate_up, or up without a gate)
    down: object                  # E views [H, I]
    first_bias: object | None = None
    down_bias: object | None = None
    first_scales: object | None = None  # fp8 weights: dwdp.kernels.ScaleTable of their block scales
    down_scales: object | None = None
    fp8_activations: bool = False  # fp8 x fp8 dots (experts_kernel="triton_fp8")


@dataclass
class LayerRuntime:
    """What the experts function of one MoE layer needs; attached to its experts module."""

    layer: int
    num_local: int
    position: torch.Tensor           # [E + Z] int64: table position of each router id
    table_order: tuple[int, ...]     # expert id at each table position (inverse of position on [0, E))
    tables: list[LayerTables]        # one per prefetch slot
    math: ExpertsMath
    prefetcher: object               # dwdp.runtime.prefetch.Prefetcher
    kernel_tables: list[KernelTables] | None = None  # per slot: the Triton path
    epilogue: object | None = None   # dwdp.kernels.Epilogue of the Triton path


def _experts_rows(runtime: LayerRuntime, x_sorted: torch.Tensor, offsets: list[int], tables: LayerTables, lo: int,
                  hi: int) -> torch.Tensor | None:
    """[rows of table positions lo..hi), H]: each expert's MLP on its rows; None when they have none."""
    r0, r1 = offsets[lo], offsets[hi]
    if r1 == r0:
        return None
    counts = [b - a for a, b in zip(offsets[lo:hi], offsets[lo + 1 : hi + 1])]
    views = {name: per_expert[lo:hi] for name, per_expert in tables.items()}
    return expert_mlp(runtime.math, x_sorted[r0:r1], counts, views)


def _ready_groups(runtime: LayerRuntime, slot: int, offsets: list[int]) -> Iterator[tuple[int, int]]:
    """Table-position ranges [lo, hi) of real experts whose weights are ready, in compute order, after
    the waits they need; at most three, and the slot's copies have all landed after the last one.

    - every copy already landed: one range for all experts (one call, like a replicated layer);
    - otherwise the local experts first, with no wait: they never move;
    - then the remote experts with rows that have landed by then (a prefix in arrival order);
    - then the rest, once every copy has landed.
    """
    prefetcher, layer = runtime.prefetcher, runtime.layer
    num_local, num_experts = runtime.num_local, len(runtime.table_order)
    if prefetcher.landed(layer, slot):
        prefetcher.wait(layer, slot)  # returns at once; counted as a zero wait (on CUDA: a stream wait)
        yield 0, num_experts
        return
    yield 0, num_local
    pending = [pos for pos in range(num_local, num_experts) if offsets[pos + 1] > offsets[pos]]
    experts = [runtime.table_order[pos] for pos in pending]
    num_landed = prefetcher.landed_prefix(layer, slot, experts) if pending else 0
    split = pending[num_landed] if num_landed < len(pending) else num_experts
    if num_landed:
        prefetcher.wait(layer, slot, experts[:num_landed])  # returns at once
        yield num_local, split
    # The slot may be refilled only after every copy into it has landed.
    prefetcher.wait(layer, slot)
    if split < num_experts:
        yield split, num_experts


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
    num_experts = len(runtime.table_order)
    num_positions = runtime.position.numel()  # E + Z
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
    math = runtime.math
    try:
        table_pos = runtime.position[top_k_index.reshape(-1)]                # [S]
        sorted_pos, perm = torch.sort(table_pos, stable=True)                # [S]
        counts = torch.bincount(sorted_pos, minlength=num_positions)         # [E + Z]
        offsets = list(itertools.accumulate(counts.tolist(), initial=0))     # E + Z + 1 row offsets
        x_sorted = hidden_states[perm // top_k]                              # [S, H]
        if math.weights_on_input:
            scale = top_k_weights.reshape(-1)[perm].unsqueeze(-1)            # [S, 1]
            x_sorted = x_sorted * scale.to(x_sorted.dtype)
        tables = runtime.tables[slot]
        parts = []                                                           # consecutive row ranges
        for lo, hi in _ready_groups(runtime, slot, offsets):
            rows = _experts_rows(runtime, x_sorted, offsets, tables, lo, hi)
            if rows is not None:
                parts.append(rows)
        if offsets[-1] > offsets[num_experts]:
            parts.append(x_sorted[offsets[num_experts]:])                    # identity experts: y = x
        if len(parts) == 1:  # one call (the copies had landed): its result as is, no [S, H] buffer to fill
            out_sorted = parts[0]                                            # [S, H]
        else:
            out_sorted = torch.cat(parts) if parts else x_sorted             # [S, H] (S = 0 without parts)
    finally:
        prefetcher.release(slot)
    weights = torch.ones_like(top_k_weights) if math.weights_on_input else top_k_weights
    result = combine(out_sorted, perm, weights, hidden_states.dtype)         # [T, H]
    if recorder is not None:
        recorder.complete(phases.MOE_COMPUTE, start, now_us(), layer=runtime.layer, iteration=recorder.iteration)
    return result


def _fused_experts(runtime: LayerRuntime, slot: int, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """One layer through the Triton multi-buffer kernel: local experts' launch first, then the wait
    for this slot's copies, then the remote experts' launch."""
    prefetcher, layer = runtime.prefetcher, runtime.layer
    waited = []

    def wait_for_remote() -> None:
        prefetcher.wait(layer, slot)
        waited.append(True)

    if prefetcher.landed(layer, slot):
        wait_for_remote()  # returns at once: one launch pair over every expert, no local-first split
    out = _kernel_call(runtime, slot, hidden_states, top_k_index, top_k_weights, split=not waited,
                       on_local_done=wait_for_remote)
    if not waited:  # no rows at all: the kernel returned before its remote part
        wait_for_remote()
    return out


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it when its data does not start on 16 bytes (Triton specialises pointers on that)."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _kernel_call(runtime: LayerRuntime, slot: int, hidden_states, top_k_index, top_k_weights, *, split: bool,
                 on_local_done, tiles=None) -> torch.Tensor:
    """moe_experts on this slot's tables, its inputs in one fixed form (contiguous, 16-byte aligned,
    fp32 routing weights, int64 table positions), so that every launch of a layer specialises the same
    way whatever the routing, the batch or the caller's dtypes: the forms `warm_kernel` compiles.
    split: local experts first, then `on_local_done()`, then the rest; else every expert in one launch.
    tiles: a (gate_up, down) pair of tile configurations (warm-up); None lets the kernel choose them."""
    tables = runtime.kernel_tables[slot]
    hidden = _aligned(hidden_states.contiguous())                     # [T, H]
    positions = runtime.position[top_k_index]                         # [T, k] int64 table positions
    weights = _aligned(top_k_weights.to(torch.float32).contiguous())  # [T, k]
    return moe_experts(hidden, positions, weights, tables.first, tables.down, first_bias=tables.first_bias,
                       down_bias=tables.down_bias, epilogue=runtime.epilogue,
                       split_at=runtime.num_local if split else None, on_local_done=on_local_done if split else None,
                       first_scales=tables.first_scales, down_scales=tables.down_scales,
                       fp8_activations=tables.fp8_activations, config=tiles)


def warm_kernel(runtime: LayerRuntime, dtype: torch.dtype, top_k: int, num_tokens: int = 64, seed: int = 0) -> int:
    """Launch this layer's experts kernel in each form a forward can launch it, on seeded random inputs
    through the slot-0 tables; returns the number of moe_experts calls. The forms: every expert at once
    (its copies had landed) or local experts first, then the rest (they had not), each with every pair
    of tiles the number of tokens can select (kernels.moe_tile_pairs). Nothing is waited for and the
    outputs are discarded: the point is that Triton compiles (or loads) each specialisation now."""
    tables = runtime.kernel_tables[0]
    device = runtime.position.device
    num_experts = len(runtime.table_order)
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, tables.first.shape[1], generator=gen).to(device=device, dtype=dtype)  # [T, H]
    index = torch.randint(0, num_experts, (num_tokens, top_k), generator=gen)                              # [T, k]
    router_ids = torch.tensor(runtime.table_order)[index].to(device)  # router ids whose positions are `index`
    weights = torch.rand(num_tokens, top_k, generator=gen).to(device)  # [T, k]
    pairs = moe_tile_pairs(dtype, tables.first, tables.down, device=kernel_launch.device_info(hidden.device),
                           epilogue=runtime.epilogue, first_scales=tables.first_scales,
                           down_scales=tables.down_scales, first_bias=tables.first_bias is not None,
                           down_bias=tables.down_bias is not None, fp8_activations=tables.fp8_activations)
    calls = 0
    for tiles in pairs:
        for split in (False, True):
            _kernel_call(runtime, 0, hidden, router_ids, weights, split=split, on_local_done=lambda: None, tiles=tiles)
            calls += 1
    return calls
