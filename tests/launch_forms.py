"""Every form a launch of the experts kernel can take, recorded as Triton specialises it and compiled for
sm_90 ahead of time (no GPU needed).

A form is one call of a public entry point (`moe_experts`: a gate_up and a down launch; `grouped_gemm`:
one launch) with one weight format (bf16, fp16, fp32, fp8 with fp32 or e8m0 block scales), one dot
(the activations' own dtype, fp8 x fp8, or fp8 weights dequantized to the activations' dtype), one
epilogue (SwiGLU [gate; up], up-only, biases, clamp, interleaved gate/up rows, h quantized to fp8) and
one load path (TMA or pointers), on the pretend H100 of kernel_launches (its shipped configuration
file). MXFP4 experts never reach the kernel (the reference path runs them): test_kernel_launch_compile
checks that instead of compiling anything for them.

Legend: T = tokens, H = hidden, I = expert intermediate size, E = experts, k = experts per token.
"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import pytest
import torch

from kernel_launches import H100, LaunchRecorder, specialization

gg = importlib.import_module("dwdp.kernels.grouped_gemm")
moe = importlib.import_module("dwdp.kernels.moe")

HIDDEN, INTER, EXPERTS, TOP_K = 1024, 512, 8, 2  # no shipped entry has these shapes: the file's defaults apply
TOKENS = 64  # what warm-up launches with
SCALE_BLOCK = 128
# e8m0 scale bytes 127 (2^0) and fp32 ones: the values never reach the compiler, only dtypes and strides.
_E8M0 = getattr(torch, "float8_e8m0fnu", None)


@dataclass(frozen=True)
class Form:
    """One call of an entry point; `name` is how a failure names it."""

    name: str
    call: str = "moe"  # "moe" (gate_up + down launches) or "gemm" (grouped_gemm, one launch)
    dtype: torch.dtype = torch.bfloat16  # activations (and dense weights)
    scales: str | None = None  # fp8 weights with "fp32" or "e8m0" block scales; None: dense weights
    fp8_dots: bool = False  # fp8 x fp8 dots (else fp8 weights are dequantized to `dtype` tiles)
    epilogue: str = "swiglu"  # swiglu, up_only, clamped (alpha, limit, up offset), interleaved, none (gemm)
    biases: bool = False
    transposed: bool = False  # weights stored [in, out], read through the transposed view
    combine: str = "sum"
    tma: bool = False  # DWDP_KERNEL_TMA=1: weights (and ungathered A) through TMA descriptors
    tiles: tuple = ()  # (gate_up, down) GroupedGemmConfig overrides; () lets the launch choose
    hidden: int = HIDDEN  # H: K of gate_up (1032 = 8 x 129: rows Triton cannot see 16-byte aligned by itself)

    @property
    def fp8(self) -> bool:
        return self.scales is not None


def _forms() -> list[Form]:
    from dwdp.kernels import GroupedGemmConfig as C

    wide = C(64, 256, 64, num_warps=8, num_stages=3)  # BLOCK_N spans two scale blocks: one scale per column
    tile_scaled = C(64, 128, 128, num_warps=4, num_stages=3)  # inside one scale block: one scale per tile
    narrow = C(64, 64, 128, num_warps=4, num_stages=3)  # gate_up tiles too narrow to write h in fp8
    forms = [
        Form("bf16 swiglu moe pointers"),
        Form("bf16 swiglu moe tma", tma=True),
        Form("bf16 swiglu moe pointers K=1032", hidden=1032),
        Form("bf16 gemm pointers K=1032", call="gemm", epilogue="none", hidden=1032),
        Form("bf16 gemm pointers", call="gemm", epilogue="none"),
        Form("bf16 gemm tma", call="gemm", epilogue="none", tma=True),
        Form("bf16 transposed biases clamped moe tma", epilogue="clamped", biases=True, transposed=True, tma=True),
        Form("bf16 transposed biases clamped moe pointers", epilogue="clamped", biases=True, transposed=True),
        Form("bf16 interleaved biases clamped moe pointers", epilogue="interleaved", biases=True),
        Form("bf16 up-only moe atomic pointers", epilogue="up_only", combine="atomic"),
        Form("bf16 up-only moe tma", epilogue="up_only", tma=True),
        Form("fp16 swiglu moe pointers", dtype=torch.float16),
        Form("fp32 gemm pointers", call="gemm", dtype=torch.float32, epilogue="none"),
    ]
    for scales in ("fp32", "e8m0"):
        forms += [
            Form(f"fp8-{scales} dequantized moe tma", scales=scales, tma=True),
            Form(f"fp8-{scales} dequantized moe pointers column-scales", scales=scales, tiles=(wide, wide)),
            Form(f"fp8-{scales} dots h-quant moe tma", scales=scales, fp8_dots=True, tma=True),
            Form(f"fp8-{scales} dots h-quant moe pointers", scales=scales, fp8_dots=True),
            Form(f"fp8-{scales} dots h-quant moe pointers tile-scale", scales=scales, fp8_dots=True,
                 tiles=(tile_scaled, tile_scaled)),
            Form(f"fp8-{scales} dots moe pointers h-unquantized", scales=scales, fp8_dots=True, tiles=(narrow, None)),
            Form(f"fp8-{scales} dots up-only moe pointers", scales=scales, fp8_dots=True, epilogue="up_only"),
            Form(f"fp8-{scales} dots gemm tma", call="gemm", scales=scales, fp8_dots=True, epilogue="none", tma=True),
        ]
    return forms


FORMS = _forms()


def _epilogue(form: Form):
    from dwdp.kernels import SWIGLU, Epilogue

    return {"swiglu": SWIGLU, "none": None, "up_only": Epilogue(activation="relu2", gated=False),
            "clamped": Epilogue(alpha=1.702, limit=7.0, up_offset=1.0),
            "interleaved": Epilogue(interleaved=True, alpha=1.702, limit=7.0, up_offset=1.0)}[form.epilogue]


def _weights(form: Form, n: int, k: int, halves: int = 1):
    """E views [n, k] of the form's format (uninitialised: only shapes, strides and addresses reach the
    compiler) and, for fp8, (E scale views, BlockQuant)."""
    from dwdp.kernels import BlockQuant

    dtype = torch.float8_e4m3fn if form.fp8 else form.dtype
    stored = torch.empty(EXPERTS, k, n, dtype=dtype).transpose(1, 2) if form.transposed else \
        torch.empty(EXPERTS, n, k, dtype=dtype)
    views = list(stored.unbind(0))  # [n, k] each (transposed views of [k, n] storage when transposed)
    if not form.fp8:
        return views, None, None
    quant = BlockQuant("fp8", (SCALE_BLOCK, SCALE_BLOCK), halves=halves)
    shape = quant.scale_shape(n, k)
    if form.scales == "e8m0":
        scales = [torch.full(shape, 127, dtype=torch.uint8).view(_E8M0) for _ in range(EXPERTS)]
    else:
        scales = [torch.ones(shape) for _ in range(EXPERTS)]
    return views, scales, quant


def routing(tokens: int, *, seed: int = 0, sparse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, k] expert ids, [T, k] fp32 routing weights): random, or `sparse` (expert 0 gets one row,
    expert 1 none, the rest share the others)."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.rand(tokens, EXPERTS, generator=gen).argsort(dim=1)[:, :TOP_K]  # [T, k] distinct per token
    if sparse:
        index = 2 + torch.randint(0, EXPERTS - 2, (tokens, TOP_K), generator=gen)
        index[:, 1] = torch.where(index[:, 0] == EXPERTS - 1, 2, index[:, 0] + 1)  # k distinct experts per token
        index[0, 0] = 0
    return index, torch.rand(tokens, TOP_K, generator=gen)


def launch(form: Form, recorder: LaunchRecorder, tokens: int = TOKENS, sparse: bool = False) -> None:
    """Make the form's call on `tokens` tokens through the installed recorder (DWDP_KERNEL_TMA set by
    the caller)."""
    epilogue = _epilogue(form)
    gated = epilogue is not None and epilogue.gated
    gen = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, form.hidden, generator=gen).to(form.dtype)  # [T, H]
    if tokens == 1:  # a contiguous one-token view whose row stride torch leaves at 1, as a sliced decode step can
        hidden = hidden.view(form.hidden, 1).t()
    if form.call == "gemm":
        weights, scales, quant = _weights(form, 2 * INTER, form.hidden, halves=2 if gated else 1)
        counts = torch.bincount(routing(tokens, sparse=sparse)[0][:, 0], minlength=EXPERTS)
        offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])  # [E + 1]
        gg.grouped_gemm(hidden, offsets, weights, activation=epilogue, wave_size=H100.num_sms,
                        weight_scales=scales, quant=quant, fp8_activations=form.fp8_dots,
                        config=form.tiles[0] if form.tiles else None)
        return
    first_rows = 2 * INTER if gated else INTER
    gate_up, first_scales, first_quant = _weights(form, first_rows, form.hidden, halves=2 if gated else 1)
    down, down_scales, down_quant = _weights(form, form.hidden, INTER)
    biases = {}
    if form.biases:
        biases = dict(first_bias=list(torch.empty(EXPERTS, first_rows, dtype=form.dtype)),
                      down_bias=list(torch.empty(EXPERTS, form.hidden, dtype=form.dtype)))
    index, weights = routing(tokens, sparse=sparse)
    moe.moe_experts(hidden, index, weights, gate_up, down, epilogue=epilogue, combine=form.combine,
                    first_scales=first_scales, down_scales=down_scales, first_quant=first_quant,
                    down_quant=down_quant, fp8_activations=form.fp8_dots, wave_size=H100.num_sms,
                    config=form.tiles or None, **biases)


def record(form: Form, tokens: int = TOKENS, sparse: bool = False) -> list[dict]:
    """The launches (kernel_launches' records) the form makes on `tokens` tokens."""
    with pytest.MonkeyPatch.context() as mp:
        recorder = LaunchRecorder().install(mp, H100)
        mp.setenv("DWDP_KERNEL_TMA", "1" if form.tma else "0")
        launch(form, recorder, tokens, sparse)
    return recorder.launches


def roles(form: Form) -> tuple[str, ...]:
    return ("gemm",) if form.call == "gemm" else ("gate_up", "down")


_COMPILE = r"""
import json, re, sys, traceback
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from dwdp.kernels.grouped_gemm import _grouped_gemm_kernel as kernel

results = []
for launch in json.load(open(sys.argv[1])):
    names = kernel.arg_names
    signature, constexprs, attrs = {}, {}, {}
    for name, (kind, value, key) in launch["args"].items():
        index = names.index(name)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[(index,)] = value
        elif key:
            attrs[(index,)] = CUDABackend.parse_attr(key)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    try:
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch["options"]).asm["ptx"]
    except Exception as exc:  # reported per launch: the test names the form that failed
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        error, cause = f"{type(exc).__name__}: " + " | ".join(lines[-3:]), exc.__cause__ or exc.__context__
        while cause is not None:  # Triton's CompilationError points at the line; its cause says why
            error += f" <- {type(cause).__name__}: {str(cause).strip().splitlines()[-1] if str(cause).strip() else ''}"
            cause = cause.__cause__ or cause.__context__
        results.append({"error": error})
        continue
    results.append({
        "async_16": len(re.findall(r"cp\.async\.cg\.shared\.global \[[^\]]*\], \[[^\]]*\], 0x10", ptx)),
        "scalar_16": ptx.count("ld.global.b16"),
        "wgmma": ptx.count("wgmma.mma_async"),
        "e4m3_cvt": len(re.findall(r"cvt\.[a-z0-9.]*e4m3x2", ptx)),
        "wgmma_fp8": len(re.findall(r"wgmma\.mma_async[^\n]*e4m3\.e4m3", ptx)),
        "scalar_8": len(re.findall(r"ld\.global(?:\.[a-z]+)*\.[bu]8 ", ptx)),
        "tma_load": ptx.count("cp.async.bulk.tensor"),
        "tensormap": ptx.count("tensormap.replace"),
    })
print(json.dumps({"triton": triton.__version__, "results": results}))
"""

# DWDP_COMPILE_TRITON: a directory holding another Triton (`pip install --no-deps --target DIR triton==3.6.0`,
# the GPU image's release); the compiles run with it instead of the installed one (.ci/run does so).
COMPILE_TRITON_ENV = "DWDP_COMPILE_TRITON"


def _cost(launch: dict) -> int:
    """Rough compile cost, to spread launches evenly over the workers."""
    args = launch["args"]
    return args["BLOCK_M"][1] * args["BLOCK_N"][1] * (2 if args["GATED"][1] else 1)


def compile_all(launches: list[dict], workers: int | None = None, timeout_s: int = 400) -> tuple[str, list[dict]]:
    """Compile each launch for sm_90 in `workers` subprocesses at once (default: up to 4, the CPUs there
    are). Returns (the Triton version that compiled, per launch its PTX counts or {"error": ...})."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # else Triton 3.9 warns on every compile
    other = os.environ.get(COMPILE_TRITON_ENV)
    if other:
        env["PYTHONPATH"] = os.pathsep.join([other] + [p for p in [env.get("PYTHONPATH")] if p])
    workers = max(1, min(workers or min(4, os.cpu_count() or 1), len(launches)))
    order = sorted(range(len(launches)), key=lambda i: -_cost(launches[i]))
    chunks = [order[w::workers] for w in range(workers)]
    results: list[dict | None] = [None] * len(launches)
    versions = set()
    with tempfile.TemporaryDirectory(prefix="dwdp-compile-") as tmp:
        procs = []
        try:
            for w, chunk in enumerate(chunks):
                path = os.path.join(tmp, f"launches{w}.json")
                with open(path, "w") as f:
                    json.dump([launches[i] for i in chunk], f)
                procs.append(subprocess.Popen([sys.executable, "-c", _COMPILE, path], stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, env=env, text=True))
            for chunk, proc in zip(chunks, procs):
                out, err = proc.communicate(timeout=timeout_s)
                if proc.returncode != 0:
                    raise RuntimeError(f"sm_90 compile worker failed (exit {proc.returncode}):\n{err[-3000:]}")
                done = json.loads(out.strip().splitlines()[-1])
                versions.add(done["triton"])
                for i, result in zip(chunk, done["results"]):
                    results[i] = result
        finally:  # a timeout, a failed worker or an interrupt: the other workers stop too
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
    return ", ".join(sorted(versions)), results


def unique(launches: list[dict]) -> dict[tuple, dict]:
    """Specialisation key -> the first launch with it."""
    out: dict[tuple, dict] = {}
    for launch in launches:
        out.setdefault(specialization(launch), launch)
    return out
