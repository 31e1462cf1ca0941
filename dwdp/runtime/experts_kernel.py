"""Which MoE layers the Triton experts kernel runs, with which epilogue, and its weight tables.

The kernel computes y = epilogue(x @ W1^T + b1) @ W2^T + b2 for one fused first projection W1
(gate_up, or up without a gate), weights stored [out, in] or transposed (or fp8 [out, in] with block
scales), biases optional; the epilogue is one of a few gates (dwdp.kernels.Epilogue). A layer's own gate function is identified
by evaluating it on a seeded random probe, wide enough to reach any clamp, and comparing it with
each epilogue the kernel implements; clamp limit and sigmoid gain come from the module's
attributes. Anything else (two first projections, a post-expert norm, routing weight on the
input, identity experts, a gate no epilogue reproduces, MXFP4 weights) runs on the reference path.
"""
from __future__ import annotations

import importlib
import itertools

import torch

from dwdp.kernels import Epilogue, epilogue_reference, expert_weight_table, is_interpreter, scale_table
from dwdp.kernels.launch import fp8_block_k
from dwdp.models.adapters import ExpertsLayer
from dwdp.models.expert_tensors import ALIGN_BYTES, ExpertsSpec
from dwdp.runtime.experts import KernelTables, LayerTables

_GROUPED_GEMM = importlib.import_module("dwdp.kernels.grouped_gemm")  # the module, not the function of that name
_PROBE_ROWS = 64
_PROBE_SCALE = 8.0  # |x| up to ~30: past any clamp limit in use (7 for gpt-oss)
_LIMIT_ATTRS = ("limit", "swiglu_limit")
_ALPHA_ATTRS = ("alpha", "swiglu_alpha")


def _attr(module: torch.nn.Module, names: tuple[str, ...], default: float) -> float:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return default


def _candidates(module: torch.nn.Module, gated: bool, interleaved_hint: bool):
    if not gated:
        for act in ("relu2", "silu", "gelu_tanh"):
            yield Epilogue(activation=act, gated=False)
        return
    alpha = _attr(module, _ALPHA_ATTRS, 1.0)
    limit = _attr(module, _LIMIT_ATTRS, float("inf"))
    layouts = (True, False) if interleaved_hint else (False, True)
    for interleaved, act, (a, lim), offset in itertools.product(
        layouts, ("silu", "gelu_tanh"), {(1.0, float("inf")), (alpha, limit), (1.0, limit)}, (0.0, 1.0)
    ):
        if act != "silu" and a != 1.0:
            continue
        yield Epilogue(activation=act, gated=True, interleaved=interleaved, alpha=a, limit=lim, up_offset=offset)


def identify_epilogue(layer: ExpertsLayer):
    """The kernel Epilogue that reproduces the layer's gate on a seeded random probe, or None."""
    spec = layer.spec
    first = spec.tensor(spec.math.first[0])
    n1 = first.shape[1] if first.name in spec.math.transposed else first.shape[0]
    probe = torch.randn(_PROBE_ROWS, n1, generator=torch.Generator().manual_seed(0)) * _PROBE_SCALE  # [R, N1]
    try:
        with torch.no_grad():
            expected = spec.math.gate(probe)
    except Exception:  # a gate that cannot run on a plain fp32 tensor is not one the kernel knows
        return None
    gated = bool(spec.extras.get("has_gate", True))
    for epilogue in _candidates(layer.module, gated, bool(spec.extras.get("interleaved"))):
        got = epilogue_reference(probe, epilogue)
        if got.shape == expected.shape and torch.allclose(got, expected, rtol=1e-5, atol=1e-5):
            return epilogue
    return None


# Triton specialises an int argument on being 1 and on divisibility by 16: one top-k of each form
# compiles every specialisation a routing's top-k can select.
TOP_K_FORMS = (1, 2, 16)
_TOP_K_FIELDS = ("num_experts_per_tok", "moe_topk", "moe_k", "moe_top_k", "top_k_experts", "num_experts_per_token")


def compiled_specialisations() -> int:
    """Specialisations of the experts kernel this process has compiled (or loaded from Triton's disk
    cache) so far; 0 where Triton is absent or interprets. A count that grows after warm-up means a
    launch met a form warm-up did not compile, and stalled while it compiled."""
    kernel = getattr(_GROUPED_GEMM, "_grouped_gemm_kernel", None)  # defined only where Triton imports
    if kernel is None:
        return 0
    caches = getattr(kernel, "device_caches", None) or {}
    return sum(len(entry[0]) for entry in caches.values())


