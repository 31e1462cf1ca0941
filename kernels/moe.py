"""Fused MoE expert path over multi-buffer weights: sort, gate_up + gate, down + routing weight.

Legend: T = tokens, k = experts per token, S = T * k token-expert pairs (slot t * k + j: token t's j-th),
H = hidden size, I = expert intermediate size, E = experts in the weight tables.

Two launches of the multi-buffer grouped GEMM, no merge copy and no permute copies:
  1. gate_up: A rows are gathered from `hidden` through the sorted slots (slot // k), bias and
     gate (SwiGLU, clamped / interleaved SwiGLU, GELU, relu^2: an Epilogue) run in the epilogue on
     the fp32 accumulators; h is [S, I] in sorted order.
  2. down: h @ down_e.T, scaled by the routing weight of each slot in the epilogue, and stored
     at the slot's own row of an [S, H] buffer (combine="sum"), which a reshape + sum over k
     brings to token order; or added with fp32 atomics straight into [T, H] (combine="atomic").
"sum" is the default: deterministic, the same order of additions as transformers'
grouped_mm path, and the extra [S, H] round trip is small next to the two GEMMs (bench/
grouped_gemm.py measures both on GPU). "atomic" saves that round trip and the [S, H] buffer
but the summation order varies from run to run.

The sort and the expert offsets are computed with torch.sort and torch.searchsorted on the
device: no host sync anywhere on CUDA.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch

from dwdp.kernels.block_scales import BlockQuant
from dwdp.kernels.block_scales import quantize_rows_fp8
from dwdp.kernels.grouped_gemm import (
    SWIGLU,
    Epilogue,
    GroupedGemmConfig,
    _as_table,
    _check_bias,
    _check_device,
    _check_split,
    _launch,
    _require_triton,
    _tile_count,
    is_interpreter,
    kernel_problem,
)
from dwdp.kernels.launch import DeviceInfo, LaunchConfig, candidate_rows, device_info, launch_config
from dwdp.kernels.scaled_weights import ScaleTable, check_fp8_activations, scale_table
from dwdp.kernels.weight_tables import ExpertWeightTable


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the S = T * k token-expert slots by expert, on device without host syncs.

    top_k_index: [T, k] integer expert ids in [0, E).
    Returns (slots [S] int64: slot t * k + j of each sorted row, expert_offsets [E + 1] int64).
    The sort is stable, so within an expert the slots keep token order.
    """
    flat = top_k_index.reshape(-1)  # [S]
    sorted_ids, slots = torch.sort(flat, stable=True)  # [S], [S]
    bounds = torch.arange(num_experts + 1, device=flat.device, dtype=sorted_ids.dtype)  # [E + 1]
    expert_offsets = torch.searchsorted(sorted_ids, bounds)  # [E + 1] first row of each expert
    return slots, expert_offsets


