"""The pair answers as vLLM alone does off the plain path, whole and streamed: a stop string that is (or
starts in) dwdp's first token, a special token first, an end token first under min_tokens, max_tokens past
max_model_len, a two-turn chat; vLLM's own disaggregated flow through a proxy written from its protocol
(tests/vllm/pd_proxy.py) with dwdp serve as the prefill pool; and OutputText against vLLM's detokenizer.

vLLM alone is the pair's own vLLM server asked directly (prefix caching off: it computes every prompt)."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from conftest import MAX_MODEL_LEN, ROOT, VLLM_MODEL, free_port

SPECIAL = {0: "[PAD]", 1: "[BOS]", 3: "[UNK]"}
EOS = 2
TWO_TURNS = [{"role": "system", "content": "w40 w41"}, {"role": "user", "content": "w100 w200 w300"},
             {"role": "assistant", "content": "w17 w18"}, {"role": "user", "content": "w9 w10 w11"}]


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 512) for _ in range(length)]


def ask(server, path: str, body: dict, stream: bool, model: str = VLLM_MODEL) -> dict:
    """A completion (or chat) answer reduced to what must agree: token ids, text, finish and stop reasons, and
    the usage (streams ask for it). A refusal: its status."""
    body = {"model": model, "temperature": 0, "return_token_ids": True, **body, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = httpx.post(f"{server.url}{path}", json=body, timeout=600)
    if r.status_code != 200:
        return {"status": r.status_code}
    chat = path.endswith("chat/completions")
    if not stream:
        answer = r.json()
        choice = answer["choices"][0]
        return {"token_ids": choice["token_ids"], "text": choice["message"]["content"] if chat else choice["text"],
                "finish_reason": choice["finish_reason"], "stop_reason": choice.get("stop_reason"),
                "usage": answer["usage"]}
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", r.text[-500:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    text = "".join((c["delta"].get("content") or "") if chat else c["text"] for c in choices)
    finishes = [c for c in choices if c["finish_reason"] is not None]
    return {"token_ids": [t for c in choices for t in (c.get("token_ids") or [])], "text": text,
            "finish_reason": finishes[-1]["finish_reason"], "stop_reason": finishes[-1].get("stop_reason"),
            "usage": chunks[-1]["usage"]}


def same(pair: dict, alone: dict) -> None:
    """Everything agrees but the usage's details (the pair loads the prompt, vLLM alone computes it)."""
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    strip = lambda a: {**a, "usage": {k: v for k, v in a.get("usage", {}).items() if k in counts}}
    assert strip(pair) == strip(alone), (pair, alone)


