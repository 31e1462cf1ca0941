"""On a CUDA GPU (skipped without one; `pytest -m gpu` runs these alone): the compiled experts kernel
against the unwrapped model for every family the family table (docs/models.md) puts on the Triton path, a 2-rank
DWDPModel on the cuda backend (both ranks on one GPU when there is only one) against the unwrapped
model with no kernel compile after warm-up, `dwdp demo --device cuda`, and `dwdp serve --device cuda`
answering the openai client, held to the bound gpu_check and the demo use: the bf16 tolerance, or twice
transformers' own spread between its eager and grouped_mm experts paths. fp8 experts (fp32 and e8m0 scales,
both dots) and sizes with partial N and K tiles are checked on the experts' own output, at one token too."""
import sys

import pytest
import torch

from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.devices import bf16_logits_bound, transformers_spread
from dwdp.runtime.group import DWDPGroup, init_group, launch_local
from dwdp.runtime.model import DWDPModel
from dwdp.models.tiny import build_tiny_model
from procs import run

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def _triton_families() -> list[str]:
    """Families whose experts run the Triton kernel on CUDA, as the family table's generator finds them."""
    if not torch.cuda.is_available():
        return ["mixtral"]  # collected only; skipped without a GPU
    from dwdp.runtime.coverage import all_families

    return [r.family for r in all_families() if r.wraps and r.path == "Triton"]


def _logits(out) -> torch.Tensor:
    return (out.logits if getattr(out, "logits", None) is not None else out[0]).float()


def _eager_reference(model, ids):
    """(eager logits, transformers' own eager / grouped_mm spread) of the unwrapped model."""
    def logits_of(m):
        torch.manual_seed(0)
        return _logits(m(input_ids=ids))

    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    reference = logits_of(model)
    return reference, transformers_spread(model, logits_of, reference)


