"""DWDPModel.from_pretrained on the expert layouts beyond stacked gate_up / down: gpt-oss (bf16, biases,
transposed, interleaved gate/up; biases replicated or moving), Llama 4 (transposed, router score on
the input), DBRX (three flattened tensors per expert), Nemotron-H (up only, no gate).

Checkpoints are written by transformers' own save_pretrained, several shards each. On 2 ranks, each
rank built from the checkpoint must equal the same rank of the fully loaded model wrapped by
DWDPModel (every tensor, and the logits), and must have read exactly the bytes it keeps.
"""
import pytest
import torch

from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.group import init_group, launch_local
from dwdp.runtime.model import DWDPModel
from dwdp.models.tiny import build_tiny_model

# (family, dtype, expert_biases)
CASES = [
    ("gpt_oss", torch.bfloat16, "auto"),
    ("gpt_oss", torch.bfloat16, "move"),
    ("llama4", torch.float32, "auto"),
    ("dbrx", torch.float32, "auto"),
    ("nemotron_h", torch.float32, "auto"),
]
ATOL, RTOL = 1e-6, 1e-6  # same weights, same code path: only summation order may differ


def _case_id(case) -> str:
    family, dtype, biases = case
    return f"{family}-{str(dtype).removeprefix('torch.')}-biases_{biases}"


def _rank(rank: int, paths: dict) -> dict:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    group = init_group()
    ids = torch.randint(3, 128, (2, 6 + rank), generator=torch.Generator().manual_seed(400 + rank))
    out = {}
    for case in CASES:
        family, dtype, biases = case
        # The tables path, explicitly: the kept bytes are then the local experts alone (composite
        # modules hold [E, ...] views).
        config = DWDPConfig(slice_bytes=2048, expert_biases=biases, experts_kernel="reference")
        full = AutoModelForCausalLM.from_pretrained(paths[family], dtype=dtype).eval()
        with DWDPModel(full, config, group) as ref, torch.no_grad():
            reference = ref(input_ids=ids).logits
            state_ref = {k: v.clone() for k, v in ref.model.state_dict().items()}
        with DWDPModel.from_pretrained(paths[family], config=config, group=group, dtype=dtype) as got, torch.no_grad():
            logits = got(input_ids=ids).logits
            state = got.model.state_dict()
            differs = sorted(n for n in set(state) | set(state_ref)
                             if n not in state or n not in state_ref or not torch.equal(state[n], state_ref[n]))
            report = got.load_report
            out[_case_id(case)] = dict(
                diff=(logits.float() - reference.float()).abs().max().item(), scale=reference.abs().max().item(),
                differs=differs, bytes_read=report.bytes_read,
                kept_bytes=sum(t.numel() * t.element_size() for t in state.values()),
                local=report.local_expert_bytes, full=report.full_expert_bytes, biases=got.expert_biases,
                copied=got.stats.bytes_copied, labels={layer.label for layer in got.experts_layers},
            )
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    paths = {}
    for family, dtype, _ in CASES:
        if family not in paths:
            path = tmp_path_factory.mktemp(family)
            build_tiny_model(family, seed=21, dtype=dtype).save_pretrained(path, max_shard_size="150KB")
            assert len(list(path.glob("*.safetensors"))) >= 2, f"{family}: expected a sharded checkpoint"
            paths[family] = str(path)
    return launch_local(_rank, 2, (paths,), timeout_s=280)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_rank_from_checkpoint_equals_wrapped_full_model(results, case):
    family, dtype, biases = case
    for rank, per_case in enumerate(results):
        r = per_case[_case_id(case)]
        where = f"{_case_id(case)} rank {rank}/2"
        bound = ATOL + RTOL * r["scale"] if dtype == torch.float32 else 0.0
        assert r["diff"] <= bound, f"{where}: max|logits diff|={r['diff']:.3e} > {bound:.3e}"
        assert not r["differs"], f"{where}: tensors differ from the wrapped full model: {r['differs'][:5]}"
        # Dense weights (replicated biases included) and this rank's experts, nothing else.
        assert r["bytes_read"] == r["kept_bytes"], f"{where}: read {r['bytes_read']} B, keeps {r['kept_bytes']} B"
        assert r["local"] < r["full"] and r["copied"] > 0, (where, r)


@pytest.mark.timeout(300)
def test_gpt_oss_biases_replicated_or_moved_as_asked(results):
    for per_case in results:
        auto = per_case[_case_id(("gpt_oss", torch.bfloat16, "auto"))]
        moved = per_case[_case_id(("gpt_oss", torch.bfloat16, "move"))]
        assert auto["biases"] == "replicated" and moved["biases"] == "moved with experts", (auto, moved)
        # Moving biases puts them in the segment: more local expert bytes than without.
        assert moved["local"] > auto["local"], (auto["local"], moved["local"])


@pytest.mark.timeout(300)
def test_adapters_used(results):
    labels = {case_id: r["labels"] for case_id, r in results[0].items()}
    assert labels[_case_id(("llama4", torch.float32, "auto"))] == {"Llama 4 (router score on the input)"}, labels
    assert labels[_case_id(("dbrx", torch.float32, "auto"))] == {"DBRX (flattened w1 / v1 / w2)"}, labels


def test_loading_does_not_import_model():
    """dwdp.runtime.model drives dwdp.models.loading (DWDPModel.from_pretrained); never the other way round."""
    import ast
    from pathlib import Path

    import dwdp.models.loading

    tree = ast.parse(Path(dwdp.models.loading.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert not {m for m in imported if m in ("model", "dwdp.runtime.model") or m.endswith(".model")}, imported
