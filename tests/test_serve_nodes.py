"""`dwdp serve` over two nodes emulated on one machine: one server a node (`--nnodes 2 --node-rank 0/1
--dist-init-addr`), 2 workers each, one DWDP group of 4 with redundancy 2. Each node has its own name
(DWDP_NODE) and node-local directory (DWDP_SHM_DIR); the host backend's segments are in a shared
"fabric" directory (DWDP_FABRIC_DIR); node 0's server hosts the group's store.

In order (the tests share the servers): both routers answer as the unwrapped model and /health shows
every rank and its node; a worker of node 1 killed under load on both routers is declared lost by node
0's workers by its beats (no pidfd across nodes), is restarted on node 1 and rejoins through the store,
with no request lost; a worker of node 0 is lost and taken back the same way by node 1; then all of node 1
is killed: node 0 declares both its ranks lost and serves on
(the placement spreads each node's experts over the ring: with 2 owners an expert, each node holds
them all), saying which experts nobody left holds where there are any."""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dwdp.runtime.group import free_port
from dwdp.runtime.placement import build_placement
from dwdp.serve.launch import ServerProcess
from servers import SERVER_START_S, server_timeout
from test_serve_lifecycle import first_token, model, prompts  # noqa: F401 (model: a fixture)

LOST_S = 1.5   # --remote-lost-after
RANKS, NODES = 2, 2


def _health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=5).json()


