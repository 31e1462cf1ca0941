"""DWDPModel in composite mode against the unwrapped model and against the multi-buffer path, on 2 ranks.

One process group runs every case (a spawn costs seconds):
- the multi-buffer (tables) path, selected explicitly, on a subset of families that covers every experts
  layout (concatenated, transposed, interleaved gate/up, biases, identity experts, flattened, quantized);
  the default mode (composite) runs every family in tests/test_families.py;
- composite mode on the quantized models (their experts class runs dwdp's path over the views);
- write-after-read stress: 7 MoE layers (odd, so the wrap from the last layer to layer 0 shares a slot),
  2 slots, several forwards of fresh inputs: a view read after its pool pages were refilled for another
  layer would change the logits;
- the composite prefetch moves exactly the remote experts' bytes, and local experts are the segment.
"""
import logging

import pytest
import torch

from dwdp.models.adapters import find_experts
from dwdp.models.quantization import ExpertsQuantization
from dwdp.models.tiny import build_tiny_model
from dwdp.models.tiny_quantized import build_tiny_quantized
from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.group import DWDPGroup, init_group, launch_local
from dwdp.runtime.model import DWDPModel
from dwdp.runtime.transport.host_composite import composite_unsupported_reason
from logits_check import check_logits

pytestmark = pytest.mark.skipif(composite_unsupported_reason() is not None,
                                reason=str(composite_unsupported_reason()))

# Families whose experts between them show every layout the experts path honours.
TABLES_SUBSET = ["mixtral", "gpt_oss", "llama4", "dbrx", "longcat_flash", "qwen2_moe"]
QUANTIZED = {"fp8": ("deepseek_v3", ExpertsQuantization("fp8", (16, 16)), {}),
             "mxfp4": ("gpt_oss", ExpertsQuantization("mxfp4"), dict(intermediate=64))}
QSHAPE = dict(hidden=32, intermediate=48, num_experts=8, top_k=2, num_layers=3)


def _layouts(model) -> set[str]:
    """The experts layouts a model's first MoE layer shows."""
    spec = find_experts(model)[0].spec
    math, found = spec.math, set()
    found.add("transposed" if math.transposed else "out_in")
    found.add("concatenated" if len(math.first) == 1 and "interleav" not in math.gate_label else "other_gate")
    if "interleav" in math.gate_label or "_apply_gate" in math.gate_label:
        found.add("interleaved_or_own_gate")
    if math.biases:
        found.add("biases")
    if math.num_identity_experts:
        found.add("identity")
    if any(t.rows for t in spec.tensors):
        found.add("flattened")
    if math.quantized:
        found.add("quantized")
    return found


def _logits(model, ids):
    out = model(input_ids=ids)
    return out.logits if getattr(out, "logits", None) is not None else out[0]


def _case(model, reference, ids_list, config, group) -> dict:
    with torch.no_grad():
        want = [_logits(reference, ids) for ids in ids_list]
    with DWDPModel(model, config, group) as wrapped, torch.no_grad():
        got = [_logits(wrapped, ids) for ids in ids_list]
        out = dict(kernel=wrapped.experts_kernel, plans=wrapped.stats.plans_issued, hits=wrapped.stats.slot_hits,
                   bytes_copied=wrapped.stats.bytes_copied, memory=wrapped.memory,
                   layers=len(wrapped.experts_layers))
    out.update(diff=max((g - w).abs().max().item() for g, w in zip(got, want)),
               scale=max(w.abs().max().item() for w in want))
    return out


def _rank(rank: int) -> dict:
    torch.set_num_threads(1)
    group = init_group(2)
    gen = torch.Generator().manual_seed(70 + rank)
    ids = [torch.randint(3, 128, (2, 5 + rank + i), generator=gen) for i in range(3)]
    out = {}
    for index, family in enumerate(TABLES_SUBSET):
        model = build_tiny_model(family, seed=index)
        reference = build_tiny_model(family, seed=index)
        layouts = _layouts(model)
        out[f"tables:{family}"] = _case(model, reference, ids[:2], DWDPConfig(slice_bytes=4096,
                                                                             experts_kernel="reference"), group)
        out[f"tables:{family}"]["layouts"] = layouts
    for name, (family, quant, kwargs) in QUANTIZED.items():
        for kernel in ("reference", "composite"):
            model, reference = build_tiny_quantized(family, quant, seed=13, **{**QSHAPE, **kwargs})
            layouts = _layouts(model)
            out[f"{kernel}:{name}"] = _case(model, reference, ids[:2], DWDPConfig(slice_bytes=1000,
                                                                                 experts_kernel=kernel), group)
            out[f"{kernel}:{name}"]["layouts"] = layouts
    # Write-after-read stress: 7 MoE layers, 2 slots, three forwards of different lengths.
    model = build_tiny_model("mixtral", seed=21, num_hidden_layers=7)
    reference = build_tiny_model("mixtral", seed=21, num_hidden_layers=7)
    out["war"] = _case(model, reference, ids, DWDPConfig(slice_bytes=1000, experts_kernel="composite"), group)
    # Experts not a multiple of the page (boundary pages), redundant (3 local of 8 per rank... 5 here).
    model = build_tiny_model("qwen3_moe", seed=22)
    reference = build_tiny_model("qwen3_moe", seed=22)
    out["redundant"] = _case(model, reference, ids[:1], DWDPConfig(num_local_experts=5, experts_kernel="composite"),
                             group)
    return out


