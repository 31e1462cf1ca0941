"""Cost model of one forward of an MoE model on one rank, and what DWDP and DEP pay for it.

Data (dwdp/data/*.json: model presets, hardware figures with a source per value) is read by
`models` and `hardware`; `formats` and `deployment` describe storage and the workload; `operators`
turns them into per-operator FLOPs, bytes and times; `forward` assembles one forward.
Units: FLOPs, bytes, seconds.
"""
from .deployment import Deployment, Workload, causal_pairs, formats
from .formats import ACT_BYTES, FORMATS, WeightFormat, weight_format
from .forward import (LayerCost, Prediction, all2all_bytes, crossover_isl, dwdp_forward_time, layer_costs,
                      predict, prefetch_time, prefetch_windows, remote_bytes_per_layer, remote_ranks_per_token,
                      replicated_weight_bytes)
from .hardware import Hardware, hardware_names, load_hardware
from .models import MLA, ModelSpec, load_model, model_names, preset_config, preset_source
from .operators import OpCost, attention_ops, attention_projections, dense_mlp_ops, expected_active, moe_ops

__all__ = [
    "ACT_BYTES", "FORMATS", "MLA", "Deployment", "Hardware", "LayerCost", "ModelSpec", "OpCost", "Prediction",
    "WeightFormat", "Workload", "all2all_bytes", "attention_ops", "attention_projections", "causal_pairs",
    "crossover_isl", "dense_mlp_ops", "dwdp_forward_time", "expected_active", "formats", "hardware_names",
    "layer_costs", "load_hardware", "load_model", "model_names", "moe_ops", "predict", "prefetch_time",
    "prefetch_windows", "preset_config", "preset_source", "remote_bytes_per_layer", "remote_ranks_per_token",
    "replicated_weight_bytes", "weight_format",
]
