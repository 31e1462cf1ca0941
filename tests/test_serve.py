"""The context server end to end: a real `dwdp serve` subprocess (3 ranks, tiny preset) shared by
every test here, checked against the unwrapped model in this process."""
from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from dwdp.runtime.group import free_port
from dwdp.serve.kv import read_kv_artifact
from dwdp.serve.launch import ServerProcess
from dwdp.serve.presets import preset_model
from servers import SERVER_START_S, paused, server_timeout

RANKS = 3
MAX_NUM_TOKENS = 256
MAX_QUEUE_TOKENS = 512
MAX_BODY_BYTES = 16384
VOCAB = 512
ATOL, RTOL = 1e-4, 1e-4


def build_tokenizer(path) -> None:
    """A word-level tokenizer over "w0".."w299" (ids 4..303) saved where AutoTokenizer finds it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 3, **{f"w{i}": i + 4 for i in range(300)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(str(path))


@pytest.fixture(scope="module")
def reference():
    """prompt ids -> (last-position logits [V], [(keys, values)] per layer) of the unwrapped model."""
    model = preset_model("tiny", seed=0)
    cache = {}

    def run(ids: list[int]):
        key = tuple(ids)
        if key not in cache:
            with torch.inference_mode():
                out = model(input_ids=torch.tensor([ids]), use_cache=True)
            layers = [(layer.keys.clone(), layer.values.clone()) for layer in out.past_key_values.layers]
            cache[key] = (out.logits[0, -1].clone(), layers)
        return cache[key]

    return run


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    (root / "shm").mkdir()
    build_tokenizer(root / "tokenizer")
    args = ["--ranks", str(RANKS), "--preset", "tiny", "--max-num-tokens", str(MAX_NUM_TOKENS),
            "--max-queue-tokens", str(MAX_QUEUE_TOKENS), "--max-body-bytes", str(MAX_BODY_BYTES),
            "--kv-dir", str(root / "kv"), "--tokenizer", str(root / "tokenizer"),
            # Workers paused on purpose (test_router_passes_over_a_loaded_worker) must not count as stalled
            # while the test sends its prompts on a loaded machine: stalls are tested in test_serve_lifecycle.
            "--stall-timeout", "60"]
    (root / "kv").mkdir(mode=0o700)
    # What a server that stopped without cleaning up left: swept at start (other files are left alone).
    for name in LEFTOVERS + ["notes.txt"]:
        (root / "kv" / name).write_bytes(b"kv")
    proc = ServerProcess(args, free_port(), env={"DWDP_SHM_DIR": str(root / "shm")}, log_path=str(root / "log"),
                         startup_timeout_s=SERVER_START_S)
    proc.root = root
    with proc:
        yield proc
    assert proc.proc.returncode == 0, proc.output()
    assert proc.left_behind == [], f"processes of the server still running after it stopped: {proc.left_behind}"
    assert list((root / "shm").iterdir()) == []
    # Every artifact still pending at stop is removed: no server would expire it later.
    assert sorted(p.name for p in (root / "kv").iterdir()) == [".dwdp-serve.lock", "notes.txt"]


LEFTOVERS = ["pf-" + "a" * 32 + ".safetensors", ".pf-" + "b" * 32 + ".safetensors.tmp"]


def prompt(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=gen).tolist()


def assert_first_token(token: int, logits: torch.Tensor) -> None:
    """`token` is the argmax of the reference logits, or ties with it within the fp tolerance."""
    best = int(logits.argmax())
    gap = float(logits[best] - logits[token])
    assert token == best or gap <= ATOL + RTOL * float(logits.abs().max()), (token, best, gap)


def assert_kv_matches(path: str, layers) -> None:
    got, meta = read_kv_artifact(path)
    assert len(got) == len(layers) == int(meta["num_layers"]), (len(got), len(layers), meta)
    for i, ((k, v), (rk, rv)) in enumerate(zip(got, layers)):
        assert k.shape == rk.shape and v.shape == rv.shape, (i, k.shape, rk.shape, v.shape, rv.shape)
        torch.testing.assert_close(k, rk, atol=ATOL, rtol=RTOL, msg=lambda m: f"layer {i} keys: {m}")
        torch.testing.assert_close(v, rv, atol=ATOL, rtol=RTOL, msg=lambda m: f"layer {i} values: {m}")


def post(server, path: str, body, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60.0, **kw)


@server_timeout(60)
@pytest.mark.parametrize("length", [1, 7, 33, MAX_NUM_TOKENS])
def test_prefill_matches_unwrapped_model(server, reference, length):
    ids = prompt(length, length)
    r = post(server, "/v1/prefill", {"input_ids": ids})
    assert r.status_code == 200, r.text
    body = r.json()
    logits, layers = reference(ids)
    assert body["prompt_tokens"] == length and 0 <= body["rank"] < RANKS, body
    assert_first_token(body["first_token_id"], logits)
    assert_kv_matches(body["kv"]["path"], layers)
    kv = body["kv"]
    assert kv["num_tokens"] == length and kv["dtype"] == "float32" and kv["num_layers"] == len(layers), kv
    # The tiny preset is DeepSeek-V3-style: its cache holds MLA's latent, written as such.
    assert kv["format"] == "dwdp-kv-mla-v1", kv
    recorded = {(t["layer"], t["kind"]): t["shape"] for t in kv["tensors"]}
    assert recorded == {(i, kind): [1, *t.shape[2:]] for i, pair in enumerate(layers)
                        for kind, t in zip(("latent", "rope"), pair)}
    assert body["timing"]["prefill_s"] > 0 and body["timing"]["queue_s"] >= 0, body["timing"]


@server_timeout(90)
def test_concurrent_clients_none_lost_or_duplicated(server, reference):
    """16 clients (> 4 x 3 ranks), 3 prompts each of mixed lengths: left-padded batches must give
    every prompt its own first token and cache, every request exactly one answer."""
    before = httpx.get(f"{server.url}/health").json()
    prompts = [prompt(1000 + i, 5 + (37 * i) % 120) for i in range(48)]

    def client(c: int):
        with httpx.Client(timeout=60.0) as http:
            return [(i, http.post(f"{server.url}/v1/prefill", json={"input_ids": prompts[i]}))
                    for i in range(c, len(prompts), 16)]

    with ThreadPoolExecutor(16) as pool:
        answers = [a for chunk in pool.map(client, range(16)) for a in chunk]
    assert sorted(i for i, _ in answers) == list(range(len(prompts)))
    assert [r.status_code for _, r in answers] == [200] * len(prompts), [r.text for _, r in answers if r.status_code != 200]
    ids = {r.json()["id"] for _, r in answers}
    assert len(ids) == len(prompts), "duplicated request ids"
    batched = 0
    for i, r in answers:
        body = r.json()
        logits, layers = reference(prompts[i])
        assert body["prompt_tokens"] == len(prompts[i])
        assert_first_token(body["first_token_id"], logits)
        assert_kv_matches(body["kv"]["path"], layers)
        batched += body["timing"]["batch_size"] > 1
    after = httpx.get(f"{server.url}/health").json()
    served = [a["served_requests"] - b["served_requests"] for a, b in zip(after["workers"], before["workers"])]
    assert sum(served) == len(prompts), served
    assert batched > 0, "no request shared a forward: batching never happened"
    assert after["in_flight"] == 0 and all(w["outstanding_tokens"] == 0 for w in after["workers"]), after


def wait_for_health(server, condition, what: str, timeout_s: float = 30.0) -> dict:
    """Poll /health until `condition(health)` holds: the router's own state, not a guess at timing."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(f"{server.url}/health", timeout=10.0).json()
        if condition(health):
            return health
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s:.0f} s: {health}"
        time.sleep(0.02)


