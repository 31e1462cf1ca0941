"""Block-scaled weight formats: what a quantized weight and its scales mean, in plain PyTorch.

Legend: N = output features (the rows of a weight), K = input features (its columns), bn = weight rows
one block scale covers, bk = weight columns one block scale covers, Kg = groups per row (K / 32 for
MXFP4), R = rows an experts call computes (of activations).

fp8: float8_e4m3fn values W_q [N, K] and one scale per bn x bk block, s [ceil(N / bn), ceil(K / bk)]
    (fp32, or float8_e8m0fnu powers of two for scale_fmt "ue8m0"): W = W_q * s[n // bn, k // bk]
    (DeepSeek-V3 `weight_scale_inv`). A fused gate/up weight [2I, K] is two weights [I, K] blocked
    each on its own (`halves=2`, as gate_proj and up_proj are quantized in the checkpoints), so its
    scale is [2 ceil(I / bn), ceil(K / bk)]; when bn divides I that is the plain blocking of [2I, K].
mxfp4 (gpt-oss): e2m1 values packed two per byte, low nibble first, blocks [N, Kg, 16] uint8, and one
    e8m0 exponent byte per 32 values along K, scales [N, Kg]: W[n, 32 g + j] = e2m1(j) * 2^(s[n, g] - 127).

`dequantize` turns one expert's weight back into a dense [N, K] tensor on use; `quantize_*` make
such weights from dense ones (tests, the tiny checkpoint maker). `quantize_rows_fp8` quantizes
activations [R, K] to fp8 with one fp32 scale per row and group of K columns (DeepSeek-V3's dynamic
1 x 128 activation scales), for fp8 x fp8 dots. Nothing here needs Triton or a GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
UE8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)  # torch >= 2.7
FP8_SCALE_DTYPES = tuple(d for d in (torch.float32, UE8M0_DTYPE) if d is not None)
MXFP4_GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FORMATS = ("fp8", "mxfp4")


@dataclass(frozen=True)
class BlockQuant:
    """How one weight is quantized: its format, the block one scale covers, and its halves.

    format: "fp8" or "mxfp4". block: (rows, cols) of weights per scale ((1, 32) for mxfp4).
    halves: 2 for a fused [gate; up] weight whose halves are blocked separately, else 1.
    """

    format: str
    block: tuple[int, int]
    halves: int = 1

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format={self.format!r} must be one of {FORMATS}")
        if len(self.block) != 2 or min(self.block) < 1:
            raise ValueError(f"block={self.block} must be two ints >= 1 (rows, cols per scale)")
        if self.format == "mxfp4" and tuple(self.block) != (1, MXFP4_GROUP):
            raise ValueError(f"mxfp4 has one scale per 1 x {MXFP4_GROUP} values, got block={self.block}")
        if self.halves not in (1, 2):
            raise ValueError(f"halves={self.halves} must be 1 or 2")

    def scale_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """Shape of the scale tensor of one [rows, cols] weight (cols = K, the logical input features)."""
        bn, bk = self.block
        return (self.halves * math.ceil(rows // self.halves / bn), math.ceil(cols / bk))

    def stored_shape(self, rows: int, cols: int) -> tuple[int, ...]:
        """Shape of the stored values of one [rows, cols] weight: itself for fp8, packed blocks for mxfp4."""
        if self.format == "mxfp4":
            return (rows, cols // MXFP4_GROUP, MXFP4_GROUP // 2)
        return (rows, cols)

    def logical_shape(self, stored: tuple[int, ...]) -> tuple[int, int]:
        """[N, K] of a weight stored as `stored` (one expert)."""
        if self.format == "mxfp4":
            return (stored[0], stored[1] * stored[2] * 2)
        return (stored[0], stored[1])

    def bytes_per_weight(self) -> float:
        """Bytes per weight value, scales excluded (fp8: 1, mxfp4: 0.5)."""
        return 0.5 if self.format == "mxfp4" else 1.0


def check_scale_shape(quant: BlockQuant, rows: int, cols: int, scale_shape: tuple[int, ...], name: str) -> None:
    """ValueError naming `name` when one expert's scale of shape `scale_shape` does not hold one scale per
    block of its [rows, cols] weight."""
    expected = quant.scale_shape(rows, cols)
    if tuple(scale_shape) != expected:
        split = " (gate and up blocked separately)" if quant.halves == 2 else ""
        raise ValueError(
            f"{name} has {list(scale_shape)} scales per expert, expected {list(expected)}: one per "
            f"{quant.block[0]} x {quant.block[1]} block of its [{rows}, {cols}] weight{split}"
        )


def _expand(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """[sr, sc] block scales -> [rows, cols] one per weight (fp32)."""
    bn, bk = block
    s = scale.to(torch.float32)
    return s.repeat_interleave(bn, dim=0)[:rows].repeat_interleave(bk, dim=1)[:, :cols]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, quant: BlockQuant, dtype: torch.dtype) -> torch.Tensor:
    """One fp8 weight [N, K] with its block scales -> [N, K] in `dtype` (products in fp32, one rounding)."""
    rows, cols = weight.shape
    half = rows // quant.halves
    scale_rows = scale.shape[0] // quant.halves
    parts = []
    for h in range(quant.halves):
        w = weight[h * half : (h + 1) * half].to(torch.float32)                      # [N / halves, K]
        s = _expand(scale[h * scale_rows : (h + 1) * scale_rows], half, cols, quant.block)
        parts.append(w * s)
    out = parts[0] if len(parts) == 1 else torch.cat(parts)                          # [N, K]
    return out.to(dtype)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One MXFP4 weight, blocks [N, Kg, 16] uint8 and scales [N, Kg] uint8 -> [N, 32 Kg] in `dtype`."""
    rows, groups, half = blocks.shape
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.empty(rows, groups, 2 * half, dtype=torch.float32, device=blocks.device)  # [N, Kg, 32]
    values[..., 0::2] = lut[(blocks & 0x0F).long()]
    values[..., 1::2] = lut[(blocks >> 4).long()]
    exponent = scales.to(torch.int32) - 127                                                   # [N, Kg]
    return torch.ldexp(values, exponent.unsqueeze(-1)).reshape(rows, groups * 2 * half).to(dtype)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, quant: BlockQuant, dtype: torch.dtype) -> torch.Tensor:
    """One expert's quantized weight (as stored) and its scales -> dense [N, K] in `dtype`."""
    if quant.format == "mxfp4":
        return dequantize_mxfp4(weight, scale, dtype)
    return dequantize_fp8(weight, scale, quant, dtype)


