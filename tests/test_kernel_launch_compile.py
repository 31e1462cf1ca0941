"""Every launch form of the experts kernel compiles for sm_90 (Hopper) with the installed Triton, on a
CPU: each form of tests/launch_forms.py (weight format x dot x epilogue x load path) and the tiles of
every entry of every shipped configuration file, captured with the exact arguments `moe_experts` and
`grouped_gemm` launch them with, specialised as Triton specialises a real launch (16-divisible pointers
and ints, ints equal to 1 as constants), compiled ahead of time in subprocesses. A form that does not
compile fails naming the form and Triton's error; one that compiles is checked in its PTX: wgmma (fp8 x
fp8 wgmma for fp8 dots), weight tiles streamed in 16-byte pieces (cp.async, or TMA loads from
descriptors built on the device), no 2-byte scalar loads. The number of tokens never makes a new form
(one row, one expert with one row and one with none included), and no Triton helper returns twice
(compiled Triton type-checks every return; the interpreter takes the first).

DWDP_COMPILE_TRITON=DIR compiles with the Triton found in DIR instead (.ci/run: triton 3.6, the GPU
image's release)."""
import ast
import importlib
import os
from pathlib import Path

import pytest
import torch

# Modules, not the same-named functions `dwdp.kernels` exports.
gg = importlib.import_module("dwdp.kernels.grouped_gemm")
moe = importlib.import_module("dwdp.kernels.moe")
launch_mod = importlib.import_module("dwdp.kernels.launch")

pytest.importorskip("triton.backends.nvidia")

import launch_forms as lf  # noqa: E402
from kernel_launches import H100, LaunchRecorder, differing, specialization  # noqa: E402

H100_SMS = H100.num_sms  # what torch reports on the H100 the shipped configuration file was measured on
TOKEN_COUNTS = (1, 2, 3, 16, 64, 513)


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


def _shipped_cases():
    """(file, device, kind, n, k, rows per expert, tiles) of every entry of the shipped configuration files
    (their defaults are the tiles the forms of launch_forms take)."""
    from dwdp.kernels import tuned_configs

    cases = []
    for path in sorted(tuned_configs.PACKAGE_DIR.glob("*.json")):
        tuned = tuned_configs.load(path)
        cases += [(path.name, tuned.device, e.kind, e.n, e.k, e.rows_per_expert, e.config) for e in tuned.entries]
    return cases


