"""The pair's answers follow vLLM's front end, router side, in process (a stand-in pool and decode server,
the tiny checkpoint's real tokenizer): stop strings across dwdp's first token, special tokens, min_tokens
on the first token, vLLM's disaggregated-prefill convention, the chat endpoint, model names, and the
fields that would change an answer refused by name. The same cases against vLLM alone: tests/vllm."""
from __future__ import annotations

from pathlib import Path

import pytest

from front_stubs import DECODED, EOS, MODEL, Decoder, client, sse, tiny_tokenizer

UNK, BOS = 3, 1


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _post(c, body: dict, path: str = "/v1/completions", **kwargs):
    return c.post(path, json={"model": MODEL, **body}, **kwargs)


def _streamed(r) -> tuple[str, list, list]:
    """(the text of every chunk joined, every chunk's token ids joined, the chunks) of a completions stream."""
    events = sse(r.text)
    assert events[-1] == "[DONE]", events
    chunks = [e for e in events[:-1] if e["choices"]]
    text = "".join(c["choices"][0].get("text", c["choices"][0].get("delta", {}).get("content", "")) for c in chunks)
    return text, [t for c in chunks for t in c["choices"][0]["token_ids"]], chunks


# -- stop strings --------------------------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_in_dwdps_first_token_stops_before_any_decode(tmp_path, tokenizer, stream):
    decoder = Decoder()
    c = client(tmp_path, decoder, tokenizer=tokenizer)
    r = _post(c, {"prompt": [5, 6], "max_tokens": 6, "stop": ["w7"], "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        text, ids, chunks = _streamed(r)
        finish, reason = chunks[-1]["choices"][0]["finish_reason"], chunks[-1]["choices"][0]["stop_reason"]
    else:
        choice = r.json()["choices"][0]
        text, ids, finish, reason = choice["text"], choice["token_ids"], choice["finish_reason"], choice["stop_reason"]
    assert (text, ids, finish, reason) == (" ", [7], "stop", "w7"), r.text
    assert decoder.bodies == [], "a choice that stopped at dwdp's token still asked the decode server"
    assert not list(Path(tmp_path).glob("*.safetensors")), "the artifact no decode reads was kept"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_spanning_dwdps_token_and_the_decoded_ones_ends_the_choice(tmp_path, tokenizer, stream):
    c = client(tmp_path, Decoder(), tokenizer=tokenizer)
    r = _post(c, {"prompt": [5, 6], "max_tokens": 6, "stop": ["w7 w101 w102"], "stream": stream})
    if stream:
        text, ids, chunks = _streamed(r)
        assert all("w7" not in ch["choices"][0]["text"] for ch in chunks), chunks  # held back, never sent
        finish = chunks[-1]["choices"][0]["finish_reason"]
    else:
        choice = r.json()["choices"][0]
        text, ids, finish = choice["text"], choice["token_ids"], choice["finish_reason"]
    assert (text, ids, finish) == (" ", [7, 101, 102], "stop"), r.text


@pytest.mark.timeout(30)
def test_include_stop_str_in_output_keeps_the_stop_string_and_min_tokens_delays_the_match(tmp_path, tokenizer):
    c = client(tmp_path, Decoder(), tokenizer=tokenizer)
    r = _post(c, {"prompt": [5], "max_tokens": 6, "stop": ["w7 w101"], "include_stop_str_in_output": True})
    assert (r.json()["choices"][0]["text"], r.json()["choices"][0]["token_ids"]) == (" w7 w101", [7, 101]), r.text
    # A stop string matches only in text after min_tokens tokens: "w7" is the first token's, so it never does.
    r = _post(c, {"prompt": [5], "max_tokens": 4, "stop": ["w7"], "min_tokens": 1})
    assert r.json()["choices"][0]["token_ids"] == [7, 101, 102, 103], r.text
    assert r.json()["choices"][0]["text"] == " w7 w101 w102 w103", r.text


# -- special and end tokens ----------------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("skip, text", [(None, " w101 w102"), (True, " w101 w102"), (False, " [UNK] w101 w102")])
def test_a_special_first_token_is_skipped_in_the_text_unless_asked(tmp_path, tokenizer, skip, text):
    decoder = Decoder()
    c = client(tmp_path, decoder, first=UNK, tokenizer=tokenizer)
    fields = {} if skip is None else {"skip_special_tokens": skip}
    r = _post(c, {"prompt": [5], "max_tokens": 3, **fields})
    assert r.json()["choices"][0]["text"] == text and r.json()["choices"][0]["token_ids"] == [UNK, 101, 102], r.text
    if skip is not None:
        assert decoder.bodies[0]["skip_special_tokens"] is skip, decoder.bodies  # the decode engine's text alike


@pytest.mark.timeout(30)
def test_an_end_token_first_is_counted_and_left_out_of_the_text(tmp_path, tokenizer):
    c = client(tmp_path, Decoder(), first=EOS, tokenizer=tokenizer)
    choice = _post(c, {"prompt": [5], "max_tokens": 3}).json()["choices"][0]
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == ("", [EOS], "stop"), choice
    choice = _post(c, {"prompt": [5], "max_tokens": 3, "skip_special_tokens": False}).json()["choices"][0]
    assert choice["text"] == "", choice  # the stop token's text is left out whatever the special-token rule
    choice = _post(c, {"prompt": [5], "max_tokens": 3, "include_stop_str_in_output": True,
                       "skip_special_tokens": False}).json()["choices"][0]
    assert choice["text"] == " [EOS]", choice


@pytest.mark.timeout(30)
@pytest.mark.parametrize("fields, banned", [
    ({}, ()), ({"min_tokens": 0}, ()), ({"min_tokens": 1}, (EOS,)), ({"min_tokens": 3, "stop_token_ids": [9, 7]},
                                                                      (EOS, 7, 9)),
    ({"min_tokens": 2, "ignore_eos": True, "stop_token_ids": [9]}, (9,)),
])
def test_min_tokens_keeps_end_and_stop_tokens_from_being_the_first_token(tmp_path, fields, banned):
    c = client(tmp_path, Decoder())
    r = _post(c, {"prompt": [5], "max_tokens": 4, **fields})
    assert r.status_code == 200 and c.pool.banned == [banned], (r.text, c.pool.banned)
    if 7 in banned:  # the stand-in pool then answers the next best token, as the worker's argmax would
        assert r.json()["choices"][0]["token_ids"][0] != 7, r.text


# -- vLLM's disaggregated prefill ----------------------------------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": [5, 6, 7]}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w9"}]})])
def test_do_remote_decode_is_answered_as_vllms_prefill_instance_would(tmp_path, tokenizer, path, body):
    decoder = Decoder()
    c = client(tmp_path, decoder, tokenizer=tokenizer)
    params = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}
    r = _post(c, {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": params}, path,
              headers={"X-Request-Id": "proxy-req-42"})
    assert r.status_code == 200 and decoder.bodies == [], (r.text, decoder.bodies)
    answer = r.json()
    assert len(answer["choices"][0]["token_ids"]) == 1 and answer["choices"][0]["finish_reason"] == "length", answer
    descriptor, = answer["kv_transfer_params"]["kv_artifacts"]
    assert descriptor["client_request_id"] == "proxy-req-42", descriptor
    assert (Path(tmp_path) / descriptor["name"]).exists(), "the artifact the decode instance will load is gone"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", ["../../etc/passwd", "x" * 200, "a b", "id\u00e9"])
def test_an_x_request_id_that_is_not_a_short_plain_id_is_ignored(tmp_path, value):
    c = client(tmp_path)
    r = _post(c, {"prompt": [5], "max_tokens": 1}, headers={"X-Request-Id": value.encode("utf-8")})
    assert r.status_code == 200 and "client_request_id" not in r.json()["kv_transfer_params"]["kv_artifacts"][0], r.text


@pytest.mark.timeout(30)
def test_other_client_kv_transfer_params_are_ignored(tmp_path):
    decoder = Decoder()
    c = client(tmp_path, decoder)
    r = _post(c, {"prompt": [5], "max_tokens": 3, "kv_transfer_params": {"do_remote_decode": "yes",
                                                                            "kv_artifacts": [{"path": "/etc/passwd"}]}})
    assert r.status_code == 200 and len(decoder.bodies) == 1, r.text
    sent, = decoder.bodies[0]["kv_transfer_params"]["kv_artifacts"]
    assert "/etc/passwd" not in str(sent) and sent["num_tokens"] == 1, sent


# -- chat ----------------------------------------------------------------------------------------
TWO_TURNS = [{"role": "user", "content": "w100 w200"}, {"role": "assistant", "content": "w300"},
             {"role": "user", "content": [{"type": "text", "text": "w9"}, {"type": "text", "text": "w10"}]}]


@pytest.mark.timeout(30)
def test_a_chat_is_the_chat_templates_prompt_answered_in_the_chat_shape(tmp_path, tokenizer):
    decoder = Decoder()
    c = client(tmp_path, decoder, tokenizer=tokenizer)
    r = _post(c, {"messages": TWO_TURNS, "max_tokens": 3}, "/v1/chat/completions")
    assert r.status_code == 200, r.text
    answer = r.json()
    template = [BOS, 5, 100, 200, 7, 6, 300, 7, 5, 9, 10, 7, 6]  # text parts joined by a newline: two words
    assert decoder.bodies[0]["prompt"] == template + [7], decoder.bodies
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-"), answer
    choice = answer["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": " w7 w101 w102"} and "text" not in choice, choice
    assert answer["usage"] == {"prompt_tokens": len(template), "completion_tokens": 3,
                               "total_tokens": len(template) + 3}, answer


@pytest.mark.timeout(30)
def test_a_streamed_chat_sends_the_role_first_then_content_deltas(tmp_path, tokenizer):
    c = client(tmp_path, Decoder(), tokenizer=tokenizer)
    r = _post(c, {"messages": TWO_TURNS, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
              "/v1/chat/completions")
    events = sse(r.text)
    chunks = [e for e in events[:-1] if e["choices"]]
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1]), events
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant", chunks[0]
    assert all("role" not in ch["choices"][0]["delta"] for ch in chunks[1:]), chunks
    assert "".join(ch["choices"][0]["delta"]["content"] for ch in chunks) == " w7 w101 w102", chunks
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and events[-2]["usage"]["completion_tokens"] == 3


@pytest.mark.timeout(30)
def test_chat_without_decoding_answers_one_token(tmp_path, tokenizer):
    r = _post(client(tmp_path, tokenizer=tokenizer), {"messages": TWO_TURNS[:1], "max_tokens": 1},
              "/v1/chat/completions")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == " w7", r.text


class _NoTemplate:
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [int(w[1:]) for w in text.split()]


class _RaisingTemplate(_NoTemplate):
    chat_template = "{{ raise_exception('roles must alternate') }}"

    def apply_chat_template(self, messages, **kwargs):
        raise ValueError("TemplateError at /opt/secret/chat_template.jinja: roles must alternate")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tokenizer_kind, messages, says", [
    ("none", [{"role": "user", "content": "w9"}], "no chat template"),
    ("real", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}],
     "takes text parts only"),
    ("raising", [{"role": "user", "content": "w9"}], "cannot be rendered"),
    ("real", [], "messages"),
])
def test_a_chat_the_server_cannot_render_is_a_400_naming_messages(tmp_path, tokenizer, tokenizer_kind, messages, says):
    kinds = {"real": tokenizer, "none": _NoTemplate(), "raising": _RaisingTemplate()}
    c = client(tmp_path, Decoder(), tokenizer=kinds[tokenizer_kind])
    r = _post(c, {"messages": messages, "max_tokens": 3}, "/v1/chat/completions")
    assert r.status_code == 400 and says in r.json()["error"]["message"] and "secret" not in r.text, r.text
    assert r.json()["error"]["param"].startswith("messages"), r.text


