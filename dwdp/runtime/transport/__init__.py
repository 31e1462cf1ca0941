"""Transports: one interface, a backend per kind of memory."""
from __future__ import annotations

from dwdp.runtime.transport.base import PeerCopyError, PeerUnreadable, PrefetchError, PrefetchTimeout, Ticket, Transport
from dwdp.runtime.transport.host import HostTransport, connect_in_process


def resolve_backend(backend: str, device) -> str:
    """`auto` picks cuda for CUDA-resident models and host otherwise; a backend that cannot serve
    the model's device is refused with the device named."""
    import torch

    device = torch.device(device)
    if backend == "auto":
        backend = "cuda" if device.type == "cuda" else "host"
    if backend == "host" and device.type != "cpu":
        raise ValueError(f"backend='host' needs the model on the CPU, found it on {device}; use backend='cuda'")
    if backend == "cuda" and device.type != "cuda":
        raise ValueError(f"backend='cuda' needs the model on a CUDA device, found it on {device}; "
                         "move it with model.to('cuda') or use backend='host'")
    return backend


def make_transport(backend: str, rank: int, config, *, device=None, mapping: str = "ipc",
                   process_group=None) -> Transport:
    """The transport of `backend` for `rank`, set up from a DWDPConfig."""
    if backend == "host":
        return HostTransport(rank, inflight=config.inflight, copy_batches=config.copy_batches)
    if backend == "cuda":
        from dwdp.runtime.transport.cuda import CudaTransport

        return CudaTransport(rank, device, copy=config.cuda_copy, copy_batches=config.copy_batches, mapping=mapping,
                             process_group=process_group, close_timeout_s=config.wait_timeout_s)
    raise ValueError(f"backend={backend!r} has no transport; expected 'host' or 'cuda'")


__all__ = ["HostTransport", "PeerCopyError", "PeerUnreadable", "PrefetchError", "PrefetchTimeout", "Ticket",
           "Transport", "connect_in_process", "make_transport", "resolve_backend"]
