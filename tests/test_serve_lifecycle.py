"""Lifecycle of the context server: a worker of a redundancy-2 group killed under load, then a
graceful SIGTERM that must drain what is in flight and leave no process and no shared-memory
segment behind."""
from __future__ import annotations

import os
import signal
import stat
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from dwdp.runtime.group import free_port
from dwdp.serve.launch import ServerProcess
from dwdp.serve.presets import preset_model
from servers import SERVER_START_S, paused, server_timeout

VOCAB = 512


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def mapped_inodes() -> set[int]:
    """Inodes of /dev/shm files some live process has mapped (other people's included). Inodes,
    not names: a named semaphore is mapped under the temporary name it was created with."""
    inodes = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                inodes.update(int(line.split()[4]) for line in f if "/dev/shm/" in line)
        except OSError:
            continue  # exited meanwhile, or not ours to read
    return inodes


def unmapped(names: set[str]) -> set[str]:
    """The files of `names` still in /dev/shm that no live process maps: leaked ones. Directories are
    not the server's (its segments go to its own DWDP_SHM_DIR): another test process made them."""
    live, left = mapped_inodes(), set()
    for name in names:
        try:
            info = os.stat(f"/dev/shm/{name}")
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(info.st_mode) and info.st_ino not in live:
            left.add(name)
    return left


@pytest.fixture(scope="module")
def model():
    return preset_model("tiny", seed=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_lifecycle")
    (root / "shm").mkdir()
    (root / "kv").mkdir()
    shm_before = shm_entries()
    # --restart never: today's behaviour, a dead worker stays dead (test_serve_restart has the other)
    # --stall-timeout 60: the tests pause workers (SIGSTOP) while they queue prompts; paused, they must not
    # count as stalled on a loaded machine (stalls are test_failover's and the chaos bench's).
    proc = ServerProcess(["--ranks", "3", "--expert-replicas", "2", "--peer-timeout", "1", "--preset", "tiny",
                          "--restart", "never", "--stall-timeout", "60", "--kv-dir", str(root / "kv")], free_port(),
                         env={"DWDP_SHM_DIR": str(root / "shm")}, log_path=str(root / "log"),
                         startup_timeout_s=SERVER_START_S)
    proc.root, proc.shm_before = root, shm_before
    proc.start()
    yield proc
    proc.kill()  # only does something if a test failed before stopping it


def first_token(model, ids: list[int]) -> int:
    with torch.inference_mode():
        return int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())


def prompts(seed: int, count: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (count, length), generator=gen).tolist()


def kill_while_busy(server, pool, post, batch, victim: int) -> tuple[list, int]:
    """Queue `batch` on paused workers (the router spreads it evenly), let them go, and SIGKILL worker
    `victim` in the middle of a forward with prompts still queued behind it. Returns (futures, the
    prompts it was running when killed). Each worker is handed more than one forward's worth of tokens,
    so the state is there to see on any machine, however fast its forwards."""
    pids = [w["pid"] for w in httpx.get(f"{server.url}/health", timeout=5).json()["workers"]]
    with paused(pids):
        futures = [pool.submit(post, ids) for ids in batch]
        wait_for(server, lambda h: h["in_flight"] == len(batch))
    while True:
        wait_for(server, lambda h: h["workers"][victim]["running"] > 0 and h["workers"][victim]["queued"] > 0)
        os.kill(pids[victim], signal.SIGSTOP)  # it starts no other forward: what the router counts stays true
        time.sleep(0.3)  # its last messages reach the router
        seen = httpx.get(f"{server.url}/health", timeout=5).json()["workers"][victim]
        if seen["running"] > 0 and seen["queued"] > 0:
            break
        # A loaded machine let it start its last queued forward between the look and the stop: go on to the next.
        assert seen["running"] + seen["queued"] > 0, f"worker {victim} ran out of prompts before it was caught: {seen}"
        os.kill(pids[victim], signal.SIGCONT)
    os.kill(pids[victim], signal.SIGKILL)
    return futures, seen["running"]


