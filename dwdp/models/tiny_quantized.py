"""Tiny quantized MoE models and checkpoints, built offline from random weights (tests, demo, examples).

Legend: E = experts, N = output features of a projection, K = input features of a projection.

`build_tiny_quantized` returns the same tiny random model twice: once with its experts quantized
(fp8 with block scales, or MXFP4) and laid out as dwdp or transformers' FP8Experts holds them, once
dense with the dequantized values of those very quantized weights. The dense one is what "the
unwrapped model on the same quantized weights" computes on a CPU, where transformers' fp8 and MXFP4
kernels do not run. `save_quantized_checkpoint` writes such a model as a real checkpoint: values,
scales and `quantization_config` in config.json, experts stacked or per expert, dense linears in fp8
too (a real fp8 checkpoint's layout; the loader dequantizes them once).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from dwdp.models.adapters import find_experts
from dwdp.models.adapters.quantized import FP8_SCALE_SUFFIX, MXFP4_SUFFIXES
from dwdp.kernels.block_scales import BlockQuant, dequantize, quantize_fp8, quantize_mxfp4
from dwdp.models.quantization import ExpertsQuantization, logical_weight, projections, relayout_experts
from dwdp.models.tiny import build_tiny_model

# Dense linears a real fp8 checkpoint leaves unquantized: the head and the routers.
DENSE_NOT_QUANTIZED = ("lm_head", "gate", "router")


def _quantize(weight: torch.Tensor, bq: BlockQuant, quant: ExpertsQuantization):
    """[..., N, K] -> (values, scales) of `quant`'s format."""
    if quant.format == "mxfp4":
        return quantize_mxfp4(weight)
    return quantize_fp8(weight, bq, quant.scale_fmt)


def _dequantize_stack(values: torch.Tensor, scales: torch.Tensor, bq: BlockQuant, dtype) -> torch.Tensor:
    """[E, ...] values and scales -> [E, N, K] dense, expert by expert (as the runtime reads them)."""
    return torch.stack([dequantize(values[e], scales[e], bq, dtype) for e in range(values.shape[0])])


def build_tiny_quantized(family: str, quant: ExpertsQuantization, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                         fp8_experts_class: bool = False, **config_kwargs):
    """(quantized model, dense reference) of a tiny random `family` model.

    fp8_experts_class: hold the fp8 experts in transformers' own FP8Experts modules (built by
    transformers.integrations.finegrained_fp8.replace_with_fp8_linear with a FineGrainedFP8Config);
    otherwise the model's experts modules keep their class with the quantized layout
    (dwdp.models.quantization.relayout_experts). Dense weights stay dense in both models.
    """
    model = build_tiny_model(family, seed=seed, dtype=dtype, **config_kwargs)
    reference = copy.deepcopy(model)
    values_by_layer = {}
    with torch.no_grad():
        for layer, ref_layer in zip(find_experts(model), find_experts(reference)):
            values = {}
            for attr, fused_gate, transposed in projections(layer):
                weight = logical_weight(layer, attr, transposed).detach()        # [E, N, K]
                bq = quant.block_quant(weight.shape[1], weight.shape[2], fused_gate)
                q, s = _quantize(weight, bq, quant)
                suffixes = MXFP4_SUFFIXES if quant.format == "mxfp4" else ("", FP8_SCALE_SUFFIX)
                values.update({attr + suffixes[0]: q, attr + suffixes[1]: s})
                dense = _dequantize_stack(q, s, bq, dtype)                        # [E, N, K]
                getattr(ref_layer.module, attr).copy_(dense.transpose(1, 2) if transposed else dense)
            values_by_layer[layer.name] = values
            if not fp8_experts_class:
                relayout_experts(layer, quant, values)
    if fp8_experts_class:
        _swap_in_fp8_experts(model, quant, values_by_layer)
    return model.eval(), reference.eval()


