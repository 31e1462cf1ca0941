"""dwdp serve --decode-url in front of vLLM's CPU build with dwdp's KV connector, end to end: every
completion equals vLLM's own generation token for token, vLLM loads the prompt's KV from dwdp's
artifact (and says so), streams end with [DONE], and an artifact that does not fit is recomputed,
with the same output and one log line naming why.

vLLM alone is the same vLLM server asked without `kv_transfer_params` (prefix caching is off, so it
computes the whole prompt)."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import DWDP_MAX_NUM_TOKENS, VLLM_MODEL

NUM_TOKENS = 12


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 512) for _ in range(length)]


def vllm_alone(vllm, ids: list[int], num_tokens: int, **fields) -> dict:
    """vLLM's own greedy generation (no kv_transfer_params: it computes the whole prompt)."""
    body = {"model": VLLM_MODEL, "prompt": ids, "max_tokens": num_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **fields}
    r = httpx.post(f"{vllm.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def model_name(dwdp) -> str:
    return httpx.get(f"{dwdp.url}/v1/models", timeout=10).json()["data"][0]["id"]


def external_tokens(vllm) -> float:
    """vLLM's count of prompt tokens loaded by its KV connector (Prometheus, all requests so far)."""
    text = httpx.get(f"{vllm.url}/metrics", timeout=10).text
    found = re.search(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\} (\S+)$', text,
                      re.M)
    assert found, "vLLM's /metrics has no vllm:prompt_tokens_by_source_total{source=\"external_kv_transfer\"}"
    return float(found.group(1))


def dwdp_metric(dwdp, event: str) -> float:
    text = httpx.get(f"{dwdp.url}/metrics", timeout=10).text
    return float(re.search(rf'^dwdp_serve_kv_artifacts_total\{{event="{event}"\}} (\S+)$', text, re.M).group(1))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("length", [7, 97, 3 * DWDP_MAX_NUM_TOKENS + 5],
                         ids=["under_a_block", "several_blocks", "chunked_prefill"])
def test_a_completion_equals_vllms_own_generation(vllm_server, dwdp_server, length):
    ids = prompt(length, length)
    want = vllm_alone(vllm_server, ids, NUM_TOKENS)["choices"][0]
    loaded_before = external_tokens(vllm_server)
    r = httpx.post(f"{dwdp_server.url}/v1/completions", json={"model": model_name(dwdp_server), "prompt": ids,
                                                               "max_tokens": NUM_TOKENS, "ignore_eos": True},
                   timeout=300)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]
    assert got["token_ids"] == want["token_ids"], (got["token_ids"], want["token_ids"])
    assert got["text"] == want["text"], (got["text"], want["text"])
    # vLLM loaded the whole prompt from dwdp's artifact and computed only dwdp's first token.
    assert got["decode"] == {"prompt_tokens_loaded": length}, got
    assert external_tokens(vllm_server) - loaded_before == length
    chunks = got["timing"]["chunks"]
    assert chunks == (1 if length <= DWDP_MAX_NUM_TOKENS else 4), got["timing"]


@pytest.mark.timeout(600)
def test_the_artifact_is_removed_once_loaded_and_counted(vllm_server, dwdp_server, kv_dir):
    loaded = dwdp_metric(dwdp_server, "loaded")
    r = httpx.post(f"{dwdp_server.url}/v1/completions", json={"model": model_name(dwdp_server),
                                                               "prompt": prompt(3, 40), "max_tokens": 3}, timeout=300)
    path = r.json()["kv_transfer_params"]["kv_artifacts"][0]["path"]
    assert path.startswith(str(kv_dir)), path
    assert not Path(path).exists(), path
    assert dwdp_metric(dwdp_server, "loaded") == loaded + 1


