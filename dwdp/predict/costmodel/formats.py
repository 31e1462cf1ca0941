"""How weights and activations are stored: bytes of a weight matrix, and of one activation element
quantized for a GEMM, in each weight dtype."""
from __future__ import annotations

import math
from dataclasses import dataclass

ACT_BYTES = 2  # activations, KV and router weights in bf16


@dataclass(frozen=True)
class WeightFormat:
    """How one weight matrix [rows, cols] (cols = reduction dim) is stored.

    bits: bits per value; block: (rows, cols) covered by one scale (None = unscaled);
    scale_bytes: bytes per block scale; tensor_scale_bytes: per-matrix global scale;
    compute: tensor-core dtype its GEMMs run at; act_bytes: bytes per activation element fed to such
    a GEMM (values + scales), and what an activation in this format costs to write or send.
    """

    name: str
    bits: int
    block: tuple[int, int] | None
    scale_bytes: int
    tensor_scale_bytes: int
    compute: str
    act_bytes: float

    @property
    def quantizes_activations(self) -> bool:
        """Whether a GEMM in this format needs its bf16 input quantized first (a memory-bound pass)."""
        return self.act_bytes < ACT_BYTES

    def matrix_bytes(self, rows: int, cols: int) -> int:
        nbytes = rows * cols * self.bits // 8
        if self.block is not None:
            nbytes += math.ceil(rows / self.block[0]) * math.ceil(cols / self.block[1]) * self.scale_bytes
        return nbytes + self.tensor_scale_bytes


FORMATS = {
    "bf16": WeightFormat("bf16", 16, None, 0, 0, "bf16", ACT_BYTES),
    # DeepSeek-V3/R1 checkpoint layout: one fp32 scale per 128x128 weight block; activations in fp8
    # with one fp32 scale per 1x128 group.
    "fp8": WeightFormat("fp8", 8, (128, 128), 4, 0, "fp8", 1 + 4 / 128),
    # NVFP4: e2m1 values, one fp8 (e4m3) scale per 16 values along K, one fp32 scale per tensor;
    # activations quantized the same way.
    "nvfp4": WeightFormat("nvfp4", 4, (1, 16), 1, 4, "fp4", 0.5 + 1 / 16),
}


def weight_format(name: str) -> WeightFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown weight dtype {name!r}; expected one of {tuple(FORMATS)}")
    return FORMATS[name]
