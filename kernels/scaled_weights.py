"""fp8 weights with block scales for the Triton grouped GEMM: each expert's scale view, wherever it
lives, next to its weight view, validated once into a table the kernel reads in its K loop.

Legend: E = experts in the table, N = output features (of one expert's weight), K = input features,
SR = rows of a weight's scale grid, SC = columns of a weight's scale grid (dwdp.kernels.block_scales).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dwdp.kernels.block_scales import FP8_DTYPE, UE8M0_DTYPE, BlockQuant
from dwdp.kernels.weight_tables import ExpertWeightTable, expert_weight_table


@dataclass(frozen=True)
class ScaleTable:
    """Per-expert base addresses of E scale views [SR, SC] and how they cover the weights.

    table: the views (fp32, or e8m0 exponent bytes viewed as uint8); quant: their blocking.
    half_rows / half_scale_rows: weight rows and scale rows of one separately blocked half.
    """

    table: ExpertWeightTable
    quant: BlockQuant
    is_e8m0: bool
    half_rows: int
    half_scale_rows: int


def scale_table(scales: Sequence[torch.Tensor] | ScaleTable, quant: BlockQuant | None, weights: ExpertWeightTable,
                name: str) -> ScaleTable:
    """Validate the scales of the fp8 `weights` ([N, K] views) and build their table once.

    Raises ValueError naming `name` (and the expert) for another format, another shape than one scale
    per block, a scale dtype other than fp32 / e8m0, or weights that are not float8_e4m3fn.
    """
    if isinstance(scales, ScaleTable):
        return scales
    if not isinstance(quant, BlockQuant):
        raise ValueError(f"{name} needs its BlockQuant (quant=...), got {quant!r}")
    if quant.format != "fp8":
        raise ValueError(f"{name}: the Triton kernel reads fp8 weights with block scales, not {quant.format} "
                         "(that runs on the reference path)")
    if weights.dtype != FP8_DTYPE:
        raise ValueError(f"{name} scales {weights.dtype} weights; block scales go with float8_e4m3fn weights")
    views = list(scales)
    if len(views) != weights.num_experts:
        raise ValueError(f"{name} has {len(views)} views, expected one per expert ({weights.num_experts})")
    rows, cols = weights.shape
    expected = quant.scale_shape(rows, cols)
    dtypes = {v.dtype for v in views}
    if len(dtypes) != 1 or next(iter(dtypes)) not in (torch.float32, UE8M0_DTYPE):
        raise ValueError(f"{name} has dtypes {sorted(map(str, dtypes))}, expected torch.float32 or e8m0 scales")
    for e, v in enumerate(views):
        if tuple(v.shape) != expected:
            raise ValueError(f"{name}[{e}] has shape {list(v.shape)}, expected {list(expected)}: one scale per "
                             f"{quant.block[0]} x {quant.block[1]} block of its [{rows}, {cols}] weight")
    is_e8m0 = views[0].dtype == UE8M0_DTYPE
    if is_e8m0:
        views = [v.view(torch.uint8) for v in views]
    table = expert_weight_table(views, name=name, aligned=False)  # scalar loads: no alignment needed
    return ScaleTable(table, quant, is_e8m0, rows // quant.halves, expected[0] // quant.halves)


def check_fp8_activations(scales: ScaleTable | None, bias, name: str, is_interpreter: bool) -> None:
    """fp8 x fp8 dots need fp8 weights whose block columns a power-of-two K tile divides (one weight
    scale and one activation scale per row / column for a whole tile, kernels.launch.fp8_block_k), and
    no bias (none of the fp8 experts in use has one). ValueError naming `name` otherwise."""
    from dwdp.kernels.launch import fp8_block_k

    if scales is None:
        raise ValueError(f"fp8_activations needs fp8 weights with block scales; {name} is missing")
    block_k = scales.quant.block[1]
    if fp8_block_k(block_k, is_interpreter) is None:
        raise ValueError(f"fp8_activations needs scale blocks whose {block_k} columns a power-of-two K tile "
                         f">= {16 if is_interpreter else 32} divides ({name})")
    if bias is not None:
        raise ValueError(f"fp8_activations does not take biases ({name}'s weights have them)")