def first_tokens(vllm, prompts: list[list[int]]) -> list[int]:
    r = httpx.post(f"{vllm.url}/v1/completions", json={"model": VLLM_MODEL, "prompt": prompts, "max_tokens": 1,
                                                        "temperature": 0, "ignore_eos": True,
                                                        "return_token_ids": True}, timeout=600)
    assert r.status_code == 200, r.text
    return [c["token_ids"][0] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


@pytest.fixture(scope="module")
def special_first(vllm_server) -> dict[int, list[int]]:
    """Prompts whose greedy first token is each special token (found among seeded random prompts)."""
    found: dict[int, list[int]] = {}
    for start in range(0, 3000, 300):
        prompts = [prompt(seed, random.Random(-seed).randrange(3, 40)) for seed in range(start, start + 300)]
        for ids, first in zip(prompts, first_tokens(vllm_server, prompts)):
            if first in SPECIAL:
                found.setdefault(first, ids)
        if len(found) >= 2:
            return found
    pytest.fail(f"no prompt among 3000 has a special first token but {found}")


PATHS = [("/v1/completions", False), ("/v1/completions", True)]
IDS = ["whole", "streamed"]


# -- stop strings, special and end tokens, min_tokens, max_model_len -------------------------------
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path, stream", PATHS, ids=IDS)
def test_a_stop_string_that_is_or_starts_in_dwdps_first_token(vllm_server, dwdp_server, path, stream):
    ids = prompt(350, 24)
    head = ask(vllm_server, path, {"prompt": ids, "max_tokens": 3, "ignore_eos": True}, False)["text"]
    words = head.split()
    for stop in (words[0], " ".join(words[:2]), [words[1], words[0][:2]], words[0][1:]):
        body = {"prompt": ids, "max_tokens": 6, "stop": stop}
        same(ask(dwdp_server, path, body, stream), ask(vllm_server, path, body, stream))
        body["include_stop_str_in_output"] = True
        same(ask(dwdp_server, path, body, stream), ask(vllm_server, path, body, stream))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path, stream", PATHS, ids=IDS)
def test_a_special_first_token(vllm_server, dwdp_server, special_first, path, stream):
    for token, ids in special_first.items():
        for flags in ({}, {"skip_special_tokens": False}, {"skip_special_tokens": False,
                                                           "spaces_between_special_tokens": False}):
            body = {"prompt": ids, "max_tokens": 5, **flags}
            pair, alone = ask(dwdp_server, path, body, stream), ask(vllm_server, path, body, stream)
            assert pair["token_ids"][0] == token, pair
            same(pair, alone)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path, stream", PATHS, ids=IDS)
def test_an_end_token_first_with_and_without_min_tokens(vllm_server, dwdp_server, path, stream):
    ids = prompt(77, 30)
    first = first_tokens(vllm_server, [ids])[0]
    for fields in ({"stop_token_ids": [first]}, {"stop_token_ids": [first], "min_tokens": 3},
                   {"stop_token_ids": [first], "min_tokens": 1, "stop": ["w"]},
                   {"stop_token_ids": [first], "include_stop_str_in_output": True}):
        body = {"prompt": ids, "max_tokens": 6, **fields}
        pair, alone = ask(dwdp_server, path, body, stream), ask(vllm_server, path, body, stream)
        same(pair, alone)
        assert (pair["token_ids"][0] == first) == ("min_tokens" not in fields), pair


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path, stream", PATHS, ids=IDS)
def test_max_tokens_past_max_model_len_is_cut_as_vllm_cuts_it(vllm_server, dwdp_server, path, stream):
    ids = prompt(5, MAX_MODEL_LEN - 4)
    body = {"prompt": ids, "max_tokens": 50, "ignore_eos": True}
    pair, alone = ask(dwdp_server, path, body, stream), ask(vllm_server, path, body, stream)
    same(pair, alone)
    assert len(pair["token_ids"]) == 4 and pair["finish_reason"] == "length", pair
    too_long = {"prompt": prompt(6, MAX_MODEL_LEN), "max_tokens": 5}
    assert ask(dwdp_server, path, too_long, stream) == ask(vllm_server, path, too_long, stream) == {"status": 400}


@pytest.mark.timeout(600)
def test_the_decode_engines_model_name_is_accepted(vllm_server, dwdp_server):
    body = {"prompt": prompt(8, 20), "max_tokens": 4}
    same(ask(dwdp_server, "/v1/completions", body, False, model=VLLM_MODEL),
         ask(vllm_server, "/v1/completions", body, False))


# -- chat ----------------------------------------------------------------------------------------
@pytest.mark.timeout(600)
@pytest.mark.parametrize("stream", [False, True], ids=IDS)
def test_a_two_turn_chat_equals_vllms_chat_answer(vllm_server, dwdp_server, stream):
    for fields in ({"max_tokens": 8}, {"max_completion_tokens": 5, "ignore_eos": True}, {"max_tokens": 6,
                                                                                          "stop": ["w"]}):
        body = {"messages": TWO_TURNS, **fields}
        same(ask(dwdp_server, "/v1/chat/completions", body, stream), ask(vllm_server, "/v1/chat/completions", body,
                                                                          stream))


# -- vLLM's disaggregated flow through a proxy -----------------------------------------------------
@pytest.fixture(scope="module")
def proxy(dwdp_server, vllm_server, tmp_path_factory):
    from dwdp.serve.launch import HttpServerProcess

    port = free_port()
    server = HttpServerProcess([sys.executable, str(Path(__file__).parent / "pd_proxy.py"), "--prefill",
                                dwdp_server.url, "--decode", vllm_server.url, "--port", str(port)], port,
                               startup_timeout_s=120, log_path=str(tmp_path_factory.mktemp("logs") / "proxy.log"),
                               name="proxy", cwd=str(ROOT)).start()
    yield server
    server.stop()


def cached(answer: dict) -> int:
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stream", [False, True], ids=IDS)
@pytest.mark.parametrize("length", [31, 200, 700])
def test_completions_through_vllms_proxy_protocol_equal_vllm_alone(vllm_server, dwdp_server, proxy, length, stream):
    model = httpx.get(f"{dwdp_server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"prompt": prompt(length + 1, length), "max_tokens": 8, "ignore_eos": True}
    got = ask(proxy, "/v1/completions", body, stream, model=VLLM_MODEL)
    same(got, ask(vllm_server, "/v1/completions", body, stream))
    assert cached(got) == length - 1, got  # every prompt token but the last came from dwdp's artifact
    assert model != VLLM_MODEL  # the proxy asked dwdp for the decode engine's name, and dwdp took it


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stream", [False, True], ids=IDS)
def test_chat_through_vllms_proxy_protocol_equals_vllm_alone(vllm_server, proxy, stream):
    body = {"messages": TWO_TURNS, "max_tokens": 8}
    got = ask(proxy, "/v1/chat/completions", body, stream)
    same(got, ask(vllm_server, "/v1/chat/completions", body, stream))
    assert cached(got) == got["usage"]["prompt_tokens"] - 1, got


# -- the detokenizer -----------------------------------------------------------------------------
@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", range(30))
def test_output_text_equals_vllms_own_detokenizer(checkpoint, seed):
    """dwdp.serve.output_text.OutputText and vLLM's FastIncrementalDetokenizer, fed the same random output
    in the same random updates: the same return values, token ids, text and streamed pieces."""
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    from dwdp.serve.output_text import OutputText

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    rng = random.Random(seed)
    ids = prompt(seed, rng.randrange(1, 8))
    words = [rng.randrange(4, 30) for _ in range(5)] + list(SPECIAL)
    output = [rng.choice(words) for _ in range(rng.randrange(1, 16))]
    stop_terminated = seed % 3 == 0
    if stop_terminated:
        output.append(EOS)
    text = tokenizer.decode(ids + output)
    stop = [text[i:i + rng.randrange(1, 8)] for i in (rng.randrange(len(text)) for _ in range(rng.randrange(0, 3)))]
    stop = [s for s in stop if s]
    options = dict(min_tokens=rng.choice([0, 0, 1, 4]), include_stop_str_in_output=seed % 4 == 0,
                   skip_special_tokens=seed % 5 != 0, spaces_between_special_tokens=seed % 10 != 5)
    params = SamplingParams(max_tokens=64, stop=stop or None, **options)
    theirs = IncrementalDetokenizer.from_new_request(tokenizer, SimpleNamespace(
        sampling_params=params, prompt_token_ids=ids, request_id=f"r{seed}", prompt_embeds=None))
    assert type(theirs).__name__ == "FastIncrementalDetokenizer", type(theirs)  # what vLLM's server uses here
    ours = OutputText(tokenizer, ids, stop=stop, **options)
    at = 0
    while at < len(output):
        n = rng.randrange(1, len(output) - at + 1)
        chunk, at = output[at:at + n], at + n
        last = at >= len(output)
        got = ours.update(chunk, stop_terminated=stop_terminated and last)
        want = theirs.update(chunk, stop_terminated=stop_terminated and last)
        assert got == want and ours.token_ids == theirs.token_ids and ours.text == theirs.output_text, (
            seed, chunk, got, want, ours.text, theirs.output_text)
        finished = got is not None or last
        assert ours.next_text(finished) == theirs.get_next_output_text(finished, delta=True), seed
        if finished:
            break