def moe_experts(
    hidden: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: Sequence[torch.Tensor] | ExpertWeightTable,
    down: Sequence[torch.Tensor] | ExpertWeightTable,
    *,
    first_bias: Sequence[torch.Tensor] | ExpertWeightTable | None = None,
    down_bias: Sequence[torch.Tensor] | ExpertWeightTable | None = None,
    epilogue: Epilogue | None = None,
    combine: Literal["sum", "atomic"] = "sum",
    split_at: int | None = None,
    on_local_done: Callable[[], None] | None = None,
    wave_size: int | None = None,
    config: GroupedGemmConfig | tuple[GroupedGemmConfig | None, GroupedGemmConfig | None] | None = None,
    first_scales: Sequence[torch.Tensor] | ScaleTable | None = None,
    down_scales: Sequence[torch.Tensor] | ScaleTable | None = None,
    first_quant: BlockQuant | None = None,
    down_quant: BlockQuant | None = None,
    fp8_activations: bool = False,
) -> torch.Tensor:
    """The experts part of one MoE layer: out[t] = sum_j w[t, j] * down_e(act(gate_e x_t) * up_e x_t).

    hidden: [T, H] bf16/fp16/fp32, contiguous. top_k_index: [T, k] integer ids in [0, E) (values
        are checked on CPU only). top_k_weights: [T, k] float routing weights.
    gate_up: E views [2I, H] ([gate; up] halves, or interleaved rows) or their ExpertWeightTable;
        [I, H] (up only) when the epilogue is not gated. down: E views [H, I]. A view may be the
        transpose of a contiguous [in, out] tensor. The views may sit in any number of buffers
        (local parameter, prefetch slots).
    first_bias, down_bias: optional E views [2I] (or [I]) and [H], added before the epilogue.
    epilogue: the gate of the first GEMM (default SwiGLU: silu(gate) * up, [gate; up] halves).
    combine: "sum" (deterministic, [S, H] buffer reduced over k) or "atomic" (fp32 atomics).
    first_scales, down_scales (+ first_quant, down_quant): fp8 gate_up / down views with E views of
        their block scales (or ScaleTables): tiles dequantized in the K loop (grouped_gemm).
    fp8_activations: with fp8 weights, quantize the tokens (and h) to fp8 per row and block of K
        (DeepSeek-V3's dynamic 1 x 128 activation scales) and run fp8 x fp8 dots, scaled per K tile.
    split_at: local-first scheduling with experts [0, split_at) local: both GEMMs first run the
        wave-aligned local prefix, then `on_local_done()` is called (e.g. make the compute stream
        wait for the prefetch), then both GEMMs run the remaining experts.
    wave_size: programs of each persistent grid (default: SMs x the tiles' programs_per_sm).
    config: tiles of both GEMMs, or a (gate_up, down) pair; default: each GEMM's own, from
        `moe_launch_configs` (`moe_tile_pairs` lists every pair a number of tokens can select).
    Returns [T, H] in hidden's dtype.
    """
    _require_triton()
    epilogue = epilogue or SWIGLU
    gate_up_table = _as_table(gate_up, "gate_up")
    down_table = _as_table(down, "down")
    first_bias_table = None if first_bias is None else _as_table(first_bias, "first_bias", ndim=1)
    down_bias_table = None if down_bias is None else _as_table(down_bias, "down_bias", ndim=1)
    first_scale_table = None if first_scales is None else scale_table(first_scales, first_quant, gate_up_table,
                                                                       "first_scales")
    down_scale_table = None if down_scales is None else scale_table(down_scales, down_quant, down_table,
                                                                    "down_scales")
    if fp8_activations:
        check_fp8_activations(first_scale_table, first_bias_table, "first_scales", is_interpreter())
        check_fp8_activations(down_scale_table, down_bias_table, "down_scales", is_interpreter())
    _check_bias(first_bias_table, gate_up_table, "first_bias", hidden.dtype)
    _check_bias(down_bias_table, down_table, "down_bias", hidden.dtype)
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ValueError(f"hidden must be a 2-D tensor [T, H], got {getattr(hidden, 'shape', type(hidden))}")
    if not hidden.is_contiguous():
        raise ValueError(f"hidden must be contiguous, got strides {hidden.stride()}")
    _check_device(hidden.device, "hidden")
    num_tokens, hidden_dim = hidden.shape
    num_experts = gate_up_table.num_experts
    two_i, h_gate_up = gate_up_table.shape
    if epilogue.gated and two_i % 2:
        raise ValueError(f"gate_up views have {two_i} rows, expected 2I (gate and up halves)")
    inter = two_i // 2 if epilogue.gated else two_i
    if h_gate_up != hidden_dim:
        raise ValueError(f"gate_up views are [{two_i}, {h_gate_up}] but hidden has H={hidden_dim}")
    if down_table.num_experts != num_experts:
        raise ValueError(f"down has {down_table.num_experts} experts but gate_up has {num_experts}")
    if down_table.shape != (hidden_dim, inter):
        raise ValueError(f"down views are {list(down_table.shape)}, expected [H, I] = [{hidden_dim}, {inter}]")
    for name, table, scales in (("gate_up", gate_up_table, first_scale_table), ("down", down_table, down_scale_table)):
        if (table.dtype != hidden.dtype and scales is None) or table.device != hidden.device:
            raise ValueError(
                f"{name} is {table.dtype} on {table.device}, expected {hidden.dtype} on {hidden.device} like hidden"
            )
    index_ok = top_k_index.dim() == 2 and top_k_index.shape[0] == num_tokens
    if not index_ok or top_k_index.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"top_k_index must be int32/int64 [T={num_tokens}, k], got {top_k_index.dtype} {tuple(top_k_index.shape)}"
        )
    if top_k_index.device != hidden.device:
        raise ValueError(f"top_k_index is on {top_k_index.device}, expected {hidden.device}")
    weights_ok = top_k_weights.shape == top_k_index.shape and top_k_weights.device == hidden.device
    if not weights_ok or not top_k_weights.is_floating_point():
        raise ValueError(
            f"top_k_weights must be a float tensor {tuple(top_k_index.shape)} on {hidden.device}, "
            f"got {top_k_weights.dtype} {tuple(top_k_weights.shape)} on {top_k_weights.device}"
        )
    if combine not in ("sum", "atomic"):
        raise ValueError(f"combine={combine!r} must be 'sum' or 'atomic'")
    if hidden.device.type == "cpu" and top_k_index.numel():  # a range check on CUDA would sync
        low, high = int(top_k_index.min()), int(top_k_index.max())
        if low < 0 or high >= num_experts:
            raise ValueError(f"top_k_index values span [{low}, {high}], expected [0, {num_experts})")
    top_k = top_k_index.shape[1]
    num_slots = num_tokens * top_k
    device = device_info(hidden.device)
    first_launch, down_launch = moe_launch_configs(
        hidden.dtype, gate_up_table, down_table, num_slots=num_slots, device=device, epilogue=epilogue,
        first_scales=first_scale_table, down_scales=down_scale_table, first_bias=first_bias_table is not None,
        down_bias=down_bias_table is not None, combine=combine, fp8_activations=fp8_activations, config=config)
    first_wave = first_launch.wave_size(device) if wave_size is None else wave_size
    down_wave = down_launch.wave_size(device) if wave_size is None else wave_size
    split = _check_split(split_at, "all" if split_at is None else "first", num_experts, first_wave)

    if num_slots == 0:
        return hidden.new_zeros(num_tokens, hidden_dim)
    slots, expert_offsets = sort_by_expert(top_k_index, num_experts)  # [S], [E + 1]
    slot_weights = top_k_weights.reshape(-1).contiguous()  # [S], indexed by slot in the kernel
    if first_launch.quant_out:  # fp8 dots: gate_up's epilogue writes h as fp8 with its scales (no h round trip)
        h = torch.empty(num_slots, inter, dtype=torch.float8_e4m3fn, device=hidden.device)  # [S, I] sorted rows
        h_scales = quantize_scales(num_slots, inter, down_scale_table.quant.block[1], hidden.device)  # [S, I / bk]
    else:
        h, h_scales = hidden.new_empty(num_slots, inter), None  # [S, I] sorted rows
    if combine == "sum":
        out = hidden.new_empty(num_slots, hidden_dim)  # [S, H] slot rows
    else:
        out = torch.zeros(num_tokens, hidden_dim, dtype=torch.float32, device=hidden.device)  # [T, H]
    # Each GEMM's split also checks the other's waves, so both cut at the same expert.
    first_partner = (_tile_count(inter, first_launch.tiles.block_n), first_launch.tiles.block_m, first_wave)
    down_partner = (_tile_count(hidden_dim, down_launch.tiles.block_n), down_launch.tiles.block_m, down_wave)

    first_a, first_a_scales = hidden, None
    if fp8_activations:  # tokens quantized once, before any launch (rows gathered with their scales)
        first_a, first_a_scales = quantize_rows_fp8(hidden, first_scale_table.quant.block[1],
                                                    groups_first=True)  # [T, H], [T, H / bk]
    parts = ("all",) if split_at is None else ("first", "second")
    for part in parts:
        if part == "second" and on_local_done is not None:
            on_local_done()
        _launch(
            first_a, expert_offsets, gate_up_table, h, launch=first_launch,
            num_rows=num_slots, slots=slots, scale=None, epilogue=epilogue, bias=first_bias_table,
            scales=first_scale_table, top_k=top_k, split_at=split, partner=down_partner, part=part,
            wave_size=first_wave, a_scales=first_a_scales, out_scales=h_scales,
            act_group=first_scale_table.quant.block[1] if fp8_activations else 1,
        )
        down_a, down_a_scales = h, h_scales
        if fp8_activations and h_scales is None:  # this part's rows of h are final: quantize them for the fp8 dots
            down_a, down_a_scales = quantize_rows_fp8(h, down_scale_table.quant.block[1],
                                                      groups_first=True)  # [S, I], [S, I / bk]
        _launch(
            down_a, expert_offsets, down_table, out, launch=down_launch,
            num_rows=num_slots, slots=slots, scale=slot_weights, epilogue=None, bias=down_bias_table,
            scales=down_scale_table, top_k=top_k, split_at=split, partner=first_partner, part=part,
            wave_size=down_wave, a_scales=down_a_scales,
            act_group=down_scale_table.quant.block[1] if fp8_activations else 1,
        )
    if combine == "sum":
        return out.view(num_tokens, top_k, hidden_dim).sum(dim=1)  # [T, H]
    return out.to(hidden.dtype)


