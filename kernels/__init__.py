"""Kernels of dwdp (installed as dwdp.kernels), each with a plain-PyTorch reference.

The Triton kernels need triton and a CUDA device (or TRITON_INTERPRET=1 on CPU); importing this
package needs neither, and the references run anywhere.

May import: the leaves `dwdp.envs` and `dwdp.versions` only; the kernels know nothing of models or ranks.
"""
from dwdp.kernels.block_scales import BlockQuant, dequantize, quantize_fp8, quantize_mxfp4
from dwdp.kernels.grouped_gemm import (
    ACTIVATIONS,
    SWIGLU,
    Epilogue,
    GroupedGemmConfig,
    default_wave_size,
    grouped_gemm,
    is_interpreter,
    local_first_split,
)
from dwdp.kernels.launch import DeviceInfo, KernelProblem, LaunchConfig, candidate_tiles, device_info, launch_config
from dwdp.kernels.moe import moe_experts, moe_launch_configs, sort_by_expert
from dwdp.kernels.tuned_configs import KernelConfigError
from dwdp.kernels.reference import epilogue_reference, grouped_gemm_reference, moe_experts_reference, swiglu_reference
from dwdp.kernels.scaled_weights import ScaleTable, scale_table
from dwdp.kernels.weight_tables import ExpertWeightTable, expert_weight_table

__all__ = [
    "ACTIVATIONS",
    "SWIGLU",
    "BlockQuant",
    "Epilogue",
    "epilogue_reference",
    "ExpertWeightTable",
    "GroupedGemmConfig",
    "candidate_tiles",
    "default_wave_size",
    "DeviceInfo",
    "device_info",
    "dequantize",
    "expert_weight_table",
    "grouped_gemm",
    "grouped_gemm_reference",
    "is_interpreter",
    "KernelConfigError",
    "KernelProblem",
    "launch_config",
    "LaunchConfig",
    "local_first_split",
    "moe_experts",
    "moe_launch_configs",
    "moe_experts_reference",
    "quantize_fp8",
    "quantize_mxfp4",
    "ScaleTable",
    "scale_table",
    "sort_by_expert",
    "swiglu_reference",
]
