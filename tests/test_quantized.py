"""Quantized experts on 2 and 3 real ranks: fp8 with block scales (dwdp's layout and transformers'
own FP8Experts, fp32 and ue8m0 scales, blocks that do not divide the dimensions) and gpt-oss MXFP4,
wrapped in memory and loaded per rank from checkpoints.

The reference is the unwrapped model on the same quantized weights: the same model with every
quantized weight replaced by its dequantized values (transformers' fp8 and MXFP4 kernels do not run
on a CPU). Those values are exactly what dwdp's reference path multiplies with (fp32 products of the
stored values and scales), so only the order of additions differs: fp32 logits within 1e-5 relative.
"""
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.group import init_group, launch_local
from dwdp.runtime.model import DWDPModel
from dwdp.models.quantization import ExpertsQuantization
from dwdp.models.tiny import build_tiny_model
from dwdp.models.tiny_quantized import build_tiny_quantized, save_quantized_checkpoint
from logits_check import check_logits

SHAPE = dict(hidden=32, intermediate=48, num_experts=8, top_k=2, num_layers=3)
FP8 = ExpertsQuantization("fp8", (16, 16))
CASES = {
    # name: (family, quantization, FP8Experts class, model kwargs)
    "fp8": ("deepseek_v3", FP8, False, {}),
    "fp8_blocks_not_dividing": ("deepseek_v3", ExpertsQuantization("fp8", (40, 24)), False, {}),
    "fp8_experts_ue8m0": ("qwen3_moe", ExpertsQuantization("fp8", (128, 128), "ue8m0"), True, {}),
    "mxfp4": ("gpt_oss", ExpertsQuantization("mxfp4"), False, dict(intermediate=64)),
}
CHECKPOINTS = {
    # name: (family, quantization, layout, model kwargs)
    "fp8_stacked": ("deepseek_v3", FP8, "stacked", {}),
    "fp8_per_expert": ("qwen3_moe", ExpertsQuantization("fp8", (16, 16), "ue8m0"), "per_expert", {}),
    "mxfp4": ("gpt_oss", ExpertsQuantization("mxfp4"), "stacked", dict(intermediate=64)),
}
GROUP_SIZES = (2, 3)


def _tokens(rank: int) -> dict:
    gen = torch.Generator().manual_seed(500 + rank)
    return {"input_ids": torch.randint(3, 128, (2, 6 + rank), generator=gen)}


def _run(wrapped, reference, inputs) -> dict:
    with torch.no_grad():
        expected = reference(**inputs).logits
        got = wrapped(**inputs).logits
        again = wrapped(**inputs).logits  # slots reused across forwards
    return {"diff": max((got - expected).abs().max().item(), (again - expected).abs().max().item()),
            "scale": expected.abs().max().item()}


def _wrapped_case(name: str, rank: int, group, experts_kernel: str = "auto") -> dict:
    family, quant, fp8_class, kwargs = CASES[name]
    model, reference = build_tiny_quantized(family, quant, seed=13, fp8_experts_class=fp8_class, **{**SHAPE, **kwargs})
    # Slices that cut values and scales mid-tensor.
    config = DWDPConfig(slice_bytes=1000, experts_kernel=experts_kernel)
    with DWDPModel(model, config, group) as wrapped:
        out = _run(wrapped, reference, _tokens(rank))
        experts = wrapped.experts_layers[0]
        out.update(memory=wrapped.memory, bytes_copied=wrapped.stats.bytes_copied,
                   plans=wrapped.stats.plans_issued,
                   stored={t.name: (t.stored(experts.module).dtype, tuple(t.stored(experts.module).shape))
                           for t in experts.spec.tensors})
    return out


def _loaded_case(path: str, rank: int, group) -> dict:
    reference = torch.load(Path(path) / "reference.pt", weights_only=False)
    with DWDPModel.from_pretrained(path, DWDPConfig(slice_bytes=1000), group, dtype=torch.float32) as wrapped:
        out = _run(wrapped, reference, _tokens(rank))
        report = wrapped.load_report
        out.update(bytes_read=report.bytes_read, local=wrapped.placement.local_experts(rank),
                   expert_bytes=report.expert_bytes, experts_format=report.experts_format)
    return out


def _rank(rank: int, group_size: int, checkpoints: dict) -> dict:
    torch.set_num_threads(1)
    group = init_group(group_size)
    out = {name: _wrapped_case(name, rank, group) for name in CASES}
    # Memory by hand is the tables layout's (16-byte padded experts, no pages): that path, explicitly.
    out["fp8_tables"] = _wrapped_case("fp8", rank, group, experts_kernel="reference")
    dense = build_tiny_model("deepseek_v3", seed=13, dtype=torch.bfloat16, **SHAPE)
    with DWDPModel(dense, DWDPConfig(experts_kernel="reference"), group) as wrapped:
        out["bf16_memory"] = wrapped.memory
    out["loaded"] = {name: _loaded_case(path, rank, group) for name, path in checkpoints.items()}
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("quantized")
    out = {}
    for name, (family, quant, layout, kwargs) in CHECKPOINTS.items():
        path = root / name
        reference = save_quantized_checkpoint(path, family, quant, layout=layout, seed=17, dtype=torch.float32,
                                              **{**SHAPE, **kwargs})
        torch.save(reference, path / "reference.pt")
        out[name] = str(path)
    return out