@pytest.mark.parametrize("family", _triton_families())
def test_compiled_kernel_matches_the_unwrapped_model(family):
    torch.manual_seed(0)
    model = build_tiny_model(family, seed=3, dtype=torch.bfloat16, initializer_range=0.02).cuda()
    ids = torch.randint(3, 128, (2, 37), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        reference, spread = _eager_reference(model, ids)
        with DWDPModel(model, DWDPConfig(experts_kernel="triton", backend="cuda"), DWDPGroup(0, 1)) as wrapped:
            wrapped.warmup(forward=False)
            torch.manual_seed(0)
            got = _logits(wrapped(input_ids=ids))
            assert wrapped.experts_kernel == "triton"
    bound = bf16_logits_bound(reference.abs().max().item(), spread)
    diff = (got - reference).abs().max().item()
    assert diff <= bound, f"{family}: max |dlogits| {diff:.3e} > {bound:.3e} (transformers' own spread {spread:.3e})"


def _two_rank(rank: int, family: str, forwards: int, kernel: str = "triton") -> dict:
    torch.cuda.set_device(rank % torch.cuda.device_count())
    group = init_group()
    model = build_tiny_model(family, seed=5, dtype=torch.bfloat16, initializer_range=0.02, hidden=256,
                             intermediate=512, num_experts=16, top_k=4).cuda()
    ids = torch.randint(3, 128, (3, 64 + 16 * rank), generator=torch.Generator().manual_seed(rank)).cuda()
    with torch.no_grad():
        reference, spread = _eager_reference(model, ids)
        # Named: under "auto" a group whose devices export cuMem handles runs composite views.
        with DWDPModel(model, DWDPConfig(backend="cuda", slice_bytes=64 << 10, experts_kernel=kernel),
                       group) as wrapped:
            wrapped.warmup()
            got = _logits(wrapped(input_ids=ids))
            gen = torch.Generator().manual_seed(100 + rank)
            for i in range(forwards):  # other batch shapes and routings: nothing may compile any more
                shape = [(1, 1), (2, 9), (4, 130), (1, 513)][i % 4]
                wrapped(input_ids=torch.randint(3, 128, shape, generator=gen).cuda())
            torch.cuda.synchronize()
            return dict(diff=(got - reference).abs().max().item(), scale=reference.abs().max().item(), spread=spread,
                        copied=wrapped.stats.bytes_copied, kernel=wrapped.experts_kernel,
                        mapping=wrapped.transport.mapping,
                        compiles=wrapped.compiles_after_warmup)


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_two_ranks_on_cuda_match_and_compile_nothing_after_warmup(family):
    for rank, r in enumerate(launch_local(_two_rank, 2, (family, 12), timeout_s=280)):
        bound = bf16_logits_bound(r["scale"], r["spread"])
        assert r["diff"] <= bound, f"{family} rank {rank}: max |dlogits| {r['diff']:.3e} > {bound:.3e} ({r})"
        assert r["kernel"] == "triton" and r["copied"] > 0, (rank, r)
        assert r["compiles"] == 0, f"{family} rank {rank}: {r['compiles']} kernel compiles after warm-up"


# name -> (experts quantization or None, experts_kernel, bound on the experts' relative error). hidden 160 and
# intermediate 96 leave partial N and K tiles (and partial scale blocks) in both GEMMs. Bounds: about twice
# what the same check measured under the CPU interpreter (TRITON_INTERPRET=1, device "cpu": 0.7% bf16, 0.8-1.5%
# dequantized fp8, whose h and outputs are rounded to bf16 and summed over k in bf16; 4-6% with fp8 x fp8
# dots, which also round tokens and h to e4m3, 2^-4 relative per value); a wrong tile or scale is O(1).
FP8_FORMS = {
    "bf16": (None, "triton", 3e-2),
    "fp8-fp32 dequantized": (("fp8", (128, 128), "float"), "triton", 3e-2),
    "fp8-fp32 dots": (("fp8", (128, 128), "float"), "triton_fp8", 1e-1),
    "fp8-e8m0 dequantized": (("fp8", (128, 128), "ue8m0"), "triton", 3e-2),
    "fp8-e8m0 dots": (("fp8", (128, 128), "ue8m0"), "triton_fp8", 1e-1),
}


def _fp32(values) -> list:
    return [v.float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for v in values]


def experts_errors(name: str, device: str, token_counts=(1, 37)) -> dict:
    """Relative error of every experts layer's output (on the input the wrapped layer saw) against the same
    layer of the dense reference model (the dequantized weights) in fp32, per token count; and the kernel
    compiles after warm-up. One rank; deepseek_v3 (fp8 checkpoints' family), hidden 160, intermediate 96.
    `device`: "cuda" (compiled kernels), or "cpu" under TRITON_INTERPRET=1 (how the bounds were checked)."""
    import copy

    from dwdp.models.adapters import find_experts
    from dwdp.models.quantization import ExpertsQuantization
    from dwdp.models.tiny_quantized import build_tiny_quantized

    quant, kernel, _ = FP8_FORMS[name]
    sizes = dict(hidden=160, intermediate=96, num_experts=8, top_k=2, initializer_range=0.02)
    if quant is None:
        model = build_tiny_model("deepseek_v3", seed=3, dtype=torch.bfloat16, **sizes)
        dense = copy.deepcopy(model)
    else:
        model, dense = build_tiny_quantized("deepseek_v3", ExpertsQuantization(*quant), seed=3, dtype=torch.bfloat16,
                                            **sizes)
    model = model.to(device)
    # fp32 copies of the dense layers: the error measured is the kernel's, not bf16 roundings of the reference
    references = [layer.module.float().to(device) for layer in find_experts(dense)]
    seen = []
    errors = {}
    with torch.no_grad(), DWDPModel(model, DWDPConfig(experts_kernel=kernel), DWDPGroup(0, 1)) as wrapped:
        assert wrapped.experts_kernel == kernel, wrapped.experts_kernel
        hooks = [layer.module.register_forward_hook(  # returns None: the layer's own output stands
            lambda module, args, kwargs, out, i=i: seen.append((i, args, kwargs, out)), with_kwargs=True)
            for i, layer in enumerate(wrapped.experts_layers)]
        wrapped.warmup(forward=False)
        for tokens in token_counts:
            seen.clear()
            wrapped(input_ids=torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(tokens))
                    .to(device))
            assert len(seen) == len(references), (tokens, len(seen))
            worst = 0.0
            for i, args, kwargs, out in seen:
                got = (out[0] if isinstance(out, tuple) else out).float()
                want = references[i](*_fp32(args), **dict(zip(kwargs, _fp32(kwargs.values()))))
                want = (want[0] if isinstance(want, tuple) else want).float()
                assert got.shape == want.shape and got.shape[0] == tokens, (tokens, got.shape, want.shape)
                worst = max(worst, ((got - want).norm() / want.norm()).item())
            errors[tokens] = worst
        for hook in hooks:
            hook.remove()
        compiles = wrapped.compiles_after_warmup
    return {"errors": errors, "compiles": compiles}


