"""How one grouped-GEMM launch is configured: the only place that decides it.

`launch_config(problem, device)` turns a KernelProblem (what is multiplied: dtypes, N, K, experts,
rows per expert, epilogue, weight layout, gather / scatter) into a LaunchConfig: the tiles, warps,
stages and persistent programs per SM (tuned data, kernels/tuned_configs.py, or a default), the load
path (TMA descriptors built on the device from the pointer table, or plain pointer loads) and every
constexpr of `_grouped_gemm_kernel`. `grouped_gemm` and `moe_experts` launch through it and nothing
else picks a tile.

Legend: N = output features (the weight rows of one expert), N_OUT = output features after the
epilogue (N / 2 when gated), K = input features, E = experts in the weight table, R = rows an experts
call computes, Re = rows per expert (R / E).

The compiled specialization of a launch is `LaunchConfig.key` (every constexpr, num_warps,
num_stages) plus what Triton derives from the arguments: the dtypes of the activations, weights and
output, and the 16-divisibility (or == 1) of the integer shape / stride arguments and of pointers.
Those are fixed for a layer (N, K, E, top_k, strides); the arguments that change from call to call
(the local-first split, which part runs, the wave sizes, the rows of A, the strides of
group-first activation scales, which are the rows too) are declared
`do_not_specialize`, so neither the routing nor the order in which remote experts arrive compiles
anything new; and a dimension of size 1 (one token, one row of scales) is given the stride its layout
has at every other size (grouped_gemm.kernel_strides), so one token specialises as many do. The tokens of a call change the key only through the tiles: Re = R / E selects the
nearest tuned entry, a choice among the few configurations `candidate_tiles` lists for a layer.

Tile choice, in order:
  1. tiles given by the caller (GroupedGemmConfig);
  2. the configuration file of this device (exact `torch.cuda.get_device_name`): an entry of the
     problem's kind with the same N and K, the one with the nearest Re (log scale);
  3. that file's default for the kind;
  4. the built-in default for the kind (DEFAULT_TILES), stepped down (STEP_DOWN) until it fits the
     device's shared memory (under the interpreter: INTERPRETER_TILES).
Candidates that would not fit the device's shared memory are skipped at every step. fp8 x fp8 dots
take a K tile that divides the scale block's columns; whether one weight scale serves a whole tile
(W_SCALE_TILE) and whether gate_up's epilogue can write h in fp8 (QUANT_GROUP: its tiles hold whole
scale groups) follow from the tiles chosen.

Load path: pointer loads by default. TMA is taken where the tiles ask for it (`tma=True`) or
DWDP_KERNEL_TMA=1 asks for it wherever possible (`tma=None` tiles); DWDP_KERNEL_TMA=0 never takes it.
Pointers stay the default until a GPU run shows TMA at least as fast on the shipped tiles, which were
all timed on pointers (gpu_check section e times both on the same tiles). TMA needs Hopper or newer
(sm_90), a Triton with `tl.make_tensor_descriptor`, weight rows that are 16-byte multiples with the
last dimension contiguous, and no interleaved gate/up rows; A goes through a descriptor too unless its
rows are gathered. Under the interpreter (CPU) `tma=True` tiles run the descriptors' indexing.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from dwdp.kernels import tuned_configs
from dwdp.kernels.settings import ACTIVATIONS, Epilogue, GroupedGemmConfig

FP8 = torch.float8_e4m3fn
_ELEMENT_BYTES = {torch.bfloat16: 2, torch.float16: 2, torch.float32: 4, FP8: 1}
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # QUANT_ROUND codes
_SMEM_SLACK = 1024  # bytes Triton adds beside the pipelined tiles (barriers, scale tiles)

# Built-in defaults per kind (used where no file matches). bf16: 128x256x64 / 8 warps / 4 stages was the
# best on the geometric mean of the three gate_up shapes of the H100 sweep (kernels/configs); gated
# kinds load two weight tiles per K step, so they take 128 columns (the same 256 weight rows per tile).
# fp8 x fp8: BLOCK_K 128 (the scale block), 64x256 was the best fused fp8 tile measured on that H100.
DEFAULT_TILES = {
    "bf16": GroupedGemmConfig(128, 256, 64, num_warps=8, num_stages=4),
    "bf16_gated": GroupedGemmConfig(128, 128, 64, num_warps=8, num_stages=4),
    "fp8": GroupedGemmConfig(64, 256, 128, num_warps=8, num_stages=3),
    "fp8_gated": GroupedGemmConfig(64, 256, 128, num_warps=8, num_stages=3),
    "fp8w": GroupedGemmConfig(64, 128, 64, num_warps=4, num_stages=3),
    "fp8w_gated": GroupedGemmConfig(64, 128, 64, num_warps=4, num_stages=3),
    "fp32": GroupedGemmConfig(64, 128, 32, num_warps=4, num_stages=3),
    "fp32_gated": GroupedGemmConfig(64, 64, 32, num_warps=4, num_stages=3),
}
# Tried in order after a default that does not fit the shared memory of the device.
STEP_DOWN = (
    GroupedGemmConfig(128, 256, 64, num_warps=8, num_stages=3),
    GroupedGemmConfig(128, 128, 64, num_warps=8, num_stages=3),
    GroupedGemmConfig(64, 128, 64, num_warps=4, num_stages=3),
    GroupedGemmConfig(64, 64, 64, num_warps=4, num_stages=2),
    GroupedGemmConfig(32, 32, 32, num_warps=4, num_stages=1),
)
# Under the interpreter programs run one after another on numpy: small tiles waste less on ragged edges.
INTERPRETER_TILES = GroupedGemmConfig(32, 32, 32, num_warps=4, num_stages=1)
INTERPRETER = "interpreter"
# Under the interpreter programs run one after another; a few programs exercise the persistent loop.
INTERPRETER_WAVE_SIZE = 4


@dataclass(frozen=True)
class DeviceInfo:
    """What the launch configuration needs to know of the device the kernel runs on."""

    name: str  # torch.cuda.get_device_name(), or "interpreter"
    capability: tuple[int, int] | None  # (9, 0) for sm_90; None under the interpreter
    shared_memory: int | None  # bytes of shared memory one program may use; None: unknown (no check)
    num_sms: int  # multiprocessors (programs of one wave per programs_per_sm)

    @property
    def is_interpreter(self) -> bool:
        return self.name == INTERPRETER


@functools.lru_cache(maxsize=None)
def _cuda_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    smem = getattr(props, "shared_memory_per_block_optin", None)
    if smem is None:
        try:
            import triton

            smem = triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]
        except Exception:  # an unknown limit only turns the shared-memory check off
            smem = None
    return DeviceInfo(torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index)), smem,
                      props.multi_processor_count)


def device_info(device: torch.device) -> DeviceInfo:
    """The DeviceInfo of a CUDA device, or of the interpreter for a CPU tensor."""
    if device.type == "cuda":
        return _cuda_info(device.index if device.index is not None else torch.cuda.current_device())
    return DeviceInfo(INTERPRETER, None, None, INTERPRETER_WAVE_SIZE)


@dataclass(frozen=True)
class KernelProblem:
    """What one launch multiplies, as far as its tiles and its compiled specialization depend on it.

    a_dtype: dtype of A as the kernel reads it (float8_e4m3fn: fp8 x fp8 dots).
    w_dtype: dtype of the weights (float8_e4m3fn with block scales: scale_format and scale_block set).
    n, k: every expert's weight view is [n, k] (n = 2 N_OUT when the epilogue is gated).
    num_experts: E, views in the table. rows_per_expert: sorted rows / E (tokens x top_k / E).
    epilogue: None for plain x @ w.T. weight_strides: element strides of every view ((k, 1) or (1, n)).
    gather_a: A rows gathered through the slots (MoE gate_up). scatter_out / atomic_out: output rows
    at the slot (or token, with fp32 atomics). has_row_scale, has_bias: the epilogue's factor and bias.
    """

    a_dtype: torch.dtype
    w_dtype: torch.dtype
    n: int
    k: int
    num_experts: int
    rows_per_expert: int
    epilogue: Epilogue | None = None
    weight_strides: tuple[int, int] | None = None
    gather_a: bool = False
    scatter_out: bool = False
    atomic_out: bool = False
    has_row_scale: bool = False
    has_bias: bool = False
    scale_format: str | None = None  # "fp32" or "e8m0" block scales of fp8 weights
    scale_block: tuple[int, int] | None = None  # (rows, cols) of weights per scale
    scale_halves: int = 1  # separately blocked halves of the weight rows ([gate; up] blocked apart: 2)
    quant_out_group: int = 0  # > 0: the output is wanted in fp8, one scale per row and this many columns
    quant_out_round: torch.dtype = torch.float32  # dtype the output is rounded to before it is quantized

    def __post_init__(self) -> None:
        for name in ("a_dtype", "w_dtype"):
            if getattr(self, name) not in _ELEMENT_BYTES:
                raise ValueError(f"{name}={getattr(self, name)} must be one of {tuple(_ELEMENT_BYTES)}")
        for name in ("n", "k", "num_experts"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be an int >= 1")
        if not isinstance(self.rows_per_expert, int) or self.rows_per_expert < 0:
            raise ValueError(f"rows_per_expert={self.rows_per_expert!r} must be an int >= 0")
        if self.w_dtype == FP8 and self.scale_format not in ("fp32", "e8m0"):
            raise ValueError(f"fp8 weights need scale_format 'fp32' or 'e8m0', got {self.scale_format!r}")
        if self.w_dtype != FP8 and self.scale_format is not None:
            raise ValueError(f"scale_format={self.scale_format!r} needs fp8 weights, got {self.w_dtype}")
        if (self.scale_format is None) != (self.scale_block is None):
            raise ValueError(f"scale_block={self.scale_block} goes with scale_format={self.scale_format!r}")
        if self.a_dtype == FP8 and self.w_dtype != FP8:
            raise ValueError(f"fp8 activations need fp8 weights, got {self.w_dtype}")
        if self.epilogue is not None and self.epilogue.gated and self.n % 2:
            raise ValueError(f"a gated epilogue needs an even n (gate and up halves), got n={self.n}")
        if self.atomic_out and not self.scatter_out:
            raise ValueError("atomic_out needs scatter_out (atomics add into token rows)")
        if self.scale_halves not in (1, 2) or self.n % self.scale_halves:
            raise ValueError(f"scale_halves={self.scale_halves} must be 1 or 2 and divide n={self.n}")
        if self.quant_out_group < 0 or self.quant_out_round not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"quant_out_group={self.quant_out_group} must be >= 0 and quant_out_round="
                             f"{self.quant_out_round} one of fp32, bf16, fp16")
        if self.quant_out_group and (self.atomic_out or self.a_dtype != FP8):
            raise ValueError("an fp8 output goes with fp8 x fp8 dots and no atomics")

    @property
    def gated(self) -> bool:
        return self.epilogue is not None and self.epilogue.gated

    @property
    def n_out(self) -> int:
        return self.n // 2 if self.gated else self.n

    @property
    def kind(self) -> str:
        """Which table of tiles applies (kernels/tuned_configs.py): the dot, and whether it is gated."""
        if self.a_dtype == FP8:
            dot = "fp8"
        elif self.w_dtype == FP8:
            dot = "fp8w"
        elif self.a_dtype == torch.float32:
            dot = "fp32"
        else:
            dot = "bf16"  # fp16 shares the bf16 tiles: same element size, same tensor-core rate
        return dot + ("_gated" if self.gated else "")

    @property
    def transposed(self) -> bool:
        """Weights stored [K, N] (read through the transpose view, strides (1, N))."""
        return self.weight_strides is not None and self.weight_strides[0] == 1 and self.weight_strides[1] != 1


def shared_memory_bytes(tiles: GroupedGemmConfig, problem: KernelProblem) -> int:
    """Shared memory the pipelined K loop asks for: num_stages copies of the A tile and of one weight tile
    (two when gated). Matches what Triton reported for the fused path on an H100 (245,760 bytes for
    128x256x64, 3 stages, gated bf16)."""
    a_bytes, w_bytes = _ELEMENT_BYTES[problem.a_dtype], _ELEMENT_BYTES[problem.w_dtype]
    weights = 2 if problem.gated else 1
    return tiles.num_stages * tiles.block_k * (tiles.block_m * a_bytes + weights * tiles.block_n * w_bytes)


def fits(tiles: GroupedGemmConfig, problem: KernelProblem, device: DeviceInfo) -> bool:
    return device.shared_memory is None or shared_memory_bytes(tiles, problem) + _SMEM_SLACK <= device.shared_memory


def fp8_block_k(scale_cols: int, interpreter: bool = False) -> int | None:
    """K tile of fp8 x fp8 dots: the largest power of two <= 128 dividing the scale block's columns (one
    activation and one weight scale per tile), at least 32 (the fp8 wgmma K; 16 in the interpreter).
    None when there is none."""
    block = 128
    while block >= (16 if interpreter else 32):
        if scale_cols % block == 0:
            return block
        block //= 2
    return None


def _fix_for_problem(tiles: GroupedGemmConfig, problem: KernelProblem, device: DeviceInfo) -> GroupedGemmConfig:
    """Rules every tile choice obeys whatever its source: fp8 x fp8 dots take a K tile that divides the
    scale block."""
    if problem.a_dtype == FP8:
        block_k = fp8_block_k(problem.scale_block[1], device.is_interpreter)
        if block_k is None:
            raise ValueError(f"fp8 x fp8 dots need scale blocks whose {problem.scale_block[1]} columns a power-of-two "
                             f"K tile >= {16 if device.is_interpreter else 32} divides")
        if tiles.block_k != block_k and problem.scale_block[1] % tiles.block_k:
            tiles = replace(tiles, block_k=block_k)
    return tiles


def _tuned_file(device: DeviceInfo):
    if device.is_interpreter:
        return None
    return tuned_configs.files_by_device().get(device.name)


def choose_tiles(problem: KernelProblem, device: DeviceInfo, tiles: GroupedGemmConfig | None = None
                 ) -> tuple[GroupedGemmConfig, str]:
    """(tiles, where they came from) for the problem on the device: the rules in the module docstring."""
    if tiles is not None:
        return _fix_for_problem(tiles, problem, device), "given"
    kind = problem.kind
    tuned = _tuned_file(device)
    candidates: list[tuple[GroupedGemmConfig, str]] = []
    if tuned is not None:
        for entry in tuned_configs.nearest(tuned.entries_for(kind, problem.n, problem.k), problem.rows_per_expert):
            candidates.append((GroupedGemmConfig(**entry.config),
                               f"{tuned.path.name}: {kind} n={entry.n} k={entry.k} rows={entry.rows_per_expert}"))
        if kind in tuned.defaults:
            candidates.append((GroupedGemmConfig(**tuned.defaults[kind]), f"{tuned.path.name}: default {kind}"))
    if device.is_interpreter:
        candidates.append((INTERPRETER_TILES, "interpreter default"))
    candidates.append((DEFAULT_TILES[kind], f"built-in default {kind}"))
    candidates += [(t, f"built-in step-down {kind}") for t in STEP_DOWN]
    for config, source in candidates:
        config = _fix_for_problem(config, problem, device)
        if fits(config, problem, device):
            return config, source
    raise ValueError(f"no tile configuration fits the {device.shared_memory} bytes of shared memory of {device.name} "
                     f"for {problem}")


def candidate_rows(problem: KernelProblem, device: DeviceInfo) -> list[int]:
    """Rows per expert at which `choose_tiles` meets every tile configuration it can return for this
    problem: none, each tuned entry's, and more than any (choices between them are nearest-entry)."""
    tuned = _tuned_file(device)
    rows = [e.rows_per_expert for e in tuned.entries_for(problem.kind, problem.n, problem.k)] if tuned else []
    return sorted({0, *rows, 1 << 30})


