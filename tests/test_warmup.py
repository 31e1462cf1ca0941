"""No kernel compiles after a model is ready: every experts-kernel launch a forward makes, over random
routings, batch shapes (so tile choices) and arrival orders of the copies, has a specialisation
`DWDPModel.warmup()` met. Launches are recorded as a GPU would see them (a pretend Hopper whose tuned
configuration file picks other tiles for other numbers of rows per expert), not run. Every weight format
and dtype is checked at 1, 2, 3, 16, 64 and 513 tokens, and with one expert given one row and another
none (MXFP4 experts run on the reference path and launch nothing)."""
import json
import os
import random
import tempfile

import pytest
import torch

pytest.importorskip("triton.backends.nvidia")

from dwdp.runtime.config import DWDPConfig  # noqa: E402
from dwdp.runtime.experts import _kernel_call  # noqa: E402
from dwdp.kernels.moe import moe_launch_configs  # noqa: E402
from dwdp.models.quantization import ExpertsQuantization  # noqa: E402
from dwdp.runtime.group import DWDPGroup, init_group, launch_local  # noqa: E402
from dwdp.kernels.tuned_configs import FORMAT, file_name  # noqa: E402
from dwdp.runtime.model import DWDPModel  # noqa: E402
from dwdp.models.tiny import build_tiny_model  # noqa: E402
from dwdp.models.tiny_quantized import build_tiny_quantized  # noqa: E402
from kernel_launches import LaunchRecorder, differing, launch_mod  # noqa: E402

BATCHES = [(1, 1), (1, 2), (1, 7), (2, 5), (3, 16), (1, 33), (4, 8), (2, 1), (4, 130)]  # (prompts, tokens)
DEVICE = launch_mod.DeviceInfo("Test Hopper", (9, 0), 232448, 132)
# Rows per expert -> tiles: three buckets, so the number of tokens of a forward selects among them.
BUCKETS = {2: (16, 32, 32), 16: (32, 32, 32), 128: (64, 64, 32)}


def _write_tuned_file(directory: str, wrapped: DWDPModel) -> None:
    """A configuration file for DEVICE with one entry per bucket for each GEMM of this model's experts (of
    the kind each launches: bf16, fp8 dots, dequantized fp8, fp32; gated or not)."""
    runtime = wrapped.experts_layers[0].module._dwdp_runtime
    tables = runtime.kernel_tables[0]
    dtype = wrapped.model.get_input_embeddings().weight.dtype
    launches = moe_launch_configs(dtype, tables.first, tables.down, num_slots=tables.first.num_experts,
                                  device=DEVICE, epilogue=runtime.epilogue, first_scales=tables.first_scales,
                                  down_scales=tables.down_scales, first_bias=tables.first_bias is not None,
                                  down_bias=tables.down_bias is not None, fp8_activations=tables.fp8_activations)
    entries = []
    for problem in (launch.problem for launch in launches):
        for rows, (bm, bn, bk) in BUCKETS.items():
            config = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=4, num_stages=2, programs_per_sm=1)
            entries.append(dict(kind=problem.kind, n=problem.n, k=problem.k, rows_per_expert=rows, config=config))
    data = dict(format=FORMAT, device=DEVICE.name, entries=entries,
                measured=dict(date="2026-11-25", torch="test", triton="test", code="test"))
    with open(os.path.join(directory, file_name(DEVICE.name)), "w") as f:
        json.dump(data, f)


