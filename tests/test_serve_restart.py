"""The server heals: a worker of a redundancy-2 group killed under load is started again, rejoins
its group and takes requests again, with no request lost; a worker that keeps dying is left down
with its reason while the others keep serving."""
from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dwdp.runtime.group import free_port
from dwdp.serve.launch import ServerProcess
from servers import SERVER_START_S, server_timeout
from test_serve_lifecycle import first_token, kill_while_busy, model, prompts, wait_for  # noqa: F401 (model: a fixture)

BACKOFF_S = 0.2
MAX_PER_MINUTE = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_restart")
    (root / "shm").mkdir()
    proc = ServerProcess(["--ranks", "3", "--expert-replicas", "2", "--peer-timeout", "1", "--preset", "tiny",
                          "--fault-injection", "--restart", "on-failure", "--restart-backoff", str(BACKOFF_S),
                          "--stall-timeout", "60",  # workers paused on purpose (kill_while_busy) are not stalled
                          "--max-restarts-per-minute", str(MAX_PER_MINUTE)], free_port(),
                         env={"DWDP_SHM_DIR": str(root / "shm")}, log_path=str(root / "log"),
                         startup_timeout_s=SERVER_START_S)
    proc.root = root
    proc.start()
    yield proc
    proc.kill()


def _post(server, ids):
    return httpx.post(f"{server.url}/v1/prefill", json={"input_ids": ids}, timeout=120)


@server_timeout(240)
def test_a_killed_worker_is_restarted_rejoins_and_serves_again_with_no_request_lost(server, model):
    health = httpx.get(f"{server.url}/health", timeout=5).json()
    initial = health["redundancy"]  # the placement's: 2 or 3 owners per expert
    assert initial and health["min_redundancy"] == 2 and health["restarts"] == 0, health
    batch = prompts(11, 24, 200)  # 8 prompts of 200 tokens a worker: more than one forward (1024 tokens)
    victim = health["workers"][1]["pid"]
    with ThreadPoolExecutor(len(batch)) as pool:
        futures, running_on_victim = kill_while_busy(server, pool, lambda ids: _post(server, ids), batch, victim=1)
        killed_at = time.monotonic()
        during = wait_for(server, lambda h: h["workers"][1]["restarts"] == 1)
        answers = [f.result() for f in futures]  # a request without an HTTP answer raises here: lost
    failed = [r for r in answers if r.status_code != 200]
    for r in failed:
        assert r.status_code >= 500 and "rank 1" in r.json()["error"]["message"], r.text
    assert len(failed) <= running_on_victim, ([r.status_code for r in answers], running_on_victim)
    for ids, r in zip(batch, answers):
        if r.status_code == 200:
            assert r.json()["first_token_id"] == first_token(model, ids), r.json()
    assert not during["workers"][1]["routable"] and during["min_redundancy"] == 1, during
    back = wait_for(server, lambda h: h["workers"][1]["routable"] and h["redundancy"] == initial, timeout_s=120)
    healed_s = time.monotonic() - killed_at
    w = back["workers"][1]
    assert w["pid"] != victim and w["restarts"] == 1 and w["rejoins"] == 1 and w["expert_source"] == "peers", w
    assert back["restarts"] == 1 and back["rejoins"] == 1 and back["status"] == "ok", back
    survivors = wait_for(server, lambda h: all(h["workers"][r]["peer_rejoins"].get("1") == 1 for r in (0, 2)))
    for rank in (0, 2):
        assert survivors["workers"][rank]["lost_peers"] == {}, survivors["workers"][rank]
    after_ids = prompts(12, 9, 30)
    after = [_post(server, ids) for ids in after_ids]
    assert [r.status_code for r in after] == [200] * len(after), [r.text for r in after]
    assert 1 in {r.json()["rank"] for r in after}, "the restarted worker got no request"
    for ids, r in zip(after_ids, after):
        assert r.json()["first_token_id"] == first_token(model, ids), r.json()
    metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
    assert 'dwdp_serve_worker_restarts_total{rank="1"} 1.0' in metrics, metrics
    assert f'dwdp_serve_expert_redundancy{{expert="0"}} {float(initial[0])}' in metrics, metrics
    print(f"kill -> worker 1 routable again with full redundancy: {healed_s:.2f} s")


