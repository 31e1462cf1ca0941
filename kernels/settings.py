"""Settings of a grouped-GEMM launch a caller may give: its tiles (GroupedGemmConfig) and the epilogue
applied to the fp32 accumulators (Epilogue). Which tiles a launch takes when none are given is decided
in kernels/launch.py."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupedGemmConfig:
    """Tile sizes and launch settings of the grouped GEMM.

    group_m: m-tiles of one expert run side by side before the next n-tile (grouped order: the A rows
        of the group and the weight tile stay in L2); 0 runs every m-tile of the expert first.
    tma: True asks for TMA descriptors (where the device, Triton and the weight layout allow them),
        False for pointer loads; None follows DWDP_KERNEL_TMA, pointer loads when it is unset
        (kernels/launch.py).
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 1  # persistent programs per SM: the wave size is num_sms * programs_per_sm
    group_m: int = 0
    tma: bool | None = None

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= 16 (tl.dot tile)")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be one of 1, 2, 4, 8, 16")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")
        if self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm={self.programs_per_sm} must be >= 1")
        if not isinstance(self.group_m, int) or self.group_m < 0:
            raise ValueError(f"group_m={self.group_m!r} must be an int >= 0 (0: every m-tile of an expert first)")
        if self.tma not in (None, True, False):
            raise ValueError(f"tma={self.tma!r} must be None (where possible), True or False")


ACTIVATIONS = {"none": 0, "silu": 1, "gelu_tanh": 2, "relu2": 3}


@dataclass(frozen=True)
class Epilogue:
    """What the kernel applies to a GEMM's fp32 accumulators (after the bias) before storing.

    gated: weight rows hold a gate and an up half (N = 2 N_OUT): out = act(gate) * (up + up_offset);
        otherwise out = act(acc) over N = N_OUT rows.
    interleaved: gate and up rows alternate (gate 2n, up 2n + 1, gpt-oss) instead of [gate; up].
    activation: "none", "silu" (x * sigmoid(alpha * x)), "gelu_tanh" or "relu2" (relu(x)^2).
    limit: gate clamped to <= limit and up to [-limit, limit] before the activation (inf: no clamp).
    """

    activation: str = "silu"
    gated: bool = True
    interleaved: bool = False
    alpha: float = 1.0
    limit: float = float("inf")
    up_offset: float = 0.0

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} is not one of {tuple(ACTIVATIONS)}")
        if self.interleaved and not self.gated:
            raise ValueError("interleaved=True needs gated=True (gate and up rows to interleave)")
        if not self.limit > 0:
            raise ValueError(f"limit={self.limit} must be > 0 (inf for no clamp)")


SWIGLU = Epilogue()