# -- fields that would change the answer, and model names -----------------------------------------
@pytest.mark.timeout(30)
@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "response_format", {"type": "json_object"}), ("/v1/completions", "guided_regex", "w1+"),
    ("/v1/completions", "allowed_token_ids", [5]), ("/v1/completions", "suffix", "w9"),
    ("/v1/completions", "add_special_tokens", False), ("/v1/completions", "skip_special_tokens", "false"),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/chat/completions", "chat_template", "{{ messages }}"), ("/v1/chat/completions", "top_logprobs", 2),
    ("/v1/chat/completions", "continue_final_message", True), ("/v1/chat/completions", "logprobs", True),
])
def test_a_field_that_would_change_the_answer_is_refused_naming_it(tmp_path, tokenizer, path, field, value):
    decoder = Decoder()
    c = client(tmp_path, decoder, tokenizer=tokenizer)
    body = {"prompt": [5]} if path == "/v1/completions" else {"messages": TWO_TURNS[:1]}
    r = _post(c, {**body, "max_tokens": 3, field: value}, path)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert decoder.bodies == [] and c.pool.count == 0, "a refused request was prefilled or decoded"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "response_format", {"type": "text"}), ("/v1/completions", "add_special_tokens", True),
    ("/v1/chat/completions", "tool_choice", "none"), ("/v1/chat/completions", "tools", []),
    ("/v1/chat/completions", "add_special_tokens", False), ("/v1/chat/completions", "logprobs", False),
])
def test_the_value_that_changes_nothing_is_accepted(tmp_path, tokenizer, path, field, value):
    body = {"prompt": [5]} if path == "/v1/completions" else {"messages": TWO_TURNS[:1]}
    r = _post(client(tmp_path, Decoder(), tokenizer=tokenizer), {**body, "max_tokens": 3, field: value}, path)
    assert r.status_code == 200, r.text