def _keys_rank(rank: int, family: str, forwards: int) -> dict:
    torch.manual_seed(0)
    os.environ["DWDP_KERNEL_CONFIGS"] = tempfile.mkdtemp(prefix=f"dwdp-tiles-{rank}-")
    group = init_group()
    model = build_tiny_model(family, seed=1, dtype=torch.bfloat16)  # bf16: the router's weights are not fp32
    recorder = LaunchRecorder().install(device=DEVICE)
    rng = random.Random(100 + rank)
    with DWDPModel(model, DWDPConfig(experts_kernel="triton", slice_bytes=4096), group) as wrapped, torch.no_grad():
        _write_tuned_file(os.environ["DWDP_KERNEL_CONFIGS"], wrapped)
        wrapped.warmup(forward=False)
        warmed = set(recorder.keys)
        recorder.launches.clear()
        # Whether a layer's copies have landed when it starts is the copies' timing on a GPU: drawn here.
        wrapped.prefetcher.landed = lambda layer, slot: rng.random() < 0.5
        tiles = set()
        for i in range(forwards):
            prompts, tokens = BATCHES[i % len(BATCHES)] if i < len(BATCHES) else rng.choice(BATCHES)
            ids = torch.randint(3, 128, (prompts, tokens), generator=torch.Generator().manual_seed(1000 * rank + i))
            wrapped(input_ids=ids)
        seen = set(recorder.keys)
        tiles = {launch["args"]["BLOCK_M"][1] for launch in recorder.launches}
    new = [differing(k, warmed) for k in seen - warmed]
    return dict(warmed=len(warmed), seen=len(seen), launches=len(recorder.launches), new=new[:3], num_new=len(new),
                tiles=sorted(tiles))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])  # plain SwiGLU; biases + interleaved clamped gate
def test_every_launch_after_warmup_has_a_warmed_specialisation(family):
    ranks = launch_local(_keys_rank, 2, (family, 24), timeout_s=140)
    for rank, r in enumerate(ranks):
        assert r["launches"] >= 24, (rank, r)
        assert r["num_new"] == 0, f"{family} rank {rank}: {r['num_new']} launch forms warmup() did not compile: {r['new']}"
        # The forwards met several tile buckets, so the check covers tile choice, not only the two forms.
        assert len(r["tiles"]) >= 2, (rank, r["tiles"])


def test_unaligned_or_bf16_inputs_launch_the_warmed_forms(monkeypatch):
    """A caller's hidden states that start off a 16-byte boundary, a one-token view whose row stride is 1,
    or bf16 routing weights, are brought to the one form the kernel is warmed for."""
    model = build_tiny_model("mixtral", seed=1, dtype=torch.bfloat16)
    with DWDPModel(model, DWDPConfig(experts_kernel="triton"), DWDPGroup(0, 1)) as wrapped:
        recorder = LaunchRecorder().install(monkeypatch, DEVICE)
        wrapped.warmup(forward=False)
        warmed = set(recorder.keys)
        runtime = wrapped.experts_layers[0].module._dwdp_runtime
        flat = torch.randn(5 * 32 + 1, dtype=torch.bfloat16)
        hidden = flat[1:].view(5, 32)  # data 2 bytes past an aligned start
        index = torch.randint(0, 8, (5, 2))
        weights = torch.rand(5, 2, dtype=torch.bfloat16)
        one_token = torch.randn(32, 1, dtype=torch.bfloat16).t()  # [1, 32], contiguous with row stride 1
        recorder.launches.clear()
        _kernel_call(runtime, 0, hidden, index, weights, split=False, on_local_done=lambda: None)
        _kernel_call(runtime, 0, one_token, index[:1], weights[:1], split=False, on_local_done=lambda: None)
        assert len(recorder.launches) == 4, len(recorder.launches)
        assert set(recorder.keys) <= warmed, [differing(k, warmed) for k in set(recorder.keys) - warmed]