@server_timeout(90)
def test_router_passes_over_a_loaded_worker(server, reference):
    """With every worker paused (SIGSTOP) nothing finishes: a 200-token prompt goes to one worker,
    then six 10-token prompts, each admitted before the next is sent. Least outstanding tokens
    puts them on the two other workers (30 tokens each, still below 200); a router that does not
    see the 200 outstanding tokens hands the third short prompt to the loaded worker."""
    idle = wait_for_health(server, lambda h: h["in_flight"] == 0, "an idle server")
    pids = [w["pid"] for w in idle["workers"]]
    long_ids, shorts = prompt(7000, 200), [prompt(7001 + i, 10) for i in range(6)]
    with ThreadPoolExecutor(1 + len(shorts)) as pool:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            futures = [pool.submit(post, server, "/v1/prefill", {"input_ids": long_ids})]
            health = wait_for_health(server, lambda h: h["in_flight"] == 1, "the long prompt admitted")
            loaded = [w["rank"] for w in health["workers"] if w["outstanding_tokens"] == 200]
            for n, ids in enumerate(shorts, start=2):
                futures.append(pool.submit(post, server, "/v1/prefill", {"input_ids": ids}))
                health = wait_for_health(server, lambda h, n=n: h["in_flight"] == n, f"{n} prompts admitted")
            outstanding = [w["outstanding_tokens"] for w in health["workers"]]
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        answers = [f.result() for f in futures]
    assert len(loaded) == 1, f"the long prompt is not on exactly one worker: {health}"
    expected = [200 if rank == loaded[0] else 30 for rank in range(RANKS)]
    assert outstanding == expected, f"outstanding tokens per rank {outstanding}, expected {expected}"
    assert [r.status_code for r in answers] == [200] * len(answers), [r.text for r in answers]
    ranks = [r.json()["rank"] for r in answers]
    assert ranks[0] == loaded[0] and loaded[0] not in ranks[1:], f"long prompt on {loaded}, answers from {ranks}"
    for ids, r in zip([long_ids, *shorts], answers):
        assert_first_token(r.json()["first_token_id"], reference(ids)[0])


