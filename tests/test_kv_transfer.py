"""The decode side's checks of a dwdp KV artifact (dwdp.integrations.kv_transfer), without vLLM: an
artifact is loaded only when it is of this prompt, this model, layer count, head shape and dtype, and
whole; every other case names its reason (vLLM then recomputes the prompt: tests/vllm/check_pair.py)."""
from __future__ import annotations

import os

import pytest
import torch

from dwdp.integrations.kv_transfer import EngineKV, FileTransfer, Refused, check_header, pick_artifact
from dwdp.serve.kv import artifact_metadata, prompt_digest, read_kv_header, write_kv_artifact

ENGINE = EngineKV(model="tiny-moe", num_layers=2, num_kv_heads=2, key_dim=32, value_dim=32, dtype="float32")
PROMPT = [5, 17, 9, 300, 42, 7, 8]


def artifact(tmp_path, ids=PROMPT, name="tiny-moe", layers=2, heads=2, dim=32, dtype=torch.float32,
             request_id="pf-1") -> dict:
    gen = torch.Generator().manual_seed(len(ids))
    kv = [(torch.randn(1, heads, len(ids), dim, generator=gen).to(dtype),
           torch.randn(1, heads, len(ids), dim, generator=gen).to(dtype)) for _ in range(layers)]
    return write_kv_artifact(tmp_path, request_id, kv, artifact_metadata(0, name, 11, (len(ids),), "packed", ids))


def params(*descriptors) -> dict:
    return {"kv_artifacts": list(descriptors)}


@pytest.mark.timeout(10)
def test_a_fitting_artifact_is_named_by_its_prompt_and_read_layer_by_layer(tmp_path):
    desc = artifact(tmp_path)
    assert desc["prompt_sha256"] == prompt_digest(PROMPT) == prompt_digest(torch.tensor(PROMPT))
    transfer = FileTransfer()
    ref = transfer.check(params(desc), PROMPT + [11], ENGINE)  # the prompt and dwdp's first token
    assert (ref.path, ref.num_tokens) == (desc["path"], len(PROMPT))
    reader = transfer.open(ref)
    keys, values = reader.layer(1)
    assert keys.shape == values.shape == (1, 2, len(PROMPT), 32)
    reader.close()
    transfer.release(ref)
    assert not os.path.exists(desc["path"])
    transfer.release(ref)  # gone already: fine


@pytest.mark.timeout(10)
def test_the_artifact_of_this_prompt_is_picked_among_several(tmp_path):
    other = artifact(tmp_path, ids=[9, 9, 9], request_id="pf-0")
    mine = artifact(tmp_path)
    assert pick_artifact([other, mine], PROMPT).path == mine["path"]


@pytest.mark.timeout(10)
def test_a_request_without_dwdp_artifacts_is_not_ours():
    transfer = FileTransfer()
    for p in (None, {}, {"do_remote_prefill": True}, {"kv_artifacts": []}, {"kv_artifacts": "x"}):
        assert transfer.check(p, PROMPT, ENGINE) is None, p


def _cases(tmp_path):
    """name -> (descriptor, prompt asked, engine, the reason's words)"""
    desc = artifact(tmp_path)
    other = artifact(tmp_path, ids=[1, 2, 3, 4, 5, 6, 7], request_id="pf-2")
    swapped = dict(desc, path=other["path"])  # this prompt's descriptor, another prompt's file
    cut = artifact(tmp_path, request_id="pf-3")
    with open(cut["path"], "r+b") as f:
        f.truncate(f.seek(0, 2) - 8)
    gone = artifact(tmp_path, request_id="pf-4")
    os.remove(gone["path"])
    no_digest = write_kv_artifact(tmp_path, "pf-5", [(torch.zeros(1, 2, 7, 32), torch.zeros(1, 2, 7, 32))
                                                     for _ in range(2)],
                                  artifact_metadata(0, "tiny-moe", 11, (7,), "packed"))
    return {
        "another_prompt": (desc, list(reversed(PROMPT)), ENGINE, "do not start with the prompt of"),
        "longer_than_the_prompt": (desc, PROMPT[:-1], ENGINE, "do not start with the prompt of"),
        "another_prompts_file": (swapped, PROMPT, ENGINE, "KV of another prompt"),
        "truncated": (cut, PROMPT, ENGINE, "is truncated"),
        "missing": (gone, PROMPT, ENGINE, "is missing"),
        "another_model": (desc, PROMPT, EngineKV(**{**ENGINE.__dict__, "model": "other"}), "made by model 'tiny-moe'"),
        "layer_count": (artifact(tmp_path, layers=3, request_id="pf-6"), PROMPT, ENGINE, "has 3 layers"),
        "heads": (artifact(tmp_path, heads=4, request_id="pf-7"), PROMPT, ENGINE, "is [1, 4, 7, 32]"),
        "head_dim": (artifact(tmp_path, dim=64, request_id="pf-8"), PROMPT, ENGINE, "is [1, 2, 7, 64]"),
        "dtype": (artifact(tmp_path, dtype=torch.bfloat16, request_id="pf-9"), PROMPT, ENGINE, "dtype bfloat16"),
        "no_digest_recorded": (dict(no_digest, prompt_sha256=prompt_digest(PROMPT)), PROMPT, ENGINE,
                               "KV of another prompt"),
        "descriptor_without_digest": ({"path": desc["path"], "num_tokens": 7}, PROMPT, ENGINE,
                                      "without path, num_tokens and prompt_sha256"),
    }


