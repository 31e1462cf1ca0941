"""The router's side of disaggregated serving, in process over a stand-in pool and a stand-in decode
server (no worker, no vLLM): one-token streams, the length fields, whole and streamed completions
behind --decode-url, API keys, and the KV ledger. The same paths against a real vLLM: tests/vllm/."""
from __future__ import annotations

import logging
import os
import time

import pytest

from dwdp.serve.kv import prompt_digest
from dwdp.serve.kv_ledger import KVLedger

from front_stubs import EOS, MODEL
from front_stubs import Decoder as _Decoder
from front_stubs import client as _client
from front_stubs import sse as _sse


# -- a prefill server (no --decode-url) ------------------------------------------------------------
@pytest.mark.timeout(30)
def test_a_one_token_stream_ends_with_done_and_carries_the_kv(tmp_path):
    r = _client(tmp_path).post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1,
                                                          "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    assert r.text.endswith("data: [DONE]\n\n"), r.text
    chunk, usage, done = _sse(r.text)
    assert chunk["choices"][0]["token_ids"] == [7] and chunk["choices"][0]["finish_reason"] == "length", chunk
    assert chunk["kv_transfer_params"]["kv_artifacts"][0]["num_tokens"] == 3, chunk
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 1, usage
    assert done == "[DONE]"


@pytest.mark.timeout(30)
def test_the_openai_client_streams_the_first_token(tmp_path):
    import openai

    client = _client(tmp_path)
    oai = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client)
    chunks = list(oai.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=1, stream=True))
    assert [c.choices[0].model_extra["token_ids"] for c in chunks] == [[7]], chunks


@pytest.mark.timeout(30)
@pytest.mark.parametrize("field, value", [("max_tokens", 2), ("max_completion_tokens", 2), ("min_tokens", 2)])
def test_a_length_field_above_one_token_is_refused_naming_it(tmp_path, field, value):
    r = _client(tmp_path).post("/v1/completions", json={"model": MODEL, "prompt": [5], field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and f"{field}={value}" in error["message"], error
    assert "--decode-url" in error["message"], error


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fields", [{"max_completion_tokens": 1}, {"min_tokens": 1}, {"ignore_eos": True},
                                    {"max_tokens": 1, "max_completion_tokens": 1}])
def test_length_fields_within_one_token_are_accepted(tmp_path, fields):
    r = _client(tmp_path).post("/v1/completions", json={"model": MODEL, "prompt": [5], **fields})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [7], r.text


# -- behind --decode-url ---------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_a_completion_is_the_first_token_then_the_decode_servers_continuation(tmp_path):
    decoder = _Decoder()
    r = _client(tmp_path, decoder).post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4,
                                                                  "ignore_eos": True, "stop": ["x"]})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == [7, 101, 102, 103] and choice["finish_reason"] == "length", choice
    assert choice["decode"] == {"prompt_tokens_loaded": 3}, choice
    assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}, r.json()
    (body,) = decoder.bodies
    assert body["prompt"] == [5, 6, 7, 7] and body["max_tokens"] == 3 and body["temperature"] == 0, body
    assert body["ignore_eos"] is True and body["stop"] == ["x"] and body["model"] == "decoder", body
    (artifact,) = body["kv_transfer_params"]["kv_artifacts"]
    assert artifact["prompt_sha256"] == prompt_digest([5, 6, 7]) and artifact["num_tokens"] == 3, artifact
    assert list(tmp_path.iterdir()) == []  # the router removed the artifact once the decode finished