@server_timeout(60)
def test_openai_client_gets_a_completion(server, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["dwdp-tiny"]
    ids = prompt(7, 19)
    completion = client.completions.create(model="dwdp-tiny", prompt=ids, max_tokens=1)
    logits, layers = reference(ids)
    choice = completion.choices[0]
    assert_first_token(choice.model_extra["token_ids"][0], logits)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(server.root / "tokenizer"), local_files_only=True)
    assert choice.text == tokenizer.decode(choice.model_extra["token_ids"]), choice
    assert completion.usage.prompt_tokens == 19 and completion.usage.completion_tokens == 1
    artifacts = completion.model_extra["kv_transfer_params"]["kv_artifacts"]
    assert len(artifacts) == 1
    assert_kv_matches(artifacts[0]["path"], layers)
    text = client.completions.create(model="dwdp-tiny", prompt="w10 w20 w30 w40", max_tokens=1)
    assert_first_token(text.choices[0].model_extra["token_ids"][0], reference([14, 24, 34, 44])[0])
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="dwdp-tiny", prompt=ids, max_tokens=16)
    assert "max_tokens" in str(err.value)


@server_timeout(30)
def test_text_prompt_uses_the_local_tokenizer(server, reference):
    r = post(server, "/v1/prefill", {"prompt": "w1 w2 w3 w299 unknown"})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_tokens"] == 5
    assert_first_token(r.json()["first_token_id"], reference([5, 6, 7, 303, 3])[0])


