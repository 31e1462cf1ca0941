"""Cost model of one forward of an MoE model on one rank, and what DWDP and DEP pay for it.

Data (dwdp/predict/data/*.json: model presets, hardware figures and fitted constants, each value with its
source) is read by `models`, `hardware` and `calibration`; `formats` and `deployment` describe
storage and the workload; `operators` turns them into per-operator FLOPs, bytes and times;
`interference` says how much copies slow an operator; `timeline` walks one DWDP rank's forward with
its copies; `forward` assembles one forward for DWDP and DEP; `outside` is what every mode pays per
forward outside it (host work, the KV hand-off). Units: FLOPs, bytes, seconds.
"""
from dwdp.predict.costmodel.calibration import (ATTENTION, DENSE_GEMM, GROUPED_GEMM, IDEAL, KERNEL_CATEGORIES, OTHERS, Calibration,
                          calibration_sources, load_calibration)
from dwdp.predict.costmodel.deployment import Deployment, ForwardShape, Workload, causal_pairs, formats, workload_shape
from dwdp.predict.costmodel.formats import ACT_BYTES, FORMATS, WeightFormat, weight_format
from dwdp.predict.costmodel.forward import (LayerCost, Prediction, all2all_bytes, all2all_time, copy_time, crossover_isl, dwdp_weight_bytes,
                      layer_costs,
                      merge_op, predict, prefetch_hidden, prefetch_time, rank_timeline, remote_bytes_per_layer,
                      remote_ranks_per_token, replicated_weight_bytes)
from dwdp.predict.costmodel.hardware import Hardware, PowerFigures, hardware_names, hardware_sources, load_hardware
from dwdp.predict.costmodel.interference import CopySlowdown, copy_slowdown
from dwdp.predict.costmodel.models import MLA, ModelSpec, load_model, model_names, preset_config, preset_source
from dwdp.predict.costmodel.operators import OpCost, attention_ops, attention_projections, dense_mlp_ops, expected_active, moe_ops
from dwdp.predict.costmodel.outside import OUTSIDE_PARTS, OutsideForward, kv_bytes_per_token, outside_forward
from dwdp.predict.costmodel.timeline import RankTimeline, dwdp_timeline

__all__ = [
    "ACT_BYTES", "ATTENTION", "DENSE_GEMM", "FORMATS", "GROUPED_GEMM", "IDEAL", "KERNEL_CATEGORIES", "MLA", "OTHERS",
    "OUTSIDE_PARTS",
    "Calibration", "CopySlowdown", "Deployment", "ForwardShape", "Hardware", "LayerCost", "ModelSpec", "OpCost",
    "OutsideForward", "PowerFigures", "Prediction", "RankTimeline", "WeightFormat", "Workload", "all2all_bytes",
    "all2all_time", "attention_ops", "attention_projections", "calibration_sources", "causal_pairs", "copy_slowdown",
    "copy_time", "crossover_isl", "dense_mlp_ops", "dwdp_weight_bytes", "dwdp_timeline", "expected_active", "formats",
    "hardware_names", "hardware_sources", "kv_bytes_per_token", "layer_costs", "load_calibration", "load_hardware",
    "load_model", "merge_op", "model_names", "moe_ops", "outside_forward", "predict", "prefetch_hidden",
    "prefetch_time", "preset_config", "preset_source", "rank_timeline", "remote_bytes_per_layer",
    "remote_ranks_per_token", "replicated_weight_bytes", "weight_format", "workload_shape",
]