@pytest.fixture(scope="module")
def results():
    return launch_local(_rank, 2, timeout_s=300)


@pytest.mark.timeout(320)
def test_tables_path_subset_matches_and_covers_every_layout(results):
    covered = set()
    for rank, out in enumerate(results):
        for name, r in out.items():
            if name.startswith("tables:") or name.startswith("reference:"):
                assert r["kernel"] == "reference", (name, r["kernel"])
                check_logits(name, r, rank)
                covered |= r["layouts"]
    want = {"transposed", "out_in", "concatenated", "interleaved_or_own_gate", "biases", "identity", "flattened",
            "quantized"}
    assert want <= covered, f"the multi-buffer subset misses layouts {sorted(want - covered)}"


@pytest.mark.timeout(320)
@pytest.mark.parametrize("name", ["fp8", "mxfp4"])
def test_quantized_experts_in_composite_mode(results, name):
    for rank, out in enumerate(results):
        r = out[f"composite:{name}"]
        assert r["kernel"] == "composite"
        check_logits(name, r, rank)
        tables = out[f"reference:{name}"]
        assert r["bytes_copied"] <= tables["bytes_copied"], "composite copies no padding: never more bytes"


@pytest.mark.timeout(320)
def test_many_layers_two_slots_no_view_read_after_refill(results):
    for rank, out in enumerate(results):
        r = out["war"]
        check_logits("war", r, rank)
        # 7 layers with slots tied to parity: layer 0 of the next forward cannot be fetched while layer 6
        # (slot 0) runs, so each forward issues all 7 plans, none already in place.
        assert (r["plans"], r["hits"]) == (3 * 7, 0), r


@pytest.mark.timeout(320)
def test_composite_moves_exactly_the_remote_experts(results):
    for rank, out in enumerate(results):
        r = out["redundant"]
        check_logits("redundant", r, rank)
        layers = r["layers"]
        per_expert = r["memory"].full_expert_bytes // (layers * 8)  # qwen3_moe: every expert tensor moves
        # One forward: every layer's plan once, each the 3 experts of 8 this rank does not own.
        assert r["bytes_copied"] == layers * 3 * per_expert, r
        assert r["memory"].local_expert_bytes >= layers * 5 * per_expert


def test_auto_falls_back_to_the_tables_path_with_one_log_line(monkeypatch, caplog):
    import dwdp.runtime.transport.host as host_module

    monkeypatch.setattr(host_module, "composite_unsupported_reason", lambda: "no MAP_FIXED here (test)")
    model = build_tiny_model("mixtral", seed=1)
    with caplog.at_level(logging.INFO, logger="dwdp"):
        with DWDPModel(model, DWDPConfig(), DWDPGroup(0, 1)) as wrapped:
            assert wrapped.experts_kernel == "reference"
    lines = [r.getMessage() for r in caplog.records if "composite views unavailable" in r.getMessage()]
    assert len(lines) == 1 and "no MAP_FIXED here (test)" in lines[0], lines
    with pytest.raises(ValueError, match="experts_kernel='composite' cannot run here: no MAP_FIXED"):
        DWDPModel(build_tiny_model("mixtral", seed=1), DWDPConfig(experts_kernel="composite"), DWDPGroup(0, 1))


@pytest.mark.timeout(200)
def test_experts_paths_bench_writes_its_table_and_json(tmp_path, capsys):
    """`dwdp bench compare --experts-paths` end to end at one size: every path checked against replicated
    inside the bench, no copy while timing, ratios that follow from the seconds in the JSON."""
    import json

    from dwdp.cli import main

    code = main(["bench", "compare", "--experts-paths", "--experts-tokens", "8", "--experts-rounds", "1",
                 "--experts-repeats", "1", "--out-dir", str(tmp_path)])
    assert code == 0
    report = json.loads((tmp_path / "experts_paths_cpu.json").read_text())
    (row,) = report["rows"]
    for path, seconds in row["seconds"].items():
        assert seconds > 0 and row["of_replicated"][path] == pytest.approx(row["seconds"]["replicated"] / seconds)
    assert report["plans_while_timed"] == {p: 0 for p in row["seconds"]}, report["plans_while_timed"]
    assert "composite/repl" in capsys.readouterr().out