@pytest.mark.timeout(30)
def test_a_decoded_stream_sends_dwdps_token_first_and_ends_with_done(tmp_path):
    r = _client(tmp_path, _Decoder()).post("/v1/completions", json={
        "model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    events = _sse(r.text)
    assert [e["choices"][0]["token_ids"] for e in events[:3]] == [[7], [101], [102]], events
    assert [e["choices"][0]["finish_reason"] for e in events[:3]] == [None, None, "length"], events
    assert events[3]["usage"]["completion_tokens"] == 3 and events[4] == "[DONE]", events


@pytest.mark.timeout(30)
def test_several_prompts_stream_side_by_side(tmp_path):
    r = _client(tmp_path, _Decoder()).post("/v1/completions", json={"model": MODEL, "prompt": [[5, 6], [8, 9, 10]],
                                                                     "max_tokens": 2, "stream": True})
    events = _sse(r.text)
    tokens = {0: [], 1: []}
    for e in events[:-1]:
        tokens[e["choices"][0]["index"]] += e["choices"][0]["token_ids"]
    assert tokens == {0: [7, 101], 1: [7, 101]} and events[-1] == "[DONE]", events


@pytest.mark.timeout(30)
def test_an_end_token_first_ends_the_choice_without_a_decode(tmp_path):
    decoder = _Decoder()
    r = _client(tmp_path, decoder, first=EOS).post("/v1/completions", json={"model": MODEL, "prompt": [5],
                                                                             "max_tokens": 5})
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == [EOS] and choice["finish_reason"] == "stop" and decoder.bodies == [], choice
    assert list(tmp_path.iterdir()) == []  # no decode reads it: dropped
    r = _client(tmp_path, decoder, first=EOS).post("/v1/completions", json={"model": MODEL, "prompt": [5],
                                                                             "max_tokens": 2, "ignore_eos": True})
    assert r.json()["choices"][0]["token_ids"] == [EOS, 101], r.json()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("decoder, says", [(_Decoder(cut=True), "ended without [DONE]"),
                                           (_Decoder(error=True), "engine died")], ids=["no_done", "error_event"])
def test_a_decode_that_breaks_off_after_the_first_token_ends_in_an_error_event(tmp_path, decoder, says):
    r = _client(tmp_path, decoder).post("/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 4,
                                                                  "stream": True})
    events = _sse(r.text)
    assert events[0]["choices"][0]["token_ids"] == [7], events
    assert says in events[-2]["error"]["message"] and events[-1] == "[DONE]", events
    r = _client(tmp_path, decoder).post("/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 4})
    assert r.status_code == 502 and says in r.json()["error"]["message"], r.text


@pytest.mark.timeout(30)
def test_a_decode_server_refusal_keeps_its_status(tmp_path):
    r = _client(tmp_path, _Decoder(status=400)).post("/v1/completions", json={"model": MODEL, "prompt": [5],
                                                                                "max_tokens": 4})
    assert r.status_code == 400 and "refused" in r.json()["error"]["message"], r.text


@pytest.mark.timeout(30)
def test_max_tokens_beyond_the_context_is_cut_to_what_the_decode_server_holds_as_vllm_does(tmp_path):
    decoder = _Decoder(max_model_len=14)
    r = _client(tmp_path, decoder).post("/v1/completions", json={"model": MODEL, "prompt": [5] * 10,
                                                                  "max_tokens": 2000})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4, r.text
    assert decoder.bodies[0]["max_tokens"] == 3 and len(decoder.bodies[0]["prompt"]) == 11, decoder.bodies
    r = _client(tmp_path, decoder).post("/v1/completions", json={"model": MODEL, "prompt": [5] * 14, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "14" in r.json()["error"]["message"] and len(decoder.bodies) == 1, r.text


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fields, status, param", [
    ({"min_tokens": 5, "max_tokens": 4}, 400, "min_tokens"),
    ({"max_tokens": 3, "max_completion_tokens": 4}, 400, "max_completion_tokens"), ({"temperature": 0.7}, 400,
                                                                                     "temperature")])
def test_decoding_refuses_lengths_beyond_the_decode_server_naming_the_field(tmp_path, fields, status, param):
    decoder = _Decoder(max_model_len=100)
    r = _client(tmp_path, decoder).post("/v1/completions", json={"model": MODEL, "prompt": [5] * 10, **fields})
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    assert decoder.bodies == []


@pytest.mark.timeout(30)
def test_max_completion_tokens_and_min_tokens_reach_the_decode_server(tmp_path):
    decoder = _Decoder()
    r = _client(tmp_path, decoder).post("/v1/completions", json={"model": MODEL, "prompt": [5], "min_tokens": 3,
                                                                  "max_completion_tokens": 5})
    assert len(r.json()["choices"][0]["token_ids"]) == 5, r.text
    assert decoder.bodies[0]["max_tokens"] == 4 and decoder.bodies[0]["min_tokens"] == 2, decoder.bodies


# -- API keys --------------------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_an_api_key_closes_v1_and_leaves_health_and_metrics_open(tmp_path):
    client = _client(tmp_path, api_key="sekret")
    body = {"model": MODEL, "prompt": [5], "max_tokens": 1}
    for headers, why in (({}, "no Authorization header"), ({"Authorization": "Bearer wrong"}, "a wrong API key"),
                         ({"Authorization": "sekret"}, "a wrong API key")):
        r = client.post("/v1/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
        error = r.json()["error"]
        assert error["code"] == 401 and error["type"] == "authentication_error" and why in error["message"], error
        assert "sekret" not in r.text
    assert client.get("/v1/models").status_code == 401
    assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert client.get("/metrics").status_code == 200
    assert client.get("/health").status_code != 401


@pytest.mark.timeout(60)
def test_a_server_bound_beyond_loopback_without_a_key_warns_at_start(tmp_path, monkeypatch, capfd):
    import tempfile

    from dwdp.cli import main
    from dwdp.serve.pool import WorkerPool

    class Stop(Exception):
        pass

    def no_workers(self):
        raise Stop()

    monkeypatch.setattr(WorkerPool, "start", no_workers)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("DWDP_API_KEY", raising=False)
    for host, key, warned in (("0.0.0.0", [], True), ("127.0.0.1", [], False), ("0.0.0.0", ["--api-key", "k"], False)):
        with pytest.raises(Stop):
            main(["serve", "--host", host, "--port", "0", *key])
        err = capfd.readouterr().err
        assert ("without an API key" in err) == warned, (host, key, err)


# -- the KV ledger ---------------------------------------------------------------------------------
@pytest.mark.timeout(10)
def test_the_ledger_counts_loaded_expired_and_dropped_artifacts(tmp_path):
    now = [0.0]
    ledger = KVLedger(ttl_s=10.0, clock=lambda: now[0])
    paths = [tmp_path / f"a{i}.safetensors" for i in range(4)]
    for p in paths:
        p.write_bytes(b"kv")
        ledger.written(str(p))
    ledger.written("/dev/null")  # not an artifact: never tracked, never removed
    paths[0].unlink()            # the decode side loaded it
    ledger.drop(str(paths[1]))   # no decode will read it
    now[0] = 5.0
    ledger.sweep()
    assert ledger.counts() == {"written": 4, "loaded": 1, "expired": 0, "dropped": 1} and ledger.pending() == 2
    now[0] = 10.5
    ledger.sweep()
    assert ledger.counts() == {"written": 4, "loaded": 1, "expired": 2, "dropped": 1} and ledger.pending() == 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.timeout(10)
def test_the_ledger_sweeps_in_its_own_thread(tmp_path):
    path = tmp_path / "a.safetensors"
    path.write_bytes(b"kv")
    ledger = KVLedger(ttl_s=0.05, interval_s=0.01).start()
    try:
        ledger.written(str(path))
        deadline = time.monotonic() + 5
        while path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not path.exists() and ledger.counts()["expired"] == 1, ledger.counts()
    finally:
        ledger.close()


@pytest.mark.timeout(10)
def test_the_router_drops_what_no_decode_read_and_counts_what_the_decode_side_removed_as_loaded(tmp_path):
    ledger = KVLedger(ttl_s=None)
    loaded, unread = tmp_path / "pf-a.safetensors", tmp_path / "pf-b.safetensors"
    for p in (loaded, unread):
        p.write_bytes(b"kv")
        ledger.written(str(p), 2, 1)
    loaded.unlink()  # the connector removed it once its KV was in the engine
    ledger.drop(str(loaded))
    ledger.drop(str(unread))
    assert ledger.counts() == {"written": 2, "loaded": 1, "expired": 0, "dropped": 1} and not unread.exists()
    ledger.drop(str(unread))  # twice: counted once
    assert ledger.counts()["dropped"] == 1 and ledger.pending() == 0 and ledger.pending_bytes() == 0


@pytest.mark.timeout(10)
def test_pending_artifacts_are_removed_at_stop(tmp_path):
    ledger = KVLedger(ttl_s=600.0).start()
    paths = [tmp_path / f"pf-{i}.safetensors" for i in range(3)]
    for p in paths:
        p.write_bytes(b"kv")
        ledger.written(str(p), 2, 1)
    paths[0].unlink()
    ledger.close(remove_pending=True)
    assert list(tmp_path.iterdir()) == [] and ledger.counts()["expired"] == 2, ledger.counts()


# -- the hand-off descriptor ----------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_descriptors_name_the_artifact_and_carry_dwdps_authenticator(tmp_path):
    from dwdp.serve.kv_handoff import ARTIFACT_NAME, authenticator

    key = b"s" * 32
    decoder = _Decoder()
    client = _client(tmp_path, kv_key=key)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 1})
    desc = r.json()["kv_transfer_params"]["kv_artifacts"][0]
    assert ARTIFACT_NAME.fullmatch(desc["name"]) and desc["path"].endswith("/" + desc["name"]), desc
    assert desc["auth"] == authenticator(key, desc["name"], prompt_digest([5, 6, 7]), MODEL, 3), desc
    client = _client(tmp_path, decoder, kv_key=key)
    client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3})
    sent = decoder.bodies[0]["kv_transfer_params"]["kv_artifacts"][0]
    assert sent["auth"] == authenticator(key, sent["name"], prompt_digest([5, 6, 7]), MODEL, 3), sent
    unsigned = _client(tmp_path).post("/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": 1})
    assert "auth" not in unsigned.json()["kv_transfer_params"]["kv_artifacts"][0]