def candidate_tiles(problem: KernelProblem, device: DeviceInfo) -> list[GroupedGemmConfig]:
    """Every tile configuration `choose_tiles` can return for this problem whatever its rows per expert:
    what a warm-up compiles to never compile during serving."""
    seen = []
    for r in candidate_rows(problem, device):
        config, _ = choose_tiles(replace(problem, rows_per_expert=r), device)
        if config not in seen:
            seen.append(config)
    return seen


def tma_blocker(problem: KernelProblem, device: DeviceInfo, tiles: GroupedGemmConfig) -> str | None:
    """Why the weights cannot be read through TMA descriptors here, or None when they can."""
    from dwdp.envs import kernel_tma

    try:
        import triton.language as tl
    except ImportError:
        return "triton is not installed"
    setting = kernel_tma()
    if setting is False:
        return "DWDP_KERNEL_TMA=0"
    if setting is None and tiles.tma is not True:
        # Every shipped tile was timed on pointers and TMA has not yet run on a GPU; one tile per expert
        # (short prompts) rebuilds the descriptors at every expert change. Pointers until a GPU shows TMA
        # at least as fast (gpu_check e times both on the same tiles).
        return "pointer loads are the default (DWDP_KERNEL_TMA=1 or tiles with tma=True take TMA)"
    if not hasattr(tl, "make_tensor_descriptor"):
        import triton

        return f"triton {triton.__version__} has no tl.make_tensor_descriptor"
    if device.is_interpreter:
        if tiles.tma is not True:
            return "the interpreter takes the pointer path unless the tiles ask for tma=True"
    elif device.capability is None or device.capability < (9, 0):
        return f"{device.name} (sm_{''.join(map(str, device.capability or ()))}) has no TMA"
    if problem.epilogue is not None and problem.epilogue.interleaved:
        return "interleaved gate/up rows (strided rows)"
    strides = problem.weight_strides or (problem.k, 1)
    if 1 not in strides:
        return f"weight strides {strides} have no contiguous dimension"
    row_bytes = max(strides) * _ELEMENT_BYTES[problem.w_dtype]
    if row_bytes % 16:
        return f"weight rows of {row_bytes} bytes are not a multiple of 16"
    inner = (tiles.block_n if problem.transposed else tiles.block_k) * _ELEMENT_BYTES[problem.w_dtype]
    if inner < 16:
        return f"a weight tile row of {inner} bytes is under TMA's 16"
    if problem.transposed and problem.gated and problem.n_out * _ELEMENT_BYTES[problem.w_dtype] % 16:
        return f"the up half starts {problem.n_out} columns in, not a 16-byte offset"
    return None