@pytest.fixture(scope="module", params=GROUP_SIZES, ids=lambda g: f"G{g}")
def results(request, checkpoints):
    group_size = request.param
    return group_size, launch_local(_rank, group_size, (group_size, checkpoints), timeout_s=300)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", sorted(CASES))
def test_wrapped_equals_unwrapped_on_same_quantized_weights(results, case):
    group_size, per_rank = results
    for rank, r in enumerate(per_rank):
        check_logits(f"{case} G{group_size}", r[case], rank)
        assert r[case]["plans"] >= 2 and r[case]["bytes_copied"] > 0, (case, rank, r[case])
        values = {name: dtype for name, (dtype, _) in r[case]["stored"].items() if not name.endswith("bias")}
        quantized = {torch.float8_e4m3fn, torch.uint8}
        assert set(values.values()) & quantized, f"{case} rank {rank}: experts held as {values}, not quantized"


def _padded(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


@pytest.mark.timeout(400)
def test_fp8_rank_holds_half_of_bf16_plus_scales(results):
    """Exact bytes from the shapes: deepseek_v3 tiny, 3 layers of which 2 MoE, E = 8, H = 32, I = 48,
    16 x 16 blocks: gate_up [96, 32] + [6, 2] fp32 scales, down [32, 48] + [2, 3] fp32 scales (each
    expert's tensor padded to 16 bytes in segments and slots)."""
    group_size, per_rank = results
    hidden, inter, experts, moe_layers = 32, 48, 8, 2
    values_fp8 = 2 * inter * hidden + hidden * inter                         # 1 byte each
    scales = _padded(2 * (inter // 16) * (hidden // 16) * 4) + _padded((hidden // 16) * (inter // 16) * 4)
    local = -(-experts // group_size)
    for rank, r in enumerate(per_rank):
        fp8, bf16 = r["fp8_tables"]["memory"], r["bf16_memory"]
        assert bf16.local_expert_bytes == moe_layers * local * 2 * values_fp8, (rank, bf16)
        assert fp8.local_expert_bytes == bf16.local_expert_bytes // 2 + moe_layers * local * scales, (rank, fp8, bf16)
        buffers = 2 * (experts - local)                                      # two slots of the remote experts
        assert bf16.prefetch_buffer_bytes == buffers * 2 * values_fp8, (rank, bf16)
        assert fp8.prefetch_buffer_bytes == bf16.prefetch_buffer_bytes // 2 + buffers * scales, (rank, fp8, bf16)
        assert r["fp8_tables"]["bytes_copied"] == r["fp8_tables"]["plans"] * (experts - local) * (values_fp8 + scales), (rank, r["fp8_tables"])


def _expected_bytes_read(path: str, local: tuple[int, ...]) -> int:
    """Checkpoint bytes of every dense tensor and of the local experts' values and scales only (and
    biases: gpt-oss's move with their experts at this size, dwdp.models.expert_tensors.place_biases)."""
    weight_map = json.loads((Path(path) / "model.safetensors.index.json").read_text())["weight_map"]
    total = 0
    for key, shard in weight_map.items():
        with safe_open(str(Path(path) / shard), "pt") as f:
            t = f.get_slice(key)
            shape, dtype = t.get_shape(), t.get_dtype()
        nbytes = torch.Size(shape).numel() * {"F8_E4M3": 1, "U8": 1, "F8_E8M0": 1, "F32": 4}[dtype]
        if ".experts." not in key:
            total += nbytes
        elif ".experts." in key and key.split(".experts.")[1].split(".")[0].isdigit():
            total += nbytes if int(key.split(".experts.")[1].split(".")[0]) in local else 0   # per expert
        else:
            total += nbytes // shape[0] * len(local)                                             # stacked
    return total


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_from_pretrained_reads_only_local_experts_and_scales(results, checkpoints, name):
    group_size, per_rank = results
    for rank, r in enumerate(per_rank):
        got = r["loaded"][name]
        check_logits(f"{name} G{group_size}", got, rank)
        expected = _expected_bytes_read(checkpoints[name], got["local"])
        assert got["bytes_read"] == expected, f"{name} rank {rank}: read {got['bytes_read']} B, expected {expected} B"
    # The load report's bytes per expert, from the shapes (deepseek_v3: gate_up [96, 32] + [6, 2] fp32 scales,
    # down [32, 48] + [2, 3]; gpt-oss MXFP4: blocks [128, 1, 16] + [128, 1] exponents, [32, 2, 16] + [32, 2],
    # fp32 biases [128] and [32]; qwen3_moe per expert with e8m0 scales: [96, 32] + [6, 2], [32, 48] + [2, 3]).
    expected = {"fp8_stacked": (96 * 32 + 32 * 48 + (6 * 2 + 2 * 3) * 4, "fp8 e4m3 values + 16x16 torch.float32"),
                "fp8_per_expert": (96 * 32 + 32 * 48 + 6 * 2 + 2 * 3, "fp8 e4m3 values + 16x16 torch.float8_e8m0fnu"),
                "mxfp4": (128 * 16 + 128 + 32 * 2 * 16 + 32 * 2 + (128 + 32) * 4, "mxfp4: e2m1 values")}[name]
    got = per_rank[0]["loaded"][name]
    assert got["expert_bytes"] == expected[0] and got["experts_format"].startswith(expected[1]), (name, got, expected)