TOO_LONG = [5] * (MAX_QUEUE_TOKENS + 1)  # past max_prompt_tokens (the queue bound here): max_num_tokens alone is chunked
BAD_INPUTS = [
    ("empty_ids", "/v1/prefill", {"input_ids": []}, 400, "input_ids"),
    ("float_id", "/v1/prefill", {"input_ids": [5, 1.5]}, 400, "input_ids"),
    ("string_id", "/v1/prefill", {"input_ids": [5, "6"]}, 400, "input_ids"),
    ("bool_id", "/v1/prefill", {"input_ids": [True]}, 400, "input_ids"),
    ("ids_not_a_list", "/v1/prefill", {"input_ids": 5}, 400, "input_ids"),
    ("id_over_vocab", "/v1/prefill", {"input_ids": [5, VOCAB]}, 400, "input_ids"),
    ("negative_id", "/v1/prefill", {"input_ids": [-1]}, 400, "input_ids"),
    ("too_long", "/v1/prefill", {"input_ids": TOO_LONG}, 400, "input_ids"),
    ("missing_ids", "/v1/prefill", {}, 400, "input_ids"),
    ("ids_and_prompt", "/v1/prefill", {"input_ids": [5], "prompt": "w1"}, 400, "prompt"),
    ("unknown_field", "/v1/prefill", {"input_ids": [5], "temperature": 0.5}, 400, "temperature"),
    ("body_not_object", "/v1/prefill", [5, 6], 400, "body"),
    ("wrong_model", "/v1/completions", {"model": "gpt-4", "prompt": [5], "max_tokens": 1}, 404, "model"),
    ("max_tokens_2", "/v1/completions", {"model": "dwdp-tiny", "prompt": [5], "max_tokens": 2}, 400, "max_tokens"),
    ("stream_not_bool", "/v1/completions", {"model": "dwdp-tiny", "prompt": [5], "stream": "yes"}, 400, "stream"),
    ("empty_prompt", "/v1/completions", {"model": "dwdp-tiny", "prompt": []}, 400, "prompt"),
    ("prompt_over_vocab", "/v1/completions", {"model": "dwdp-tiny", "prompt": [[5], [9999]]}, 400, "prompt.1"),
    ("missing_prompt", "/v1/completions", {"model": "dwdp-tiny"}, 400, "prompt"),
]


@server_timeout(60)
def test_a_prompt_past_max_num_tokens_is_prefilled_in_chunks(server, reference):
    """2 x max_num_tokens (the queue bound) in two chunks equals one unchunked forward; one more is 400."""
    ids = prompt(77, 2 * MAX_NUM_TOKENS)
    r = post(server, "/v1/prefill", {"input_ids": ids})
    assert r.status_code == 200, r.text
    body = r.json()
    logits, layers = reference(ids)
    assert_first_token(body["first_token_id"], logits)
    assert_kv_matches(body["kv"]["path"], layers)
    _, meta = read_kv_artifact(body["kv"]["path"])
    chunks = [int(c) for c in meta["chunks"].split(",")]
    assert sum(chunks) == len(ids) and len(chunks) >= 2 and max(chunks) <= MAX_NUM_TOKENS, meta
    assert meta["positions"] == f"0..{len(ids) - 1}" and meta["forward"] == "packed", meta
    r = post(server, "/v1/prefill", {"input_ids": ids + [5]})
    assert r.status_code == 400 and f"at most {MAX_QUEUE_TOKENS}" in r.json()["error"]["message"], r.text
    health = httpx.get(f"{server.url}/health").json()
    assert health["forwards"] == "packed" and health["padded_reason"] == "", health


