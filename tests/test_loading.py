"""DWDPModel.from_pretrained: each rank reads only dense weights and its local experts from disk.

Checkpoints are written here in both expert layouts (stacked transformers 5 names and per-expert
names of older checkpoints, Mixtral's w1/w3/w2 included), each split over several shards with an
index, and compared rank by rank with the fully loaded model wrapped by DWDPModel.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.group import init_group, launch_local
from dwdp.models.loading import CheckpointError, write_shards
from dwdp.runtime.model import DWDPModel
from dwdp.models.tiny import FAMILIES, build_tiny_model

LAYOUTS = ("stacked", "per_expert")
ATOL, RTOL = 1e-6, 1e-6          # same weights, same code path: only summation order may differ
MIB = 1 << 20
NOISE_BYTES = 8 * MIB            # interpreter and allocator noise in an RSS delta at the load peak
# After the load, freed-but-cached heap and lazily imported code stay resident too; far below the
# non-local experts this bound exists to catch (half or more of the experts in these tests).
STEADY_NOISE_BYTES = 24 * MIB


# -- writing checkpoints ------------------------------------------------------------------------
def _per_expert_names(family: str, name: str) -> tuple[str, tuple[str, str, str]]:
    """The experts prefix and (gate, up, down) names of older checkpoints for `name` (model side)."""
    if family == "mixtral":
        return name.replace(".mlp.", ".block_sparse_moe."), ("w1", "w3", "w2")
    return name, ("gate_proj", "up_proj", "down_proj")


def _per_expert_state(family: str, model) -> dict:
    """model.state_dict() with every stacked experts tensor split into per-expert tensors."""
    out = {}
    for key, t in model.state_dict().items():
        module, _, leaf = key.rpartition(".")
        if module.endswith(".experts") and leaf in ("gate_up_proj", "down_proj"):
            prefix, (gate, up, down) = _per_expert_names(family, module)
            for e in range(t.shape[0]):
                if leaf == "gate_up_proj":
                    half = t.shape[1] // 2
                    out[f"{prefix}.{e}.{gate}.weight"] = t[e, :half].clone()  # [I, H]
                    out[f"{prefix}.{e}.{up}.weight"] = t[e, half:].clone()    # [I, H]
                else:
                    out[f"{prefix}.{e}.{down}.weight"] = t[e].clone()         # [H, I]
        elif family == "mixtral" and ".mlp.gate." in key:
            out[key.replace(".mlp.", ".block_sparse_moe.")] = t.clone()
        else:
            out[key] = t.clone()
    return out


def save_checkpoint(family: str, model, directory: Path, layout: str, num_shards: int = 3) -> Path:
    """config.json, generation_config.json and the weights of `model` in `layout`."""
    model.config.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    if layout == "stacked":
        state = {k: v.clone() for k, v in model.state_dict().items()}
    else:
        state = _per_expert_state(family, model)
    write_shards(state, directory, num_shards)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for family in FAMILIES:
        model = build_tiny_model(family, seed=11)
        for layout in LAYOUTS:
            out[(family, layout)] = str(save_checkpoint(family, model, root / f"{family}-{layout}", layout))
    return out


# -- one rank from the checkpoint equals the same rank of the fully loaded model -----------------
def _tokens(rank: int) -> dict:
    gen = torch.Generator().manual_seed(300 + rank)
    return {"input_ids": torch.randint(3, 128, (2, 7 + rank), generator=gen)}


def _rank_state(wrapped) -> dict:
    return {k: v.clone() for k, v in wrapped.model.state_dict().items()}


def _compare(state_ref: dict, state: dict) -> list:
    """Names whose tensor differs (or exists on one side only); local expert views included."""
    names = set(state_ref) | set(state)
    return sorted(n for n in names if n not in state or n not in state_ref or not torch.equal(state_ref[n], state[n]))


def _rank_from_pretrained(rank: int, group, checkpoints: dict) -> dict:
    from transformers import AutoModelForCausalLM

    # The tables path, explicitly: the rank's state (what it keeps) is then its local experts alone; in
    # composite mode the modules hold [E, ...] views (tests/test_quantized.py loads in that mode).
    config = DWDPConfig(slice_bytes=2048, experts_kernel="reference")
    inputs = _tokens(rank)
    out = {}
    cases = [(f, torch.float32) for f in FAMILIES] + [("deepseek_v3", torch.bfloat16)]
    for family, dtype in cases:
        full = AutoModelForCausalLM.from_pretrained(checkpoints[(family, "per_expert")], dtype=dtype).eval()
        with DWDPModel(full, config, group) as ref, torch.no_grad():
            reference = ref(**inputs).logits
            state_ref = _rank_state(ref)
        for layout in LAYOUTS:
            path = checkpoints[(family, layout)]
            with DWDPModel.from_pretrained(path, config=config, group=group, dtype=dtype) as got, torch.no_grad():
                logits = got(**inputs).logits
                report = got.load_report
                state = _rank_state(got)
                on_meta = [n for n, t in got.model.state_dict().items() if t.is_meta]
            out[(family, str(dtype), layout)] = {
                "diff": (logits - reference).abs().max().item(), "scale": reference.abs().max().item(),
                "state_differs": _compare(state_ref, state), "on_meta": on_meta,
                "bytes_read": report.bytes_read, "state_numel": sum(t.numel() for t in state.values()),
                "local_expert_bytes": report.local_expert_bytes, "full_expert_bytes": report.full_expert_bytes,
                "rank": report.rank, "group_size": report.group_size,
            }
    return out


def _rank_memory(path: str, group) -> dict:
    """Load the big checkpoint first thing in a fresh process; the load report's RSS figures."""
    with DWDPModel.from_pretrained(path, group=group) as model:
        r = model.load_report
    return {"layout": Path(path).name, **{k: getattr(r, k) for k in (
        "load_peak_bytes", "steady_bytes", "dense_bytes", "local_expert_bytes", "full_expert_bytes",
        "largest_shard_bytes", "peak_is_load_only")}}


