"""The group's store dies (`dwdp serve` over two emulated nodes, one worker each; node 0's router hosts
the store and is killed, its worker left running): node 1 serves on with the same answers, its
workers see the other node's liveness as unknown (never lost for the store's silence), and a worker
of node 1 that dies then cannot rejoin: its restart says why (the store is unreachable) and, once its
restarts are spent, it is left down with that reason. Healing waits for the group to be started again."""
from __future__ import annotations

import os
import signal

import httpx

from dwdp.runtime.group import free_port
from dwdp.serve.launch import ServerProcess
from servers import SERVER_START_S, server_timeout
from test_serve_lifecycle import first_token, model, prompts  # noqa: F401 (model: a fixture)
from test_serve_nodes import _health, _post, _wait, start_nodes


@server_timeout(240)
def test_node_1_serves_on_when_the_store_host_dies_and_healing_waits(tmp_path, model):
    servers = start_nodes(tmp_path, ranks=1, replicas=1, extra=["--max-restarts-per-minute", "1"])
    try:
        node0, node1 = servers
        ids_list = prompts(70, 4, 20)
        before = [_post(node1, ids) for ids in ids_list]
        assert [r.status_code for r in before] == [200] * len(before), [r.text for r in before]
        os.kill(node0.proc.pid, signal.SIGKILL)  # node 0's router, the store's host; its worker lives on
        unknown = _wait(node1, lambda h: [g["state"] for g in h["group"]] == ["unknown", "serving"])
        assert unknown["workers"][0]["lost_peers"] == {}, unknown["workers"][0]
        after = [_post(node1, ids) for ids in ids_list]
        assert [r.status_code for r in after] == [200] * len(after), [r.text for r in after]
        for ids, r in zip(ids_list, after):
            assert r.json()["first_token_id"] == first_token(model, ids), r.json()
        os.kill(_health(node1)["workers"][0]["pid"], signal.SIGKILL)
        down = _wait(node1, lambda h: h["workers"][0]["down_reason"] is not None, timeout_s=120)
        reason = down["workers"][0]["down_reason"]
        assert "cannot rejoin" in reason and "store" in reason, reason
        assert down["status"] == "unavailable", down["status"]
    finally:
        for s in servers:
            s.kill()
