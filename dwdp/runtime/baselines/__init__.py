"""Baselines DWDP is measured against, on the same transformers models and the same process group.

- `DEPModel`: attention data parallel + expert parallel (each rank keeps a disjoint share of the
  experts; tokens travel to their experts and back with two all-to-alls per MoE layer).
- `ReplicatedModel`: every rank keeps every expert and never communicates (the upper bound).

Both are transforms of a finished model, called exactly like it, like `DWDPModel`.
"""
from dwdp.runtime.baselines.dep import DEP_IMPLEMENTATION, CommStats, DEPModel, expert_split
from dwdp.runtime.baselines.replicated import REPLICATED_IMPLEMENTATION, ReplicatedModel

__all__ = ["CommStats", "DEPModel", "DEP_IMPLEMENTATION", "REPLICATED_IMPLEMENTATION", "ReplicatedModel",
           "expert_split"]