def _rank_worker(rank: int, group_size: int, checkpoints: dict, memory_path: str | None) -> dict:
    group = init_group(group_size)
    memory = _rank_memory(memory_path, group) if memory_path else None
    return {"memory": memory, "cases": _rank_from_pretrained(rank, group, checkpoints)}


# Experts dominate: 4 MoE layers of 32 experts of 3 * 256 * 512 fp32 = 192 MiB of experts, ~3 MiB dense,
# in 4 shards of about one layer each (real checkpoints: a shard is larger than a rank's share of a layer).
BIG = dict(hidden=256, intermediate=512, num_experts=32, top_k=2, num_layers=4, vocab=256)
MEMORY_LAYOUT = {2: "stacked", 3: "per_expert"}  # which checkpoint each fresh group measures
GROUP_SIZES = (1, 2, 3)


@pytest.fixture(scope="module")
def launches(checkpoints, tmp_path_factory) -> dict:
    """{group size: per-rank results}, one local launch per group size."""
    root = tmp_path_factory.mktemp("big")
    model = build_tiny_model("qwen3_moe", seed=1, **BIG)
    big = {layout: str(save_checkpoint("qwen3_moe", model, root / layout, layout, num_shards=4)) for layout in LAYOUTS}
    del model
    out = {}
    for g in GROUP_SIZES:
        memory_path = big[MEMORY_LAYOUT[g]] if g in MEMORY_LAYOUT else None
        with pytest.MonkeyPatch.context() as env:
            if memory_path:  # spawned: a rank forked from the preloaded forkserver (conftest) would count
                env.delenv("DWDP_FORKSERVER_PRELOAD", raising=False)  # its writes to inherited pages as load
            out[g] = launch_local(_rank_worker, g, (g, checkpoints, memory_path), timeout_s=200)
    return out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("group_size", GROUP_SIZES, ids=lambda g: f"G{g}")
