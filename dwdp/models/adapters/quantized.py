"""One stacked projection of an experts module, dense or quantized, as the tensors that carry it.

Legend: E = experts stored, N = output features of the projection, K = input features of the projection.

Dense: `<name>` [E, N, K] ([E, K, N] when the module stores weights transposed).
fp8 (transformers' FP8Experts, or a layer dwdp's loader laid out the same way): `<name>`
    float8_e4m3fn [E, N, K] next to `<name>_scale_inv` [E, ceil(N / bn), ceil(K / bk)] (fp32 or e8m0),
    with the module's `block_size` (bn, bk) (None: one scale per matrix). A fused gate/up projection
    is blocked per half (dwdp.kernels.block_scales).
MXFP4 (gpt-oss checkpoints): `<name>_blocks` uint8 [E, N, K / 32, 16] and `<name>_scales` uint8
    [E, N, K / 32], always [out, in].
Values and scales are separate expert tensors: both live with their expert's owners and travel together.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dwdp.models.expert_tensors import ExpertTensor, QuantizedWeight
from dwdp.kernels.block_scales import FP8_DTYPE, FP8_SCALE_DTYPES, MXFP4_GROUP, BlockQuant
from dwdp.models.adapters.base import Unsupported

FP8_SCALE_SUFFIX = "_scale_inv"
MXFP4_SUFFIXES = ("_blocks", "_scales")


@dataclass(frozen=True)
class Projection:
    """One projection of every expert: its tensors, and its shape as the math reads it.

    shape: [E, a, b] per the module's orientation ([E, N, K], or [E, K, N] when stored transposed);
    quantized: how values and scales combine, None when dense.
    """

    shape: tuple[int, int, int]
    tensors: tuple[ExpertTensor, ...]
    quantized: QuantizedWeight | None = None

    @property
    def weight(self) -> str:
        return self.tensors[0].name


def _tensor(module: torch.nn.Module, attr: str):
    value = getattr(module, attr, None)
    return value if isinstance(value, torch.Tensor) else None


def _describe(t) -> str:
    return "missing" if t is None else f"{t.dtype} of shape {list(t.shape)}"


def read_projection(name: str, module: torch.nn.Module, attr: str, *, fused_gate: bool,
                    transposed: bool) -> Projection:
    """The projection `attr` ("gate_up_proj", "up_proj", "down_proj") of `module`, dense or quantized.

    fused_gate: it holds gate and up halves (their fp8 scales are blocked per half).
    Raises Unsupported naming the tensor when its values, scales or layout do not fit.
    """
    value = _tensor(module, attr)
    blocks, exponents = (_tensor(module, attr + s) for s in MXFP4_SUFFIXES)
    if value is None and blocks is not None:
        return _mxfp4(name, module, attr, blocks, exponents)
    if value is None or value.dim() != 3:
        raise Unsupported(name, module, attr, f"is {_describe(value)}, expected a 3-D tensor [num_experts, ...]")
    if value.dtype != FP8_DTYPE:
        if value.element_size() == 1 or not value.is_floating_point():
            raise Unsupported(name, module, attr, f"is {value.dtype}: dwdp reads dense float weights, float8_e4m3fn "
                                                  f"with {attr}{FP8_SCALE_SUFFIX}, or MXFP4 {attr}_blocks / _scales")
        return Projection(tuple(value.shape), (ExpertTensor(attr, attr, tuple(value.shape[1:]), value.dtype),))
    return _fp8(name, module, attr, value, fused_gate, transposed)


def _fp8(name, module, attr: str, value: torch.Tensor, fused_gate: bool, transposed: bool) -> Projection:
    scale_attr = attr + FP8_SCALE_SUFFIX
    scale = _tensor(module, scale_attr)
    if transposed:
        raise Unsupported(name, module, attr, "is float8_e4m3fn stored [in, out]: fp8 block scales are read on "
                                              "[out, in] weights only")
    if scale is None or scale.dim() != 3 or scale.dtype not in FP8_SCALE_DTYPES:
        raise Unsupported(name, module, scale_attr, f"is {_describe(scale)}; float8_e4m3fn {attr} needs its block "
                                                    f"scales, a 3-D {' or '.join(map(str, FP8_SCALE_DTYPES))} tensor")
    num, rows, cols = value.shape
    block = getattr(module, "block_size", None)
    # None: one scale per matrix (per half of a fused gate/up, as FP8Experts allocates it).
    block = (rows // 2 if fused_gate else rows, cols) if block is None else tuple(int(b) for b in block)
    # A fused gate/up is blocked per half (gate_proj and up_proj quantized apart, as checkpoints store
    # them); a scale grid only the plain blocking of [2I, K] explains is read that way.
    candidates = [BlockQuant("fp8", block, 2)] if fused_gate else []
    candidates.append(BlockQuant("fp8", block, 1))
    quant = next((q for q in candidates if tuple(scale.shape) == (num, *q.scale_shape(rows, cols))), None)
    if quant is None:
        expected = " or ".join(str([num, *q.scale_shape(rows, cols)]) for q in candidates)
        raise Unsupported(name, module, scale_attr,
                          f"has shape {list(scale.shape)}, expected {expected}: one scale per {block[0]} x "
                          f"{block[1]} block of {attr} {list(value.shape)}")
    expected = quant.scale_shape(rows, cols)
    tensors = (ExpertTensor(attr, attr, (rows, cols), value.dtype),
               ExpertTensor(scale_attr, scale_attr, expected, scale.dtype))
    return Projection((num, rows, cols), tensors, QuantizedWeight(attr, scale_attr, quant))


def _mxfp4(name, module, attr: str, blocks: torch.Tensor, exponents) -> Projection:
    blocks_attr, scales_attr = (attr + s for s in MXFP4_SUFFIXES)
    if blocks.dim() != 4 or blocks.dtype != torch.uint8 or blocks.shape[-1] != MXFP4_GROUP // 2:
        raise Unsupported(name, module, blocks_attr, f"is {_describe(blocks)}, expected uint8 [num_experts, N, K / "
                                                     f"{MXFP4_GROUP}, {MXFP4_GROUP // 2}] (two e2m1 values per byte)")
    num, rows, groups, _ = blocks.shape
    if exponents is None or exponents.dtype != torch.uint8 or tuple(exponents.shape) != (num, rows, groups):
        raise Unsupported(name, module, scales_attr, f"is {_describe(exponents)}, expected uint8 {[num, rows, groups]}: "
                                                     f"one exponent per {MXFP4_GROUP} values of {blocks_attr}")
    quant = BlockQuant("mxfp4", (1, MXFP4_GROUP))
    tensors = (ExpertTensor(blocks_attr, blocks_attr, tuple(blocks.shape[1:]), torch.uint8),
               ExpertTensor(scales_attr, scales_attr, (rows, groups), torch.uint8))
    return Projection((num, rows, groups * MXFP4_GROUP), tensors, QuantizedWeight(blocks_attr, scales_attr, quant))
