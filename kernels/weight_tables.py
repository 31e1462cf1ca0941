"""Tables of per-expert weight views that may live in different buffers: each expert's base address,
checked once per layer and slot, for the grouped GEMM to read every expert where it lives.

Legend: E = experts, N = output features (the rows of an expert's weight), K = input features (its columns).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Tables hold weights, fp8 weights (read with their block scales) and the scales themselves.
_TABLE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.uint8)
ALIGN_BYTES = 16  # vectorised loads


@dataclass(frozen=True)
class ExpertWeightTable:
    """Per-expert base addresses of E weight views [N, K] that may live in different buffers.

    Build it once per layer and buffer slot with `expert_weight_table` (the addresses of the
    local parameter and of the prefetch slots do not change) and pass it instead of the list.
    `views` keeps the underlying buffers alive as long as the table is.
    """

    addresses: torch.Tensor  # [E] int64 data_ptr of each view, on the views' device
    views: tuple[torch.Tensor, ...]
    shape: tuple[int, ...]  # (N, K) of weights, (N,) of biases
    dtype: torch.dtype
    device: torch.device
    strides: tuple[int, ...] = ()  # element strides of every view: (K, 1), or (1, N) for [K, N] storage

    @property
    def num_experts(self) -> int:
        return len(self.views)


def expert_weight_table(weights: Sequence[torch.Tensor], *, name: str = "weights", ndim: int = 2,
                        aligned: bool = True) -> ExpertWeightTable:
    """Validate E per-expert views and collect their base addresses.

    ndim=2: weights [N, K], each contiguous or the transpose of a contiguous [K, N] tensor (read
    without a copy), all with the same strides. ndim=1: biases [N], contiguous.
    Every view must have the same shape, dtype and device and start on a 16-byte boundary
    (vectorised loads; `aligned=False` for tables read element by element, such as block scales).
    Raises ValueError naming `name[e]` otherwise.
    """
    what = "[N, K]" if ndim == 2 else "[N]"
    if isinstance(weights, torch.Tensor):
        raise ValueError(f"{name} must be a sequence of E views {what}, got one tensor of shape {tuple(weights.shape)}")
    views = tuple(weights)
    if not views:
        raise ValueError(f"{name} is empty: expected one {what} view per expert")
    first = views[0]
    for e, w in enumerate(views):
        if not isinstance(w, torch.Tensor):
            raise ValueError(f"{name}[{e}] must be a torch.Tensor, got {type(w).__name__}")
        if w.dim() != ndim:
            raise ValueError(f"{name}[{e}] must be {ndim}-D {what}, got shape {tuple(w.shape)}")
        if w.shape != first.shape:
            raise ValueError(f"{name}[{e}] has shape {tuple(w.shape)}, expected {tuple(first.shape)} like {name}[0]")
        if w.dtype not in _TABLE_DTYPES:
            raise ValueError(f"{name}[{e}] has dtype {w.dtype}, expected one of {_TABLE_DTYPES}")
        if w.dtype != first.dtype:
            raise ValueError(f"{name}[{e}] has dtype {w.dtype}, expected {first.dtype} like {name}[0]")
        if w.device != first.device:
            raise ValueError(f"{name}[{e}] is on {w.device}, expected {first.device} like {name}[0]")
        dense = w.is_contiguous() or (ndim == 2 and w.t().is_contiguous())
        if not dense or w.stride() != first.stride():
            raise ValueError(f"{name}[{e}] must be contiguous (or a transposed contiguous [K, N]) with the strides "
                             f"of {name}[0] {first.stride()}, got strides {w.stride()}")
        if aligned and w.data_ptr() % ALIGN_BYTES:
            raise ValueError(f"{name}[{e}] starts at address {w.data_ptr():#x}, not {ALIGN_BYTES}-byte aligned")
    addresses = torch.tensor([w.data_ptr() for w in views], dtype=torch.int64)  # [E]
    if first.device.type != "cpu":
        addresses = addresses.to(first.device, non_blocking=True)
    return ExpertWeightTable(addresses, views, tuple(first.shape), first.dtype, first.device, tuple(first.stride()))
