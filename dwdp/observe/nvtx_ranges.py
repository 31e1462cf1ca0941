"""NVTX ranges for Nsight, named exactly as `dwdp.observe.phases` (the trace readers match those names).

The `nvtx` package is used when importable: one "dwdp" domain, the MoE layer in the payload and
the prefetch slot as the category, event attributes built once per (phase, layer, slot) so a push
costs about 0.1 us. Without it, `torch.cuda.nvtx` pushes the bare phase name. Only CUDA models
make ranges; on the CPU `DWDPModel` holds None and nothing here runs.
"""
from __future__ import annotations

import logging

log = logging.getLogger("dwdp")

DOMAIN = "dwdp"
NO_SLOT = -1


class NvtxRanges:
    """push(phase, layer, slot) / pop() on this thread's NVTX range stack."""

    def __init__(self, module=None):
        """module: the `nvtx` package (None imports it; torch.cuda.nvtx when it is missing)."""
        if module is None:
            try:
                import nvtx as module
            except ImportError:
                module = None
        self._attributes: dict[tuple[str, int, int], object] = {}
        if module is not None:
            self._domain = module.get_domain(DOMAIN)
            self.source = "nvtx"
        else:
            import torch.cuda.nvtx as torch_nvtx

            self._domain = None
            self._torch = torch_nvtx
            self.source = "torch.cuda.nvtx"
        log.info("NVTX ranges through %s", self.source)

    def push(self, phase: str, layer: int = -1, slot: int = NO_SLOT) -> None:
        if self._domain is None:
            self._torch.range_push(phase)
            return
        key = (phase, layer, slot)
        attributes = self._attributes.get(key)
        if attributes is None:
            attributes = self._attributes[key] = self._domain.get_event_attributes(
                message=phase, payload=layer, category=None if slot == NO_SLOT else slot
            )
        self._domain.push_range(attributes)

    def pop(self) -> None:
        if self._domain is None:
            self._torch.range_pop()
        else:
            self._domain.pop_range()