def wait_for(server, predicate, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = httpx.get(f"{server.url}/health", timeout=5).json()
        if predicate(health):
            return health
        time.sleep(0.005)
    raise AssertionError(f"condition not reached within {timeout_s} s: {health}")


@server_timeout(240)
def test_killing_a_worker_of_a_redundant_group_loses_no_request(server, model):
    """Every request gets an answer: the right first token, or a 5xx naming the killed rank (only
    those running on it when it died). Its queued requests go elsewhere, the survivors re-plan
    around it and keep serving every expert."""
    batch = prompts(1, 48, 200)  # three forwards a worker: a loaded machine gets a second try
    post = lambda ids: httpx.post(f"{server.url}/v1/prefill", json={"input_ids": ids}, timeout=120)
    with ThreadPoolExecutor(48) as pool:
        futures, running_on_victim = kill_while_busy(server, pool, post, batch, victim=1)
        answers = [f.result() for f in futures]  # a request without an HTTP answer raises here: lost
    failed = [r for r in answers if r.status_code != 200]
    for r in failed:
        error = r.json()["error"]
        assert r.status_code >= 500 and "rank 1" in error["message"], r.text
    assert len(failed) <= running_on_victim, ([r.status_code for r in answers], running_on_victim)
    for ids, r in zip(batch, answers):
        if r.status_code == 200:
            assert r.json()["first_token_id"] == first_token(model, ids), r.json()
    health = wait_for(server, lambda h: all("1" in h["workers"][r]["lost_peers"] for r in (0, 2)))
    assert health["status"] == "degraded" and health["retried"] >= 1, health
    dead = health["workers"][1]
    assert not dead["alive"] and not dead["routable"] and dead["exit_code"] == -signal.SIGKILL, dead
    for rank in (0, 2):
        w = health["workers"][rank]
        assert w["routable"] and w["replans"] == 1 and w["unservable_experts"] == [], w
        assert "exited without closing" in w["lost_peers"]["1"], w
    after_ids = prompts(2, 6, 30)
    after = [post(ids) for ids in after_ids]
    assert [r.status_code for r in after] == [200] * 6 and {r.json()["rank"] for r in after} <= {0, 2}, \
        [r.text for r in after]
    for ids, r in zip(after_ids, after):
        assert r.json()["first_token_id"] == first_token(model, ids), r.json()


@server_timeout(90)
def test_sigterm_drains_in_flight_requests_and_leaves_nothing(server, model):
    health = httpx.get(f"{server.url}/health", timeout=5).json()
    pids = [w["pid"] for w in health["workers"]]
    batch = prompts(3, 8, 120)
    post = lambda ids: httpx.post(f"{server.url}/v1/prefill", json={"input_ids": ids}, timeout=60)
    with ThreadPoolExecutor(8) as pool:
        with paused(pids):  # all 8 are in flight when SIGTERM comes, however fast the forwards
            futures = [pool.submit(post, ids) for ids in batch]
            wait_for(server, lambda h: h["in_flight"] == len(batch))
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)  # the server stops listening before any of them is answered
        answers = [f.result() for f in futures]
    assert [r.status_code for r in answers] == [200] * len(batch), [r.text for r in answers]
    for ids, r in zip(batch, answers):
        assert r.json()["first_token_id"] == first_token(model, ids)
    assert server.proc.wait(timeout=60) == 0, server.output()
    assert "dwdp serve: stopped" in server.output()
    for pid in pids + [server.proc.pid]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert list((server.root / "shm").iterdir()) == []
    leaked = unmapped(shm_entries() - server.shm_before)
    assert not leaked, f"segments left in /dev/shm by nobody alive: {leaked}"
    # Pending artifacts are removed at stop: no server would expire them once this one is gone.
    left = [p.name for p in (server.root / "kv").iterdir()]
    assert left == [".dwdp-serve.lock"], f"left in the KV directory after the server stopped: {left}"
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=2)
