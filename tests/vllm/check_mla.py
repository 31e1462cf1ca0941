"""MLA (a tiny DeepSeek-V3) through the pair: dwdp writes the latent (`dwdp-kv-mla-v1`: kv_a_layernorm's
output and the roped shared key, rope dims in interleaved pairs), vLLM's CPU MLA backend loads every
prompt token of it into its latent cache with its own cache write and decodes on; an artifact of
per-head keys and values (`dwdp-kv-v1`) is refused by the MLA engine.

Not checked here: that the tokens equal vLLM's own generation. On these tiny random DeepSeek-V3
models vLLM's CPU build and transformers already disagree with no connector involved (the first
token, computed by each from the whole prompt, differs on most prompts), so equality would test the
two model implementations, not the hand-off. test_vllm_and_transformers_disagree_without_dwdp keeps
that fact visible: when it starts to fail, the two agree and equality belongs here."""
from __future__ import annotations

import httpx
import pytest
from safetensors import safe_open
from safetensors.torch import save_file

from check_pair import NUM_TOKENS, model_name, prompt, vllm_alone
from conftest import DWDP_MAX_NUM_TOKENS


@pytest.mark.timeout(900)
@pytest.mark.parametrize("length", [7, 40, DWDP_MAX_NUM_TOKENS + 30], ids=["under_a_block", "several_blocks",
                                                                          "chunked_prefill"])
def test_an_mla_prompt_is_loaded_from_dwdps_latent(mla_vllm_server, mla_dwdp_server, length):
    ids = prompt(100 + length, length)
    r = httpx.post(f"{mla_dwdp_server.url}/v1/completions", json={
        "model": model_name(mla_dwdp_server), "prompt": ids, "max_tokens": NUM_TOKENS, "ignore_eos": True},
        timeout=300)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]
    assert r.json()["kv_transfer_params"]["kv_artifacts"][0]["format"] == "dwdp-kv-mla-v1", r.json()
    assert len(got["token_ids"]) == NUM_TOKENS and got["finish_reason"] == "length", got
    assert got["decode"] == {"prompt_tokens_loaded": length}, got


@pytest.mark.timeout(900)
def test_per_head_keys_and_values_are_refused_by_an_mla_engine(mla_vllm_server, mla_dwdp_server):
    ids = prompt(5, 30)
    r = httpx.post(f"{mla_dwdp_server.url}/v1/prefill", json={"input_ids": ids}, timeout=300).json()
    path = r["kv"]["path"]
    with safe_open(path, framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {name.replace(".latent", ".keys").replace(".rope", ".values"): f.get_tensor(name).unsqueeze(1)
                   for name in f.keys()}
    meta["format"] = "dwdp-kv-v1"
    save_file(tensors, path, metadata=meta)
    want = vllm_alone(mla_vllm_server, ids + [r["first_token_id"]], 4)
    got = vllm_alone(mla_vllm_server, ids + [r["first_token_id"]], 4,
                     kv_transfer_params=r["kv_transfer_params"])
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, got["usage"]
    name = path.rsplit("/", 1)[-1]
    lines = [line for line in mla_vllm_server.output().splitlines() if "dwdp connector" in line and name in line]
    assert len(lines) == 1 and "this engine runs MLA and caches the latent" in lines[0], lines


@pytest.mark.timeout(900)
def test_vllm_and_transformers_disagree_without_dwdp(mla_vllm_server, mla_dwdp_server):
    """dwdp's first token is transformers' greedy token; vLLM alone computes its own from the prompt."""
    firsts = []
    for seed in range(3):
        ids = prompt(300 + seed, 40)
        dwdp = httpx.post(f"{mla_dwdp_server.url}/v1/prefill", json={"input_ids": ids}, timeout=300).json()
        firsts.append((dwdp["first_token_id"], vllm_alone(mla_vllm_server, ids, 1)["choices"][0]["token_ids"][0]))
    assert any(a != b for a, b in firsts), f"transformers and vLLM agree on {firsts}: check token equality instead"