def test_rank_equals_wrapped_full_model(launches, group_size):
    for rank, result in enumerate(launches[group_size]):
        per_case = result["cases"]
        assert len(per_case) == 2 * (len(FAMILIES) + 1)
        for (family, dtype, layout), r in per_case.items():
            where = f"{family} {dtype} {layout} rank {rank}/{group_size}"
            bound = ATOL + RTOL * r["scale"] if dtype == "torch.float32" else 0.0
            assert r["diff"] <= bound, f"{where}: max|logits diff|={r['diff']:.3e} > {bound:.3e}"
            differs = r["state_differs"]
            assert not differs, f"{where}: tensors differ from the wrapped full model: {differs[:5]}"
            assert not r["on_meta"], f"{where}: left on meta: {r['on_meta'][:5]}"
            assert (r["rank"], r["group_size"]) == (rank, group_size), (where, r["rank"], r["group_size"])
            # Only dense weights and local experts were read: exactly the (fp32) checkpoint bytes of the
            # rank's state dict.
            expected = 4 * r["state_numel"]
            assert r["bytes_read"] == expected, f"{where}: read {r['bytes_read']} B, keeps {expected} B"
            if group_size > 1:
                assert r["local_expert_bytes"] < r["full_expert_bytes"], (where, r)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("group_size", sorted(MEMORY_LAYOUT), ids=lambda g: f"G{g}-{MEMORY_LAYOUT[g]}")
def test_load_peak_memory_is_dense_plus_local_experts(launches, group_size):
    for rank, result in enumerate(launches[group_size]):
        r = result["memory"]
        if not r["peak_is_load_only"]:
            pytest.skip("/proc/self/clear_refs is not writable here: VmHWM cannot be reset for the load")
        where = f"rank {rank}/{group_size} ({r['layout']})"
        bound = r["dense_bytes"] + r["local_expert_bytes"] + r["largest_shard_bytes"] + NOISE_BYTES
        # The bound must be far below what a rank holding every expert would need.
        assert bound < r["dense_bytes"] + r["full_expert_bytes"] - 32 * MIB, (where, r)
        assert r["load_peak_bytes"] <= bound, (
            f"{where}: load peak {r['load_peak_bytes'] / MIB:.1f} MiB > dense + local + shard + noise "
            f"{bound / MIB:.1f} MiB ({r})"
        )
        # The measurement sees the local experts at all (a broken RSS reading would pass the bound).
        assert r["steady_bytes"] >= 0.9 * r["local_expert_bytes"], (where, r)
        assert r["steady_bytes"] <= r["dense_bytes"] + r["local_expert_bytes"] + STEADY_NOISE_BYTES, (where, r)
        assert STEADY_NOISE_BYTES < r["full_expert_bytes"] - r["local_expert_bytes"], (where, r)


# -- other checkpoints in one process (one-rank group) -------------------------------------------
def _logits_equal_unwrapped(model, path, **kwargs):
    ids = _tokens(0)["input_ids"]
    with torch.no_grad():
        reference = model(input_ids=ids).logits
    with DWDPModel.from_pretrained(path, **kwargs) as got, torch.no_grad():
        logits = got(input_ids=ids).logits
        return got, (logits - reference).abs().max().item(), reference.abs().max().item()


def test_save_pretrained_checkpoint(tmp_path):
    """What transformers itself writes (its own per-expert names, its own sharding) loads as is."""
    model = build_tiny_model("mixtral", seed=2)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) >= 2
    _, diff, scale = _logits_equal_unwrapped(model, tmp_path)
    assert diff <= 1e-5 + 1e-5 * scale, f"max|diff|={diff:.3e} (scale {scale:.3e})"