@pytest.mark.parametrize("name", list(FP8_FORMS))
def test_experts_output_of_fp8_and_partial_tile_models_at_one_and_many_tokens(name):
    """fp8 experts (fp32 and e8m0 scales; bf16-dequantized and fp8 x fp8 dots) and bf16 ones whose sizes
    leave partial N and K tiles: each experts layer's output against the dense reference layer, for a
    one-token forward and a 37-token one, and no kernel compiles after warm-up."""
    bound = FP8_FORMS[name][2]
    r = experts_errors(name, "cuda")
    for tokens, err in r["errors"].items():
        assert err < bound, f"{name}, {tokens} tokens: experts' relative error {err:.3e} >= {bound:.0e} ({r})"
    assert r["compiles"] == 0, f"{name}: {r['compiles']} kernel compiles after warm-up"


def test_demo_on_cuda():
    done = run([sys.executable, "-m", "dwdp", "demo", "--device", "cuda", "--ranks", "2", "--repeats", "2"], timeout=280)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "2/2 ranks match the unwrapped model" in done.stdout and "cuda backend" in done.stdout, done.stdout


def test_serve_on_cuda_answers_the_openai_client(tmp_path):
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    import httpx

    from dwdp.runtime.group import free_port
    from dwdp.serve.launch import ServerProcess

    args = ["--device", "cuda", "--ranks", "2", "--preset", "tiny", "--kv-dir", str(tmp_path)]
    with ServerProcess(args, free_port(), startup_timeout_s=280, log_path=str(tmp_path / "log")) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model="dwdp-tiny", prompt=[5, 6, 7, 8, 9], max_tokens=1)
        health = httpx.get(f"{server.url}/health").json()
    assert len(answer.choices) == 1 and answer.usage.prompt_tokens == 5, answer
    workers = health["workers"]
    expected = sorted(f"cuda:{r % torch.cuda.device_count()}" for r in range(2))
    assert sorted(w["device"] for w in workers) == expected, workers
    assert all(w["backend"] == "cuda" and w["dtype"] == "bfloat16" for w in workers), workers
    assert all(w["kernel_compiles_after_ready"] == 0 for w in workers), workers


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_two_ranks_on_cuda_in_composite_mode_match(family):
    """Composite views over cuMem (POSIX fds through pidfd_getfd, two ranks possibly on one GPU): the
    model's own experts implementation on the views, within the bf16 bound. Passed on one H200, 2026-11-27."""
    for rank, r in enumerate(launch_local(_two_rank, 2, (family, 4, "composite"), timeout_s=280)):
        bound = bf16_logits_bound(r["scale"], r["spread"])
        assert r["kernel"] == "composite" and r["mapping"].startswith("vmm-") and r["copied"] > 0, (rank, r)
        assert r["diff"] <= bound, f"{family} rank {rank}: max |dlogits| {r['diff']:.3e} > {bound:.3e} ({r})"