def _wait(server, predicate, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        health = _health(server)
        if predicate(health):
            return health
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {timeout_s} s on node {health['node_rank']}: {health}")
        time.sleep(0.02)


def _post(server, ids):
    return httpx.post(f"{server.url}/v1/prefill", json={"input_ids": ids}, timeout=120)


def start_nodes(root, ranks: int = RANKS, replicas: int = 2, extra: tuple = ()) -> list[ServerProcess]:
    """Two `dwdp serve`s, one a node, started together (each waits for the other's workers to join)."""
    for name in ("node0", "node1", "fabric"):
        (root / name).mkdir()
    address = f"127.0.0.1:{free_port()}"
    servers = []
    for node in range(NODES):
        servers.append(ServerProcess(
            ["--ranks", str(ranks), "--nnodes", str(NODES), "--node-rank", str(node), "--dist-init-addr", address,
             "--expert-replicas", str(replicas), "--peer-timeout", "0.5", "--remote-lost-after", str(LOST_S),
             "--preset", "tiny", "--restart", "on-failure", "--restart-backoff", "0.2", "--stall-timeout", "6",
             *extra], free_port(),
            env={"DWDP_NODE": f"node{node}", "DWDP_SHM_DIR": str(root / f"node{node}"),
                 "DWDP_FABRIC_DIR": str(root / "fabric")},
            log_path=str(root / f"log{node}"), startup_timeout_s=SERVER_START_S))
    errors = []

    def start(server):
        try:
            server.start()
        except BaseException as exc:  # noqa: BLE001 (reported below, with the other node's)
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in servers:
            s.kill()
        raise errors[0]
    return servers


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    servers = start_nodes(tmp_path_factory.mktemp("serve_nodes"))
    yield servers
    for s in servers:
        s.kill()


@server_timeout(60)
def test_both_nodes_answer_as_the_model_and_show_the_whole_group(nodes, model):
    for node, server in enumerate(nodes):
        health = _health(server)
        assert (health["node"], health["nnodes"], health["node_rank"]) == (f"node{node}", NODES, node), health
        assert [w["rank"] for w in health["workers"]] == [node * RANKS + i for i in range(RANKS)], health["workers"]
        assert all(w["node"] == f"node{node}" for w in health["workers"]), health["workers"]
        group = _wait(server, lambda h: all(g["state"] in ("serving", "alive") for g in h["group"]))["group"]
        assert [(g["rank"], g["node"]) for g in group] == [(r, f"node{r // RANKS}") for r in range(RANKS * NODES)], group
        ids_list = prompts(40 + node, 6, 20)
        answers = [_post(server, ids) for ids in ids_list]
        assert [r.status_code for r in answers] == [200] * len(answers), [r.text for r in answers]
        for ids, r in zip(ids_list, answers):
            assert r.json()["first_token_id"] == first_token(model, ids), r.json()
            assert r.json()["rank"] in [w["rank"] for w in health["workers"]], r.json()


@server_timeout(240)
def test_a_killed_worker_on_node_1_is_lost_by_its_beats_and_rejoins_through_the_store(nodes, model):
    node0, node1 = nodes
    victim_rank = 3
    victim = _health(node1)["workers"][1]
    assert victim["rank"] == victim_rank
    batches = [prompts(50, 24, 60), prompts(51, 24, 60)]
    with ThreadPoolExecutor(48) as pool:
        futures = [(server, ids, pool.submit(_post, server, ids)) for server, batch in zip(nodes, batches)
                   for ids in batch]
        _wait(node1, lambda h: h["in_flight"] > 0)
        os.kill(victim["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        lost = _wait(node0, lambda h: all(str(victim_rank) in w["lost_peers"] for w in h["workers"]))
        declared_s = time.monotonic() - killed_at
        answers = [(server, ids, f.result()) for server, ids, f in futures]  # no HTTP answer raises: lost
    for w in lost["workers"]:
        why = w["lost_peers"][str(victim_rank)]
        assert "another node" in why and "has not beaten" in why, why
    for server, ids, r in answers:
        if r.status_code == 200:
            assert r.json()["first_token_id"] == first_token(model, ids), r.json()
        else:  # only a prompt running on the killed worker, on its own node's router
            assert server is node1 and r.status_code >= 500 and f"rank {victim_rank}" in r.text, r.text
    back = _wait(node1, lambda h: h["workers"][1]["rejoins"] == 1 and h["workers"][1]["routable"], timeout_s=120)
    assert back["workers"][1]["pid"] != victim["pid"] and back["workers"][1]["expert_source"] == "peers", back
    healed = _wait(node0, lambda h: all(w["peer_rejoins"].get(str(victim_rank)) == 1 and not w["lost_peers"]
                                        for w in h["workers"]), timeout_s=60)
    healed_s = time.monotonic() - killed_at
    assert healed["min_redundancy"] == 2, healed["redundancy"]
    ids_list = prompts(52, 8, 20)
    after = [_post(node1, ids) for ids in ids_list]
    assert [r.status_code for r in after] == [200] * len(after), [r.text for r in after]
    assert victim_rank in {r.json()["rank"] for r in after}, "the restarted worker got no request"
    for ids, r in zip(ids_list, after):
        assert r.json()["first_token_id"] == first_token(model, ids), r.json()
    print(f"rank {victim_rank} on node 1 killed: declared lost by node 0 in {declared_s:.2f} s (bound {LOST_S} s), "
          f"healed in {healed_s:.2f} s")


@server_timeout(180)
def test_a_killed_worker_on_node_0_rejoins_too_and_node_1_takes_it_back(nodes, model):
    """Rank 0 (node 0, beside the store's host): node 1's workers lose it by its beats and take its
    replacement back once it published in the store."""
    node0, node1 = nodes
    victim = _health(node0)["workers"][0]
    assert victim["rank"] == 0
    os.kill(victim["pid"], signal.SIGKILL)
    _wait(node1, lambda h: all("0" in w["lost_peers"] or w["peer_rejoins"].get("0") == 1 for w in h["workers"]))
    back = _wait(node0, lambda h: h["workers"][0]["rejoins"] == 1 and h["workers"][0]["routable"], timeout_s=120)
    assert back["workers"][0]["pid"] != victim["pid"] and back["workers"][0]["expert_source"] == "peers", back
    healed = _wait(node1, lambda h: all(w["peer_rejoins"].get("0") == 1 and not w["lost_peers"]
                                        for w in h["workers"]), timeout_s=60)
    assert [g["state"] for g in healed["group"]] == ["alive", "alive", "serving", "serving"], healed["group"]
    ids_list = prompts(55, 6, 20)
    after = [_post(node0, ids) for ids in ids_list]
    assert [r.status_code for r in after] == [200] * len(after), [r.text for r in after]
    for ids, r in zip(ids_list, after):
        assert r.json()["first_token_id"] == first_token(model, ids), r.json()


@server_timeout(120)
def test_node_0_serves_on_when_node_1_dies_and_names_the_experts_nobody_holds(nodes, model):
    """With the placement spread over nodes, nobody: node 0 holds every expert and answers as before."""
    node0, node1 = nodes
    num_experts = len(_health(node0)["redundancy"])
    placement = build_placement(num_experts, RANKS * NODES, replicas=2, ranks_per_node=RANKS)
    held = {e for r in range(RANKS) for e in placement.local_experts(r)}
    unreachable = sorted(set(range(num_experts)) - held)
    node1.kill()  # its router, its workers: the whole node
    gone = _wait(node0, lambda h: all(set(w["lost_peers"]) == {"2", "3"} for w in h["workers"]), timeout_s=60)
    for w in gone["workers"]:
        assert w["unservable_experts"] == unreachable, (w["unservable_experts"], unreachable)
        assert all("another node" in why for why in w["lost_peers"].values()), w["lost_peers"]
    assert [g["state"] for g in gone["group"]] == ["serving" if not unreachable else "ready"] * 2 + ["lost"] * 2, gone
    assert unreachable == [] and gone["status"] == "ok" and gone["min_redundancy"] == 1, gone
    for ids in prompts(60, 6, 20):
        r = _post(node0, ids)
        assert r.status_code == 200 and r.json()["first_token_id"] == first_token(model, ids), r.text
