"""The decode side's checks of a dwdp KV artifact (dwdp.integrations.kv_transfer), without vLLM: an
artifact is loaded only when it is of this prompt, this model, layer count, head shape and dtype, and
whole; every other case names its reason (vLLM then recomputes the prompt: tests/vllm/check_pair.py).
Hostile descriptors, files and races: tests/test_kv_hostile.py."""
from __future__ import annotations

import os
import struct
import hashlib
import uuid

import pytest
import torch

from dwdp.integrations.kv_transfer import EngineKV, FileTransfer, Refused
from dwdp.serve.kv import artifact_metadata, prompt_digest, read_kv_artifact, write_kv_artifact
from dwdp.serve.kv_handoff import handoff_descriptor

ENGINE = EngineKV(model="tiny-moe", num_layers=2, num_kv_heads=2, key_dim=32, value_dim=32, dtype="float32")
PROMPT = [5, 17, 9, 300, 42, 7, 8]


@pytest.fixture
def kv_dir(tmp_path):
    path = tmp_path / "kv"
    path.mkdir(mode=0o700)
    return path


def artifact(kv_dir, ids=PROMPT, name="tiny-moe", layers=2, heads=2, dim=32, dtype=torch.float32,
             key: bytes | None = None) -> dict:
    """An honest artifact of `ids` in `kv_dir` and its hand-off descriptor (signed with `key` if given)."""
    gen = torch.Generator().manual_seed(len(ids) + layers + heads + dim)
    kv = [(torch.randn(1, heads, len(ids), dim, generator=gen).to(dtype),
           torch.randn(1, heads, len(ids), dim, generator=gen).to(dtype)) for _ in range(layers)]
    request_id = f"pf-{uuid.uuid4().hex}"
    desc = write_kv_artifact(kv_dir, request_id, kv, artifact_metadata(0, name, 11, (len(ids),), "packed", ids))
    return handoff_descriptor(request_id, desc, name, key)


def params(*descriptors) -> dict:
    return {"kv_artifacts": list(descriptors)}


@pytest.mark.timeout(10)
def test_a_fitting_artifact_is_named_by_its_prompt_and_read_layer_by_layer(kv_dir):
    desc = artifact(kv_dir)
    assert desc["prompt_sha256"] == prompt_digest(PROMPT) == prompt_digest(torch.tensor(PROMPT))
    transfer = FileTransfer(str(kv_dir))
    ref = transfer.check(params(desc), PROMPT + [11], ENGINE)  # the prompt and dwdp's first token
    assert (ref.name, ref.num_tokens) == (desc["name"], len(PROMPT))
    written, _ = read_kv_artifact(desc["path"])
    reader = transfer.open(ref)
    for layer, (keys, values) in enumerate(written):
        got_keys, got_values = reader.layer(layer)
        assert torch.equal(got_keys, keys) and torch.equal(got_values, values), layer  # bit-exact, read with pread
    reader.close()
    assert transfer.release(ref) and not os.path.exists(desc["path"])
    assert not transfer.release(ref)  # gone already: fine


@pytest.mark.timeout(10)
def test_a_request_without_dwdp_artifacts_is_not_ours(kv_dir):
    transfer = FileTransfer(str(kv_dir))
    for p in (None, {}, {"do_remote_prefill": True}, {"kv_artifacts": []}, [1, 2], "kv_artifacts"):
        assert transfer.check(p, PROMPT, ENGINE) is None, p


@pytest.mark.timeout(10)
def test_the_prompt_digest_is_fixed_width_ids_and_pinned():
    """Ids joined without a separator would collide ([1, 23, 4] and [12, 3, 4] both "1234"); fixed-width
    ids never do. The encoding is pinned: a tag, the count (8 bytes) and each id (4 bytes), little-endian."""
    assert prompt_digest([1, 23, 4]) != prompt_digest([12, 3, 4])
    assert prompt_digest([1, 23, 4]) != prompt_digest([1, 23, 4, 0])
    assert prompt_digest([]) != prompt_digest([0])
    want = hashlib.sha256(b"dwdp-prompt-ids-u32le-v1" + struct.pack("<Q", 3) + struct.pack("<3I", 1, 23, 4)).hexdigest()
    assert prompt_digest([1, 23, 4]) == want
    with pytest.raises(ValueError, match="token id -1 is outside"):
        prompt_digest([5, -1])