@pytest.mark.timeout(30)
def test_the_served_model_name_and_the_decode_engines_name_are_both_accepted(tmp_path):
    c = client(tmp_path, Decoder(), served_model_name="mixtral-pair")
    for name in (MODEL, "mixtral-pair", "decoder"):  # "decoder": the stand-in decode server's name
        r = c.post("/v1/completions", json={"model": name, "prompt": [5], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == name, r.text
    r = c.post("/v1/completions", json={"model": "gpt-4", "prompt": [5], "max_tokens": 2})
    assert r.status_code == 404 and "'mixtral-pair'" in r.json()["error"]["message"], r.text
    assert [m["id"] for m in c.get("/v1/models").json()["data"]] == [MODEL, "mixtral-pair"]
    assert DECODED[0] == 101  # the stand-in's continuation the other tests read


@pytest.mark.timeout(30)
@pytest.mark.parametrize("value", [[-1], [512], [2**40], "2", [True], list(range(1025))])
def test_stop_token_ids_outside_the_vocabulary_are_refused_naming_the_field(tmp_path, value):
    c = client(tmp_path, Decoder())
    r = _post(c, {"prompt": [5], "max_tokens": 3, "min_tokens": 1, "stop_token_ids": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids", r.text
    assert "[0, 512)" in r.json()["error"]["message"] and len(r.text) < 1000 and c.pool.count == 0, r.text


def test_the_greedy_first_token_passes_over_banned_ones_and_ignores_ids_outside_the_logits():
    import torch

    from dwdp.serve.protocol import greedy_first

    logits = torch.randn(64, generator=torch.Generator().manual_seed(3))
    order = logits.argsort(descending=True).tolist()
    assert greedy_first(logits) == order[0]
    assert greedy_first(logits, (order[0], order[1])) == order[2]
    assert greedy_first(logits, (-64 + order[0], 64 + order[0])) == order[0]  # a negative id must not wrap
    assert logits.argmax().item() == order[0], "the caller's logits were changed"