CASES = ["another_prompt", "longer_than_the_prompt", "another_prompts_file", "truncated", "missing", "another_model",
         "layer_count", "heads", "head_dim", "dtype", "no_digest_recorded", "descriptor_without_digest"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("case", CASES)
def test_an_artifact_that_does_not_fit_is_refused_naming_why(tmp_path, case):
    desc, prompt, engine, says = _cases(tmp_path)[case]
    with pytest.raises(Refused, match=says.replace("[", r"\[").replace("]", r"\]")):
        FileTransfer().check(params(desc), prompt, engine)


@pytest.mark.timeout(10)
def test_a_header_promises_the_file_size(tmp_path):
    desc = artifact(tmp_path)
    meta, tensors, size = read_kv_header(desc["path"])
    assert size == os.path.getsize(desc["path"]) and meta["prompt_sha256"] == desc["prompt_sha256"]
    assert tensors["layers.0.keys"]["shape"] == [1, 2, 7, 32]
    check_header(pick_artifact([desc], PROMPT), ENGINE)


# -- MLA: the latent, as vLLM and SGLang cache it --------------------------------------------------
MLA_ENGINE = EngineKV(model="tiny-mla", num_layers=2, num_kv_heads=1, key_dim=24, value_dim=24,
                      dtype="float32", latent_dim=32, rope_dim=16)


@pytest.fixture(scope="module")
def mla_cache():
    """A tiny DeepSeek-V3's own cache of PROMPT (transformers caches MLA's latent: 32 + 16 per token per
    layer here), and its latent layout."""
    from dwdp.models.tiny import build_tiny_model
    from dwdp.serve.kv import latent_layout

    model = build_tiny_model("deepseek_v3", seed=0, hidden=64, intermediate=64, num_experts=4, top_k=2, num_layers=2,
                             vocab=512)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([PROMPT]), use_cache=True)
    return [(layer.keys.clone(), layer.values.clone()) for layer in out.past_key_values.layers], \
        latent_layout(model.config)


def mla_artifact(tmp_path, mla_cache, request_id="pf-mla") -> tuple[dict, list]:
    layers, latent = mla_cache
    meta = artifact_metadata(0, "tiny-mla", 11, (len(PROMPT),), "packed", PROMPT, latent)
    return write_kv_artifact(tmp_path, request_id, layers, meta), layers


@pytest.mark.timeout(60)
def test_an_mla_cache_is_written_as_its_latent_and_read_back_as_transformers_holds_it(tmp_path, mla_cache):
    from dwdp.serve.kv import read_kv_artifact

    desc, layers = mla_artifact(tmp_path, mla_cache)
    assert desc["format"] == "dwdp-kv-mla-v1", desc
    assert [(t["kind"], t["shape"]) for t in desc["tensors"][:2]] == [("latent", [1, 7, 32]), ("rope", [1, 7, 16])]
    got, meta = read_kv_artifact(desc["path"])
    assert meta["rope_layout"] == "interleaved" and meta["cache_rope"] == "halves" and meta["kv_lora_rank"] == "32"
    for (k, v), (rk, rv) in zip(got, layers):
        assert torch.equal(k, rk) and torch.equal(v, rv)
    ref = FileTransfer().check(params(desc), PROMPT + [11], MLA_ENGINE)
    latent, rope = FileTransfer().open(ref).layer(0)
    assert latent.shape == (1, 7, 32) and rope.shape == (1, 7, 16)


@pytest.mark.timeout(10)
def test_the_rope_dims_are_stored_as_interleaved_pairs():
    """transformers ropes DeepSeek's interleaved pairs and caches them as two halves; the artifact holds
    the pairs as vLLM's GPT-J-style rope computes them: x[2i], x[2i+1] rotated by angle i."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    from dwdp.serve.kv import halve_pairs, interleave_halves

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 1, 5, 8, generator=gen)                                     # [B, 1, T, P]
    angle = torch.rand(1, 5, 4, generator=gen) * 6                                 # [B, T, P / 2]
    cos, sin = torch.cat([angle.cos()] * 2, dim=-1), torch.cat([angle.sin()] * 2, dim=-1)
    _, halves = apply_rotary_pos_emb_interleave(x, x, cos, sin)
    pairs = torch.empty_like(x)
    pairs[..., 0::2] = x[..., 0::2] * angle.cos()[:, None] - x[..., 1::2] * angle.sin()[:, None]
    pairs[..., 1::2] = x[..., 1::2] * angle.cos()[:, None] + x[..., 0::2] * angle.sin()[:, None]
    torch.testing.assert_close(interleave_halves(halves), pairs, atol=1e-6, rtol=1e-6)
    assert torch.equal(halve_pairs(interleave_halves(halves)), halves)


@pytest.mark.timeout(60)
def test_formats_and_engines_must_agree_on_mla(tmp_path, mla_cache):
    mla, _ = mla_artifact(tmp_path, mla_cache)
    plain = artifact(tmp_path)
    with pytest.raises(Refused, match="holds an MLA latent"):
        FileTransfer().check(params(mla), PROMPT, EngineKV(**{**MLA_ENGINE.__dict__, "latent_dim": None,
                                                              "rope_dim": None, "model": None}))
    with pytest.raises(Refused, match="this engine runs MLA and caches the latent"):
        FileTransfer().check(params(plain), PROMPT, EngineKV(**{**MLA_ENGINE.__dict__, "model": None}))
    with pytest.raises(Refused, match=r"layers.0.latent is \[1, 7, 32\], this engine caches \[1, 7, 512\]"):
        FileTransfer().check(params(mla), PROMPT, EngineKV(**{**MLA_ENGINE.__dict__, "latent_dim": 512}))