def a_tma_blocker(problem: KernelProblem, tiles: GroupedGemmConfig) -> str | None:
    """Why A cannot be read through one TMA descriptor (given that the weights can), or None."""
    if problem.gather_a:
        return "A rows are gathered through the slots"
    row_bytes = problem.k * _ELEMENT_BYTES[problem.a_dtype]
    if row_bytes % 16:
        return f"A rows of {row_bytes} bytes are not a multiple of 16"
    if tiles.block_k * _ELEMENT_BYTES[problem.a_dtype] < 16:
        return f"an A tile row of {tiles.block_k * _ELEMENT_BYTES[problem.a_dtype]} bytes is under TMA's 16"
    return None


def weight_scale_per_tile(problem: KernelProblem, tiles: GroupedGemmConfig) -> bool:
    """Every weight tile (gate and up alike) lies inside one scale block, so one scale per tile and K step
    serves it: BLOCK_N divides the block rows and the half it sits in (and the up half's offset), BLOCK_K
    divides the block columns."""
    if problem.scale_block is None or (problem.epilogue is not None and problem.epilogue.interleaved):
        return False
    rows, cols = problem.scale_block
    half = problem.n // problem.scale_halves
    up_ok = not problem.gated or problem.n_out % tiles.block_n == 0
    return rows % tiles.block_n == 0 and half % tiles.block_n == 0 and up_ok and cols % tiles.block_k == 0