@pytest.mark.timeout(10)
def test_the_kv_key_comes_from_the_environment_or_a_private_file(tmp_path, monkeypatch):
    from dwdp.serve.kv_handoff import KVKeyError, kv_key

    monkeypatch.delenv("DWDP_KV_KEY", raising=False)
    monkeypatch.delenv("DWDP_KV_KEY_FILE", raising=False)
    assert kv_key() is None
    monkeypatch.setenv("DWDP_KV_KEY", "x" * 32)
    assert kv_key() == b"x" * 32
    monkeypatch.setenv("DWDP_KV_KEY", "short")
    with pytest.raises(KVKeyError, match="DWDP_KV_KEY holds a key of 5 bytes; give at least 16"):
        kv_key()
    path = tmp_path / "kv.key"
    path.write_text("f" * 64 + "\n")
    os.chmod(path, 0o644)
    monkeypatch.setenv("DWDP_KV_KEY_FILE", str(path))
    with pytest.raises(KVKeyError, match="has mode 644: a key file must be a regular file only its owner can read"):
        kv_key()
    os.chmod(path, 0o600)
    assert kv_key() == b"f" * 64


# -- API keys: the environment's, exact open paths, any case of "Bearer" --------------------------
@pytest.mark.timeout(30)
def test_dwdp_api_key_in_the_environment_protects_the_server(tmp_path, monkeypatch):
    from dwdp.cli import _front_config, build_parser

    monkeypatch.setenv("DWDP_API_KEY", "from-env")
    front = _front_config(build_parser().parse_args(["serve"]))
    assert front.api_key == "from-env"
    client = _client(tmp_path, api_key=front.api_key)
    body = {"model": MODEL, "prompt": [5], "max_tokens": 1}
    assert client.post("/v1/completions", json=body).status_code == 401
    assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer from-env"}).status_code == 200
    monkeypatch.setenv("DWDP_API_KEY", "")
    assert _front_config(build_parser().parse_args(["serve"])).api_key is None