def _swap_in_fp8_experts(model: torch.nn.Module, quant: ExpertsQuantization, values_by_layer: dict) -> None:
    """Replace every experts module by transformers' FP8Experts (dense linears kept) holding `values`."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    if quant.format != "fp8":
        raise ValueError(f"FP8Experts holds fp8 experts, not {quant.format}")
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    config = FineGrainedFP8Config(weight_block_size=quant.block, scale_fmt=quant.scale_fmt)
    replace_with_fp8_linear(model, modules_to_not_convert=linears, quantization_config=config, pre_quantized=True)
    for name, values in values_by_layer.items():
        module = model.get_submodule(name)
        for attr, tensor in values.items():
            setattr(module, attr, torch.nn.Parameter(tensor, requires_grad=False))


# -- checkpoints ----------------------------------------------------------------------------------
def _per_expert(prefix: str, attr: str, tensor: torch.Tensor, fused_gate: bool, suffix: str) -> dict:
    """Stacked [E, ...] -> per-expert `{prefix}.{e}.{gate,up,down}_proj.weight{suffix}` tensors."""
    out = {}
    for e in range(tensor.shape[0]):
        if fused_gate:
            gate, up = tensor[e].chunk(2, dim=0)
            out[f"{prefix}.{e}.gate_proj.weight{suffix}"] = gate.clone()
            out[f"{prefix}.{e}.up_proj.weight{suffix}"] = up.clone()
        else:
            out[f"{prefix}.{e}.{attr}.weight{suffix}"] = tensor[e].clone()
    return out


def quantized_state(model: torch.nn.Module, reference: torch.nn.Module, quant: ExpertsQuantization, layout: str,
                    quantize_dense: bool) -> dict:
    """The checkpoint tensors of a model built by `build_tiny_quantized` (dwdp layout).

    layout: "stacked" (`experts.gate_up_proj` + `_scale_inv`, MXFP4 `_blocks` / `_scales`) or
    "per_expert" (fp8 only: `experts.{e}.gate_proj.weight` + `.weight_scale_inv`, gate and up apart).
    quantize_dense: store dense linears (not the head nor routers) in fp8 with `weight_block_size`
    blocks; `reference` gets their dequantized values, as the loader will read them.
    """
    if layout not in ("stacked", "per_expert"):
        raise ValueError(f"layout={layout!r} must be 'stacked' or 'per_expert'")
    if layout == "per_expert" and quant.format != "fp8":
        raise ValueError("per-expert checkpoints are written for fp8; MXFP4 checkpoints are stacked (gpt-oss)")
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    layers = find_experts(model)
    if layout == "per_expert":
        for layer in layers:
            for q in layer.spec.math.quantized:
                fused = q.weight == layer.spec.math.first[0] and layer.spec.extras.get("has_gate", True)
                state.update(_per_expert(layer.name, q.weight, state.pop(f"{layer.name}.{q.weight}"), fused, ""))
                state.update(_per_expert(layer.name, q.weight, state.pop(f"{layer.name}.{q.scale}"), fused,
                                         FP8_SCALE_SUFFIX))
    if quantize_dense and quant.format == "fp8":
        experts = tuple(layer.name + "." for layer in layers)
        for name, module in reference.named_modules():
            leaf = name.rpartition(".")[2]
            if not isinstance(module, torch.nn.Linear) or leaf in DENSE_NOT_QUANTIZED or name.startswith(experts):
                continue
            weight = module.weight.detach()                                                  # [N, K]
            bq = quant.block_quant(*weight.shape, fused_gate=False)
            q, s = quantize_fp8(weight, bq, quant.scale_fmt)
            state[f"{name}.weight"], state[f"{name}.weight_scale_inv"] = q, s
            with torch.no_grad():
                module.weight.copy_(dequantize(q, s, bq, weight.dtype))
    return state


def save_quantized_checkpoint(directory: str | Path, family: str, quant: ExpertsQuantization, *,
                              layout: str = "stacked", quantize_dense: bool = True, seed: int = 0,
                              dtype: torch.dtype = torch.bfloat16, num_shards: int = 3, **config_kwargs):
    """Write a tiny random `family` checkpoint quantized as `quant` to `directory` (config.json with its
    quantization_config, generation_config.json, `num_shards` safetensors shards and their index).

    Returns the dense reference model (the dequantized values of every quantized weight, in `dtype`).
    """
    from dwdp.models.loading import write_shards

    directory = Path(directory)
    model, reference = build_tiny_quantized(family, quant, seed=seed, dtype=dtype, **config_kwargs)
    state = quantized_state(model, reference, quant, layout, quantize_dense)
    model.config.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quant.config_dict()
    if quantize_dense and quant.format == "fp8":
        config["quantization_config"]["modules_to_not_convert"] = list(DENSE_NOT_QUANTIZED)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    model.generation_config.save_pretrained(directory)
    write_shards(state, directory, num_shards)
    return reference
