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


def dense_checksum(model: torch.nn.Module, skip_modules) -> int:
    """A checksum of the bytes of every parameter and buffer of `model` outside `skip_modules`.

    Integer sums of each tensor's 32-bit words (bytes when a tensor's size is not a multiple of 4),
    mixed in name order: exact and independent of reduction order and thread count, so ranks holding
    the same weights agree bit for bit; one pass over the memory, on the tensors' own device."""
    skip = {id(t) for m in skip_modules for t in list(m.parameters()) + list(m.buffers())}
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    total = 0
    for name in sorted(named):
        t = named[name]
        if id(t) in skip or t.is_meta:
            continue
        data = t.detach().contiguous().reshape(-1).view(torch.uint8)
        is_word_aligned = data.numel() % 4 == 0 and data.storage_offset() % 4 == 0
        words = data.view(torch.int32) if is_word_aligned else data
        total = (total * 1_000_003 + int(words.sum(dtype=torch.int64))) % (1 << 64)
    return total


def dense_bytes(model: torch.nn.Module, expert_tensors) -> int:
    """Bytes of every parameter and buffer of `model` that is not one of `expert_tensors`."""
    skip = {id(t) for t in expert_tensors}
    return tensor_bytes(t for t in list(model.parameters()) + list(model.buffers()) if id(t) not in skip)
