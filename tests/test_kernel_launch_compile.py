"""The Triton kernel compiles for sm_90 with the exact arguments the CUDA experts path launches it
with: the launches of `moe_experts` (local experts first, then the rest) and of `grouped_gemm` are
captured here, specialised as Triton specialises a real launch (16-divisible pointers and ints,
ints equal to 1 as constants), and compiled for Hopper in a subprocess. Without the alignment
hint on the weight table's loaded address Triton falls back to 2-byte scalar loads and no
cp.async pipeline, and without bf16 inputs no wgmma: the PTX is checked for both. Where the launch
takes the TMA path (Hopper, kernels/launch.py) the tiles arrive through cp.async.bulk.tensor from
descriptors built on the device (tensormap.replace); every shipped configuration is compiled too."""
import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

# Modules, not the same-named functions `dwdp.kernels` exports.
gg = importlib.import_module("dwdp.kernels.grouped_gemm")
moe = importlib.import_module("dwdp.kernels.moe")
launch_mod = importlib.import_module("dwdp.kernels.launch")

from kernel_launches import H100, LaunchRecorder, specialization  # noqa: E402

H100_SMS = H100.num_sms  # what torch reports on the H100 the shipped configuration file was measured on
_COMPILE = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend
from triton.compiler import ASTSource
from dwdp.kernels.grouped_gemm import _grouped_gemm_kernel as kernel

counts = []
for launch in json.load(sys.stdin):
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
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=launch["options"]).asm["ptx"]
    counts.append({
        "async_16": len(re.findall(r"cp\.async\.cg\.shared\.global \[[^\]]*\], \[[^\]]*\], 0x10", ptx)),
        "scalar_16": ptx.count("ld.global.b16"),
        "wgmma": ptx.count("wgmma.mma_async"),
        "e4m3_cvt": len(re.findall(r"cvt\.[a-z0-9.]*e4m3x2", ptx)),
        "wgmma_fp8": len(re.findall(r"wgmma\.mma_async[^\n]*e4m3\.e4m3", ptx)),
        "scalar_8": len(re.findall(r"ld\.global(?:\.[a-z]+)*\.[bu]8 ", ptx)),
        "tma_load": ptx.count("cp.async.bulk.tensor"),
        "tensormap": ptx.count("tensormap.replace"),
    })