FP8 = ExpertsQuantization("fp8", (128, 128))
FP8_E8M0 = ExpertsQuantization("fp8", (128, 128), "ue8m0")
# fp8 models 256 wide: two 128-column scale groups per row, so one token's activation scales are a [1, 2]
# tensor whose strides torch may leave row-major (one group, [R, 1], has the same strides at every R).
FP8_SIZES = dict(hidden=256, intermediate=256)
# name -> (family, dtype, experts quantization, experts_kernel)
FORMATS = {
    "bf16": ("mixtral", torch.bfloat16, None, "triton"),
    "fp16": ("mixtral", torch.float16, None, "triton"),
    "fp32": ("mixtral", torch.float32, None, "triton"),
    "gpt_oss bf16 (biases, interleaved clamped gate)": ("gpt_oss", torch.bfloat16, None, "triton"),
    "fp8-fp32 dequantized": ("deepseek_v3", torch.bfloat16, FP8, "triton"),
    "fp8-fp32 dots": ("deepseek_v3", torch.bfloat16, FP8, "triton_fp8"),
    "fp8-e8m0 dequantized": ("deepseek_v3", torch.bfloat16, FP8_E8M0, "triton"),
    "fp8-e8m0 dots": ("deepseek_v3", torch.bfloat16, FP8_E8M0, "triton_fp8"),
    "mxfp4": ("gpt_oss", torch.bfloat16, ExpertsQuantization("mxfp4"), "auto"),
}
TOKEN_COUNTS = (1, 2, 3, 16, 64, 513)


def _sparse_routing(num_experts: int, tokens: int, top_k: int) -> torch.Tensor:
    """[T, k] router ids where expert 0 has one row, expert 1 none, and the others share the rest."""
    others = num_experts - 2
    index = torch.tensor([[2 + (t + j) % others for j in range(top_k)] for t in range(tokens)])  # [T, k]
    index[0, 0] = 0
    return index


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", list(FORMATS))
def test_every_token_count_of_every_format_launches_a_warmed_form(name, monkeypatch, tmp_path):
    family, dtype, quant, kernel = FORMATS[name]
    if quant is None:
        model = build_tiny_model(family, seed=1, dtype=dtype)
    else:
        sizes = {"intermediate": 64} if quant.format == "mxfp4" else FP8_SIZES
        model, _ = build_tiny_quantized(family, quant, seed=1, dtype=dtype, **sizes)
    monkeypatch.setenv("DWDP_KERNEL_CONFIGS", str(tmp_path))
    monkeypatch.delenv("DWDP_KERNEL_TMA", raising=False)
    recorder = LaunchRecorder().install(monkeypatch, DEVICE)
    with DWDPModel(model, DWDPConfig(experts_kernel=kernel), DWDPGroup(0, 1)) as wrapped, torch.no_grad():
        if quant is not None and quant.format == "mxfp4":
            wrapped.warmup(forward=False)
            wrapped(input_ids=torch.randint(3, 128, (1, 16)))
            # MXFP4 never reaches the Triton kernel: composite views (the default on Linux) or the reference path.
            assert wrapped.experts_kernel in ("composite", "reference") and not recorder.launches, (
                wrapped.experts_kernel, len(recorder.launches))
            return
        assert wrapped.experts_kernel == kernel, wrapped.experts_kernel
        _write_tuned_file(str(tmp_path), wrapped)
        wrapped.warmup(forward=False)
        warmed = set(recorder.keys)
        recorder.launches.clear()
        for tokens in TOKEN_COUNTS:
            ids = torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(tokens))
            wrapped(input_ids=ids)
        runtime = wrapped.experts_layers[0].module._dwdp_runtime
        hidden_dim, top_k = runtime.kernel_tables[0].first.shape[1], wrapped.model.config.num_experts_per_tok
        for tokens in (1, 3):
            hidden = torch.randn(tokens, hidden_dim, dtype=dtype)
            index = _sparse_routing(len(runtime.table_order), tokens, top_k)
            for split in (False, True):
                _kernel_call(runtime, 0, hidden, index, torch.rand(tokens, top_k), split=split,
                             on_local_done=lambda: None)
        seen = set(recorder.keys)
        tiles = {launch["args"]["BLOCK_M"][1] for launch in recorder.launches}
    new = [differing(k, warmed) for k in seen - warmed]
    assert not new, f"{name}: {len(new)} launch forms warmup() did not compile, e.g. {new[:2]}"
    # The forwards met several tile buckets, so the check covers tile choice, not only the forms.
    assert len(tiles) >= 2, (name, tiles)