@pytest.mark.timeout(30)
def test_only_the_exact_open_paths_skip_the_key_and_bearer_is_matched_in_any_case(tmp_path):
    client = _client(tmp_path, api_key="sekret")
    for path in ("/healthz", "/health/x", "/metricsx", "/metrics/", "/health/../v1/models", "/HEALTH"):
        r = client.get(path)
        assert r.status_code == 401, (path, r.status_code, r.text)
    body = {"model": MODEL, "prompt": [5], "max_tokens": 1}
    for header in ("Bearer sekret", "bearer sekret", "BEARER sekret", "  Bearer   sekret "):
        assert client.post("/v1/completions", json=body, headers={"Authorization": header}).status_code == 200, header
    for header in ("Basic sekret", "Bearersekret", "Bearer sekret2", "sekret"):
        assert client.post("/v1/completions", json=body, headers={"Authorization": header}).status_code == 401, header


# -- bad text, internal errors ----------------------------------------------------------------------
class _Tokenizer:
    """Encodes words "w<i>" as i; raises on anything else, as a tokenizer library may."""

    def encode(self, text, add_special_tokens=True):
        if "boom" in text:
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...] at /opt/secret/path")
        return [int(w[1:]) for w in text.split()]

    def decode(self, ids, **kwargs):
        return " ".join(f"w{i}" for i in ids)