def _shipped_launch(device: str, kind: str, n: int, k: int, rows: int) -> dict:
    """grouped_gemm's launch for one shipped entry on a device of that name, on its default (pointer) path;
    fp8 kinds with e8m0 scales (the format whose column scales reach a helper the fp32 ones do not)."""
    from dwdp.kernels import SWIGLU, BlockQuant

    experts = 2
    gated, fp8 = kind.endswith("_gated"), kind.startswith("fp8")
    x = torch.empty(rows * experts, k, dtype=torch.bfloat16)
    offsets = torch.arange(experts + 1) * rows
    kwargs = {"activation": SWIGLU if gated else None}
    if fp8:
        quant = BlockQuant("fp8", (128, 128), halves=2 if gated else 1)
        weights = [torch.empty(n, k, dtype=torch.float8_e4m3fn) for _ in range(experts)]
        scales = [torch.full(quant.scale_shape(n, k), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
                  for _ in range(experts)]
        kwargs.update(weight_scales=scales, quant=quant, fp8_activations=not kind.startswith("fp8w"))
    else:
        weights = [torch.empty(n, k, dtype=torch.bfloat16) for _ in range(experts)]
    with pytest.MonkeyPatch.context() as mp:
        recorder = LaunchRecorder().install(mp, launch_mod.DeviceInfo(device, (9, 0), H100.shared_memory, H100_SMS))
        mp.delenv("DWDP_KERNEL_TMA", raising=False)
        gg.grouped_gemm(x, offsets, weights, wave_size=H100_SMS, **kwargs)
    (launch,) = recorder.launches
    return launch


SHIPPED = _shipped_cases()


def _shipped_name(case) -> str:
    name, _, kind, n, k, rows, _ = case
    return f"{name} {kind} n={n} k={k} rows={rows}"


@pytest.fixture(scope="module")
def compiled():
    """Every form's and shipped entry's launches, compiled once: {"forms": name -> [(role, launch, result)],
    "shipped": name -> (launch, result), "triton": version}. Launches with the same specialisation key
    compile once."""
    forms = {form.name: lf.record(form) for form in lf.FORMS}
    shipped = {_shipped_name(case): _shipped_launch(*case[1:6]) for case in SHIPPED}
    everything = [launch for launches in forms.values() for launch in launches] + list(shipped.values())
    keys = lf.unique(everything)
    version, results = lf.compile_all(list(keys.values()))
    by_key = dict(zip(keys, results))
    return {"triton": version,
            "forms": {name: [(role, launch, by_key[specialization(launch)])
                             for role, launch in zip(lf.roles(form), forms[name])]
                      for form, name in ((f, f.name) for f in lf.FORMS)},
            "shipped": {name: (launch, by_key[specialization(launch)]) for name, launch in shipped.items()}}


def _check_ptx(name: str, launch: dict, c: dict, *, scalar_16: int | None = 0) -> None:
    """The launch compiled, and its weight and A tiles reach wgmma in 16-byte pieces or more: through TMA
    where the launch took that path (descriptors built on the device: tensormap.replace), through cp.async
    where it did not. scalar_16: 2-byte scalar loads allowed (bias rows; None: interleaved rows)."""
    assert "error" not in c, f"{name} does not compile for sm_90: {c['error']}"
    args = launch["args"]
    w_tma, a_tma, fp32 = args["W_TMA"][1], args["A_TMA"][1], args["a_ptr"][0] == "*fp32"
    if not fp32:  # fp32 dots are IEEE fp32 FMAs (no TF32), like torch.mm
        assert c["wgmma"] > 0, f"{name}: no wgmma in sm_90 PTX: {c}"
    if w_tma:
        assert c["tma_load"] > 0 and c["tensormap"] > 0, f"{name}: TMA path without TMA loads: {c}"
    else:
        assert c["tma_load"] == 0 and c["tensormap"] == 0, f"{name}: pointer path with TMA ops: {c}"
    if not (w_tma and a_tma) and not fp32:
        assert c["async_16"] > 0, f"{name}: tiles read through pointers without 16-byte cp.async: {c}"
    if scalar_16 is not None:
        assert c["scalar_16"] <= scalar_16, f"{name}: 2-byte scalar loads in sm_90 PTX: {c}"
    if args["A_FP8"][1]:
        assert c["wgmma_fp8"] > 0, f"{name}: no fp8 x fp8 wgmma in sm_90 PTX: {c}"
    elif args["W_SCALED"][1]:
        assert c["e4m3_cvt"] > 0, f"{name}: fp8 weights without e4m3 conversions: {c}"
    if args["W_SCALED"][1] and not args["SCALE_E8M0"][1]:  # e8m0 scales are bytes: their loads are u8
        assert c["scalar_8"] == 0, f"{name}: byte loads in sm_90 PTX: {c}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("form", lf.FORMS, ids=[f.name for f in lf.FORMS])
def test_launch_form_compiles_for_sm_90(compiled, form):
    """Each launch of the form compiles, on the path it asked for, with its tiles streamed into wgmma."""
    for role, launch, result in compiled["forms"][form.name]:
        name = f"{form.name} / {role} (triton {compiled['triton']})"
        args = launch["args"]
        assert args["W_TMA"][1] is form.tma or (form.tma and args["INTERLEAVED"][1]), (name, args["W_TMA"])
        assert args["W_SCALED"][1] is form.fp8 and args["A_FP8"][1] is form.fp8_dots, (name, args["W_SCALED"])
        assert args["SCALE_E8M0"][1] is (form.scales == "e8m0"), (name, args["SCALE_E8M0"])
        biased = args["HAS_BIAS"][1]
        _check_ptx(name, launch, result, scalar_16=None if args["INTERLEAVED"][1] else 2 if biased else 0)


def test_forms_cover_every_dot_scale_epilogue_and_path():
    """The matrix holds every value of every axis a launch can vary along, so a form added to the kernel
    without one here fails this, not a GPU."""
    launches = [launch for form in lf.FORMS for launch in lf.record(form)]
    seen = {}
    for launch in launches:
        for name, (_, value, _) in launch["args"].items():
            if name.isupper():
                seen.setdefault(name, set()).add(value)
    for name, values in {"GATED": {True, False}, "INTERLEAVED": {True, False}, "HAS_BIAS": {True, False},
                         "CLAMP": {True, False}, "W_SCALED": {True, False}, "SCALE_E8M0": {True, False},
                         "A_FP8": {True, False}, "W_TMA": {True, False}, "A_TMA": {True, False},
                         "W_TRANSPOSED": {True, False}, "W_SCALE_TILE": {True, False}, "ATOMIC_OUT": {True, False},
                         "GATHER_A": {True, False}, "SCATTER_OUT": {True, False}, "FP32_DOT": {True, False},
                         "ACTIVATION": {0, 1, 3}}.items():
        assert values <= seen[name], f"no form launches {name} in {sorted(values - seen[name], key=str)}"
    assert any(v > 0 for v in seen["QUANT_GROUP"]) and 0 in seen["QUANT_GROUP"], seen["QUANT_GROUP"]
    dtypes = {launch["args"]["a_ptr"][0] for launch in launches}
    assert {"*bf16", "*fp16", "*fp32", "*fp8e4nv"} <= dtypes, dtypes
    # Both scale formats meet both ways of reading a scale, for both dots.
    pairs = {(a["SCALE_E8M0"][1], a["A_FP8"][1], a["W_SCALE_TILE"][1]) for a in (x["args"] for x in launches)
             if a["W_SCALED"][1]}
    assert len(pairs) == 8, sorted(pairs)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", SHIPPED, ids=[_shipped_name(c) for c in SHIPPED])
def test_shipped_configuration_compiles_for_sm_90(compiled, case):
    """Each entry of each shipped file, launched as grouped_gemm launches it on a device of that name,
    takes the entry's tiles and compiles with its tiles streamed into wgmma."""
    name = f"{_shipped_name(case)} (triton {compiled['triton']})"
    launch, result = compiled["shipped"][_shipped_name(case)]
    tiles = case[6]
    got = tuple(launch["args"][f"BLOCK_{d}"][1] for d in "MNK")
    assert got == (tiles["block_m"], tiles["block_n"], tiles["block_k"]), (name, got, tiles)
    _check_ptx(name, launch, result)


def test_compiles_ran_with_the_triton_asked_for(compiled):
    """The matrix compiled with the installed Triton, or with the one DWDP_COMPILE_TRITON points at."""
    import triton

    other = os.environ.get(lf.COMPILE_TRITON_ENV)
    if other:
        from importlib.metadata import distributions

        (dist,) = [d for d in distributions(path=[other]) if d.metadata["Name"] == "triton"]
        assert compiled["triton"] == dist.version, (compiled["triton"], dist.version, other)
    else:
        assert compiled["triton"] == triton.__version__, (compiled["triton"], triton.__version__)


@pytest.mark.parametrize("form", lf.FORMS, ids=[f.name for f in lf.FORMS])
def test_token_count_never_makes_a_new_form(form):
    """With its tiles fixed, a form launches with the same specialisation at 1, 2, 3, 16, 64 and 513 tokens,
    and when one expert has one row and another none: no stride or size that can be 1 reaches a
    specialised argument."""
    reference = [specialization(x) for x in lf.record(form)]
    for tokens in TOKEN_COUNTS:
        for sparse in (False, True):
            got = [specialization(x) for x in lf.record(form, tokens=tokens, sparse=sparse)]
            for role, key, want in zip(lf.roles(form), got, reference):
                assert key == want, (f"{form.name} / {role} at {tokens} tokens{' (sparse)' if sparse else ''} "
                                     f"specialises apart from {lf.TOKENS} tokens: {differing(key, {want})}")


def test_mxfp4_experts_never_reach_the_kernel():
    """MXFP4 is a weight format with no launch form: the reference path runs it, under "auto" and as the
    reason an explicit "triton" is refused."""
    from dwdp.models.adapters import find_experts
    from dwdp.runtime.experts_kernel import choose_experts_kernel, kernel_blocker
    from dwdp.models.quantization import ExpertsQuantization
    from dwdp.models.tiny_quantized import build_tiny_quantized

    model, _ = build_tiny_quantized("gpt_oss", ExpertsQuantization("mxfp4"), seed=1, intermediate=64)
    layers = find_experts(model)
    assert choose_experts_kernel("auto", torch.device("cuda"), layers) == "reference"
    assert "mxfp4" in kernel_blocker(layers[0]), kernel_blocker(layers[0])


@pytest.mark.parametrize("shape,strides,inner,expected", [
    ((1, 64), (1, 1), 1, (64, 1)),      # a one-row view whose row stride torch left at 1
    ((1, 64), (128, 1), 1, (64, 1)),    # one row sliced out of a wider tensor
    ((5, 64), (64, 1), 1, (64, 1)),     # many rows: as they are
    ((5, 64), (128, 1), 1, (128, 1)),
    ((1, 3), (3, 1), 0, (1, 1)),        # one row of groups-first scales, left row-major by .t().contiguous().t()
    ((4, 1), (1, 1), 0, (1, 4)),        # one column group of groups-first scales
    ((4, 3), (1, 4), 0, (1, 4)),
    ((1, 1), (1, 1), 0, (1, 1)),
])
def test_kernel_strides_give_a_size_1_dimension_its_layouts_stride(shape, strides, inner, expected):
    t = torch.empty(4096).as_strided(shape, strides)
    assert gg.kernel_strides(t, inner) == expected, (shape, strides, inner, gg.kernel_strides(t, inner))


def test_kernel_strides_refuse_what_is_not_a_matrix():
    with pytest.raises(ValueError, match=r"kernel_strides takes a 2-D tensor and inner 0 or 1, got shape \(4,\)"):
        gg.kernel_strides(torch.empty(4))
    with pytest.raises(ValueError, match=r"inner=2"):
        gg.kernel_strides(torch.empty(2, 2), 2)


def _jit_functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def test_every_triton_function_returns_once_at_its_end():
    """Compiled Triton type-checks every return of a helper, also those behind a constexpr branch, while the
    interpreter takes the first it meets: an early `return` of another type (fp32 beside uint8) passes
    every CPU test and fails on the GPU. Each @triton.jit function returns at most once, as its last
    statement."""
    kernels = Path(gg.__file__).resolve().parent
    found = 0
    for path in sorted(kernels.glob("*.py")):
        for fn in _jit_functions(path):
            found += 1
            returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return)]
            where = f"{path.name}:{fn.lineno} {fn.name}"
            assert len(returns) <= 1, f"{where} returns {len(returns)} times (lines {[r.lineno for r in returns]})"
            assert not returns or fn.body[-1] is returns[0], f"{where} returns before its end (line {returns[0].lineno})"
    assert found >= 10, f"only {found} @triton.jit functions found under {kernels}"


