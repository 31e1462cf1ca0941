"""The experts path with the Triton multi-buffer kernel (interpreter on CPU), and no merge copy."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dwdp.models.adapters import find_experts
from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.experts_kernel import identify_epilogue
from dwdp.kernels import Epilogue
from dwdp.runtime.group import init_group, launch_local
from dwdp.runtime.model import DWDPModel
from dwdp.models.quantization import ExpertsQuantization
from dwdp.models.tiny import build_tiny_model
from dwdp.models.tiny_quantized import build_tiny_quantized
from releases import family_case

MERGE_OPS = ("aten.cat", "aten.stack", "aten._cat", "aten.index_select", "aten.index.Tensor", "aten.clone",
             "aten.contiguous", "aten._to_copy", "aten.copy_")


class OpLog(TorchDispatchMode):
    """Records (op name, input shapes) of every aten op run on this thread."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = [tuple(a.shape) for a in torch.utils._pytree.tree_leaves(args) if isinstance(a, torch.Tensor)]
        self.ops.append((str(func), shapes))  # e.g. "aten.index.Tensor"
        return func(*args, **(kwargs or {}))


# family -> DWDPConfig changes: plain SwiGLU, and the layouts the kernel grew (gpt-oss: biases moving
# with their expert, weights stored [in, out], interleaved clamped gate; Nemotron-H: up only, relu^2).
TRITON_CASES = {"mixtral": {}, "deepseek_v3": {}, "gpt_oss": dict(expert_biases="move"), "nemotron_h": {}}


