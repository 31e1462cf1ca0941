"""gpu_check section g  fp8 experts (128 x 128 block scales): the kernel's bf16 dots and fp8 x fp8 dots against their
   references, TFLOP/s of both next to the same experts in bf16."""
from __future__ import annotations

import torch

from .common import time_on

KEY = "g_fp8"


def run(sections: dict, tokens: int = 4096) -> dict:
    """fp8 experts with 128 x 128 block scales (DeepSeek-V3's format, gate and up blocked apart) through
    the Triton kernel: bf16 dots (tiles dequantized in the K loop) and fp8 x fp8 dots (tokens quantized
    per row and 128 columns) against their references, and their speed next to bf16 weights."""
    from dwdp.kernels import BlockQuant, moe_experts, moe_experts_reference, quantize_fp8

    gen = torch.Generator(device="cuda").manual_seed(4)
    hidden, inter, experts, top_k = 2048, 768, 16, 8
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    first_quant, down_quant = BlockQuant("fp8", (128, 128), halves=2), BlockQuant("fp8", (128, 128))
    gate_up, gate_up_scales = quantize_fp8(torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen)
                                           / hidden**0.5, first_quant)
    down, down_scales = quantize_fp8(torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5,
                                     down_quant)
    index = torch.stack([torch.randperm(experts, device="cuda", generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, device="cuda", generator=gen), -1)
    fp8 = dict(first_scales=list(gate_up_scales), down_scales=list(down_scales), first_quant=first_quant,
               down_quant=down_quant)
    accuracy, timing, failures = {}, {}, []
    for name, extra in (("bf16 dots", {}), ("fp8 dots", {"fp8_activations": True})):
        want = moe_experts_reference(x[:512], index[:512], weights[:512], list(gate_up), list(down), **fp8,
                                     **extra).float()
        got = moe_experts(x[:512], index[:512], weights[:512], list(gate_up), list(down), **fp8, **extra).float()
        accuracy[name] = ((got - want).norm() / want.norm()).item()
        if not accuracy[name] < 1e-2:
            failures.append(f"fp8 kernel {name}: relative error {accuracy[name]:.3e} >= 1e-2 against the reference")
        timing[name] = time_on(torch.cuda.current_stream(), lambda extra=extra: moe_experts(
            x, index, weights, list(gate_up), list(down), **fp8, **extra), warmup=3, repeats=10)
    dense_gate_up = [w.bfloat16() for w in gate_up.float()]
    dense_down = [w.bfloat16() for w in down.float()]
    timing["bf16 weights"] = time_on(torch.cuda.current_stream(), lambda: moe_experts(
        x, index, weights, dense_gate_up, dense_down), warmup=3, repeats=10)
    flops = 2 * tokens * top_k * (2 * inter * hidden + hidden * inter)
    return {"accuracy": accuracy, "ms": {k: 1e3 * v for k, v in timing.items()},
            "tflops": {k: flops / v / 1e12 for k, v in timing.items()}, "tokens": tokens, "failures": failures}


def summary(section: dict) -> list[tuple[str, str, str, str]]:
    """(check, measured, target, verdict) rows of this section for the table."""
    rows = []
    if "accuracy" in section:
        for name, err in section["accuracy"].items():
            rows.append((f"g fp8 experts, {name} vs reference", f"{err:.2e} rel", "< 1e-2",
                         "ok" if err < 1e-2 else "FAIL"))
        for name, tf in section["tflops"].items():
            rows.append((f"g moe T={section['tokens']}, {name}", f"{tf:.0f} TFLOP/s ({section['ms'][name]:.2f} ms)", "", "info"))
    return rows