@pytest.mark.parametrize("tma", [None, "1"], ids=["default", "tma"])
def test_cuda_experts_path_syncs_nothing_and_splits_local_first(recorder, monkeypatch, tma):
    """moe_experts on CUDA reads no tensor value on the host, runs both GEMMs' local parts, calls the wait,
    then both second parts; pointer loads unless DWDP_KERNEL_TMA=1 (then weights and h through TMA,
    gathered token rows through pointers)."""
    if tma is None:
        monkeypatch.delenv("DWDP_KERNEL_TMA", raising=False)
    else:
        monkeypatch.setenv("DWDP_KERNEL_TMA", tma)
    x, gate_up, down, index, weights = _inputs()
    waited = []
    with _ScalarReads() as reads:
        moe.moe_experts(x, index, weights, list(gate_up.unbind(0)), list(down.unbind(0)), split_at=8,
                        on_local_done=lambda: waited.append(len(recorder.launches)), wave_size=H100_SMS)
    # No host sync on the path: the only scalar reads are the CPU-only range check of the expert ids
    # (min and max), which a CUDA input skips.
    assert reads.count == 2, f"{reads.count} device-to-host scalar reads in moe_experts"
    assert len(recorder.launches) == 4 and waited == [2], (len(recorder.launches), waited)
    parts = [launch["args"]["part"][1] for launch in recorder.launches]
    assert parts == [1, 1, 2, 2], parts
    first = recorder.launches[0]["args"]
    assert first["a_ptr"][0] == "*bf16" and first["FP32_DOT"][1] is False and first["GATED"][1] is True
    assert first["stride_ak"][0] == "constexpr" and first["K"][2] == "D", first
    paths = [(launch["args"]["W_TMA"][1], launch["args"]["A_TMA"][1]) for launch in recorder.launches[:2]]
    assert paths == ([(True, False), (True, True)] if tma else [(False, False), (False, False)]), paths


