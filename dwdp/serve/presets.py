"""Built-in random-weight models `dwdp serve --preset` can serve (no checkpoint, no download)."""
from __future__ import annotations

import torch

from ..demo import DEMO_MODEL
from ..tiny import build_tiny_model


def preset_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The unwrapped model of preset `name` in `dtype` (on the CPU): identical in every process for the same seed."""
    if name == "tiny":
        return build_tiny_model("deepseek_v3", seed=seed, dtype=dtype, **DEMO_MODEL)
    raise ValueError(f"preset={name!r} is not one of ('tiny',)")