def quant_group(problem: KernelProblem, tiles: GroupedGemmConfig) -> int:
    """Columns per scale of an fp8 output quantized in the epilogue, or 0 where the tile cannot (its columns
    must be whole groups, and a group a power of two)."""
    group = problem.quant_out_group
    if group and group & (group - 1) == 0 and tiles.block_n % group == 0:
        return group
    return 0


@dataclass(frozen=True)
class LaunchConfig:
    """Everything one launch of `_grouped_gemm_kernel` is configured with."""

    tiles: GroupedGemmConfig
    source: str  # where the tiles came from
    w_tma: bool  # weights read through one TMA descriptor per expert, built on the device
    a_tma: bool  # A read through one TMA descriptor
    tma_note: str | None  # why TMA is off, when it is
    constexprs: tuple[tuple[str, object], ...]  # every constexpr of the kernel, in its order
    problem: KernelProblem | None = None  # what the launch multiplies

    @property
    def quant_out(self) -> bool:
        """The launch stores its output as fp8 with per-row, per-group scales."""
        return dict(self.constexprs)["QUANT_GROUP"] > 0

    @property
    def key(self) -> tuple:
        """The launch's share of the compiled specialization: constexprs, warps, stages."""
        return self.constexprs + (("num_warps", self.tiles.num_warps), ("num_stages", self.tiles.num_stages))

    @property
    def label(self) -> str:
        t = self.tiles
        path = "tma(" + ",".join(n for n, on in (("w", self.w_tma), ("a", self.a_tma)) if on) + ")" if self.w_tma \
            else "pointers"
        return (f"{t.block_m}x{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages} p{t.programs_per_sm} "
                f"g{t.group_m} {path} [{self.source}]")

    def wave_size(self, device: DeviceInfo) -> int:
        """Programs of one wave: SMs x programs_per_sm (a small fixed count under the interpreter)."""
        return device.num_sms * (1 if device.is_interpreter else self.tiles.programs_per_sm)