@pytest.mark.parametrize("tma", ["1", "0"], ids=["tma", "pointers"])
def test_a_tma_launch_gives_a_fresh_context_its_allocator(recorder, monkeypatch, tma):
    """A thread that never set an allocator: a TMA launch gives Triton one for its descriptors, a pointer
    launch leaves the context as it found it."""
    import contextvars

    from triton.runtime import _allocation

    monkeypatch.setenv("DWDP_KERNEL_TMA", tma)
    x, gate_up, _, index, _ = _inputs(top_k=2)
    counts = torch.bincount(index.reshape(-1), minlength=gate_up.shape[0])
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    x_sorted = torch.randn(int(offsets[-1]), x.shape[1], generator=torch.Generator().manual_seed(1)).bfloat16()

    def launch_in_fresh_context():
        gg.grouped_gemm(x_sorted, offsets, list(gate_up.unbind(0)), wave_size=H100_SMS)
        return not isinstance(_allocation._allocator.get(), _allocation.NullAllocator)

    has_allocator = contextvars.Context().run(launch_in_fresh_context)
    assert has_allocator == (tma == "1"), (tma, has_allocator)
    (launch,) = recorder.launches
    assert (launch["args"]["W_TMA"][1], launch["args"]["A_TMA"][1]) == ((True, True) if tma == "1" else (False, False))


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