def quantize_fp8(weight: torch.Tensor, quant: BlockQuant, scale_fmt: str = "float") -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [..., N, K] -> (float8_e4m3fn [..., N, K], scales [..., sr, sc]): each block divided by
    its max |w| / 448 (rounded up to a power of two for scale_fmt "ue8m0", stored as e8m0)."""
    if scale_fmt not in ("float", "ue8m0"):
        raise ValueError(f"scale_fmt={scale_fmt!r} must be 'float' or 'ue8m0'")
    if scale_fmt == "ue8m0" and UE8M0_DTYPE is None:
        raise RuntimeError(f"scale_fmt='ue8m0' needs torch.float8_e8m0fnu (torch >= 2.7), torch is {torch.__version__}")
    *lead, rows, cols = weight.shape
    bn, bk = quant.block
    half = rows // quant.halves
    qs, ss = [], []
    for h in range(quant.halves):
        w = weight[..., h * half : (h + 1) * half, :].to(torch.float32)               # [..., n, K]
        sr, sc = math.ceil(half / bn), math.ceil(cols / bk)
        padded = w.new_zeros(*lead, sr * bn, sc * bk)
        padded[..., :half, :cols] = w
        amax = padded.unflatten(-1, (sc, bk)).unflatten(-3, (sr, bn)).abs().amax(dim=(-3, -1))  # [..., sr, sc]
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        if scale_fmt == "ue8m0":
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        q = (w / _expand_lead(scale, half, cols, quant.block)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        qs.append(q)
        ss.append(scale)
    q = torch.cat(qs, dim=-2)
    s = torch.cat(ss, dim=-2)
    return q, (s.to(UE8M0_DTYPE) if scale_fmt == "ue8m0" else s)


def _expand_lead(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    bn, bk = block
    return scale.repeat_interleave(bn, dim=-2)[..., :rows, :].repeat_interleave(bk, dim=-1)[..., :cols]


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense [..., N, K] (K a multiple of 32) -> (blocks [..., N, K / 32, 16] uint8, scales [..., N, K / 32]
    uint8): each group of 32 scaled by the power of two that brings its max |w| to at most 6, values
    rounded to the nearest e2m1 value."""
    *lead, rows, cols = weight.shape
    if cols % MXFP4_GROUP:
        raise ValueError(f"mxfp4 needs K divisible by {MXFP4_GROUP}, got a weight of shape {list(weight.shape)}")
    w = weight.to(torch.float32).unflatten(-1, (cols // MXFP4_GROUP, MXFP4_GROUP))  # [..., N, Kg, 32]
    amax = w.abs().amax(dim=-1)                                                        # [..., N, Kg]
    exponent = torch.ceil(torch.log2(torch.where(amax > 0, amax / 6.0, torch.ones_like(amax)))).clamp(-127, 127)
    scaled = w / torch.exp2(exponent).unsqueeze(-1)
    grid = torch.tensor(E2M1_VALUES[:8])                                               # magnitudes
    nearest = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(dim=-1)                 # [..., N, Kg, 32]
    codes = (nearest | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)                                # [..., N, Kg, 16]
    return blocks, (exponent + 127).to(torch.uint8)


def quantize_rows_fp8(x: torch.Tensor, group: int, *, groups_first: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [R, K] -> (float8_e4m3fn [R, K], fp32 scales [R, ceil(K / group)]): each row's group
    of `group` columns divided by its max |x| / 448 (scale 1 for an all-zero group). groups_first: the
    scales are stored group after group ([Kg, R] in memory, returned as its [R, Kg] transpose), so the
    rows of one kernel tile read one group's scales from consecutive addresses."""
    rows, cols = x.shape
    groups = math.ceil(cols / group)
    padded = torch.nn.functional.pad(x.to(torch.float32), (0, groups * group - cols))  # [R, Kg * group]
    amax = padded.view(rows, groups, group).abs().amax(dim=-1)                        # [R, Kg]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (padded.view(rows, groups, group) / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    if groups_first:
        # [R, Kg] view of [Kg, R] storage, strides (1, R) at every R: `.t().contiguous().t()` would leave a
        # one-row scale as it is (a size-1 dimension never breaks contiguity), strides (Kg, 1), and the kernel
        # would specialise a one-token launch apart from every other.
        scale = torch.empty(groups, rows, dtype=scale.dtype, device=scale.device).t().copy_(scale)
    return q.view(rows, groups * group)[:, :cols].to(FP8_DTYPE), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """The fp32 values of activations quantized by `quantize_rows_fp8`: [R, K]."""
    return q.to(torch.float32) * scale.repeat_interleave(group, dim=1)[:, : q.shape[1]]
