"""Plain-PyTorch reference of the transport: execute a copy plan sequentially in one thread."""
from __future__ import annotations

import torch

from dwdp.runtime.plan import CopyPlan


def execute_plan_reference(plan: CopyPlan, segments: list[torch.Tensor], slot_buffer: torch.Tensor) -> torch.Tensor:
    """Copy every slice of `plan` from `segments[peer]` (uint8) into `slot_buffer` (uint8); returns it."""
    for s in plan.slices:
        slot_buffer[s.dst_offset : s.dst_offset + s.nbytes] = segments[s.peer][s.src_offset : s.src_offset + s.nbytes]
    return slot_buffer