def quantize_scales(rows: int, cols: int, group: int, device: torch.device) -> torch.Tensor:
    """Room for the scales of fp8 activations [rows, cols], one per row and `group` columns: a [rows, Kg]
    view of [Kg, rows] storage, the layout quantize_rows_fp8(groups_first=True) returns."""
    return torch.empty(-(-cols // group), rows, dtype=torch.float32, device=device).t()


def moe_launch_configs(
    dtype: torch.dtype,
    gate_up: ExpertWeightTable,
    down: ExpertWeightTable,
    *,
    num_slots: int,
    device: DeviceInfo,
    epilogue: Epilogue | None = None,
    first_scales: ScaleTable | None = None,
    down_scales: ScaleTable | None = None,
    first_bias: bool = False,
    down_bias: bool = False,
    combine: Literal["sum", "atomic"] = "sum",
    fp8_activations: bool = False,
    config: GroupedGemmConfig | tuple[GroupedGemmConfig | None, GroupedGemmConfig | None] | None = None,
) -> tuple[LaunchConfig, LaunchConfig]:
    """The launch configurations of `moe_experts`' two GEMMs (gate_up, down) for `num_slots` = T * k
    token-expert slots of activations in `dtype` (kernels/launch.py chooses them; `config`: tiles for
    both, or a (gate_up, down) pair). With fp8 activations gate_up asks to store h in fp8 with the scales
    the down GEMM's dots read (done where its tiles cover whole scale groups: `LaunchConfig.quant_out`)."""
    a_dtype = torch.float8_e4m3fn if fp8_activations else dtype
    first = kernel_problem(a_dtype, gate_up, num_rows=num_slots, epilogue=epilogue or SWIGLU, scales=first_scales,
                           gather_a=True, has_bias=first_bias,
                           quant_out_group=down_scales.quant.block[1] if fp8_activations else 0, quant_out_round=dtype)
    second = kernel_problem(a_dtype, down, num_rows=num_slots, scales=down_scales, scatter_out=True,
                            atomic_out=combine == "atomic", has_row_scale=True, has_bias=down_bias)
    first_tiles, down_tiles = config if isinstance(config, tuple) else (config, config)
    return launch_config(first, device, first_tiles), launch_config(second, device, down_tiles)


def moe_tile_pairs(dtype: torch.dtype, gate_up: ExpertWeightTable, down: ExpertWeightTable, *, device: DeviceInfo,
                   **options) -> list[tuple[GroupedGemmConfig, GroupedGemmConfig]]:
    """Every (gate_up tiles, down tiles) pair `moe_experts` can launch with for these weights, whatever
    the number of tokens: the pairs a warm-up passes as `config` so that serving compiles nothing.
    options: as moe_launch_configs (epilogue, scales, biases, combine, fp8_activations)."""
    experts = gate_up.num_experts
    rows = set()
    for launch in moe_launch_configs(dtype, gate_up, down, num_slots=experts, device=device, **options):
        rows.update(candidate_rows(launch.problem, device))
    pairs = []
    for r in sorted(rows):
        first, second = moe_launch_configs(dtype, gate_up, down, num_slots=r * experts, device=device, **options)
        if (first.tiles, second.tiles) not in pairs:
            pairs.append((first.tiles, second.tiles))
    return pairs