@server_timeout(240)
def test_the_worker_hosting_the_group_store_is_restarted_and_rejoins_too(server, model):
    """Worker 0 hosts the process group's store (the setup's one collective). Nothing after setup
    needs it: killed, it is started again, rejoins through the board, and serves; the server still
    stops cleanly afterwards (the last test)."""
    before = httpx.get(f"{server.url}/health", timeout=5).json()
    victim, restarts = before["workers"][0]["pid"], before["workers"][0]["restarts"]
    initial = before["redundancy"]
    os.kill(victim, signal.SIGKILL)
    back = wait_for(server, lambda h: h["workers"][0]["restarts"] == restarts + 1 and h["workers"][0]["routable"]
                    and h["redundancy"] == initial, timeout_s=120)
    w = back["workers"][0]
    assert w["pid"] != victim and w["rejoins"] == 1 and w["expert_source"] == "peers", w
    wait_for(server, lambda h: all(h["workers"][r]["peer_rejoins"].get("0") == 1 for r in (1, 2)))
    ids_list = prompts(14, 9, 30)
    answers = [_post(server, ids) for ids in ids_list]
    assert [r.status_code for r in answers] == [200] * len(answers), [r.text for r in answers]
    assert 0 in {r.json()["rank"] for r in answers}, "the restarted worker 0 got no request"
    for ids, r in zip(ids_list, answers):
        assert r.json()["first_token_id"] == first_token(model, ids), r.json()


@server_timeout(240)
def test_a_worker_that_keeps_dying_is_left_down_with_its_reason(server, model):
    """Rank 2 loses its device (the fault hook): the router stops it and starts it again; then it is
    killed each time it comes up: restarted MAX_PER_MINUTE times in all with a growing back-off,
    then left down; ranks 0 and 1 keep serving every expert."""
    first = httpx.get(f"{server.url}/health", timeout=5).json()["workers"][2]["pid"]
    httpx.post(f"{server.url}/admin/fault", json={"rank": 2}, timeout=30).raise_for_status()
    restarted = wait_for(server, lambda h: h["workers"][2]["restarts"] == 1)["workers"][2]
    assert restarted["exit_code"] is None and restarted["pid"] != first, restarted
    pids = {first}
    deadline = time.monotonic() + 120
    while True:
        h = httpx.get(f"{server.url}/health", timeout=5).json()
        w = h["workers"][2]
        if w["down_reason"] is not None:
            break
        assert time.monotonic() < deadline, f"rank 2 never left down: {w}"
        if w["pid"] is not None and w["pid"] not in pids and w["restarting_in_s"] is None:
            pids.add(w["pid"])
            try:
                os.kill(w["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    assert w["restarts"] == MAX_PER_MINUTE and "left down" in w["down_reason"], w
    assert "exit code -9" in w["down_reason"], w["down_reason"]
    assert h["status"] == "degraded" and not w["routable"], h
    assert h["min_redundancy"] == 1, h["redundancy"]
    after_ids = prompts(13, 4, 30)
    after = [_post(server, ids) for ids in after_ids]
    assert [r.status_code for r in after] == [200] * len(after), [r.text for r in after]
    for ids, r in zip(after_ids, after):
        assert r.json()["first_token_id"] == first_token(model, ids) and r.json()["rank"] in (0, 1), r.json()
    metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
    assert 'dwdp_serve_worker_down{rank="2"} 1.0' in metrics, metrics
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, server.output()
    assert list((server.root / "shm").iterdir()) == [], list((server.root / "shm").iterdir())
