"""Quantized experts in a model: what a checkpoint's `quantization_config` says about its experts, and
laying an experts module out for quantized values and scales.

Legend: E = experts, N = output features of a projection, K = input features of a projection, I = expert
intermediate size, H = hidden size.

Two expert formats are read (dwdp.kernels.block_scales): fp8 with block scales (`quant_method` "fp8",
DeepSeek-V3 / R1 and transformers' FineGrainedFP8Config: `weight_block_size`, `scale_fmt` float or
ue8m0, dynamic activations) and MXFP4 (`quant_method` "mxfp4", gpt-oss). Experts stay quantized in
memory and on the wire: `relayout_experts` swaps a dense experts module's projections for tensors of
the quantized layout (fp8 values + `<name>_scale_inv`, as FP8Experts holds them; MXFP4 `<name>_blocks`
+ `<name>_scales`), which dwdp.models.adapters then reads like FP8Experts. Dense weights are not the subject
here: the loader dequantizes them once at load (they are replicated, never moved).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from dwdp.models.adapters import ExpertsLayer
from dwdp.models.adapters.quantized import FP8_SCALE_SUFFIX, MXFP4_SUFFIXES
from dwdp.kernels.block_scales import FP8_DTYPE, MXFP4_GROUP, UE8M0_DTYPE, BlockQuant

SCALE_FORMATS = ("float", "ue8m0")


@dataclass(frozen=True)
class ExpertsQuantization:
    """How a checkpoint stores its experts.

    format: "fp8" or "mxfp4"; block: fp8 (rows, cols) per scale, None for one scale per matrix;
    scale_fmt: fp8 scales as fp32 ("float") or e8m0 powers of two ("ue8m0").
    """

    format: str
    block: tuple[int, int] | None = None
    scale_fmt: str = "float"

    @classmethod
    def from_config(cls, config, where: str) -> "ExpertsQuantization":
        """From a checkpoint's `quantization_config` (dict or transformers config object); ValueError
        naming `where` and the unsupported setting otherwise."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        method = str(get("quant_method", None))
        if method == "mxfp4":
            return cls("mxfp4")
        if method != "fp8":
            raise ValueError(f"{where}: quantization_config quant_method={method!r} is not supported; dwdp reads "
                             "'fp8' (block-scaled, e.g. DeepSeek-V3/R1) and 'mxfp4' (gpt-oss) experts")
        block = get("weight_block_size", None)
        scale_fmt = get("scale_fmt", "float") or "float"
        activation = get("activation_scheme", "dynamic") or "dynamic"
        expert_dtype = get("expert_dtype", "fp8") or "fp8"
        if block is not None and (len(block) != 2 or min(int(b) for b in block) < 1):
            raise ValueError(f"{where}: quantization_config weight_block_size={block!r} must be two ints >= 1")
        if scale_fmt not in SCALE_FORMATS:
            raise ValueError(f"{where}: quantization_config scale_fmt={scale_fmt!r} is not one of {SCALE_FORMATS}")
        if activation != "dynamic":
            raise ValueError(f"{where}: quantization_config activation_scheme={activation!r} is not supported: "
                             "dwdp reads fp8 weights with dynamic activations")
        if expert_dtype != "fp8":
            raise ValueError(f"{where}: quantization_config expert_dtype={expert_dtype!r} is not supported: "
                             "dwdp reads fp8 expert weights")
        return cls("fp8", None if block is None else (int(block[0]), int(block[1])), scale_fmt)

    @property
    def scale_dtype(self) -> torch.dtype:
        if self.format == "mxfp4":
            return torch.uint8
        if self.scale_fmt == "ue8m0" and UE8M0_DTYPE is None:
            raise RuntimeError(f"scale_fmt='ue8m0' needs torch.float8_e8m0fnu (torch >= 2.7), torch is "
                               f"{torch.__version__}")
        return UE8M0_DTYPE if self.scale_fmt == "ue8m0" else torch.float32

    def block_quant(self, rows: int, cols: int, fused_gate: bool) -> BlockQuant:
        """The BlockQuant of one [rows, cols] projection (`fused_gate`: [gate; up] blocked per half)."""
        if self.format == "mxfp4":
            return BlockQuant("mxfp4", (1, MXFP4_GROUP))
        halves = 2 if fused_gate else 1
        return BlockQuant("fp8", self.block or (rows // halves, cols), halves)

    def config_dict(self) -> dict:
        """The `quantization_config` a checkpoint of this format carries (as transformers writes it)."""
        if self.format == "mxfp4":
            return {"quant_method": "mxfp4"}
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": list(self.block) if self.block else None, "scale_fmt": self.scale_fmt}


def projections(layer: ExpertsLayer) -> list[tuple[str, bool, bool]]:
    """(attribute, is a fused gate/up, stored transposed) of each dense projection of a standard layer."""
    spec = layer.spec
    math_ = spec.math
    if len(math_.first) != 1 or math_.quantized or math_.weights_on_input:
        raise ValueError(f"{layer.name} ({type(layer.module).__name__}): quantized experts are read for stacked "
                         f"experts with one first projection; this layer has {[t.name for t in spec.tensors]}")
    gated = bool(spec.extras.get("has_gate", True))
    return [(math_.first[0], gated, math_.first[0] in math_.transposed),
            (math_.down, False, math_.down in math_.transposed)]


def logical_weight(layer: ExpertsLayer, attr: str, transposed: bool) -> torch.Tensor:
    """The stacked projection as [E, N, K] (a view; transposed storage read transposed)."""
    stored = getattr(layer.module, attr)
    return stored.transpose(1, 2) if transposed else stored


def relayout_experts(layer: ExpertsLayer, quant: ExpertsQuantization,
                     values: dict[str, torch.Tensor] | None = None) -> None:
    """Swap `layer`'s dense projections for the quantized layout of the same logical [E, N, K] shapes.

    Without `values` the new tensors are on the meta device (a loader fills them); with them, `values`
    maps each new attribute name to its tensor. An MXFP4 layout is [out, in] whatever the dense one
    was. fp8 needs [out, in] storage (ValueError otherwise); the module gets `block_size` like FP8Experts.
    """
    module = layer.module
    for attr, fused_gate, transposed in projections(layer):
        num, rows, cols = logical_weight(layer, attr, transposed).shape
        bq = quant.block_quant(rows, cols, fused_gate)
        if quant.format == "fp8":
            if transposed:
                raise ValueError(f"{layer.name}.{attr} is stored [in, out]: fp8 block scales are read on [out, in] "
                                 "weights only")
            shapes = {attr: ((num, rows, cols), FP8_DTYPE),
                      attr + FP8_SCALE_SUFFIX: ((num, *bq.scale_shape(rows, cols)), quant.scale_dtype)}
        else:
            if cols % MXFP4_GROUP:
                raise ValueError(f"{layer.name}.{attr}: mxfp4 needs K divisible by {MXFP4_GROUP}, K={cols}")
            blocks, scales = (attr + s for s in MXFP4_SUFFIXES)
            shapes = {blocks: ((num, *bq.stored_shape(rows, cols)), torch.uint8),
                      scales: ((num, rows, cols // MXFP4_GROUP), torch.uint8)}
        del module._parameters[attr]
        for name, (shape, dtype) in shapes.items():
            tensor = torch.empty(shape, dtype=dtype, device="meta") if values is None else values[name]
            if tuple(tensor.shape) != shape or tensor.dtype != dtype:
                raise ValueError(f"{layer.name}.{name} is {tensor.dtype} {list(tensor.shape)}, expected {dtype} "
                                 f"{list(shape)}")
            module.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
    if quant.format == "fp8":
        module.block_size = quant.block
