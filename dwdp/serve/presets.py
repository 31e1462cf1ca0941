"""Built-in random-weight models `dwdp serve --preset` can serve (no checkpoint, no download)."""
from __future__ import annotations

import torch

from dwdp.models.demo_model import DEMO_MODEL
from dwdp.models.tiny import build_tiny_model


# A Qwen3-MoE-shaped model big enough for a GPU to time (4 layers of 16 experts, 2048 wide: 384 MiB of
# bf16 experts), small enough to build in seconds.
SMALL_MODEL = dict(hidden=2048, intermediate=1024, num_experts=16, top_k=4, num_layers=4, vocab=4096,
                   initializer_range=0.02)


def preset_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The unwrapped model of preset `name` in `dtype` (on the CPU): identical in every process for the same seed.
    "tiny": the demo's DeepSeek-V3-style model; "small": SMALL_MODEL (a Qwen3-MoE shape)."""
    if name == "tiny":
        return build_tiny_model("deepseek_v3", seed=seed, dtype=dtype, **DEMO_MODEL)
    if name == "small":
        return build_tiny_model("qwen3_moe", seed=seed, dtype=dtype, **SMALL_MODEL)
    raise ValueError(f"preset={name!r} is not one of ('tiny', 'small')")
