"""`dwdp serve --mode dep` end to end: the same front as DWDP mode, checked against the unwrapped
model; then a worker killed under load, which must fail every request it touched by name, and
hang none (the last test here: a DEP group does not survive it)."""
from __future__ import annotations

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
from servers import SERVER_START_S, server_timeout

VOCAB = 512
ATOL, RTOL = 1e-4, 1e-4


@pytest.fixture(scope="module")
def model():
    return preset_model("tiny", seed=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_dep")
    (root / "kv").mkdir()
    proc = ServerProcess(["--mode", "dep", "--ranks", "2", "--preset", "tiny", "--max-num-tokens", "256",
                          "--step-timeout", "60", "--kv-dir", str(root / "kv")], free_port(),
                         log_path=str(root / "log"),
                         startup_timeout_s=SERVER_START_S)
    proc.start()
    yield proc
    proc.kill()


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def reference(model, ids):
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
    return out.logits[0, -1], [(layer.keys, layer.values) for layer in out.past_key_values.layers]


@server_timeout(90)
def test_dep_server_answers_like_the_unwrapped_model(server, model):
    """24 concurrent prompts of mixed lengths over 2 ranks: batches of different sizes per rank per
    step, idle steps when one rank's queue runs dry; every answer equals the unwrapped model's."""
    prompts = [prompt(100 + i, 3 + (41 * i) % 150) for i in range(24)]
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda ids: httpx.post(f"{server.url}/v1/prefill", json={"input_ids": ids},
                                                       timeout=60), prompts))
    assert [r.status_code for r in answers] == [200] * len(prompts), [r.text for r in answers if r.status_code != 200]
    for ids, r in zip(prompts, answers):
        body = r.json()
        logits, layers = reference(model, ids)
        best = int(logits.argmax())
        assert body["first_token_id"] == best or float(logits[best] - logits[body["first_token_id"]]) <= ATOL, body
        got, _ = read_kv_artifact(body["kv"]["path"])
        for i, ((k, v), (rk, rv)) in enumerate(zip(got, layers)):
            torch.testing.assert_close(k, rk, atol=ATOL, rtol=RTOL, msg=lambda m: f"layer {i} keys: {m}")
            torch.testing.assert_close(v, rv, atol=ATOL, rtol=RTOL, msg=lambda m: f"layer {i} values: {m}")
    health = httpx.get(f"{server.url}/health").json()
    assert health["mode"] == "dep" and health["status"] == "ok", health
    assert sorted({r.json()["rank"] for r in answers}) == [0, 1], "the router used one rank only"
    assert 'dwdp_serve_mode{mode="dep"} 1.0' in httpx.get(f"{server.url}/metrics").text


@server_timeout(60)
def test_openai_client_gets_a_dep_completion(server, model):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    ids = prompt(7, 19)
    completion = client.completions.create(model="dwdp-tiny", prompt=ids, max_tokens=1)
    logits, _ = reference(model, ids)
    assert completion.choices[0].model_extra["token_ids"] == [int(logits.argmax())], completion


@server_timeout(90)
def test_a_killed_dep_worker_fails_requests_by_name_and_hangs_none(server):
    """SIGKILL rank 1 while both ranks hold prompts: its running prompts fail as worker_died, rank
    0's as dep_group_broken naming rank 1, later ones as no_healthy_worker; all answered, none hung."""
    health = httpx.get(f"{server.url}/health").json()
    pids = [w["pid"] for w in health["workers"]]
    prompts = [prompt(500 + i, 200) for i in range(16)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(httpx.post, f"{server.url}/v1/prefill", json={"input_ids": ids}, timeout=60)
                   for ids in prompts]
        deadline = time.monotonic() + 30
        while not all(w["running"] for w in httpx.get(f"{server.url}/health").json()["workers"]):
            assert time.monotonic() < deadline, "both ranks never ran a forward at once"
            time.sleep(0.005)
        os.kill(pids[1], signal.SIGKILL)
        killed = time.monotonic()
        answers = [f.result() for f in futures]
        answered_after_s = time.monotonic() - killed
    # Well before the server's 60 s step timeout: the peer's closed connections ended the step, not the clock.
    assert answered_after_s < 40, f"requests still open {answered_after_s:.1f} s after the kill"
    errors = [r.json()["error"] for r in answers if r.status_code != 200]
    assert all(r.status_code in (200, 503) for r in answers), [r.text for r in answers]
    kinds = {e["type"] for e in errors}
    assert "dep_group_broken" in kinds and kinds <= {"dep_group_broken", "worker_died", "no_healthy_worker"}, errors
    broken = [e["message"] for e in errors if e["type"] == "dep_group_broken"]
    assert all(f"rank 1 (pid {pids[1]}) exited" in m for m in broken), broken
    deadline = time.monotonic() + 20
    while httpx.get(f"{server.url}/health").json()["status"] != "unavailable":
        assert time.monotonic() < deadline, "the surviving DEP rank kept serving without its peer's experts"
        time.sleep(0.05)
    late = httpx.post(f"{server.url}/v1/prefill", json={"input_ids": prompt(9, 5)}, timeout=30)
    assert late.status_code == 503 and late.json()["error"]["type"] == "no_healthy_worker", late.text