@pytest.mark.timeout(30)
def test_text_the_tokenizer_cannot_encode_is_a_400_without_internals(tmp_path):
    client = _client(tmp_path, tokenizer=_Tokenizer())
    lone = b'{"model": "%s", "prompt": "w5 \\ud800 w6", "max_tokens": 1}' % MODEL.encode()  # JSON's escape
    r = client.post("/v1/completions", content=lone, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "lone surrogate at character 3" in r.json()["error"]["message"], r.text
    r = client.post("/v1/prefill", json={"prompt": "w5 boom"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert "secret" not in r.text and "TextEncodeInput" not in r.text, r.text
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": "w5 w6", "max_tokens": 1}).status_code == 200


@pytest.mark.timeout(30)
def test_a_500_names_an_error_id_and_leaves_the_exception_to_the_log(tmp_path, caplog):
    client = _client(tmp_path)
    client.pool.fail = RuntimeError("worker detail at /opt/secret/path")
    with caplog.at_level(logging.ERROR, logger="dwdp.serve"):
        r = client.post("/v1/prefill", json={"input_ids": [5, 6]})
    assert r.status_code == 500, r.text
    message = r.json()["error"]["message"]
    assert "secret" not in r.text and "RuntimeError" not in r.text and message.startswith("internal error "), r.text
    error_id = message.split()[2].rstrip(":")
    assert any(error_id in rec.getMessage() and rec.exc_info for rec in caplog.records), caplog.records


# -- the KV budget ----------------------------------------------------------------------------------
class _FileSystem:
    """A statvfs stand-in: `free` bytes available in blocks of 4096."""

    def __init__(self, free: int):
        self.free = free

    def __call__(self, path):
        return os.statvfs_result((4096, 4096, 1 << 30, 0, self.free // 4096, 0, 0, 0, 0, 255))


@pytest.mark.timeout(30)
def test_the_kv_budget_answers_429_with_retry_after_and_recovers_once_artifacts_are_gone(tmp_path):
    from dwdp.serve.kv_budget import KVBudget

    client = _client(tmp_path, budget=KVBudget(max_pending=3))
    body = {"model": MODEL, "prompt": [[5, 6], [7, 8]], "max_tokens": 1}
    assert client.post("/v1/completions", json=body).status_code == 200       # 2 pending
    r = client.post("/v1/completions", json=body)                             # 2 more: over 3
    assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["type"] == "kv_budget_exceeded" and "--kv-max-pending" in r.text, r.text
    assert client.pool.count == 2, "a refused request reached a worker"
    assert client.post("/v1/prefill", json={"input_ids": [9]}).status_code == 200  # 3 pending
    assert client.post("/v1/prefill", json={"input_ids": [9]}).status_code == 429
    for artifact in tmp_path.glob("pf-*.safetensors"):
        artifact.unlink()  # the decode side loaded them
    client.get("/metrics")  # the ledger sweeps at each scrape here
    assert client.post("/v1/completions", json=body).status_code == 200


@pytest.mark.timeout(30)
def test_pending_bytes_and_free_space_are_kept(tmp_path):
    from dwdp.serve.kv_budget import KVBudget

    disk = _FileSystem(free=1 << 20)
    client = _client(tmp_path, budget=KVBudget(max_pending=100, max_pending_bytes=1000, min_free_bytes=4096),
                     statvfs=disk)
    assert client.post("/v1/prefill", json={"input_ids": [5] * 40}).status_code == 200  # 640 bytes: 16 a token
    r = client.post("/v1/prefill", json={"input_ids": [5] * 40})                      # 640 more: over 1000
    assert r.status_code == 429 and "--kv-max-pending-bytes" in r.text, r.text
    disk.free = 4096 + 100
    r = client.post("/v1/prefill", json={"input_ids": [5] * 10})                      # 160 of 100 spare
    assert r.status_code == 503 and r.json()["error"]["type"] == "kv_disk_full", r.text
    assert r.headers["retry-after"] == "1"
    disk.free = 1 << 20
    assert client.post("/v1/prefill", json={"input_ids": [5] * 10}).status_code == 200


@pytest.mark.timeout(30)
def test_a_request_with_more_prompts_than_allowed_is_refused_before_any_prefill(tmp_path):
    client = _client(tmp_path, max_prompts_per_request=4)
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [[5]] * 5, "max_tokens": 1})
    assert r.status_code == 400 and "prompt holds 5 prompts; this server takes at most 4" in r.text, r.text
    assert client.pool.count == 0
    assert client.post("/v1/completions", json={"model": MODEL, "prompt": [[5]] * 4, "max_tokens": 1}).status_code == 200
