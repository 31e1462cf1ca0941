"""Multi-buffer grouped GEMM: each expert's weights are read in place through a table of addresses.

After prefetch a layer's experts live in several tensors (the rank's local parameter and one
buffer per source peer). Instead of merging them into one [E, N, K] tensor, the wrapper builds
an int64 table of per-expert base addresses and the kernel loads the base of the expert it is
working on. There is no cap on the number of distinct buffers.

Legend: R = rows an experts call computes (token-expert pairs, sorted by expert), K = input features,
N = output features (the rows of each expert's weight), N_OUT = output features after the epilogue
(N, or N / 2 with the SwiGLU epilogue), E = experts in the table, W = wave size (programs of the
persistent grid, one tile each per wave), Kg = groups per row (of fp8 activations' scales).

Schedule: tiles are numbered expert by expert; inside an expert, m-tiles run fastest in groups of
GROUP_M (all of the expert's m-tiles when 0), then the n-tile, so the programs of one wave share a
weight tile and a group of A rows through L2. The tile count of every expert comes from
`expert_offsets` on the device, so no host sync is needed; the grid is a persistent one of at most
W programs striding over the tiles, and a program reads an expert's base addresses once for all of
its tiles of that expert.

Local-first: with `split_at=L` (experts [0, L) local), `part="first"` runs a prefix of the local
experts and `part="second"` the rest, so the first launch can start while remote experts are
still being copied. The prefix is the longest one of at most L experts such that the two
launches need no more waves than a single launch: ceil(P1 / W) + ceil((P - P1) / W) ==
ceil(P / W) for the P1 tiles of the prefix and P tiles in all, for this GEMM and for its partner
(the fused MoE path's other GEMM, whose tiles and wave are passed in), so both split at the same
expert. `local_first_split` is the host mirror of that choice. The part, the split and the waves
are runtime arguments: a launch compiles the same whichever part it runs.

Load paths: on Hopper (sm_90+) each program builds, from the pointer table, one TMA descriptor per
expert it works on (not per tile) and streams that expert's weight tiles through it, zero-filled
past N and K; A goes through one descriptor too unless its rows are gathered (MoE gate_up). The
descriptors live in global scratch that Triton asks an allocator for at launch
(`ensure_tma_allocator`). Elsewhere, and for layouts TMA cannot read (interleaved gate/up rows,
rows that are not 16-byte multiples), tiles are masked pointer loads (cp.async on GPUs). Tiles,
warps, stages and the load path come from kernels/launch.py (`launch_config`), the one place that
configures a launch.

Interpreter: Triton's interpreter computes bf16/fp16 `tl.dot` wrongly, so under TRITON_INTERPRET
the tiles are upcast to fp32 before the dot (FP32_DOT). On GPU bf16/fp16 tiles go to the tensor
cores with fp32 accumulation; fp32 inputs use IEEE fp32 dots (no TF32), like torch.mm.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch

from dwdp.kernels.block_scales import BlockQuant
from dwdp.kernels.settings import ACTIVATIONS, SWIGLU, Epilogue, GroupedGemmConfig
from dwdp.kernels.weight_tables import ALIGN_BYTES, ExpertWeightTable, expert_weight_table

__all__ = ["ACTIVATIONS", "SWIGLU", "Epilogue", "GroupedGemmConfig", "grouped_gemm", "local_first_split", "default_wave_size", "is_interpreter"]

if TYPE_CHECKING:
    from dwdp.kernels.launch import KernelProblem, LaunchConfig
    from dwdp.kernels.scaled_weights import ScaleTable

try:
    import triton
    import triton.language as tl
except ImportError:  # dwdp.kernels must import on machines without Triton (CPU runtime uses reference.py)
    triton = None
    tl = None

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OFFSET_DTYPES = (torch.int32, torch.int64)
_PARTS = {"all": 0, "first": 1, "second": 2}
# Kernel arguments that change from call to call (local-first split, part, waves): not specialised by
# Triton, so they never compile a new variant.
RUNTIME_ARGS = ("split_at", "part", "wave_size", "n_tiles_partner", "block_m_partner", "wave_partner", "num_a_rows",
                "stride_ask", "stride_osk")


def _as_table(weights: Sequence[torch.Tensor] | ExpertWeightTable, name: str, ndim: int = 2) -> ExpertWeightTable:
    return weights if isinstance(weights, ExpertWeightTable) else expert_weight_table(weights, name=name, ndim=ndim)


def _tile_count(n: int, block: int) -> int:
    return (n + block - 1) // block


def local_first_split(
    expert_offsets: torch.Tensor | Sequence[int],
    split_at: int,
    *,
    n_tiles: Sequence[int],
    block_m: int,
    wave_size: int,
    partners: Sequence[tuple[int, int, int]] = (),
) -> int:
    """Host mirror of the kernel's local-first split (reads the offsets, so it syncs on CUDA).

    Returns the number s <= split_at of leading experts that `part="first"` computes: the largest
    s such that, for every GEMM, the first launch (tiles of experts [0, s)) and the second (the
    rest) together need no more waves than one launch over all experts. The GEMMs are those with
    n-tile counts `n_tiles` at `block_m` rows per tile and `wave_size` programs, plus `partners`,
    each (n_tiles, block_m, wave_size) of a GEMM with other tiles or another wave.
    """
    offsets = expert_offsets.tolist() if isinstance(expert_offsets, torch.Tensor) else list(expert_offsets)
    num_experts = len(offsets) - 1
    gemms = [(n, block_m, wave_size) for n in n_tiles] + list(partners)
    prefixes = {}
    for _, bm, _ in gemms:
        if bm not in prefixes:
            prefix = [0]
            for e in range(num_experts):
                prefix.append(prefix[-1] + _tile_count(max(offsets[e + 1] - offsets[e], 0), bm))
            prefixes[bm] = prefix
    best = 0
    for s in range(min(split_at, num_experts) + 1):
        fits = True
        for n, bm, wave in gemms:
            prefix = prefixes[bm]
            head, tail = prefix[s] * n % wave, (prefix[-1] - prefix[s]) * n % wave
            fits &= head == 0 or tail == 0 or head + tail > wave
        if fits:
            best = s
    return best


if triton is not None:

    @triton.jit
    def _activate(x, alpha, ACTIVATION: tl.constexpr):
        """x [BLOCK_M, BLOCK_N] fp32 -> act(x): 0 identity, 1 x * sigmoid(alpha x), 2 tanh-GELU, 3 relu^2."""
        if ACTIVATION == 1:
            x = x * tl.sigmoid(alpha * x)
        elif ACTIVATION == 2:
            # tanh(z) = 2 sigmoid(2z) - 1, with z = sqrt(2 / pi) (x + 0.044715 x^3)
            z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            x = x * tl.sigmoid(2.0 * z)
        elif ACTIVATION == 3:
            x = tl.maximum(x, 0.0)
            x = x * x
        return x

    @triton.jit
    def _dequantize_tile(w, s_base, s_rows, k_blocks, stride_sn, stride_sk, mask, SCALE_E8M0: tl.constexpr):
        """w [BLOCK_K, BLOCK_N] fp8 -> fp32 times the block scale of each element (rows s_rows [BLOCK_N],
        columns k_blocks [BLOCK_K] of the expert's scale grid)."""
        s_ptrs = s_base + s_rows[None, :].to(tl.int64) * stride_sn + k_blocks[:, None] * stride_sk
        if SCALE_E8M0:
            s = tl.exp2(tl.load(s_ptrs, mask=mask, other=127).to(tl.float32) - 127.0)
        else:
            s = tl.load(s_ptrs, mask=mask, other=0.0)
        return w.to(tl.float32) * s

    @triton.jit
    def _column_scales(s_base, s_rows, k_block, stride_sn, stride_sk, mask, SCALE_E8M0: tl.constexpr):
        """[BLOCK_N] fp32 block scales of scale rows s_rows at scale column k_block."""
        s_ptrs = s_base + s_rows.to(tl.int64) * stride_sn + k_block * stride_sk
        # One return: compiled Triton type-checks every return, so an early fp32 one beside a uint8 load
        # does not compile (the interpreter would take the branch and never notice).
        if SCALE_E8M0:
            s = tl.exp2(tl.load(s_ptrs, mask=mask, other=127).to(tl.float32) - 127.0)
        else:
            s = tl.load(s_ptrs, mask=mask, other=0.0)
        return s

    @triton.jit
    def _tile_scale(s_base, s_row, k_block, stride_sn, stride_sk, SCALE_E8M0: tl.constexpr):
        """The fp32 block scale at scale row s_row, column k_block (one for a whole weight tile)."""
        raw = tl.load(s_base + s_row.to(tl.int64) * stride_sn + k_block * stride_sk)
        if SCALE_E8M0:
            s = tl.exp2(raw.to(tl.float32) - 127.0)
        else:
            s = raw
        return s

    @triton.jit
    def _round_e4m3(x):
        """fp32 x (|x| <= 448) rounded to the nearest float8_e4m3fn value, ties to even, in fp32 arithmetic:
        the interpreter's own fp32 -> fp8 conversion loses the carry into the exponent (127.5 -> 64)."""
        exponent = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        exponent = tl.maximum(exponent, -6)  # subnormals share the smallest normal exponent's spacing
        quantum = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # spacing of 3 mantissa bits
        steps = x / quantum
        return ((steps + 12582912.0) - 12582912.0) * quantum  # 1.5 * 2^23: round half to even

    @triton.jit
    def _quantize_groups(acc, col_mask, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr,
                         ROUND: tl.constexpr, INTERPRETED: tl.constexpr):
        """acc [BLOCK_M, BLOCK_N] fp32 -> (values divided by their group's scale, clamped to fp8's range,
        [BLOCK_M, BLOCK_N]; scales [BLOCK_M, BLOCK_N / GROUP]): one scale max|x| / 448 (1 for an all-zero
        group) per row and GROUP columns, as quantize_rows_fp8 computes it on the rounded values."""
        acc = tl.where(col_mask[None, :], acc, 0.0)  # columns past N_OUT never count towards a scale
        if ROUND == 1:
            acc = acc.to(tl.bfloat16).to(tl.float32)
        elif ROUND == 2:
            acc = acc.to(tl.float16).to(tl.float32)
        grouped = tl.reshape(acc, (BLOCK_M, BLOCK_N // GROUP, GROUP))
        amax = tl.max(tl.abs(grouped), axis=2)  # [BLOCK_M, BLOCK_N / GROUP]
        scale = tl.where(amax > 0, amax / 448.0, 1.0)
        q = tl.reshape(grouped / scale[:, :, None], (BLOCK_M, BLOCK_N))
        q = tl.minimum(tl.maximum(q, -448.0), 448.0)
        if INTERPRETED:
            q = _round_e4m3(q)
        return q, scale

    @triton.jit
    def _fp8_dot(a, w, FP32_DOT: tl.constexpr):
        """a [BLOCK_M, BLOCK_K] fp8 @ w [BLOCK_K, BLOCK_N] fp8 -> fp32 (fp8 tensor cores on sm_89+; exact
        fp32 products in the interpreter)."""
        if FP32_DOT:
            d = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            d = tl.dot(a, w)
        return d

    @triton.jit
    def _tile_coords(local, num_m, num_n, GROUP_M: tl.constexpr):
        """(m_tile, n_tile) of an expert's local tile index: m fastest within groups of GROUP_M m-tiles (all
        of them when 0), then n, then the next group."""
        if GROUP_M == 0:
            m_tile = local % num_m
            n_tile = local // num_m
        else:
            width = GROUP_M * num_n
            first_m = (local // width) * GROUP_M
            size_m = tl.minimum(num_m - first_m, GROUP_M)
            m_tile = first_m + (local % width) % size_m
            n_tile = (local % width) // size_m
        return m_tile, n_tile

    @triton.jit
    def _descriptor_tile(desc, n0, k0, W_TRANSPOSED: tl.constexpr):
        """[BLOCK_K, BLOCK_N] weight tile at weight row n0, column k0 from an expert's descriptor (over [N, K],
        or over [K, N] for transposed storage)."""
        if W_TRANSPOSED:
            tile = desc.load([k0, n0])
        else:
            tile = desc.load([n0, k0]).T
        return tile

    @triton.jit
    def _waves_fit(m_tiles_begin, total_m, n_tiles, wave):
        """[BLOCK_E] whether splitting before each expert costs no extra wave: two partial waves cost one
        more unless together they overflow a single wave anyway."""
        head = m_tiles_begin * n_tiles % wave
        tail = (total_m - m_tiles_begin) * n_tiles % wave
        return (head == 0) | (tail == 0) | (head + tail > wave)

    @triton.jit(do_not_specialize=RUNTIME_ARGS)
    def _grouped_gemm_kernel(
        a_ptr,  # [rows of A, K] activations: the sorted rows, or token rows gathered through slots
        w_table_ptr,  # [E] int64 base address of each expert's [N, K] weight view (any strides, see stride_w*)
        bias_table_ptr,  # [E] int64 base address of each expert's [N] bias, read when HAS_BIAS
        scale_table_ptr,  # [E] int64 base address of each expert's [SR, SC] fp8 block scales, read when W_SCALED
        offsets_ptr,  # [E + 1] int32/int64 first sorted row of each expert, then R
        slots_ptr,  # [R] int64 slot (token * top_k + j) of each sorted row, read when HAS_SLOTS
        scale_ptr,  # [R] (or [slots]) per-row scale, indexed by slot when HAS_SLOTS, read when HAS_SCALE
        out_ptr,  # [rows of out, N_OUT] output: sorted rows, slots, or tokens (ATOMIC_OUT)
        num_experts,  # E
        N_OUT,  # output features
        K,  # input features
        top_k,  # slot // top_k is the token row of a slot
        split_at,  # experts [0, split_at) may run in the first part
        part,  # 0 all experts, 1 first (local prefix), 2 second (the rest)
        wave_size,  # W: programs one wave of this launch runs
        n_tiles_partner,  # n-tiles of a second GEMM that must split at the same expert (own count when alone)
        block_m_partner,  # its rows per m-tile (own BLOCK_M when alone)
        wave_partner,  # its wave size (own when alone)
        stride_am, stride_ak,  # A strides
        stride_wn, stride_wk,  # strides of every expert's weight view ((K, 1), or (1, N) for [K, N] storage)
        stride_om, stride_on,  # output strides
        alpha,  # fp32 sigmoid gain of ACTIVATION 1
        limit,  # fp32 clamp of gate (above) and up (both sides) when CLAMP
        up_offset,  # fp32 added to up before the product (gpt-oss: 1)
        half_rows,  # weight rows per separately blocked half (N, or N / 2 for a [gate; up] blocked per half)
        half_scale_rows,  # scale rows per half
        scale_block_n, scale_block_k,  # weights per scale: bn rows x bk columns
        stride_sn, stride_sk,  # strides of every expert's scale view
        a_scale_ptr,  # [rows of A, ceil(K / act_group)] fp32 scales of fp8 activations, read when A_FP8
        stride_asm, stride_ask,  # its strides (row, K block): (1, rows) for the groups-first layout
        act_group,  # columns of A per activation scale (a multiple of BLOCK_K)
        num_a_rows,  # rows of A (the bound of its TMA descriptor)
        out_scale_ptr,  # [rows of out, ceil(N_OUT / QUANT_GROUP)] fp32 scales of an fp8 output, written when QUANT_GROUP
        stride_osm, stride_osk,  # its strides (row, column group)
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_E: tl.constexpr,  # power of two > E: one lane per expert plus the "all experts" prefix
        GROUP_M: tl.constexpr,  # m-tiles of an expert run side by side per n-tile (0: all of them)
        HAS_SLOTS: tl.constexpr,
        GATHER_A: tl.constexpr,  # A row of sorted row m is slots[m] // top_k
        HAS_SCALE: tl.constexpr,
        SCATTER_OUT: tl.constexpr,  # output row of sorted row m is slots[m] (or its token with ATOMIC_OUT)
        ATOMIC_OUT: tl.constexpr,  # accumulate into token rows with atomics (fp32 output)
        HAS_BIAS: tl.constexpr,  # add each expert's bias row before the epilogue
        GATED: tl.constexpr,  # weight rows hold gate and up halves (N = 2 N_OUT); out = act(gate) * (up + up_offset)
        INTERLEAVED: tl.constexpr,  # gate row 2n, up row 2n + 1 (else gate row n, up row N_OUT + n)
        ACTIVATION: tl.constexpr,  # 0 none, 1 silu(alpha), 2 gelu (tanh), 3 relu^2
        CLAMP: tl.constexpr,  # clamp gate and up by limit before the activation
        FP32_DOT: tl.constexpr,  # upcast tiles and use IEEE fp32 dots
        W_SCALED: tl.constexpr,  # fp8 weights, dequantized with their block scales tile by tile in the K loop
        SCALE_E8M0: tl.constexpr,  # scales are e8m0 exponent bytes (2^(s - 127)), else fp32
        A_FP8: tl.constexpr,  # with W_SCALED: A is fp8 with row scales; fp8 x fp8 dots, both scales applied per K tile
        W_TMA: tl.constexpr,  # weights through one TMA descriptor per expert, built on the device from the table
        A_TMA: tl.constexpr,  # A through one TMA descriptor (rows not gathered)
        W_TRANSPOSED: tl.constexpr,  # weights stored [K, N] (stride_wn == 1): descriptor over [K, N]
        W_SCALE_TILE: tl.constexpr,  # every weight tile sits in one scale block: one scale per tile and K step
        QUANT_GROUP: tl.constexpr,  # > 0: store out as fp8, one scale per row and QUANT_GROUP columns (else 0)
        QUANT_ROUND: tl.constexpr,  # before quantizing, round to 0 fp32 (none), 1 bf16, 2 fp16 (h's dtype)
        K_DIV: tl.constexpr,  # a power of two (<= 16) dividing K
        A_ROW_DIV: tl.constexpr,  # one dividing A's row stride (1 unless A's K is contiguous)
        W_ROW_DIV: tl.constexpr,  # one dividing the weights' row stride (1 unless their K is contiguous)
    ):
        # Triton reads a divisibility off an int argument only when it is a multiple of 16. For K = 1032
        # (8 x 129) it read none, and every A and weight tile was loaded 2 bytes at a time with no cp.async
        # (the sm_90 PTX: 96 `ld.global.b16`, no 16-byte cp.async). Rebuilt as (x // d) * d, a value the
        # compiler sees is a multiple of d (the launcher checked it is one, so the value is the same).
        if K_DIV > 1:
            K = (K // K_DIV) * K_DIV
        if A_ROW_DIV > 1:
            stride_am = (stride_am // A_ROW_DIV) * A_ROW_DIV
        if W_ROW_DIV > 1:
            stride_wn = (stride_wn // W_ROW_DIV) * W_ROW_DIV
        pid = tl.program_id(0)
        num_programs = tl.num_programs(0)
        n_tiles = tl.cdiv(N_OUT, BLOCK_N)

        # Tile schedule of all experts, recomputed by every program from the offsets on device.
        experts = tl.arange(0, BLOCK_E)  # [BLOCK_E]
        is_expert = experts < num_experts
        row_lo = tl.load(offsets_ptr + experts, mask=is_expert, other=0).to(tl.int32)  # [BLOCK_E]
        row_hi = tl.load(offsets_ptr + experts + 1, mask=is_expert, other=0).to(tl.int32)  # [BLOCK_E]
        rows_of = tl.maximum(row_hi - row_lo, 0)  # [BLOCK_E]
        m_tiles = (rows_of + BLOCK_M - 1) // BLOCK_M  # [BLOCK_E]
        m_tiles_end = tl.cumsum(m_tiles, 0)  # [BLOCK_E] inclusive prefix
        m_tiles_begin = m_tiles_end - m_tiles  # [BLOCK_E] m-tiles before expert e (lane E: all)
        tile_end = m_tiles_end * n_tiles  # [BLOCK_E]
        total_m = tl.sum(m_tiles, 0)
        total = total_m * n_tiles

        # Largest expert prefix s <= split_at whose two launches fit the waves of one launch, for this
        # GEMM and its partner (the fused MoE path splits both GEMMs alike).
        fits = _waves_fit(m_tiles_begin, total_m, n_tiles, wave_size)
        m_tiles_p = (rows_of + block_m_partner - 1) // block_m_partner  # [BLOCK_E] partner's m-tiles
        m_begin_p = tl.cumsum(m_tiles_p, 0) - m_tiles_p
        fits = fits & _waves_fit(m_begin_p, tl.sum(m_tiles_p, 0), n_tiles_partner, wave_partner)
        fits = fits & (experts <= split_at) & (experts <= num_experts)
        split = tl.max(tl.where(fits, experts, 0), 0)
        first_end = tl.sum(tl.where(experts == split, m_tiles_begin, 0), 0) * n_tiles
        begin = tl.where(part == 2, first_end, 0)
        end = tl.where(part == 1, first_end, total)

        if A_TMA:
            a_desc = tl.make_tensor_descriptor(a_ptr, shape=[num_a_rows, K], strides=[stride_am, 1],
                                               block_shape=[BLOCK_M, BLOCK_K])
        if GATED:
            n_w = 2 * N_OUT
        else:
            n_w = N_OUT

        tile = begin + pid
        while tile < end:
            # This program's next tile opens an expert: its rows, tiles and base addresses, read once for
            # every tile of it this program runs.
            expert = tl.sum((tile_end <= tile).to(tl.int32), 0)
            is_mine = experts == expert
            expert_first = tl.sum(tl.where(is_mine, m_tiles_begin, 0), 0) * n_tiles
            expert_m_tiles = tl.sum(tl.where(is_mine, m_tiles, 0), 0)
            expert_stop = tl.minimum(expert_first + expert_m_tiles * n_tiles, end)
            lo = tl.sum(tl.where(is_mine, row_lo, 0), 0)
            hi = tl.sum(tl.where(is_mine, row_hi, 0), 0)
            # Base of this expert's weights, wherever its buffer is; 16-byte alignment checked on host.
            if W_SCALED:
                w_base = tl.multiple_of(tl.load(w_table_ptr + expert).to(tl.pointer_type(tl.float8e4nv)), 16)
                if SCALE_E8M0:
                    s_base = tl.load(scale_table_ptr + expert).to(tl.pointer_type(tl.uint8))
                else:
                    s_base = tl.load(scale_table_ptr + expert).to(tl.pointer_type(tl.float32))
            else:
                w_base = tl.multiple_of(tl.load(w_table_ptr + expert).to(tl.pointer_type(a_ptr.dtype.element_ty)), 16)
            if W_TMA:  # one descriptor per expert and program, zero-filled past N and K
                if W_TRANSPOSED:
                    w_desc = tl.make_tensor_descriptor(w_base, shape=[K, n_w], strides=[stride_wk, 1],
                                                       block_shape=[BLOCK_K, BLOCK_N])
                else:
                    w_desc = tl.make_tensor_descriptor(w_base, shape=[n_w, K], strides=[stride_wn, 1],
                                                       block_shape=[BLOCK_N, BLOCK_K])
            if HAS_BIAS:
                b_base = tl.multiple_of(tl.load(bias_table_ptr + expert).to(tl.pointer_type(a_ptr.dtype.element_ty)),
                                        16)

            while tile < expert_stop:
                m_tile, n_tile = _tile_coords(tile - expert_first, expert_m_tiles, n_tiles, GROUP_M)
                rows = lo + m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] sorted rows
                row_mask = rows < hi
                if HAS_SLOTS:
                    slots = tl.load(slots_ptr + rows, mask=row_mask, other=0).to(tl.int64)  # [BLOCK_M]
                else:
                    slots = rows.to(tl.int64)
                if GATHER_A:
                    a_rows = slots // top_k
                else:
                    a_rows = rows.to(tl.int64)
                cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features
                col_mask = cols < N_OUT
                # Weight rows behind each output feature: the gate (or only) row, and the up row.
                if GATED and INTERLEAVED:
                    w_rows = 2 * cols
                    up_rows = 2 * cols + 1
                else:
                    w_rows = cols
                    up_rows = cols + N_OUT
                if W_SCALED:
                    # Scale row of each weight row: its half, then its block within the half.
                    s_rows = (w_rows // half_rows) * half_scale_rows + (w_rows % half_rows) // scale_block_n
                    s_up_rows = (up_rows // half_rows) * half_scale_rows + (up_rows % half_rows) // scale_block_n
                    if W_SCALE_TILE:  # the tile's rows share one scale row (gate, and up N_OUT rows further)
                        n_first = n_tile * BLOCK_N
                        s_row0 = (n_first // half_rows) * half_scale_rows + (n_first % half_rows) // scale_block_n
                        up_first = N_OUT + n_first
                        s_up_row0 = (up_first // half_rows) * half_scale_rows + (up_first % half_rows) // scale_block_n
                ks = tl.arange(0, BLOCK_K)  # [BLOCK_K]
                a_ptrs = a_ptr + a_rows[:, None] * stride_am + ks[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
                w_ptrs = w_base + w_rows[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                if GATED:
                    up_ptrs = w_base + up_rows[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
                    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                n0 = n_tile * BLOCK_N
                for k0 in range(0, K, BLOCK_K):
                    k_mask = ks < K - k0
                    if A_TMA:  # rows past the expert belong to the next one (or are zero-filled): never stored
                        a = a_desc.load([lo + m_tile * BLOCK_M, k0])
                    else:
                        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                    if W_TMA:
                        w = _descriptor_tile(w_desc, n0, k0, W_TRANSPOSED)
                    else:
                        w = tl.load(w_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                    if A_FP8:
                        # One activation scale per row and one weight scale per column (or per tile) for this
                        # whole K tile: the dot of one scale block, promoted to fp32 with both scales.
                        a_s = tl.load(a_scale_ptr + a_rows * stride_asm + (k0 // act_group) * stride_ask, mask=row_mask,
                                      other=0.0)  # [BLOCK_M]
                        if W_SCALE_TILE:
                            w_s = _tile_scale(s_base, s_row0, k0 // scale_block_k, stride_sn, stride_sk, SCALE_E8M0)
                            acc += _fp8_dot(a, w, FP32_DOT) * (a_s * w_s)[:, None]
                        else:
                            w_s = _column_scales(s_base, s_rows, k0 // scale_block_k, stride_sn, stride_sk, col_mask,
                                                 SCALE_E8M0)
                            acc += _fp8_dot(a, w, FP32_DOT) * a_s[:, None] * w_s[None, :]
                    else:
                        if W_SCALED:
                            if W_SCALE_TILE:
                                w_s = _tile_scale(s_base, s_row0, k0 // scale_block_k, stride_sn, stride_sk,
                                                  SCALE_E8M0)
                                w = (w.to(tl.float32) * w_s).to(a.dtype)
                            else:
                                k_blocks = (k0 + ks) // scale_block_k  # [BLOCK_K] scale column of each k
                                w = _dequantize_tile(w, s_base, s_rows, k_blocks, stride_sn, stride_sk,
                                                     k_mask[:, None] & col_mask[None, :], SCALE_E8M0).to(a.dtype)
                        if FP32_DOT:
                            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
                        else:
                            acc = tl.dot(a, w, acc)
                    if GATED:
                        if W_TMA:
                            w_up = _descriptor_tile(w_desc, N_OUT + n0, k0, W_TRANSPOSED)
                        else:
                            w_up = tl.load(up_ptrs, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                        if A_FP8:
                            if W_SCALE_TILE:
                                w_up_s = _tile_scale(s_base, s_up_row0, k0 // scale_block_k, stride_sn, stride_sk,
                                                     SCALE_E8M0)
                                acc_up += _fp8_dot(a, w_up, FP32_DOT) * (a_s * w_up_s)[:, None]
                            else:
                                w_up_s = _column_scales(s_base, s_up_rows, k0 // scale_block_k, stride_sn, stride_sk,
                                                        col_mask, SCALE_E8M0)
                                acc_up += _fp8_dot(a, w_up, FP32_DOT) * a_s[:, None] * w_up_s[None, :]
                        else:
                            if W_SCALED:
                                if W_SCALE_TILE:
                                    w_up_s = _tile_scale(s_base, s_up_row0, k0 // scale_block_k, stride_sn, stride_sk,
                                                         SCALE_E8M0)
                                    w_up = (w_up.to(tl.float32) * w_up_s).to(a.dtype)
                                else:
                                    w_up = _dequantize_tile(w_up, s_base, s_up_rows, k_blocks, stride_sn, stride_sk,
                                                            k_mask[:, None] & col_mask[None, :], SCALE_E8M0).to(a.dtype)
                            if FP32_DOT:
                                acc_up = tl.dot(a.to(tl.float32), w_up.to(tl.float32), acc_up, input_precision="ieee")
                            else:
                                acc_up = tl.dot(a, w_up, acc_up)
                        if not W_TMA:
                            up_ptrs += BLOCK_K * stride_wk
                    if not A_TMA:
                        a_ptrs += BLOCK_K * stride_ak
                    if not W_TMA:
                        w_ptrs += BLOCK_K * stride_wk

                if HAS_BIAS:
                    acc += tl.load(b_base + w_rows, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                    if GATED:
                        acc_up += tl.load(b_base + up_rows, mask=col_mask, other=0.0).to(tl.float32)[None, :]
                if GATED:
                    if CLAMP:
                        acc = tl.minimum(acc, limit)
                        acc_up = tl.minimum(tl.maximum(acc_up, -limit), limit)
                    acc = _activate(acc, alpha, ACTIVATION) * (acc_up + up_offset)
                else:
                    acc = _activate(acc, alpha, ACTIVATION)
                if HAS_SCALE:
                    scale = tl.load(scale_ptr + slots, mask=row_mask, other=0.0).to(tl.float32)  # [BLOCK_M]
                    acc = acc * scale[:, None]
                if SCATTER_OUT:
                    if ATOMIC_OUT:
                        out_rows = slots // top_k
                    else:
                        out_rows = slots
                else:
                    out_rows = rows.to(tl.int64)
                if QUANT_GROUP > 0:
                    acc, q_scale = _quantize_groups(acc, col_mask, BLOCK_M, BLOCK_N, QUANT_GROUP, QUANT_ROUND, FP32_DOT)  # [BM, BN], [BM, BN / Kg]
                    groups = n_tile * (BLOCK_N // QUANT_GROUP) + tl.arange(0, BLOCK_N // QUANT_GROUP)
                    s_ptrs = out_scale_ptr + out_rows[:, None] * stride_osm + groups[None, :] * stride_osk
                    tl.store(s_ptrs, q_scale, mask=row_mask[:, None] & (groups * QUANT_GROUP < N_OUT)[None, :])
                out_ptrs = out_ptr + out_rows[:, None] * stride_om + cols[None, :] * stride_on
                out_mask = row_mask[:, None] & col_mask[None, :]
                if ATOMIC_OUT:
                    tl.atomic_add(out_ptrs, acc, mask=out_mask)
                else:
                    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
                tile += num_programs


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("the Triton grouped GEMM needs triton; on CPU use dwdp.kernels.grouped_gemm_reference")


def is_interpreter() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1 at import time)."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_grouped_gemm_kernel, InterpretedFunction)


def default_wave_size(device: torch.device, config: GroupedGemmConfig) -> int:
    """Programs of one wave: SMs x programs_per_sm on CUDA, a small fixed count in the interpreter."""
    from dwdp.kernels.launch import device_info

    info = device_info(device)
    return info.num_sms * (1 if info.is_interpreter else config.programs_per_sm)


def _check_device(device: torch.device, name: str) -> None:
    if device.type == "cuda":
        return
    if device.type == "cpu" and is_interpreter():
        return
    raise ValueError(
        f"{name} is on {device}: the Triton kernel runs on CUDA (or on CPU under TRITON_INTERPRET=1); "
        "use dwdp.kernels.grouped_gemm_reference on CPU"
    )


def _check_offsets(expert_offsets: torch.Tensor, num_experts: int, num_rows: int, device: torch.device) -> None:
    if not isinstance(expert_offsets, torch.Tensor):
        raise ValueError(f"expert_offsets must be a tensor, got {type(expert_offsets).__name__}")
    if expert_offsets.dtype not in _OFFSET_DTYPES:
        raise ValueError(f"expert_offsets has dtype {expert_offsets.dtype}, expected int32 or int64")
    if expert_offsets.shape != (num_experts + 1,):
        raise ValueError(
            f"expert_offsets has shape {tuple(expert_offsets.shape)}, expected ({num_experts + 1},) = E + 1"
        )
    if expert_offsets.device != device:
        raise ValueError(f"expert_offsets is on {expert_offsets.device}, expected {device}")
    if not expert_offsets.is_contiguous():
        raise ValueError(f"expert_offsets must be contiguous, got stride {expert_offsets.stride()}")
    if device.type == "cpu":  # reading values on CUDA would sync the host, so they are checked here only
        values = expert_offsets.tolist()
        if values[0] != 0 or values[-1] > num_rows or any(b < a for a, b in zip(values, values[1:])):
            raise ValueError(f"expert_offsets={values} must rise from 0 to at most R={num_rows}")


def _check_split(split_at: int | None, part: str, num_experts: int, wave_size: int) -> int:
    if part not in _PARTS:
        raise ValueError(f"part={part!r} must be one of {tuple(_PARTS)}")
    if not isinstance(wave_size, int) or wave_size < 1:
        raise ValueError(f"wave_size={wave_size!r} must be an int >= 1")
    if split_at is None:
        if part != "all":
            raise ValueError(f"part={part!r} needs split_at (number of local experts)")
        return 0
    if not isinstance(split_at, int) or not 0 <= split_at <= num_experts:
        raise ValueError(f"split_at={split_at!r} must be an int in [0, E={num_experts}]")
    return split_at


def _tma_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    """Global scratch Triton asks for at launch: where the device-built TMA descriptors live (128 bytes
    each per program), from torch's caching allocator on the current device."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_tma_allocator() -> None:
    """Give Triton a scratch allocator for device-side tensor descriptors, unless one is set in this
    context (Triton keeps it in a context variable: each thread that launches needs its own)."""
    try:
        from triton.runtime import _allocation

        is_set = not isinstance(_allocation._allocator.get(), _allocation.NullAllocator)
    except (ImportError, AttributeError):  # another Triton layout: set ours every time
        is_set = False
    if not is_set:
        triton.set_allocator(_tma_scratch)


def kernel_problem(
    a_dtype: torch.dtype,
    table: ExpertWeightTable,
    *,
    num_rows: int,
    epilogue: Epilogue | None = None,
    scales: "ScaleTable | None" = None,
    gather_a: bool = False,
    scatter_out: bool = False,
    atomic_out: bool = False,
    has_row_scale: bool = False,
    has_bias: bool = False,
    quant_out_group: int = 0,
    quant_out_round: torch.dtype = torch.float32,
) -> "KernelProblem":
    """The KernelProblem of one launch over `table` (kernels/launch.py): A of `a_dtype` (float8_e4m3fn for
    fp8 x fp8 dots), `num_rows` sorted rows spread over the table's experts; quant_out_group > 0 asks for
    an fp8 output with one scale per row and that many columns, rounded to quant_out_round first."""
    from dwdp.kernels.launch import KernelProblem

    n, k = table.shape
    return KernelProblem(
        a_dtype=a_dtype, w_dtype=table.dtype if scales is None else torch.float8_e4m3fn, n=n, k=k,
        num_experts=table.num_experts, rows_per_expert=-(-num_rows // table.num_experts), epilogue=epilogue,
        weight_strides=tuple(table.strides), gather_a=gather_a, scatter_out=scatter_out, atomic_out=atomic_out,
        has_row_scale=has_row_scale, has_bias=has_bias,
        scale_format=None if scales is None else ("e8m0" if scales.is_e8m0 else "fp32"),
        scale_block=None if scales is None else tuple(scales.quant.block),
        scale_halves=1 if scales is None else scales.quant.halves, quant_out_group=quant_out_group,
        quant_out_round=quant_out_round,
    )


def kernel_strides(t: torch.Tensor, inner: int = 1) -> tuple[int, int]:
    """The strides of a 2-D tensor argument as the kernel is given them.

    A dimension of size 1 is only ever indexed at 0, so its stride is free, and torch leaves it at whatever
    the tensor came from (`.contiguous()` keeps a one-row view's row stride; `.t().contiguous().t()` of a
    one-row tensor keeps its strides). Triton specialises a stride of 1 apart from any other, so such a
    stride would compile a new kernel the first time one row (one token, one column group) comes. Here it
    is the stride the same layout has at every other size: a launch over one row specialises as one over
    many. inner: the dimension stored innermost (1: rows of contiguous values, A and the outputs; 0: the
    groups-first activation scales, an [R, Kg] view of [Kg, R] storage). Returns (stride 0, stride 1).
    """
    if t.dim() != 2 or inner not in (0, 1):
        raise ValueError(f"kernel_strides takes a 2-D tensor and inner 0 or 1, got shape {tuple(t.shape)}, "
                         f"inner={inner!r}")
    strides = list(t.stride())
    outer = 1 - inner
    if t.shape[inner] == 1:
        strides[inner] = 1
    if t.shape[outer] == 1:
        strides[outer] = strides[inner] * t.shape[inner]
    return strides[0], strides[1]


def _launch(
    a: torch.Tensor,  # [rows of A, K]
    expert_offsets: torch.Tensor,  # [E + 1]
    table: ExpertWeightTable,
    out: torch.Tensor,  # [rows of out, N_OUT]
    *,
    launch: "LaunchConfig",  # from kernels.launch.launch_config: tiles, path, constexprs
    num_rows: int,  # R: sorted rows covered by the offsets
    slots: torch.Tensor | None,  # [R] int64
    scale: torch.Tensor | None,
    epilogue: Epilogue | None,  # None: plain x @ w.T
    bias: ExpertWeightTable | None,  # E views [N]
    scales: "ScaleTable | None",  # fp8 weights: E views of block scales (kernels.scaled_weights)
    top_k: int,
    a_scales: torch.Tensor | None = None,  # [rows of A, ceil(K / act_group)] fp32 (any strides): `a` is fp8
    act_group: int = 1,
    out_scales: torch.Tensor | None = None,  # [rows of out, ceil(N_OUT / group)] fp32: out is fp8 (launch.quant_out)
    split_at: int,
    partner: tuple[int, int, int] | None,  # (n_tiles, block_m, wave_size) of a GEMM splitting at the same expert
    part: str,
    wave_size: int,
) -> None:
    """Launch the kernel on validated arguments (shared by grouped_gemm and the fused MoE path)."""
    tiles = launch.tiles
    n_out = out.shape[1]
    n_tiles = _tile_count(n_out, tiles.block_n)
    max_tiles = (_tile_count(num_rows, tiles.block_m) + table.num_experts) * n_tiles
    grid = (max(1, min(wave_size, max_tiles)),)
    partner = partner or (n_tiles, tiles.block_m, wave_size)
    if launch.quant_out != (out_scales is not None) or launch.quant_out != (out.dtype == torch.float8_e4m3fn):
        raise ValueError(f"an fp8 output needs its scales and a launch that quantizes (quant_out={launch.quant_out}, "
                         f"out {out.dtype}, out_scales {'given' if out_scales is not None else 'missing'})")
    from dwdp.kernels.launch import power_of_two_divisor

    a_strides, out_strides = kernel_strides(a), kernel_strides(out)
    if launch.a_tma and a_strides != (a.shape[1], 1):
        raise ValueError(f"the TMA path reads A as a contiguous [rows, K] tensor, got strides {a.stride()}")
    if launch.w_tma and not is_interpreter():
        ensure_tma_allocator()
    dummy = expert_offsets  # never read when the matching flag is off
    ep = epilogue or Epilogue(activation="none", gated=False)
    scale_strides = scales.table.strides if scales is not None else (0, 0)
    block = scales.quant.block if scales is not None else (1, 1)
    _grouped_gemm_kernel[grid](
        a, table.addresses, bias.addresses if bias is not None else dummy,
        scales.table.addresses if scales is not None else dummy, expert_offsets,
        slots if slots is not None else dummy,
        scale if scale is not None else dummy,
        out,
        table.num_experts, n_out, a.shape[1], top_k, split_at, _PARTS[part], wave_size, *partner,
        *a_strides,
        table.strides[0], table.strides[1],
        *out_strides,
        float(ep.alpha), float(min(ep.limit, 3.0e38)), float(ep.up_offset),
        scales.half_rows if scales is not None else 1, scales.half_scale_rows if scales is not None else 1,
        block[0], block[1], scale_strides[0], scale_strides[1],
        a_scales if a_scales is not None else dummy, *(kernel_strides(a_scales, 0) if a_scales is not None else (0, 0)),
        act_group, a.shape[0],
        out_scales if out_scales is not None else dummy,
        *(kernel_strides(out_scales, 0) if out_scales is not None else (0, 0)),
        **dict(launch.constexprs), A_ROW_DIV=power_of_two_divisor(a_strides[0]) if a_strides[1] == 1 else 1,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def _check_bias(bias: ExpertWeightTable | None, weights: ExpertWeightTable, name: str,
                dtype: torch.dtype | None = None) -> None:
    """Biases: one [N] view per expert, in `dtype` (default: the weights' dtype; the activations' dtype
    next to fp8 weights)."""
    if bias is None:
        return
    if bias.num_experts != weights.num_experts or bias.shape != (weights.shape[0],):
        raise ValueError(f"{name} has {bias.num_experts} views of shape {list(bias.shape)}, expected "
                         f"{weights.num_experts} of [{weights.shape[0]}] (one per expert, N of its weights)")
    dtype = dtype or weights.dtype
    like = "like its weights" if dtype == weights.dtype else "like the activations (its weights are quantized)"
    if bias.dtype != dtype or bias.device != weights.device:
        raise ValueError(f"{name} is {bias.dtype} on {bias.device}, expected {dtype} on {weights.device} {like}")


def grouped_gemm(
    x_sorted: torch.Tensor,
    expert_offsets: torch.Tensor,
    weights: Sequence[torch.Tensor] | ExpertWeightTable,
    *,
    activation: Literal["swiglu"] | Epilogue | None = None,
    bias: Sequence[torch.Tensor] | ExpertWeightTable | None = None,
    row_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    split_at: int | None = None,
    part: Literal["all", "first", "second"] = "all",
    wave_size: int | None = None,
    config: GroupedGemmConfig | None = None,
    weight_scales: Sequence[torch.Tensor] | ScaleTable | None = None,
    quant: BlockQuant | None = None,
    fp8_activations: bool = False,
) -> torch.Tensor:
    """out[rows of e] = epilogue(x_sorted[rows of e] @ weights[e].T) for each expert e, one launch.

    x_sorted: [R, K] bf16/fp16/fp32, contiguous, rows grouped by expert in table order.
    expert_offsets: [E + 1] int32 or int64 on x's device; expert e owns rows
        [offsets[e], offsets[e + 1]). Values are checked on CPU only (on CUDA it would sync).
    weights: E contiguous views [N, K] of x's dtype, in any number of distinct buffers, or an
        `ExpertWeightTable` built once from them. Read in place, never concatenated.
    activation: "swiglu" treats each weight as [gate; up] (N = 2 * N_OUT) and returns
        silu(x @ gate.T) * (x @ up.T); an Epilogue picks another gate or activation; None returns
        x @ w.T (N_OUT = N).
    bias: optional E views [N] (or their table), added before the activation.
    row_scale: optional [R] per-row factor applied in fp32 after the activation.
    out: optional [R, N_OUT] output of x's dtype; rows past offsets[E] and, with part set, rows
        of the other part are left untouched.
    split_at, part: local-first scheduling. Experts [0, split_at) are local; "first" computes the
        wave-aligned local prefix (see `local_first_split`), "second" everything else.
    wave_size: programs of the persistent grid (default: SMs x the tiles' programs_per_sm).
    config: tiles, warps and stages to use; default: chosen by kernels.launch.launch_config (tuned
        configuration files, kernels/configs/).
    weight_scales, quant: fp8 weights (float8_e4m3fn views) with E views of their block scales
        (kernels.block_scales; or a ScaleTable): each weight tile is dequantized in the K loop, in
        fp32, then rounded to x's dtype for the dot, as grouped_gemm_reference dequantizes them.
    fp8_activations: with fp8 weights, x is quantized to fp8 per row and block of K columns and each
        K tile is an fp8 x fp8 dot scaled by both scales (the K tile divides the block columns; no
        bias).
    Returns out [R, N_OUT] in x's dtype; accumulation is fp32.
    """
    from dwdp.kernels.block_scales import quantize_rows_fp8
    from dwdp.kernels.scaled_weights import check_fp8_activations, scale_table

    _require_triton()
    table = _as_table(weights, "weights")
    scales = None if weight_scales is None else scale_table(weight_scales, quant, table, "weight_scales")
    if not isinstance(x_sorted, torch.Tensor) or x_sorted.dim() != 2:
        raise ValueError(f"x_sorted must be a 2-D tensor [R, K], got {getattr(x_sorted, 'shape', type(x_sorted))}")
    if x_sorted.dtype not in _DTYPES:
        raise ValueError(f"x_sorted has dtype {x_sorted.dtype}, expected one of {_DTYPES}")
    if not x_sorted.is_contiguous():
        raise ValueError(f"x_sorted must be contiguous, got strides {x_sorted.stride()}")
    if x_sorted.data_ptr() % ALIGN_BYTES:
        raise ValueError(f"x_sorted starts at address {x_sorted.data_ptr():#x}, not {ALIGN_BYTES}-byte aligned")
    _check_device(x_sorted.device, "x_sorted")
    num_rows, k = x_sorted.shape
    n, k_w = table.shape
    if k_w != k:
        raise ValueError(f"weights have K={k_w} but x_sorted has K={k} (shape {tuple(x_sorted.shape)})")
    if table.dtype != x_sorted.dtype and scales is None:
        raise ValueError(f"weights have dtype {table.dtype} but x_sorted has {x_sorted.dtype}"
                         + (" (fp8 weights need weight_scales)" if table.dtype == torch.float8_e4m3fn else ""))
    if table.device != x_sorted.device:
        raise ValueError(f"weights are on {table.device} but x_sorted is on {x_sorted.device}")
    _check_offsets(expert_offsets, table.num_experts, num_rows, x_sorted.device)
    if activation is not None and activation != "swiglu" and not isinstance(activation, Epilogue):
        raise ValueError(f"activation={activation!r} must be None, 'swiglu' or an Epilogue")
    epilogue = SWIGLU if activation == "swiglu" else activation
    gated = epilogue is not None and epilogue.gated
    if gated and n % 2:
        raise ValueError(f"activation={activation!r} needs an even N (gate and up halves), weights have N={n}")
    n_out = n // 2 if gated else n
    bias_table = None if bias is None else _as_table(bias, "bias", ndim=1)
    _check_bias(bias_table, table, "bias", x_sorted.dtype)
    if row_scale is not None:
        if not isinstance(row_scale, torch.Tensor) or row_scale.shape != (num_rows,):
            raise ValueError(
                f"row_scale must be a tensor of shape ({num_rows},), got {getattr(row_scale, 'shape', row_scale)}"
            )
        if not row_scale.is_floating_point() or row_scale.device != x_sorted.device or not row_scale.is_contiguous():
            raise ValueError(
                f"row_scale must be a contiguous float tensor on {x_sorted.device}, "
                f"got {row_scale.dtype} on {row_scale.device}"
            )
    if out is None:
        out = x_sorted.new_empty(num_rows, n_out)  # [R, N_OUT]
    elif out.shape != (num_rows, n_out) or out.dtype != x_sorted.dtype or out.device != x_sorted.device:
        raise ValueError(
            f"out is {tuple(out.shape)} {out.dtype} on {out.device}, "
            f"expected ({num_rows}, {n_out}) {x_sorted.dtype} on {x_sorted.device}"
        )
    if fp8_activations:
        check_fp8_activations(scales, bias_table, "weight_scales", is_interpreter())
    from dwdp.kernels.launch import device_info, launch_config

    device = device_info(x_sorted.device)
    launch = launch_config(kernel_problem(
        torch.float8_e4m3fn if fp8_activations else x_sorted.dtype, table, num_rows=num_rows, epilogue=epilogue,
        scales=scales, has_row_scale=row_scale is not None, has_bias=bias_table is not None), device, config)
    wave = launch.wave_size(device) if wave_size is None else wave_size
    split = _check_split(split_at, part, table.num_experts, wave)
    if num_rows == 0:
        return out
    a, a_scales, group = x_sorted, None, 1
    if fp8_activations:
        group = scales.quant.block[1]
        a, a_scales = quantize_rows_fp8(x_sorted, group, groups_first=True)  # [R, K] fp8, [R, K / bk]
    _launch(
        a, expert_offsets, table, out, launch=launch,
        num_rows=num_rows, slots=None, scale=row_scale, epilogue=epilogue, bias=bias_table, scales=scales, top_k=1,
        split_at=split, partner=None, part=part, wave_size=wave, a_scales=a_scales, act_group=group,
    )
    return out