@pytest.mark.timeout(600)
def test_a_stream_through_the_pair_starts_with_dwdps_token_and_ends_with_done(vllm_server, dwdp_server):
    import openai

    ids = prompt(11, 50)
    want = vllm_alone(vllm_server, ids, NUM_TOKENS)["choices"][0]["token_ids"]
    client = openai.OpenAI(base_url=f"{dwdp_server.url}/v1", api_key="unused", max_retries=0)
    chunks = list(client.completions.create(model=model_name(dwdp_server), prompt=ids, max_tokens=NUM_TOKENS,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    tokens = [t for c in chunks if c.choices for t in c.choices[0].model_extra["token_ids"]]
    assert tokens == want, (tokens, want)
    assert chunks[0].choices[0].model_extra["rank"] in (0, 1) and chunks[-1].usage.completion_tokens == NUM_TOKENS
    with httpx.stream("POST", f"{dwdp_server.url}/v1/completions", timeout=300,
                      json={"model": model_name(dwdp_server), "prompt": ids, "max_tokens": 4, "stream": True}) as r:
        assert r.read().decode().endswith("data: [DONE]\n\n")


# -- artifacts that must not be loaded -------------------------------------------------------------
def rewrite(path: str, change) -> None:
    """Rewrite an artifact with change(tensors, metadata) applied (both dicts, changed in place)."""
    with safe_open(path, framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    change(tensors, meta)
    save_file(tensors, path, metadata=meta)


def truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(f.seek(0, 2) - 100)


def drop_last_layer(tensors: dict, meta: dict) -> None:
    last = int(meta["num_layers"]) - 1
    del tensors[f"layers.{last}.keys"], tensors[f"layers.{last}.values"]
    meta["num_layers"] = str(last)


def to_bf16(tensors: dict, meta: dict) -> None:
    for name in tensors:
        tensors[name] = tensors[name].to(torch.bfloat16)
    meta["dtype"] = "bfloat16"


BAD = {
    "truncated": (lambda path, other: truncate(path), "is truncated"),
    "missing": (lambda path, other: __import__("os").remove(path), "is missing"),
    "another_prompts_file": (lambda path, other: __import__("os").replace(other, path), "KV of another prompt"),
    "another_model": (lambda path, other: rewrite(path, lambda t, m: m.update(model="another-model")),
                      "was made by model 'another-model'"),
    "other_layer_count": (lambda path, other: rewrite(path, drop_last_layer), "has 1 layers"),
    "other_dtype": (lambda path, other: rewrite(path, to_bf16), "dtype bfloat16"),
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", list(BAD) + ["another_prompt"])
def test_an_artifact_that_does_not_fit_is_recomputed_with_the_same_output(vllm_server, dwdp_server, kind):
    ids = prompt(21, 70)
    r = httpx.post(f"{dwdp_server.url}/v1/prefill", json={"input_ids": ids}, timeout=300).json()
    first, descriptor = r["first_token_id"], r["kv_transfer_params"]["kv_artifacts"][0]
    asked = ids + [first]
    if kind == "another_prompt":  # dwdp's artifact, sent with a prompt it was not made of
        asked, says = list(reversed(ids)) + [first], "do not start with the prompt of"
    else:
        other = httpx.post(f"{dwdp_server.url}/v1/prefill", json={"input_ids": prompt(22, 70)}, timeout=300).json()
        change, says = BAD[kind]
        change(descriptor["path"], other["kv"]["path"])
    want = vllm_alone(vllm_server, asked, 6)
    got = vllm_alone(vllm_server, asked, 6, kv_transfer_params={"kv_artifacts": [descriptor]})
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"], (got, want)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, got["usage"]
    name = descriptor["name"]
    lines = [line for line in vllm_server.output().splitlines() if "dwdp connector" in line and name in line]
    assert len(lines) == 1 and "recomputes" in lines[0] and says in lines[0], lines


@pytest.mark.timeout(600)
def test_a_fitting_artifact_sent_straight_to_vllm_is_loaded(vllm_server, dwdp_server):
    """The hand-off as any proxy makes it: dwdp's kv_transfer_params passed on to vLLM as they are."""
    ids = prompt(31, 45)
    r = httpx.post(f"{dwdp_server.url}/v1/completions", json={"model": model_name(dwdp_server), "prompt": ids,
                                                               "max_tokens": 1}, timeout=300).json()
    # --decode-url answers max_tokens=1 itself and drops the artifact: prefill it again for vLLM.
    r = httpx.post(f"{dwdp_server.url}/v1/prefill", json={"input_ids": ids}, timeout=300).json()
    params = r["kv_transfer_params"]
    got = vllm_alone(vllm_server, ids + [r["first_token_id"]], 5, kv_transfer_params=params)
    want = vllm_alone(vllm_server, ids, 6)["choices"][0]["token_ids"]
    assert [r["first_token_id"]] + got["choices"][0]["token_ids"] == want
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids), got["usage"]
    name = params["kv_artifacts"][0]["name"]
    assert got["kv_transfer_params"] == {"dwdp": {"loaded_tokens": len(ids), "artifact": name}}, got
    # vLLM's own disaggregated flow sends the prompt alone: all but its last token load.
    r = httpx.post(f"{dwdp_server.url}/v1/prefill", json={"input_ids": ids}, timeout=300).json()
    got = vllm_alone(vllm_server, ids, 6, kv_transfer_params=r["kv_transfer_params"])
    assert got["choices"][0]["token_ids"] == want and got["usage"]["prompt_tokens_details"]["cached_tokens"] == len(
        ids) - 1, json.dumps(got)


@pytest.mark.timeout(600)
def test_with_the_kv_key_a_descriptor_dwdp_did_not_sign_is_recomputed(vllm_server, dwdp_server):
    """Both servers hold the KV key (as the docs set them up): dwdp's descriptor loads; the same descriptor
    unsigned, signed with another key, or with its token count and digest changed by the client does not."""
    from dwdp.serve.kv import prompt_digest
    from dwdp.serve.kv_handoff import authenticator

    ids = prompt(41, 64)
    want = vllm_alone(vllm_server, ids, 6)
    cases = []
    for change, says in ((lambda d: d.pop("auth"), "no valid authenticator"),
                         (lambda d: d.update(auth=authenticator(b"another-key-0123456789", d["name"], d["prompt_sha256"],
                                                                "tiny-moe", d["num_tokens"])),
                          "the authenticator does not match"),
                         (lambda d: d.update(num_tokens=20, prompt_sha256=prompt_digest(ids[:20])),
                          "the authenticator does not match")):
        r = httpx.post(f"{dwdp_server.url}/v1/prefill", json={"input_ids": ids}, timeout=300).json()
        desc = r["kv_transfer_params"]["kv_artifacts"][0]
        change(desc)
        got = vllm_alone(vllm_server, ids, 6, kv_transfer_params={"kv_artifacts": [desc]})
        assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"], (says, got)
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, (says, got["usage"])
        lines = [line for line in vllm_server.output().splitlines() if "dwdp connector" in line and desc["name"] in line]
        assert len(lines) == 1 and says in lines[0], (says, lines)
        cases.append(desc["name"])
    r = httpx.post(f"{dwdp_server.url}/v1/prefill", json={"input_ids": ids}, timeout=300).json()
    got = vllm_alone(vllm_server, ids, 6, kv_transfer_params=r["kv_transfer_params"])
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == len(ids) - 1, got["usage"]
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]


@pytest.mark.timeout(600)
def test_vllm_with_the_connector_keeps_the_cores_vllm_alone_keeps(vllm_server, dwdp_server):
    """Started with dwdp.integrations.vllm_cpu_env(): vLLM's CPU build reserves one core for its scheduler
    (not two, its default with a KV connector) and the connector has no advice to give."""
    log = vllm_server.output()
    assert re.search(r"reserve_cpu_num=1\b", log), [line for line in log.splitlines() if "reserve" in line]
    assert "dwdp connector: vLLM's CPU build reserves" not in log, "the connector advised a reservation it has"
