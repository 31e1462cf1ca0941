"""The demo's tiny model: its shape (shared by `dwdp demo`, the serve preset "tiny" and
`dwdp bench compare`) and the (model to wrap, unwrapped reference) pair for each experts dtype."""
from __future__ import annotations

import torch

from dwdp.models.quantization import ExpertsQuantization
from dwdp.models.tiny import build_tiny_model
from dwdp.models.tiny_quantized import build_tiny_quantized

DEMO_MODEL = dict(hidden=256, intermediate=256, num_experts=16, top_k=4, num_layers=5, vocab=512)
FP8_BLOCK = (128, 128)  # DeepSeek-V3's weight scale blocks

def demo_models(family: str, dtype: str, seed: int, model_dtype: torch.dtype = torch.float32, **shape):
    """(model to wrap, unwrapped reference) of the demo: the same model twice for unquantized experts;
    for "fp8" / "mxfp4" its experts quantized (fp8: 128 x 128 block scales, DeepSeek-V3's) next to the
    model holding the dequantized values of those quantized weights (what the unwrapped model computes
    on them). model_dtype: the dense weights' dtype (and the experts' when unquantized).
    shape: tiny model sizes (default DEMO_MODEL)."""
    shape = shape or DEMO_MODEL
    if dtype in ("fp32", "bf16"):
        model = build_tiny_model(family, seed=seed, dtype=model_dtype, **shape)
        return model, model
    quant = ExpertsQuantization("fp8", FP8_BLOCK) if dtype == "fp8" else ExpertsQuantization(dtype)
    return build_tiny_quantized(family, quant, seed=seed, dtype=model_dtype, **shape)
