"""How weights and activations are stored: bytes of a matrix in each weight dtype."""
from __future__ import annotations

import math
from dataclasses import dataclass

ACT_BYTES = 2  # activations, KV and router weights in bf16



@dataclass(frozen=True)
class WeightFormat:
    """How one weight matrix [rows, cols] (cols = reduction dim) is stored.

    bits: bits per value; block: (rows, cols) covered by one scale (None = unscaled);
    scale_bytes: bytes per block scale; tensor_scale_bytes: per-matrix global scale;
    compute: tensor-core dtype its GEMMs run at.
    """

    name: str
    bits: int
    block: tuple[int, int] | None
    scale_bytes: int
    tensor_scale_bytes: int
    compute: str

    def matrix_bytes(self, rows: int, cols: int) -> int:
        nbytes = rows * cols * self.bits // 8
        if self.block is not None:
            nbytes += math.ceil(rows / self.block[0]) * math.ceil(cols / self.block[1]) * self.scale_bytes
        return nbytes + self.tensor_scale_bytes


FORMATS = {
    "bf16": WeightFormat("bf16", 16, None, 0, 0, "bf16"),
    # DeepSeek-V3/R1 checkpoint layout: one fp32 scale per 128x128 block.
    "fp8": WeightFormat("fp8", 8, (128, 128), 4, 0, "fp8"),
    # NVFP4: e2m1 values, one fp8 (e4m3) scale per 16 values along K, one fp32 scale per tensor.
    "nvfp4": WeightFormat("nvfp4", 4, (1, 16), 1, 4, "fp4"),
}


def weight_format(name: str) -> WeightFormat:
    if name not in FORMATS:
        raise ValueError(f"unknown weight dtype {name!r}; expected one of {tuple(FORMATS)}")
    return FORMATS[name]


# ---------------------------------------------------------------------------------------------