def test_tied_embeddings_and_single_file(tmp_path):
    """A model that ties lm_head to the embeddings, saved as one model.safetensors without an index."""
    model = build_tiny_model("qwen3_moe", seed=4, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    assert not (tmp_path / "model.safetensors.index.json").exists()
    got, diff, scale = _logits_equal_unwrapped(model, tmp_path)
    inner = got.model
    assert inner.lm_head.weight is inner.model.embed_tokens.weight, "lm_head is not tied to the embeddings"
    assert diff <= 1e-5 + 1e-5 * scale, f"max|diff|={diff:.3e} (scale {scale:.3e})"


def test_rotary_buffers_recomputed(checkpoints):
    """inv_freq is not in checkpoints: it must be computed from the config, as a normal load does."""
    from transformers import AutoModelForCausalLM

    path = checkpoints[("qwen2_moe", "stacked")]
    normal = AutoModelForCausalLM.from_pretrained(checkpoints[("qwen2_moe", "per_expert")])
    with DWDPModel.from_pretrained(path) as got:
        buffers = dict(got.model.named_buffers())
        for name, expected in normal.named_buffers():
            assert torch.equal(buffers[name], expected), f"{name}: {buffers[name][:4]} != {expected[:4]}"


# -- errors name the file and the tensor ----------------------------------------------------------
@pytest.fixture
def small(tmp_path, checkpoints):
    """A private copy of the tiny qwen3_moe checkpoints (stacked, per_expert) to break."""
    return {layout: Path(shutil.copytree(checkpoints[("qwen3_moe", layout)], tmp_path / layout)) for layout in LAYOUTS}


def _index(path: Path) -> dict:
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]


def _rewrite_shard(path: Path, key: str, change) -> str:
    """Apply change(dict of the shard holding `key`) and write it back; returns the shard name."""
    weight_map = _index(path)
    shard = weight_map[key]
    tensors = load_file(str(path / shard))
    change(tensors)
    save_file(tensors, str(path / shard), metadata={"format": "pt"})
    return shard


def test_missing_shard(small):
    path = small["stacked"]
    weight_map = _index(path)
    shard = weight_map["model.embed_tokens.weight"]
    (path / shard).unlink()
    with pytest.raises(CheckpointError, match=rf"{shard} is missing.*'model.embed_tokens.weight'"):
        DWDPModel.from_pretrained(path)


def test_missing_tensor(small):
    path = small["stacked"]
    key = "model.layers.1.post_attention_layernorm.weight"
    _rewrite_shard(path, key, lambda t: t.pop(key))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"][key]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"model.safetensors.index.json: tensors \['{key}'\]"):
        DWDPModel.from_pretrained(path)


def test_missing_expert_piece(small):
    path = small["per_expert"]
    key = "model.layers.2.mlp.experts.5.up_proj.weight"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"][key]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model.layers.2.mlp.experts.gate_up_proj of expert 5 is missing"):
        DWDPModel.from_pretrained(path)


def test_shape_mismatch_with_config(small):
    path = small["stacked"]
    config = json.loads((path / "config.json").read_text())
    config["moe_intermediate_size"] = 40
    (path / "config.json").write_text(json.dumps(config))
    shard = _index(path)["model.layers.0.mlp.experts.gate_up_proj"]
    with pytest.raises(
        CheckpointError,
        match=rf"{shard}: tensor 'model.layers.0.mlp.experts.gate_up_proj' has shape \[8, 96, 32\], "
        r"the model config expects \[8, 80, 32\]",
    ):
        DWDPModel.from_pretrained(path)


def test_expert_index_outside_model(small):
    path = small["per_expert"]
    config = json.loads((path / "config.json").read_text())
    config["num_local_experts"] = 6  # transformers 5 saves qwen3_moe's num_experts under this name
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.\d.mlp.experts.[67].\w+.weight' is expert [67], "
                                              r"outside the model's 6 experts"):
        DWDPModel.from_pretrained(path)


def test_dtype_that_cannot_be_cast(small):
    path = small["stacked"]
    key = "model.norm.weight"
    shard = _rewrite_shard(path, key, lambda t: t.update({key: t[key].to(torch.int32)}))
    with pytest.raises(CheckpointError, match=rf"{shard}: tensor '{key}' is torch.int32 and cannot be cast"):
        DWDPModel.from_pretrained(path)
    with pytest.raises(ValueError, match=r"dtype=torch.int8 must be a floating"):
        DWDPModel.from_pretrained(small["per_expert"], dtype=torch.int8)


def test_tensor_with_no_place_in_model(small):
    path = small["stacked"]
    key = "model.layers.0.mlp.experts.gate_up_proj"
    shard = _rewrite_shard(path, key, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.ones(3)}))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = shard
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"'model.layers.0.mlp.extra.weight'\] \(in {shard}\)"):
        DWDPModel.from_pretrained(path)