def routing_top_k(model: torch.nn.Module) -> int | None:
    """Experts per token of `model`'s router as its config states it (text sub-config included), or None."""
    config = getattr(model, "config", None)
    for cfg in (config, getattr(config, "text_config", None), getattr(config, "ffn_config", None)):
        for field in _TOP_K_FIELDS:
            value = getattr(cfg, field, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def kernel_blocker(layer: ExpertsLayer) -> str | None:
    """Why the Triton kernel cannot run this layer, or None when it can."""
    spec: ExpertsSpec = layer.spec
    math = spec.math
    if len(math.first) != 1:
        return f"its first projection is {len(math.first)} separate tensors {list(math.first)}"
    if math.post_norm is not None:
        return "it applies a norm after each expert"
    if math.weights_on_input:
        return "its routing weight scales the expert's input"
    if math.num_identity_experts:
        return f"it has {math.num_identity_experts} identity experts"
    not_fp8 = [q.quant.format for q in math.quantized if q.quant.format != "fp8"]
    if not_fp8:
        return f"its weights are {not_fp8[0]} (the kernel reads fp8 weights with block scales)"
    if len(math.quantized) not in (0, 2):
        return "only one of its projections is quantized"
    scales = set(math.scales)
    dtypes = {t.dtype for t in spec.tensors if t.name not in scales and math.quantization(t.name) is None}
    if len(dtypes) > 1 or not all(d.is_floating_point for d in dtypes):
        return f"its expert tensors have dtypes {sorted(map(str, dtypes))}"
    unaligned = [t.name for t in spec.replicated if t.nbytes % ALIGN_BYTES]
    if unaligned:
        # Tensors that stay on every rank are read as rows of the module's [E, ...] tensor.
        return f"rows of {unaligned} are not {ALIGN_BYTES}-byte aligned"
    if identify_epilogue(layer) is None:
        return f"its gate ({math.gate_label}) is none of the kernel's epilogues"
    return None


def epilogue_of(layer: ExpertsLayer):
    epilogue = identify_epilogue(layer)
    if epilogue is None:
        raise ValueError(f"{layer.name}: the Triton experts kernel has no epilogue for {layer.spec.math.gate_label}")
    return epilogue


# fp8 experts under "auto": the path that dequantizes weight tiles to bf16 in the K loop ran at 21 TFLOP/s on
# an H100 against 205 for the same experts in bf16 (gpu_check g); "auto" takes a path only at >= 0.9x of
# bf16, so it runs fp8 experts with fp8 x fp8 dots ("triton_fp8"), or on the reference path where those
# cannot run. experts_kernel="triton" still asks for the dequantizing path.
AUTO_DEQUANTIZED_FP8 = False


def choose_experts_kernel(requested: str, device: torch.device, layers: list[ExpertsLayer]) -> str:
    """"triton" for CUDA models whose every layer the kernel runs ("triton_fp8" under "auto" when their
    experts are fp8: see AUTO_DEQUANTIZED_FP8), "reference" otherwise; an explicit "triton" (or
    "triton_fp8") that cannot work is an error naming the layer and the reason, not a silent fallback."""
    if requested == "reference" or (requested == "auto" and device.type != "cuda"):
        return "reference"
    fp8_layers = [layer for layer in layers if layer.spec.math.quantized]
    fp8_dots = requested == "triton_fp8" or (requested == "auto" and bool(fp8_layers) and not AUTO_DEQUANTIZED_FP8)
    for layer in layers:
        blocker = kernel_blocker(layer)
        if blocker is None and fp8_dots:
            blocker = fp8_dot_blocker(layer)
        if blocker is not None:
            if requested in ("triton", "triton_fp8"):
                raise ValueError(f"experts_kernel={requested!r} cannot run {layer.name} ({type(layer.module).__name__}): "
                                 f"{blocker}")
            return "reference"
    return "triton_fp8" if fp8_dots else "triton"


def fp8_dot_blocker(layer: ExpertsLayer) -> str | None:
    """Why fp8 x fp8 dots cannot run this layer (on top of kernel_blocker), or None."""
    math = layer.spec.math
    if len(math.quantized) != 2:
        return "fp8 dots need fp8 weights with block scales"
    columns = [q.quant.block[1] for q in math.quantized]
    if any(fp8_block_k(c, is_interpreter()) is None for c in columns):
        return (f"its scale blocks span {columns} columns, which no power-of-two K tile >= "
                f"{16 if is_interpreter() else 32} divides")
    if math.biases:
        return "fp8 dots take no biases"
    return None


def kernel_weight_tables(spec: ExpertsSpec, tables: LayerTables, fp8_activations: bool = False) -> KernelTables:
    """The Triton path's address tables of one slot's per-expert views (built once, reused)."""
    math = spec.math

    def weights(name: str):
        views = tables[name]
        if name in math.transposed:
            views = [v.t() for v in views]  # [in, out] storage as an [out, in] view
        return expert_weight_table(views, name=name)

    def bias(name: str | None):
        return None if name is None else expert_weight_table(tables[name], name=name, ndim=1)

    first, down = weights(math.first[0]), weights(math.down)

    def scales(name: str, table):
        quantized = math.quantization(name)
        return None if quantized is None else scale_table(tables[quantized.scale], quantized.quant, table,
                                                           quantized.scale)

    return KernelTables(first, down, bias(math.first_bias[0]), bias(math.down_bias), scales(math.first[0], first),
                        scales(math.down, down), fp8_activations)
