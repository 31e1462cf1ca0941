"""Rank functions of bench/gpu_offpath.py (importable by spawned ranks). Not yet run on a GPU."""
from __future__ import annotations

import torch


def after_close_rank(rank: int) -> dict:
    """A 2-rank composite DWDPModel on one GPU, closed, then its experts read: a Python error, and the
    device still synchronises (no illegal address left behind)."""
    from dwdp.models.tiny import build_tiny_model
    from dwdp.runtime.config import DWDPConfig
    from dwdp.runtime.group import init_group
    from dwdp.runtime.model import DWDPModel

    torch.cuda.set_device(0)
    group = init_group()
    model = build_tiny_model("mixtral", seed=1, dtype=torch.bfloat16).cuda()
    wrapped = DWDPModel(model, DWDPConfig(backend="cuda", experts_kernel="composite"), group)
    kernel = wrapped.experts_kernel
    wrapped.close()
    try:
        model.cpu()
        error = None
    except NotImplementedError as exc:
        error = str(exc)[:80]
    torch.cuda.synchronize()
    return {"kernel": kernel, "error": error}