@server_timeout(30)
@pytest.mark.parametrize("name,path,body,status,param", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_names_the_field(server, name, path, body, status, param):
    r = post(server, path, body)
    assert r.status_code == status, (name, r.status_code, r.text)
    error = r.json()["error"]
    assert error["param"] == param and param.split(".")[0] in error["message"], (name, error)


@server_timeout(30)
def test_malformed_json_and_oversize_body(server):
    r = httpx.post(f"{server.url}/v1/prefill", content=b'{"input_ids": [1, 2', timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "body", r.text
    big = json.dumps({"input_ids": [5] * MAX_BODY_BYTES}).encode()
    r = httpx.post(f"{server.url}/v1/prefill", content=big, timeout=10, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body", r.text

    def chunks():  # no Content-Length: the limit must hold while the body streams in
        for start in range(0, len(big), 4096):
            yield big[start:start + 4096]

    r = httpx.post(f"{server.url}/v1/prefill", content=chunks(), timeout=10, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["param"] == "body", r.text
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


@server_timeout(90)
def test_overload_answers_429_with_retry_after(server, reference):
    """36 prompts of 200 tokens at once are 7200 tokens against 3 x 512 of queue room: the rest
    must be refused with 429 + Retry-After, and every admitted one must still be answered right."""
    prompts = [prompt(5000 + i, 200) for i in range(36)]
    pids = [w["pid"] for w in httpx.get(f"{server.url}/health").json()["workers"]]
    with ThreadPoolExecutor(36) as pool:
        with paused(pids):  # nothing is answered until every prompt was admitted or refused: fast forwards too
            futures = [pool.submit(post, server, "/v1/prefill", {"input_ids": ids}) for ids in prompts]
            deadline = time.monotonic() + 30
            while sum(f.done() for f in futures) + httpx.get(f"{server.url}/health").json()["in_flight"] < len(prompts):
                assert time.monotonic() < deadline, "36 prompts neither admitted nor refused within 30 s"
                time.sleep(0.01)
        answers = [f.result() for f in futures]
    codes = [r.status_code for r in answers]
    assert set(codes) == {200, 429}, codes
    for ids, r in zip(prompts, answers):
        if r.status_code == 429:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "overloaded", r.text
        else:
            assert_first_token(r.json()["first_token_id"], reference(ids)[0])
    health = httpx.get(f"{server.url}/health").json()
    assert health["in_flight"] == 0 and all(w["outstanding_tokens"] == 0 for w in health["workers"]), health
    # Every forward after a worker's first is measured from the previous one's end (waits for work left out).
    for w in health["workers"]:
        assert 1 <= w["forwards"] - w["outside_forwards"] <= 1 + w["forwards"] // 2, w
        assert w["forward_s"] > 0 and w["kv_write_s"] > 0 and w["outside_s"] > 0, w


@server_timeout(30)
def test_metrics_in_prometheus_text(server):
    from prometheus_client.parser import text_string_to_metric_families

    post(server, "/v1/prefill", {"input_ids": [5, 6, 7]})
    post(server, "/v1/prefill", {"input_ids": []})
    r = httpx.get(f"{server.url}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.headers
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    for name in ("dwdp_serve_queue_depth", "dwdp_serve_outstanding_tokens", "dwdp_serve_worker_up",
                 "dwdp_serve_prefetch_wait_seconds_total", "dwdp_serve_requests_total", "dwdp_serve_worker_routable",
                 "dwdp_serve_worker_stalled", "dwdp_serve_lost_peers", "dwdp_serve_replans_total",
                 "dwdp_serve_retried_slices_total"):
        assert sorted(s.labels["rank"] for s in samples[name]) == [str(r) for r in range(RANKS)], name
    assert [s.value for s in samples["dwdp_serve_lost_peers"]] == [0.0] * RANKS, samples["dwdp_serve_lost_peers"]
    assert samples["dwdp_serve_failed_requests_total"][0].value == 0
    assert samples["dwdp_serve_tokens_per_second"][0].value > 0
    assert samples["dwdp_serve_ttft_seconds_count"][0].value >= 1
    assert sum(s.value for s in samples["dwdp_serve_prefetch_wait_seconds_total"]) > 0
    errors = {s.labels["type"]: s.value for s in samples["dwdp_serve_errors_total"]}
    assert errors.get("invalid_request_error", 0) >= 1, errors


@server_timeout(30)
def test_health_and_metrics_name_each_workers_device_and_memory(server):
    """Each worker reports where it runs, what it holds there, and how long it took to be ready (warmed up)."""
    from prometheus_client.parser import text_string_to_metric_families

    from dwdp.models.demo_model import DEMO_MODEL
    from dwdp.runtime.transport.host_composite import composite_unsupported_reason

    # Tiny preset: per MoE layer 16 experts of gate_up [2I, H] + down [H, I] fp32; ceil(16 / 3) = 6 local per
    # rank, and each of the two prefetch slots holds the 10 others of one layer.
    layers = DEMO_MODEL["num_layers"] - 1  # the first layer is dense
    expert = 3 * DEMO_MODEL["hidden"] * DEMO_MODEL["intermediate"] * 4
    num_local = -(-DEMO_MODEL["num_experts"] // RANKS)
    local, slots = layers * num_local * expert, 2 * (DEMO_MODEL["num_experts"] - num_local) * expert
    workers = httpx.get(f"{server.url}/health").json()["workers"]
    for w in workers:
        kernel = "composite" if composite_unsupported_reason() is None else "reference"  # the default here
        assert (w["device"], w["backend"], w["experts_kernel"], w["dtype"]) == ("cpu", "host", kernel, "float32"), w
        assert w["local_expert_bytes"] == local and w["prefetch_buffer_bytes"] == slots, (w, local, slots)
        assert 0 < w["warmup_s"] < w["ready_s"], w
    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    devices = sorted((s.labels["rank"], s.labels["device"], s.labels["backend"]) for s in samples["dwdp_serve_worker_device"])
    assert devices == [(str(r), "cpu", "host") for r in range(RANKS)], devices
    by_rank = {s.labels["rank"]: s.value for s in samples["dwdp_serve_local_expert_bytes"]}
    assert by_rank == {str(r): float(local) for r in range(RANKS)}, by_rank
    assert all(s.value > 0 for s in samples["dwdp_serve_worker_ready_seconds"]), samples["dwdp_serve_worker_ready_seconds"]


@server_timeout(30)
def test_fault_injection_is_off_unless_asked_for(server):
    r = post(server, "/admin/fault", {"rank": 1})
    assert r.status_code == 404 and "--fault-injection" in r.json()["error"]["message"], r.text
    health = httpx.get(f"{server.url}/health").json()
    assert all(w["routable"] and w["lost_peers"] == {} for w in health["workers"]), health


@server_timeout(120)
def test_short_load_loses_nothing_and_every_answer_names_its_worker(server, reference):
    """bench/serve_load.py's open-loop arrivals, prompts up to 1.5 x max_num_tokens (the long ones
    chunked): one answer per request, 200s name a rank and carry the unwrapped model's first token;
    the only refusals allowed are 429s for a full queue."""
    import asyncio
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "serve_load.py"
    spec = importlib.util.spec_from_file_location("serve_load", path)
    serve_load = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve_load)
    plan = serve_load.arrivals(6.0, 24, 10.0, 4, 3 * MAX_NUM_TOKENS // 2, 0.25, 0.2, MAX_NUM_TOKENS, seed=5)
    assert any(len(ids) > MAX_NUM_TOKENS for _, _, ids in plan), "no prompt long enough to be chunked"
    results, _ = asyncio.run(serve_load.run_rate(server.url, plan, 100.0))
    assert len(results) == len(plan)
    assert all(r["status"] in (200, 429) for r in results), [r for r in results if r["status"] not in (200, 429)]
    answered = [(ids, r) for (_, _, ids), r in zip(plan, results) if r["status"] == 200]
    assert len(answered) >= len(plan) // 2, [r["status"] for r in results]
    for ids, r in answered:
        assert 0 <= r["rank"] < RANKS and r["tokens"] == len(ids), r
        assert_first_token(r["first_token_id"], reference(ids)[0])


@server_timeout(60)
def test_the_server_is_reachable_on_loopback_only_and_keeps_its_kv_private(server):
    """Bound to 127.0.0.1, no process of the server (router, workers, their rendezvous store and gloo's
    sockets) listens beyond this host; the KV directory is private, each artifact 0600, and an earlier
    server's leftovers were swept at start."""
    from dwdp.runtime.processes import group_members
    from sockets import is_loopback, listening

    sockets = listening(group_members(server.proc.pid))
    assert len({pid for _, _, pid in sockets}) >= 2, sockets  # the router and the store's host at least
    assert all(is_loopback(address) for address, _, _ in sockets), sockets
    kv = server.root / "kv"
    assert os.stat(kv).st_mode & 0o777 == 0o700 and not any((kv / name).exists() for name in LEFTOVERS)
    assert "removed 2 KV artifacts an earlier server left" in server.output()
    r = httpx.post(f"{server.url}/v1/prefill", json={"input_ids": prompt(77, 9)}, timeout=60).json()
    assert os.stat(r["kv"]["path"]).st_mode & 0o777 == 0o600, r["kv"]
