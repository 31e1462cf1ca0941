"""LongCat-Flash: routed experts plus zero-computation (identity) experts. The router picks ids in
[0, E + Z); ids >= E return their input. `gate_up_proj` holds E + Z rows (the last Z unused) and
`down_proj` E. The experts module has the standard interface; dwdp's function is installed on it."""
from __future__ import annotations

import torch

from dwdp.models.expert_tensors import ExpertsSpec
from dwdp.models.adapters.base import ExpertsAdapter
from dwdp.models.adapters.interface import has_standard_interface, interface_spec, is_decorated


class IdentityExpertsAdapter(ExpertsAdapter):
    kind = "LongCat-Flash (identity experts)"

    def spec(self, name: str, module: torch.nn.Module, model: torch.nn.Module) -> ExpertsSpec | None:
        routed, total = getattr(module, "num_routed_experts", None), getattr(module, "total_experts", None)
        if is_decorated(module) or not has_standard_interface(module):
            return None
        if not (isinstance(routed, int) and isinstance(total, int) and total > routed > 0):
            return None
        return interface_spec(name, module, num_experts=routed, num_identity_experts=total - routed)