def power_of_two_divisor(n: int, most: int = 16) -> int:
    """The largest power of two up to `most` that divides `n` (`most` for 0)."""
    n = abs(int(n))
    div = 1
    while div < most and n % (div * 2) == 0:
        div *= 2
    return div


def launch_config(problem: KernelProblem, device: DeviceInfo, tiles: GroupedGemmConfig | None = None) -> LaunchConfig:
    """The full configuration of one launch: tiles (see `choose_tiles`), load path and constexprs."""
    chosen, source = choose_tiles(problem, device, tiles)
    blocker = tma_blocker(problem, device, chosen)
    if chosen.tma is False:
        blocker = "the tiles ask for tma=False"
    w_tma = blocker is None
    a_tma = w_tma and a_tma_blocker(problem, chosen) is None
    ep = problem.epilogue or Epilogue(activation="none", gated=False)
    import triton

    constexprs = (
        ("BLOCK_M", chosen.block_m), ("BLOCK_N", chosen.block_n), ("BLOCK_K", chosen.block_k),
        ("BLOCK_E", triton.next_power_of_2(problem.num_experts + 1)), ("GROUP_M", chosen.group_m),
        ("HAS_SLOTS", problem.gather_a or problem.scatter_out), ("GATHER_A", problem.gather_a),
        ("HAS_SCALE", problem.has_row_scale), ("SCATTER_OUT", problem.scatter_out), ("ATOMIC_OUT", problem.atomic_out),
        ("HAS_BIAS", problem.has_bias), ("GATED", ep.gated), ("INTERLEAVED", ep.interleaved),
        ("ACTIVATION", ACTIVATIONS[ep.activation]), ("CLAMP", ep.limit != float("inf")),
        ("FP32_DOT", device.is_interpreter or problem.a_dtype == torch.float32),
        ("W_SCALED", problem.scale_format is not None), ("SCALE_E8M0", problem.scale_format == "e8m0"),
        ("A_FP8", problem.a_dtype == FP8), ("W_TMA", w_tma), ("A_TMA", a_tma),
        ("W_TRANSPOSED", w_tma and problem.transposed),
        ("W_SCALE_TILE", weight_scale_per_tile(problem, chosen)),
        ("QUANT_GROUP", quant_group(problem, chosen)), ("QUANT_ROUND", _ROUND[problem.quant_out_round]),
        # Alignment Triton cannot read off K or a row stride that is not a multiple of 16 (A's comes with the
        # tensor: grouped_gemm passes A_ROW_DIV at the launch).
        ("K_DIV", power_of_two_divisor(problem.k)),
        ("W_ROW_DIV", power_of_two_divisor(problem.weight_strides[0])
         if problem.weight_strides and problem.weight_strides[1] == 1 else 1),
    )
    return LaunchConfig(chosen, source, w_tma, a_tma, blocker, constexprs, problem)
