"""Transports: one interface, a backend per kind of memory."""
from __future__ import annotations

from .base import PrefetchTimeout, Ticket, Transport
from .host import HostTransport


def resolve_backend(backend: str, device) -> str:
    """`auto` picks cuda for CUDA-resident models and host otherwise."""
    import torch

    device = torch.device(device)
    if backend == "auto":
        backend = "cuda" if device.type == "cuda" else "host"
    if backend == "host" and device.type != "cpu":
        raise ValueError(f"backend='host' needs the model on the CPU, found it on {device}")
    if backend == "cuda":
        raise RuntimeError(
            "backend='cuda' (copy-engine prefetch) is not part of this release yet; "
            "run the model on the CPU with backend='host'"
        )
    return backend


def make_transport(backend: str, rank: int, inflight: int) -> Transport:
    if backend == "host":
        return HostTransport(rank, inflight=inflight)
    raise ValueError(f"backend={backend!r} has no transport; expected 'host'")


__all__ = ["HostTransport", "PrefetchTimeout", "Ticket", "Transport", "make_transport", "resolve_backend"]