def _rank(rank: int) -> dict:
    group = init_group()
    out = {}
    for family, changes in TRITON_CASES.items():
        model = build_tiny_model(family, seed=2)
        ids = torch.randint(3, 128, (2, 5 + rank), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            reference = model(ids).logits
        with DWDPModel(model, DWDPConfig(experts_kernel="triton", **changes), group) as wrapped, torch.no_grad():
            out[family] = ((wrapped(ids).logits - reference).abs().max().item(), wrapped.experts_kernel)
    # fp8 experts (dwdp's layout; transformers' FP8Experts with ue8m0 scales): dequantized in the K loop.
    for name, quant, fp8_class in (("fp8", ExpertsQuantization("fp8", (16, 16)), False),
                                   ("fp8_experts_ue8m0", ExpertsQuantization("fp8", (128, 128), "ue8m0"), True)):
        model, dense = build_tiny_quantized("deepseek_v3", quant, seed=2, fp8_experts_class=fp8_class)
        ids = torch.randint(3, 128, (2, 5 + rank), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            reference = dense(ids).logits
        with DWDPModel(model, DWDPConfig(experts_kernel="triton"), group) as wrapped, torch.no_grad():
            out[name] = ((wrapped(ids).logits - reference).abs().max().item(), wrapped.experts_kernel)
    # fp8 x fp8 dots (experts_kernel="triton_fp8"): tokens quantized per row and 128 columns.
    model, dense = build_tiny_quantized("deepseek_v3", ExpertsQuantization("fp8", (128, 128)), seed=2)
    with torch.no_grad():
        reference = dense(ids).logits
    with DWDPModel(model, DWDPConfig(experts_kernel="triton_fp8"), group) as wrapped, torch.no_grad():
        out["fp8_dots"] = ((wrapped(ids).logits - reference).abs().max().item(), wrapped.experts_kernel,
                           reference.abs().max().item())
    # Reference path: weights are read where they live, transposed ones through views, never copied.
    out["merge_ops"], out["num_ops"] = [], 0
    for family, changes in (("mixtral", {}), ("gpt_oss", dict(expert_biases="move"))):
        model = build_tiny_model(family, seed=4)
        experts = find_experts(model)[0].module
        weight_shapes = {s for t in (experts.gate_up_proj, experts.down_proj) for s in (t.shape[1:], t.shape[1:][::-1])}
        with DWDPModel(model, DWDPConfig(experts_kernel="reference", **changes), group) as wrapped, torch.no_grad():
            log = OpLog()
            with log:
                wrapped(torch.randint(3, 128, (2, 6)))
        out["merge_ops"] += [
            (family, op, shapes) for op, shapes in log.ops
            if op.startswith(MERGE_OPS) and any(s[-2:] in weight_shapes for s in shapes if len(s) >= 2)
        ]
        out["num_ops"] += len(log.ops)
    return out


@pytest.mark.timeout(300)
def test_triton_experts_path_equals_unwrapped_and_reference_path_merges_nothing():
    results = launch_local(_rank, 2, timeout_s=280, env={"TRITON_INTERPRET": "1"})
    for rank, r in enumerate(results):
        for family in [*TRITON_CASES, "fp8", "fp8_experts_ue8m0"]:
            diff, kernel = r[family]
            assert kernel == "triton"
            assert diff <= 1e-4, f"{family} rank {rank}: triton experts path max|diff|={diff:.3e}"
        # Quantized activations: each K tile's fp8 values are within 2^-4 of the tokens, so logits move
        # by a few percent of their largest value, yet always by something (bf16-dot fp8 matched to 1e-4).
        diff, kernel, scale = r["fp8_dots"]
        assert kernel == "triton_fp8" and 1e-4 < diff <= 5e-2 * scale, f"rank {rank}: fp8 dots {diff:.3e} of {scale:.3e}"
        assert r["num_ops"] > 100, "the op log saw nothing: the check would be vacuous"
        assert r["merge_ops"] == [], f"rank {rank}: weights were gathered or concatenated: {r['merge_ops'][:5]}"


def test_explicit_triton_on_unsupported_activation_is_an_error():
    model = build_tiny_model("mixtral", seed=1, hidden_act="gelu")
    with pytest.raises(ValueError, match=r"experts_kernel='triton' cannot run model.layers.0.mlp.experts "
                                         r"\(MixtralExperts\): its gate \(GELUActivation\(gate\) \* up\) is none "
                                         r"of the kernel's epilogues"):
        DWDPModel(model, DWDPConfig(experts_kernel="triton"), init_group())


def test_explicit_triton_on_mxfp4_is_an_error():
    model, _ = build_tiny_quantized("gpt_oss", ExpertsQuantization("mxfp4"), seed=1, intermediate=64)
    with pytest.raises(ValueError, match=r"experts_kernel='triton' cannot run model.layers.0.mlp.experts "
                                         r"\(GptOssExperts\): its weights are mxfp4 \(the kernel reads fp8 weights "
                                         r"with block scales\)"):
        DWDPModel(model, DWDPConfig(experts_kernel="triton"), init_group())


def test_bad_experts_kernel_value():
    with pytest.raises(ValueError, match="experts_kernel='cutlass'"):
        DWDPConfig(experts_kernel="cutlass")


@pytest.mark.parametrize("family,expected", [
    ("mixtral", Epilogue()),
    ("gemma4", Epilogue(activation="gelu_tanh")),
    ("nemotron_h", Epilogue(activation="relu2", gated=False)),
    ("gpt_oss", Epilogue(interleaved=True, alpha=1.702, limit=7.0, up_offset=1.0)),
    ("minimax_m3_vl", Epilogue(alpha=1.702, limit=7.0, up_offset=1.0)),
    ("deepseek_v4", Epilogue(limit=10.0)),
    family_case("inkling2", None),  # softcapped SwiGLU: reference path
])
def test_epilogue_identified_from_the_module_gate(family, expected):
    """The kernel epilogue is found by probing each family's own gate function, clamp limits included."""
    layer = find_experts(build_tiny_model(family, seed=0))[0]
    assert identify_epilogue(layer) == expected, f"{family}: {identify_epilogue(layer)} != {expected}"


def test_auto_runs_fp8_experts_with_fp8_dots_never_the_dequantizing_path():
    """On CUDA, "auto" takes the dequantizing fp8 path only if it reaches 0.9x of bf16 (it ran at 0.1x on an
    H100): fp8 experts get fp8 x fp8 dots, or the reference path where their scale blocks cannot take them;
    bf16 experts keep the triton kernel. Decided from the layers alone (no GPU needed)."""
    from dwdp.runtime.experts_kernel import choose_experts_kernel

    cuda = torch.device("cuda")
    fp8, _ = build_tiny_quantized("deepseek_v3", ExpertsQuantization("fp8", (128, 128)), seed=1)
    assert choose_experts_kernel("auto", cuda, find_experts(fp8)) == "triton_fp8"
    assert choose_experts_kernel("triton", cuda, find_experts(fp8)) == "triton"  # asked for explicitly
    odd, _ = build_tiny_quantized("deepseek_v3", ExpertsQuantization("fp8", (16, 24)), seed=1)
    assert choose_experts_kernel("auto", cuda, find_experts(odd)) == "reference"  # no K tile divides 24 columns
    dense = build_tiny_model("deepseek_v3", seed=1)
    assert choose_experts_kernel("auto", cuda, find_experts(dense)) == "triton"
    assert choose_experts_kernel("auto", torch.device("cpu"), find_experts(fp8)) == "reference"