print(json.dumps(counts))
"""


@pytest.fixture
def recorder(monkeypatch):
    """The kernel replaced by a recorder, launches seen as on an H100 (its configuration file, sm_90)."""
    pytest.importorskip("triton.backends.nvidia")
    return LaunchRecorder().install(monkeypatch, H100)


class _ScalarReads:
    """Counts the host reading tensor values (.item(), .tolist(), .numpy(), int(), float(), bool(),
    use as an index): each is a device-to-host sync on CUDA."""

    METHODS = ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__")

    def __enter__(self):
        self.count, self._saved = 0, {}
        for name in self.METHODS:
            original = self._saved[name] = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, **kwargs):
                self.count += 1
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)


def _inputs(tokens=300, hidden=2048, inter=768, experts=16, top_k=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen).bfloat16()  # [E, 2I, H]
    down = torch.randn(experts, hidden, inter, generator=gen).bfloat16()          # [E, H, I]
    index = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    return x, gate_up, down, index, weights


def _assert_streamed(name: str, launch: dict, c: dict, scalar_16: int = 0) -> None:
    """Weight and A tiles reach wgmma in 16-byte pieces or more: through TMA where the launch took that
    path (descriptors built on the device: tensormap.replace), through cp.async where it did not."""
    w_tma, a_tma = launch["args"]["W_TMA"][1], launch["args"]["A_TMA"][1]
    assert c["wgmma"] > 0, f"{name}: no wgmma in sm_90 PTX: {c}"
    if w_tma:
        assert c["tma_load"] > 0 and c["tensormap"] > 0, f"{name}: TMA path without TMA loads: {c}"
    else:
        assert c["tma_load"] == 0 and c["tensormap"] == 0, f"{name}: pointer path with TMA ops: {c}"
    if not (w_tma and a_tma):
        assert c["async_16"] > 0, f"{name}: tiles read through pointers without 16-byte cp.async: {c}"
    assert c["scalar_16"] <= scalar_16, f"{name}: 2-byte scalar loads in sm_90 PTX: {c}"


def _compile(launches):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", _COMPILE], input=json.dumps(launches), env=env, capture_output=True,
                          text=True, timeout=170)
    assert done.returncode == 0, f"sm_90 compile failed:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(180)
def test_cuda_experts_path_launches_compile_with_wgmma_and_16_byte_loads(recorder):
    x, gate_up, down, index, weights = _inputs()
    waited = []
    with _ScalarReads() as reads:
        moe.moe_experts(x, index, weights, list(gate_up.unbind(0)), list(down.unbind(0)), split_at=8,
                        on_local_done=lambda: waited.append(len(recorder.launches)), wave_size=H100_SMS)
    # No host sync on the path: the only scalar reads are the CPU-only range check of the expert ids
    # (min and max), which a CUDA input skips.
    assert reads.count == 2, f"{reads.count} device-to-host scalar reads in moe_experts"
    # Local-first: both GEMMs' first parts, the wait for the copies, both GEMMs' second parts.
    assert len(recorder.launches) == 4 and waited == [2], (len(recorder.launches), waited)
    parts = [launch["args"]["part"][1] for launch in recorder.launches]
    assert parts == [1, 1, 2, 2], parts
    first = recorder.launches[0]["args"]
    assert first["a_ptr"][0] == "*bf16" and first["FP32_DOT"][1] is False and first["GATED"][1] is True
    assert first["stride_ak"][0] == "constexpr" and first["K"][2] == "D", first
    # On Hopper: weights through per-expert descriptors; gathered token rows through pointers, h through TMA.
    paths = [(launch["args"]["W_TMA"][1], launch["args"]["A_TMA"][1]) for launch in recorder.launches[:2]]
    assert paths == [(True, False), (True, True)], paths
    counts = _compile(recorder.launches[:2])  # gate_up (SwiGLU, gathered rows) and down (scaled, scattered)
    for name, launch, c in zip(("gate_up", "down"), recorder.launches, counts):
        _assert_streamed(name, launch, c)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tma", ["1", "0"], ids=["tma", "pointers"])
def test_plain_grouped_gemm_launch_compiles_with_wgmma_and_16_byte_loads(recorder, monkeypatch, tma):
    monkeypatch.setenv("DWDP_KERNEL_TMA", tma)
    x, gate_up, _, index, _ = _inputs(top_k=2)
    counts = torch.bincount(index.reshape(-1), minlength=gate_up.shape[0])
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    x_sorted = torch.randn(int(offsets[-1]), x.shape[1], generator=torch.Generator().manual_seed(1)).bfloat16()
    import contextvars

    from triton.runtime import _allocation

    def launch_in_fresh_context():  # a thread that never set an allocator: the TMA launch gives Triton one
        gg.grouped_gemm(x_sorted, offsets, list(gate_up.unbind(0)), wave_size=H100_SMS)
        return not isinstance(_allocation._allocator.get(), _allocation.NullAllocator)

    has_allocator = contextvars.Context().run(launch_in_fresh_context)
    assert has_allocator == (tma == "1"), (tma, has_allocator)
    (launch,) = recorder.launches
    assert (launch["args"]["W_TMA"][1], launch["args"]["A_TMA"][1]) == ((True, True) if tma == "1" else (False, False))
    (c,) = _compile(recorder.launches)
    _assert_streamed("plain", launch, c)


@pytest.mark.timeout(180)
def test_transposed_biased_launches_compile_with_wgmma(recorder):
    """Weights stored [in, out] (read transposed, Llama 4 / gpt-oss), biases, clamped SwiGLU with a
    gain and an up offset. The only scalar loads allowed are the bias rows, a few per tile; the weight
    tiles must still stream (through descriptors over the [in, out] storage on Hopper) into wgmma. (gpt-oss also interleaves its gate and up
    rows; those strided columns are loaded 2 bytes at a time today: see docs/limitations.md.)"""
    from dwdp.kernels import Epilogue

    gen = torch.Generator().manual_seed(5)
    tokens, hidden, inter, experts, top_k = 200, 1024, 512, 8, 4
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    gate_up = torch.randn(experts, hidden, 2 * inter, generator=gen).bfloat16()  # [E, H, 2I] as stored
    down = torch.randn(experts, inter, hidden, generator=gen).bfloat16()          # [E, I, H] as stored
    first_bias = torch.randn(experts, 2 * inter, generator=gen).bfloat16()
    down_bias = torch.randn(experts, hidden, generator=gen).bfloat16()
    index = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    epilogue = Epilogue(alpha=1.702, limit=7.0, up_offset=1.0)
    moe.moe_experts(x, index, weights, [w.t() for w in gate_up], [w.t() for w in down],
                    first_bias=list(first_bias), down_bias=list(down_bias), epilogue=epilogue, split_at=4,
                    on_local_done=lambda: None, wave_size=H100_SMS)
    assert len(recorder.launches) == 4, len(recorder.launches)
    assert [launch["args"]["W_TRANSPOSED"][1] for launch in recorder.launches[:2]] == [True, True]
    for name, launch, c in zip(("gate_up", "down"), recorder.launches, _compile(recorder.launches[:2])):
        _assert_streamed(name, launch, c, scalar_16=2)  # the bias rows, a few per tile


@pytest.mark.timeout(180)
def test_fp8_block_scaled_launches_compile_with_wgmma_and_16_byte_loads(recorder):
    """fp8 weights with 128 x 128 block scales (DeepSeek-V3's layout, gate and up blocked apart):
    the fp8 tiles stream in (TMA on Hopper) like bf16 ones, are converted from e4m3 in
    registers, scaled and fed to bf16 wgmma; no fp8 value is loaded a byte at a time. With fp8
    activations the dots are fp8 x fp8 wgmma."""
    from dwdp.kernels import BlockQuant, quantize_fp8

    gen = torch.Generator().manual_seed(6)
    tokens, hidden, inter, experts, top_k = 200, 1024, 512, 8, 4
    x = torch.randn(tokens, hidden, generator=gen).bfloat16()
    first_quant, down_quant = BlockQuant("fp8", (128, 128), halves=2), BlockQuant("fp8", (128, 128))
    gate_up, gate_up_scales = quantize_fp8(torch.randn(experts, 2 * inter, hidden, generator=gen), first_quant)
    down, down_scales = quantize_fp8(torch.randn(experts, hidden, inter, generator=gen), down_quant)
    index = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    moe.moe_experts(x, index, weights, list(gate_up), list(down), first_scales=list(gate_up_scales),
                    down_scales=list(down_scales), first_quant=first_quant, down_quant=down_quant, split_at=4,
                    on_local_done=lambda: None, wave_size=H100_SMS)
    assert len(recorder.launches) == 4, len(recorder.launches)
    first = recorder.launches[0]["args"]
    assert first["W_SCALED"][1] is True and first["SCALE_E8M0"][1] is False, first
    for name, launch, c in zip(("gate_up", "down"), recorder.launches, _compile(recorder.launches[:2])):
        _assert_streamed(name, launch, c)
        assert c["e4m3_cvt"] > 0 and c["scalar_8"] == 0, f"{name}: fp8 conversions / byte loads in sm_90 PTX: {c}"
    # fp8 activations: the same launches become fp8 x fp8 wgmma, activation tiles streamed as fp8.
    recorder.launches.clear()
    moe.moe_experts(x, index, weights, list(gate_up), list(down), first_scales=list(gate_up_scales),
                    down_scales=list(down_scales), first_quant=first_quant, down_quant=down_quant, split_at=4,
                    on_local_done=lambda: None, wave_size=H100_SMS, fp8_activations=True)
    first = recorder.launches[0]["args"]
    assert first["A_FP8"][1] is True and first["a_ptr"][0] == "*fp8e4nv", first["a_ptr"]
    for name, launch, c in zip(("gate_up", "down"), recorder.launches, _compile(recorder.launches[:2])):
        _assert_streamed(name, launch, c)
        assert c["wgmma_fp8"] > 0, f"{name}: no fp8 x fp8 wgmma in sm_90 PTX: {c}"
        assert c["scalar_8"] == 0, f"{name}: byte loads in sm_90 PTX: {c}"


def test_specialization_does_not_depend_on_routing_or_arrival(recorder):
    """The compiled variants of a layer are the same whatever the routing (group sizes, experts with no
    rows), the local-first split and the part: only the layer's shapes and its tiles key them."""
    x, gate_up, down, index, weights = _inputs(tokens=64, hidden=256, inter=128, experts=8, top_k=2)
    skewed = torch.zeros_like(index)
    skewed[:, 1] = 1  # every token on experts 0 and 1: six experts without rows
    views = (list(gate_up.unbind(0)), list(down.unbind(0)))
    moe.moe_experts(x, index, weights, *views, wave_size=H100_SMS)
    moe.moe_experts(x, skewed, weights, *views, wave_size=H100_SMS)
    moe.moe_experts(x, index, weights, *views, split_at=3, on_local_done=lambda: None, wave_size=H100_SMS)
    moe.moe_experts(x, skewed, weights, *views, split_at=5, on_local_done=lambda: None, wave_size=7)
    assert len(recorder.launches) == 12, len(recorder.launches)
    gate_up_keys = {specialization(launch) for launch in recorder.launches[0::2]}
    down_keys = {specialization(launch) for launch in recorder.launches[1::2]}
    assert len(gate_up_keys) == 1 and len(down_keys) == 1, (len(gate_up_keys), len(down_keys))


def _shipped_cases():
    """(file, kind, n, k, rows per expert) of every entry and default of the shipped configuration files."""
    from dwdp.kernels import tuned_configs

    cases = []
    for path in sorted(tuned_configs.PACKAGE_DIR.glob("*.json")):
        tuned = tuned_configs.load(path)
        cases += [(path.name, e.kind, e.n, e.k, e.rows_per_expert) for e in tuned.entries]
        cases += [(path.name, kind, 512, 256, 64) for kind in tuned.defaults]  # a shape no entry has
    return cases


@pytest.mark.timeout(300)
def test_every_shipped_configuration_compiles_for_sm_90(recorder):
    """Each entry and default of the shipped files, launched as grouped_gemm launches it on a device of
    that name (plain or SwiGLU, bf16, or fp8 weights with fp8 activations), compiles with wgmma and its
    tiles streamed in (TMA where chosen), and takes the tiles of that entry. Weights are uninitialised
    views: only their shapes, strides and addresses reach the compiler."""
    from dwdp.kernels import SWIGLU, BlockQuant

    cases = _shipped_cases()
    assert cases, "no shipped configuration"
    experts, keys, launches, names = 2, set(), [], []
    for name, kind, n, k, rows in cases:
        assert name == "NVIDIA_H100_80GB_HBM3.json", name  # the only device whose name the fixture gives
        gated, fp8 = kind.endswith("_gated"), kind.startswith("fp8") and not kind.startswith("fp8w")
        x = torch.empty(rows * experts, k, dtype=torch.bfloat16)
        offsets = torch.arange(experts + 1) * rows
        kwargs = {"activation": SWIGLU if gated else None}
        if fp8:
            quant = BlockQuant("fp8", (128, 128), halves=2 if gated else 1)
            weights = [torch.empty(n, k, dtype=torch.float8_e4m3fn) for _ in range(experts)]
            kwargs.update(weight_scales=[torch.ones(*quant.scale_shape(n, k)) for _ in range(experts)], quant=quant,
                          fp8_activations=True)
        else:
            weights = [torch.empty(n, k, dtype=torch.bfloat16) for _ in range(experts)]
        recorder.launches.clear()
        gg.grouped_gemm(x, offsets, weights, wave_size=H100_SMS, **kwargs)
        (launch,) = recorder.launches
        assert launch["args"]["GATED"][1] is gated and launch["args"]["A_FP8"][1] is fp8, (kind, launch["args"])
        key = specialization(launch)
        if key not in keys:
            keys.add(key)
            launches.append(launch)
            names.append(f"{kind} n={n} k={k} rows={rows}")
    for name, launch, c in zip(names, launches, _compile(launches)):
        _assert_streamed(name, launch, c)
        if name.startswith("fp8"):
            assert c["wgmma_fp8"] > 0, f"{name}: no fp8 x fp8 wgmma: {c}"
