"""`dwdp serve`: bind the port, start the workers, serve HTTP until SIGINT/SIGTERM, drain, stop."""
from __future__ import annotations

import shutil
import signal
import socket
import sys
import tempfile
import time

from dwdp.serve.auth import is_loopback
from dwdp.serve.config import ServeConfig, split_address
from dwdp.serve.front import FrontConfig
from dwdp.serve.kv_budget import default_budget
from dwdp.serve.kv_dir import KVDirError, claim_kv_dir
from dwdp.serve.kv_ledger import KVLedger
from dwdp.serve.pool import StartupError, WorkerPool
from dwdp.serve.preflight import PreflightError, preflight


def _bind(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def run_server(config: ServeConfig, front: FrontConfig | None = None) -> int:
    """Serve until interrupted; returns the process exit code (2 for a model or tokenizer path that
    does not load, 1 when a worker fails to start). front: the decode server, KV expiry, API key."""
    import uvicorn

    from dwdp.serve.api import BodyLimit, create_app

    # Paths first, in this process: a bad one is one line before any port, directory or worker exists.
    try:
        tokenizer = preflight(config)
    except PreflightError as exc:
        print(f"dwdp serve: {exc}", file=sys.stderr)
        return 2
    # Bound next: a taken port fails before any worker is spawned, and --port 0 picks a free one.
    sock = _bind(config.host, config.port)
    host, port = sock.getsockname()[:2]
    front = front or FrontConfig()
    if front.api_key is None and not is_loopback(config.host):
        print(f"dwdp serve: warning: bound to {config.host} without an API key: anyone who reaches the port can use "
              "it (give --api-key or DWDP_API_KEY)", file=sys.stderr, flush=True)
    if config.nnodes > 1 and config.node_rank == 0 and not is_loopback(split_address(config.dist_init_addr)[0]):
        print(f"dwdp serve: the group's store listens on {config.dist_init_addr} without authentication: anyone who "
              "reaches it can rewrite the group's board; keep that address on a network only the group's nodes "
              "reach", file=sys.stderr, flush=True)
    kv_dir = config.kv_dir or tempfile.mkdtemp(prefix="dwdp-kv-")
    try:
        claim = claim_kv_dir(kv_dir)
    except KVDirError as exc:
        print(f"dwdp serve: {exc}", file=sys.stderr)
        sock.close()
        return 2
    if claim.swept:
        print(f"dwdp serve: removed {claim.swept} KV artifacts an earlier server left in {claim.path}", flush=True)
    pool = WorkerPool(config, claim.path)
    ledger = KVLedger(front.kv_ttl_s).start()
    budget = default_budget(claim.path, front.kv_max_pending, front.kv_max_pending_bytes, front.kv_min_free_bytes)
    started = time.monotonic()
    try:
        pool.start()
        # A start that never gets ready (a launcher's bound runs out) shows how far it got in the log.
        nodes = (f" (group ranks {config.first_rank}..{config.first_rank + config.ranks - 1} of {config.group_ranks}, "
                 f"node {config.node_rank} of {config.nnodes}, store at {config.dist_init_addr}"
                 f"{', hosted here' if config.node_rank == 0 else ''})") if config.nnodes > 1 else ""
        print(f"dwdp serve: {config.ranks} {config.mode} workers{nodes} started; waiting for them to build the model and "
              f"join (at most {config.startup_timeout_s:.0f} s)", flush=True)
        try:
            pool.wait_ready()
        except StartupError as exc:
            print(f"dwdp serve: {exc}", file=sys.stderr)
            return 1
        workers = pool.snapshot()["workers"]
        warmup = max(w.get("warmup_s", 0.0) for w in workers)
        devices = ", ".join(sorted({w.get("device", "?") for w in workers}))
        print(f"dwdp serve: ready in {time.monotonic() - started:.1f} s on {devices} (slowest warm-up "
              f"{warmup:.1f} s: kernels compiled before the first request)", flush=True)
        from dwdp.models.tiny import SPECIAL_TOKEN_IDS
        from dwdp.serve.decode import eos_token_ids

        eos = eos_token_ids(config.model, tokenizer, None if config.model else SPECIAL_TOKEN_IDS["eos_token_id"])
        app = BodyLimit(create_app(pool, config, tokenizer, front, ledger, eos, budget=budget), config.max_body_bytes)
        server = uvicorn.Server(uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off",
            timeout_graceful_shutdown=int(config.drain_timeout_s)))
        print(f"dwdp serve: {config.ranks} {config.mode} workers ({config.model_name}, max_num_tokens "
              f"{config.max_num_tokens}, batch order {config.batch_order}) "
              f"listening on http://{host}:{port}; KV artifacts in {kv_dir}"
              + (f"; decode on {front.decode_url}" if front.decode_url else "")
              + ("; API key required" if front.api_key else ""), flush=True)
        # uvicorn ends its loop gracefully on both signals, then re-raises them to these handlers;
        # they must return so the pool below drains and stops the workers.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda signum, frame: None)
        server.run(sockets=[sock])
        return 0
    finally:
        pool.close()
        ledger.close(remove_pending=True)  # nobody expires them once this server is gone
        claim.release()
        sock.close()
        if config.kv_dir is None:
            shutil.rmtree(kv_dir, ignore_errors=True)
        print("dwdp serve: stopped", flush=True)
