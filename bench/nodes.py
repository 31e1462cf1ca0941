"""A DWDP group of 4 over two nodes emulated on one machine, against the same group on one host, in one run.

Per layout (`dwdp serve --ranks 2 --nnodes 2` twice, with DWDP_NODE, per-node DWDP_SHM_DIR and a shared
DWDP_FABRIC_DIR; or `dwdp serve --ranks 4`), the tiny preset, redundancy 2:
- setup: from starting the server(s) to every router answering /health (every worker built its model,
  joined the group and warmed up), and the slowest worker's own `ready_s` (its model and the group's setup);
- per trial (`--trials`), worker rank 3 is killed (SIGKILL) while the routers are idle:
  `declared`: until every worker of rank 0's router reports rank 3 lost (node 0 learns it by beats in the
  store when the group spans nodes, by its pidfd on one host); `healed`: until those workers report rank
  3 rejoined (its router restarted it and it rejoined through the board: the store's, or the node's).
Times are read by polling /health every 20 ms; workers report every --stall-timeout / 4 s, so each time
is late by up to that much (the `resolution` column). Prints the table; writes bench/results/nodes_cpu.json.

    PYTHONPATH=. python bench/nodes.py [--trials 3] [--remote-lost-after 1.5]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from dwdp.observe.timing import load_average_1min, machine
from dwdp.runtime.group import free_port
from dwdp.serve.launch import ServerProcess

RESULTS = Path(__file__).resolve().parent / "results"
VICTIM = 3


def _health(server) -> dict:
    return httpx.get(f"{server.url}/health", timeout=5).json()


def _until(server, predicate, timeout_s: float = 120.0) -> float:
    start = time.monotonic()
    while not predicate(_health(server)):
        if time.monotonic() - start > timeout_s:
            raise TimeoutError(f"not reached within {timeout_s} s: {_health(server)}")
        time.sleep(0.02)
    return time.monotonic()


def start(layout: str, root: Path, args) -> tuple[list[ServerProcess], float]:
    common = ["--expert-replicas", "2", "--peer-timeout", str(args.peer_timeout), "--preset", "tiny",
              "--restart", "on-failure", "--restart-backoff", "0.2", "--max-restarts-per-minute", "20",
              "--stall-timeout", str(args.stall_timeout)]
    if layout == "one host":
        (root / "shm").mkdir()
        servers = [ServerProcess(["--ranks", "4", *common], free_port(), env={"DWDP_SHM_DIR": str(root / "shm")},
                                 log_path=str(root / "log"), startup_timeout_s=300)]
    else:
        address = f"127.0.0.1:{free_port()}"
        for name in ("node0", "node1", "fabric"):
            (root / name).mkdir()
        servers = [ServerProcess(["--ranks", "2", "--nnodes", "2", "--node-rank", str(node), "--dist-init-addr",
                                  address, "--remote-lost-after", str(args.remote_lost_after), *common], free_port(),
                                 env={"DWDP_NODE": f"node{node}", "DWDP_SHM_DIR": str(root / f"node{node}"),
                                      "DWDP_FABRIC_DIR": str(root / "fabric")},
                                 log_path=str(root / f"log{node}"), startup_timeout_s=300) for node in (0, 1)]
    started = time.monotonic()
    threads = [threading.Thread(target=s.start) for s in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in servers:
        _health(s)  # raises when a start failed
    return servers, time.monotonic() - started


def trial(servers: list[ServerProcess], rejoins_before: int) -> tuple[float, float]:
    first, owner = servers[0], servers[-1]  # rank 0's router; the victim's (the same one on one host)
    victim = next(w for w in _health(owner)["workers"] if w["rank"] == VICTIM)
    watchers = [w["rank"] for w in _health(first)["workers"] if w["rank"] != VICTIM]
    killed = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    declared = _until(first, lambda h: all(str(VICTIM) in w["lost_peers"] for w in h["workers"]
                                           if w["rank"] in watchers))
    healed = _until(first, lambda h: all(w["peer_rejoins"].get(str(VICTIM), 0) > rejoins_before
                                         and not w["lost_peers"] for w in h["workers"] if w["rank"] in watchers))
    return declared - killed, healed - killed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--remote-lost-after", type=float, default=1.5)
    parser.add_argument("--peer-timeout", type=float, default=0.5)
    parser.add_argument("--stall-timeout", type=float, default=1.0)
    args = parser.parse_args()
    load_before = load_average_1min()
    rows = []
    for layout in ("one host", "two nodes"):
        with tempfile.TemporaryDirectory(prefix="dwdp-nodes-") as tmp:
            servers, setup_s = start(layout, Path(tmp), args)
            try:
                ready_s = max(w["ready_s"] for s in servers for w in _health(s)["workers"])
                times = [trial(servers, i) for i in range(args.trials)]
            finally:
                for s in servers:
                    s.kill()
        rows.append({"layout": layout, "setup_s": setup_s, "slowest_worker_ready_s": ready_s,
                     "declared_s": [d for d, _ in times], "healed_s": [h for _, h in times],
                     "declared_median_s": statistics.median(d for d, _ in times),
                     "healed_median_s": statistics.median(h for _, h in times)})
    base = rows[0]
    print(f"\n4 ranks, tiny preset, redundancy 2; remote bound {args.remote_lost_after} s; health reports every "
          f"{args.stall_timeout / 4:.2f} s (the resolution of every time below); {args.trials} kills of rank {VICTIM}")
    print(f"{'layout':10s} {'setup s':>8s} {'ready s':>8s} {'declared s (median)':>20s} {'x one host':>10s} "
          f"{'healed s (median)':>18s} {'x one host':>10s}")
    for r in rows:
        print(f"{r['layout']:10s} {r['setup_s']:8.2f} {r['slowest_worker_ready_s']:8.2f} "
              f"{r['declared_median_s']:20.2f} {r['declared_median_s'] / base['declared_median_s']:10.2f} "
              f"{r['healed_median_s']:18.2f} {r['healed_median_s'] / base['healed_median_s']:10.2f}")
    out = RESULTS / "nodes_cpu.json"
    out.write_text(json.dumps({"machine": machine(), "load_average_1min": [load_before, load_average_1min()],
                               "args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
