"""gpu_check section g  fp8 experts (128 x 128 block scales): the kernel's bf16 dots and fp8 x fp8 dots against their
   references; per shape, TFLOP/s of fp8 dots, of the dequantizing bf16-dot path, of the same experts in bf16 through our
   kernel and through torch's grouped_mm on the experts merged beforehand, the ratios, and the launch configurations."""
from __future__ import annotations

import torch

from .common import time_on

KEY = "g_fp8"
# (name, hidden H, expert intermediate I, experts E, experts per token k): the fused shape the H100 tile data
# was taken on, and DeepSeek-V3's expert dimensions with a quarter of its experts (to fit beside the bf16 copies).
SHAPES = (("h2048-i768-e16", 2048, 768, 16, 8), ("dsv3-dims-e64", 7168, 2048, 64, 8))
FP8_OVER_BF16_TARGET = 1.6


def _shape(name: str, hidden: int, inter: int, experts: int, top_k: int, tokens: int, bench, device="cuda",
           part: str = "all") -> dict:
    """One shape's accuracy (part "correctness"), speeds ("timing"), or both ("all")."""
    from dwdp.kernels import (BlockQuant, device_info, expert_weight_table, moe_experts, moe_experts_reference,
                              moe_launch_configs, quantize_fp8, scale_table)

    gen = torch.Generator(device=device).manual_seed(4)
    x = torch.randn(tokens, hidden, device=device, generator=gen).bfloat16()
    first_quant, down_quant = BlockQuant("fp8", (128, 128), halves=2), BlockQuant("fp8", (128, 128))
    gate_up, gate_up_scales = quantize_fp8(torch.randn(experts, 2 * inter, hidden, device=device, generator=gen)
                                           / hidden**0.5, first_quant)
    down, down_scales = quantize_fp8(torch.randn(experts, hidden, inter, device=device, generator=gen) / inter**0.5,
                                     down_quant)
    index = torch.stack([torch.randperm(experts, device=device, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, device=device, generator=gen), -1)
    fp8 = dict(first_scales=list(gate_up_scales), down_scales=list(down_scales), first_quant=first_quant,
               down_quant=down_quant)
    # Tables built once, as DWDP builds them per layer and slot: the timed calls launch, nothing else.
    gate_up_table, down_table = expert_weight_table(list(gate_up)), expert_weight_table(list(down))
    tables = dict(first_scales=scale_table(list(gate_up_scales), first_quant, gate_up_table, "first"),
                  down_scales=scale_table(list(down_scales), down_quant, down_table, "down"))
    accuracy, timing, failures = {}, {}, []
    for variant, extra in (("bf16 dots", {}), ("fp8 dots", {"fp8_activations": True})):
        if part in ("all", "correctness"):
            want = moe_experts_reference(x[:512], index[:512], weights[:512], list(gate_up), list(down), **fp8,
                                         **extra).float()
            got = moe_experts(x[:512], index[:512], weights[:512], list(gate_up), list(down), **fp8, **extra).float()
            accuracy[variant] = ((got - want).norm() / want.norm()).item()
            if not accuracy[variant] < 1e-2:
                failures.append(f"fp8 kernel {name} {variant}: relative error {accuracy[variant]:.3e} >= 1e-2")
        if part == "correctness":
            continue
        timing[variant] = time_on(torch.cuda.current_stream(), lambda extra=extra: moe_experts(
            x, index, weights, gate_up_table, down_table, **tables, **extra), warmup=3, repeats=10)
    if part == "correctness":
        return {"accuracy": accuracy, "failures": failures}
    dense_gate_up = [w.bfloat16() for w in gate_up.float()]  # the same values in bf16
    dense_down = [w.bfloat16() for w in down.float()]
    dense_tables = (expert_weight_table(dense_gate_up), expert_weight_table(dense_down))
    timing["bf16 weights"] = time_on(torch.cuda.current_stream(), lambda: moe_experts(
        x, index, weights, *dense_tables), warmup=3, repeats=10)
    if bench._grouped_mm_supported(device, torch.bfloat16):
        merged = (torch.stack(dense_gate_up), torch.stack(dense_down))  # merged outside the timing
        timing["grouped_mm bf16 merged"] = time_on(torch.cuda.current_stream(), lambda: bench._moe_grouped_mm_baseline(
            x, index, weights, dense_gate_up, dense_down, merged), warmup=3, repeats=10)
        merged = None
    info = device_info(x.device)
    configs = {}
    for variant, fp8_activations in (("fp8 dots", True), ("bf16 dots", False)):
        first, second = moe_launch_configs(torch.bfloat16, gate_up_table, down_table, num_slots=index.numel(),
                                           device=info, fp8_activations=fp8_activations, **tables)
        configs[variant] = {"gate_up": first.label, "down": second.label, "h_fp8_from_gate_up": first.quant_out}
    first, second = moe_launch_configs(torch.bfloat16, *dense_tables, num_slots=index.numel(), device=info)
    configs["bf16 weights"] = {"gate_up": first.label, "down": second.label}
    flops = 2 * tokens * top_k * (2 * inter * hidden + hidden * inter)
    tflops = {k: flops / v / 1e12 for k, v in timing.items()}
    ratios = {"fp8 dots / our bf16": tflops["fp8 dots"] / tflops["bf16 weights"],
              "bf16 dots (dequantizing) / our bf16": tflops["bf16 dots"] / tflops["bf16 weights"]}
    if "grouped_mm bf16 merged" in tflops:
        ratios["fp8 dots / grouped_mm bf16"] = tflops["fp8 dots"] / tflops["grouped_mm bf16 merged"]
        ratios["our bf16 / grouped_mm bf16"] = tflops["bf16 weights"] / tflops["grouped_mm bf16 merged"]
    return {"shape": {"hidden": hidden, "inter": inter, "experts": experts, "top_k": top_k, "tokens": tokens},
            "accuracy": accuracy, "ms": {k: 1e3 * v for k, v in timing.items()}, "tflops": tflops, "ratios": ratios,
            "configs": configs, "failures": failures}


def run(sections: dict, tokens: int = 4096, part: str = "all") -> dict:
    """fp8 experts with 128 x 128 block scales (DeepSeek-V3's format, gate and up blocked apart) through
    the Triton kernel, per shape: bf16 dots (tiles dequantized in the K loop) and fp8 x fp8 dots (tokens
    quantized per row and 128 columns, h quantized in gate_up's epilogue) against their references, and
    their speed next to the same experts in bf16 (ours, and torch's grouped_mm on merged weights)."""
    from .e_kernel import _grouped_gemm_bench

    bench = _grouped_gemm_bench()
    shapes, failures = {}, []
    for name, hidden, inter, experts, top_k in SHAPES:
        shapes[name] = _shape(name, hidden, inter, experts, top_k, tokens, bench, part=part)
        failures += shapes[name].pop("failures")
        torch.cuda.empty_cache()
    return {"tokens": tokens, "shapes": shapes, "target_fp8_over_bf16": FP8_OVER_BF16_TARGET, "failures": failures}


def summary(section: dict) -> list[tuple[str, str, str, str]]:
    """(check, measured, target, verdict) rows of this section for the table."""
    rows = []
    for name, shape in section.get("shapes", {}).items():
        for variant, err in shape.get("accuracy", {}).items():
            rows.append((f"g {name} {variant} vs reference", f"{err:.2e} rel", "< 1e-2", "ok" if err < 1e-2 else "FAIL"))
        if "tflops" not in shape:
            continue
        tf, ratios = shape["tflops"], shape["ratios"]
        ratio = ratios["fp8 dots / our bf16"]
        rows.append((f"g {name} T={section['tokens']} fp8 dots / our bf16",
                     f"{tf['fp8 dots']:.0f} / {tf['bf16 weights']:.0f} TFLOP/s = {ratio:.2f}x",
                     f">= {section['target_fp8_over_bf16']}x", "ok" if ratio >= section["target_fp8_over_bf16"] else "miss"))
        if "fp8 dots / grouped_mm bf16" in ratios:
            rows.append((f"g {name} fp8 dots / grouped_mm bf16 merged",
                         f"{tf['fp8 dots']:.0f} / {tf['grouped_mm bf16 merged']:.0f} TFLOP/s = "
                         f"{ratios['fp8 dots / grouped_mm bf16']:.2f}x", "", "info"))
        rows.append((f"g {name} dequantizing bf16 dots / our bf16",
                     f"{tf['bf16 dots']:.0f} TFLOP/s = {ratios['bf16 dots (dequantizing) / our bf16']:.2f}x",
                     ">= 0.9x to be in auto", "info"))
        for variant, config in shape["configs"].items():
            rows.append((f"g {name} config, {variant}", f"gate_up {config['gate_up']}; down {config['down']}", "",
                         "info"))
    return rows
