"""What every model wrapper (DWDP and the baselines) shares: called exactly like the wrapped model,
its attributes passed through, and the byte counts of its memory reports."""
from __future__ import annotations

import torch


class ModelWrapper(torch.nn.Module):
    """Holds `self.model`; calls and unknown attributes go to it."""

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def dense_bytes(model: torch.nn.Module, expert_tensors) -> int:
    """Bytes of every parameter and buffer of `model` that is not one of `expert_tensors`."""
    skip = {id(t) for t in expert_tensors}
    return tensor_bytes(t for t in list(model.parameters()) + list(model.buffers()) if id(t) not in skip)