def _cases(kv_dir):
    """name -> (descriptor, prompt asked, engine, the reason's words)"""
    desc = artifact(kv_dir)
    other = artifact(kv_dir, ids=[1, 2, 3, 4, 5, 6, 7])
    swapped = artifact(kv_dir)
    os.replace(other["path"], swapped["path"])  # this prompt's descriptor, another prompt's file under its name
    cut = artifact(kv_dir)
    with open(cut["path"], "r+b") as f:
        f.truncate(f.seek(0, 2) - 8)
    gone = artifact(kv_dir)
    os.remove(gone["path"])
    request_id = f"pf-{uuid.uuid4().hex}"
    no_digest = handoff_descriptor(request_id, write_kv_artifact(
        kv_dir, request_id, [(torch.randn(1, 2, 7, 32), torch.randn(1, 2, 7, 32)) for _ in range(2)],
        artifact_metadata(0, "tiny-moe", 11, (7,), "packed")), "tiny-moe", None)
    return {
        "another_prompt": (desc, list(reversed(PROMPT)), ENGINE, "do not start with the prompt of"),
        "longer_than_the_prompt": (desc, PROMPT[:-1], ENGINE, r"num_tokens=7: expected an int in \[1, 6\]"),
        "another_prompts_file": (swapped, PROMPT, ENGINE, "KV of another prompt"),
        "truncated": (cut, PROMPT, ENGINE, "is truncated"),
        "missing": (gone, PROMPT, ENGINE, "is missing"),
        "another_model": (desc, PROMPT, EngineKV(**{**ENGINE.__dict__, "model": "other"}), "made by model 'tiny-moe'"),
        "layer_count": (artifact(kv_dir, layers=3), PROMPT, ENGINE, "has 3 layers"),
        "heads": (artifact(kv_dir, heads=4), PROMPT, ENGINE, r"is \[1, 4, 7, 32\]"),
        "head_dim": (artifact(kv_dir, dim=64), PROMPT, ENGINE, r"is \[1, 2, 7, 64\]"),
        "dtype": (artifact(kv_dir, dtype=torch.bfloat16), PROMPT, ENGINE, "dtype bfloat16"),
        "no_digest_recorded": (dict(no_digest, prompt_sha256=prompt_digest(PROMPT)), PROMPT, ENGINE,
                               "KV of another prompt"),
        "descriptor_without_digest": ({"name": desc["name"], "num_tokens": 7}, PROMPT, ENGINE,
                                      "prompt_sha256=None is not 64 lowercase hex digits"),
    }


CASES = ["another_prompt", "longer_than_the_prompt", "another_prompts_file", "truncated", "missing", "another_model",
         "layer_count", "heads", "head_dim", "dtype", "no_digest_recorded", "descriptor_without_digest"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("case", CASES)
def test_an_artifact_that_does_not_fit_is_refused_naming_why(kv_dir, case):
    desc, prompt, engine, says = _cases(kv_dir)[case]
    with pytest.raises(Refused, match=says):
        FileTransfer(str(kv_dir)).check(params(desc), prompt, engine)


@pytest.mark.timeout(10)
def test_an_artifacts_file_is_mode_0600_whatever_the_umask_and_the_safetensors_release(kv_dir, monkeypatch):
    """safetensors 0.8 writes through a temporary file of its own (0600); older releases, and its open pull
    request, create the file with the umask's mode: an artifact is 0600 either way."""
    from safetensors.torch import save

    import dwdp.serve.kv as kv

    def save_with_the_umask(tensors, path, metadata=None):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        with os.fdopen(fd, "wb") as f:
            f.write(save(tensors, metadata=metadata))

    old = os.umask(0o000)
    try:
        plain = artifact(kv_dir)
        monkeypatch.setattr(kv, "save_file", save_with_the_umask)
        umasked = artifact(kv_dir)
    finally:
        os.umask(old)
    for desc in (plain, umasked):
        assert oct(os.stat(desc["path"]).st_mode & 0o777) == oct(0o600), desc["path"]


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


def mla_artifact(kv_dir, mla_cache) -> tuple[dict, list]:
    layers, latent = mla_cache
    meta = artifact_metadata(0, "tiny-mla", 11, (len(PROMPT),), "packed", PROMPT, latent)
    request_id = f"pf-{uuid.uuid4().hex}"
    return handoff_descriptor(request_id, write_kv_artifact(kv_dir, request_id, layers, meta), "tiny-mla", None), layers


@pytest.mark.timeout(60)
def test_an_mla_cache_is_written_as_its_latent_and_read_back_as_transformers_holds_it(kv_dir, mla_cache):
    desc, layers = mla_artifact(kv_dir, mla_cache)
    assert desc["format"] == "dwdp-kv-mla-v1", desc
    assert [(t["kind"], t["shape"]) for t in desc["tensors"][:2]] == [("latent", [1, 7, 32]), ("rope", [1, 7, 16])]
    got, meta = read_kv_artifact(desc["path"])
    assert meta["rope_layout"] == "interleaved" and meta["cache_rope"] == "halves" and meta["kv_lora_rank"] == "32"
    for (k, v), (rk, rv) in zip(got, layers):
        assert torch.equal(k, rk) and torch.equal(v, rv)
    ref = FileTransfer(str(kv_dir)).check(params(desc), PROMPT + [11], MLA_ENGINE)
    latent, rope = FileTransfer(str(kv_dir)).open(ref).layer(0)
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
def test_formats_and_engines_must_agree_on_mla(kv_dir, mla_cache):
    mla, _ = mla_artifact(kv_dir, mla_cache)
    plain = artifact(kv_dir)
    with pytest.raises(Refused, match="holds an MLA latent"):
        FileTransfer(str(kv_dir)).check(params(mla), PROMPT, EngineKV(**{**MLA_ENGINE.__dict__, "latent_dim": None,
                                                              "rope_dim": None, "model": None}))
    with pytest.raises(Refused, match="this engine runs MLA and caches the latent"):
        FileTransfer(str(kv_dir)).check(params(plain), PROMPT, EngineKV(**{**MLA_ENGINE.__dict__, "model": None}))
    with pytest.raises(Refused, match=r"layers.0.latent is \[1, 7, 32\], this engine caches \[1, 7, 512\]"):
        FileTransfer(str(kv_dir)).check(params(mla), PROMPT, EngineKV(**{**MLA_ENGINE.__dict__, "latent_dim": 512}))
