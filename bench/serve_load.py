"""Open-loop load against `dwdp serve`: Poisson arrivals at each offered rate, prompt lengths from
the workload generator's imbalanced per-client streams, bounded in requests and in time.

Clients stand in for the workload generator's ranks: client r's share of arrivals is f_r / G
(factors with coefficient of variation --cv, dwdp.predict.workload.rank_factors), and its prompt lengths
are uniform in [ceil(isl_ratio * isl), isl] as in dwdp.predict.workload. The superposition is Poisson at
the offered rate. Each row reports what the client measured (TTFT = request sent -> first token
answered) and how the router spread prompt tokens over the ranks.

Starts its own server on a free loopback port unless --url is given; deletes each KV artifact once
answered (a generation server would consume it). Prints the table last; writes
bench/results/serve_load_<device>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np

from dwdp.benchmarks.load import add_load_arguments
from dwdp.benchmarks.serving import render_table
from dwdp.runtime.group import free_port
from dwdp.serve.launch import ServerProcess
from dwdp.observe.timing import load_average_1min
from dwdp.predict.workload import WorkloadConfig, coefficient_of_variation, make_workload

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 512  # the tiny preset's; ids are drawn in [3, VOCAB)


def arrivals(rate: float, num_requests: int, duration_s: float, clients: int, isl: int, isl_ratio: float, cv: float,
             max_num_tokens: int, seed: int) -> list[tuple[float, int, list[int]]]:
    """(send time s, client, prompt ids) of every request, in time order, at most `num_requests`
    and none after `duration_s`."""
    mean_len = (1 + isl_ratio) / 2 * isl
    per_client = max(isl, math.ceil(2 * num_requests * mean_len / clients))  # room for the busiest client
    # The server chunks prompts past max_num_tokens; the workload model asks that each fits one forward.
    workload = make_workload(WorkloadConfig(clients, per_client, isl, isl_ratio, cv, max(max_num_tokens, isl), seed))
    share = np.array(workload.factors) / sum(workload.factors)
    rng = np.random.default_rng(seed)
    streams = [list(s.requests) for s in workload.streams]
    t, out = 0.0, []
    while len(out) < num_requests:
        t += rng.exponential(1.0 / rate)
        if t > duration_s:
            break
        client = int(rng.choice(clients, p=share))
        if not streams[client]:
            continue  # this client's stream is used up; its share of later arrivals is dropped
        length = streams[client].pop(0)
        out.append((t, client, rng.integers(3, VOCAB, length).tolist()))
    return out


async def _one(http: httpx.AsyncClient, url: str, ids: list[int]) -> dict:
    """One request; `done` is the perf_counter time its answer (or transport error) came back."""
    sent = time.perf_counter()
    try:
        r = await http.post(f"{url}/v1/prefill", json={"input_ids": ids})
    except httpx.HTTPError as exc:
        done = time.perf_counter()
        return {"status": "transport", "error": type(exc).__name__, "message": str(exc), "ttft_s": done - sent,
                "done": done}
    done = time.perf_counter()
    ttft = done - sent
    body = r.json()
    if r.status_code != 200:
        error = body.get("error", {})
        return {"status": r.status_code, "error": error.get("type", "?"), "message": error.get("message", ""),
                "ttft_s": ttft, "done": done}
    try:
        os.unlink(body["kv"]["path"])
    except OSError:
        pass  # a server elsewhere, or already consumed
    return {"status": 200, "ttft_s": ttft, "done": done, "tokens": body["prompt_tokens"], "rank": body["rank"],
            "first_token_id": body["first_token_id"], "queue_s": body["timing"]["queue_s"],
            "prefill_s": body["timing"]["prefill_s"], "batch_size": body["timing"]["batch_size"],
            "batch_tokens": body["timing"]["batch_tokens"]}


async def run_rate(url: str, plan: list, timeout_s: float, start: float | None = None) -> tuple[list[dict], float]:
    """Send every request of `plan` at its time after `start` (perf_counter; default now), whatever
    is still in flight (open loop)."""
    limits = httpx.Limits(max_connections=len(plan) + 1, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
        start = time.perf_counter() if start is None else start
        tasks = []
        for at, _, ids in plan:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival process, not a stand-in for work
            tasks.append(asyncio.create_task(_one(http, url, ids)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def summarise(rate: float, plan: list, results: list[dict], makespan: float, ranks: int, waits: float) -> dict:
    ok = [r for r in results if r["status"] == 200]
    ttft = np.array([r["ttft_s"] for r in ok]) if ok else np.array([float("nan")])
    per_rank = [sum(r["tokens"] for r in ok if r["rank"] == k) for k in range(ranks)]
    return {
        "offered_rate": rate, "sent": len(plan), "ok": len(ok),
        "errors": dict(Counter(f"{r['status']}:{r['error']}" for r in results if r["status"] != 200)),
        "makespan_s": makespan, "throughput_rps": len(ok) / makespan,
        "tokens_per_s": sum(r["tokens"] for r in ok) / makespan,
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
        "queue_mean_s": float(np.mean([r["queue_s"] for r in ok])) if ok else float("nan"),
        "prefill_mean_s": float(np.mean([r["prefill_s"] for r in ok])) if ok else float("nan"),
        "batch_mean": float(np.mean([r["batch_size"] for r in ok])) if ok else float("nan"),
        "tokens_per_rank": per_rank, "rank_token_cv": coefficient_of_variation(per_rank),
        "client_token_cv": coefficient_of_variation(
            [sum(len(ids) for _, c, ids in plan if c == k) for k in {c for _, c, _ in plan}]),
        "prefetch_wait_s": waits,
    }


def format_table(rows: list[dict]) -> str:
    header = ("offered req/s", "sent", "ok", "errors", "req/s", "tok/s", "TTFT p50 ms", "TTFT p99 ms",
              "queue ms", "prefill ms", "batch", "client tok CV", "rank tok CV", "prefetch wait s")
    lines = [(f"{r['offered_rate']:g}", str(r["sent"]), str(r["ok"]), str(sum(r["errors"].values())),
              f"{r['throughput_rps']:.2f}", f"{r['tokens_per_s']:.0f}", f"{1e3 * r['ttft_p50_s']:.0f}",
              f"{1e3 * r['ttft_p99_s']:.0f}", f"{1e3 * r['queue_mean_s']:.0f}", f"{1e3 * r['prefill_mean_s']:.0f}",
              f"{r['batch_mean']:.1f}", f"{r['client_token_cv']:.2f}", f"{r['rank_token_cv']:.2f}",
              f"{r['prefetch_wait_s']:.2f}") for r in rows]
    return render_table(header, lines)


def command_line(script: str, args: argparse.Namespace) -> str:
    """The command that reproduces a run: every option given or defaulted, --out left out."""
    return f"python bench/{script} " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None and k != "out")


def _prefetch_wait(url: str) -> float:
    return sum(w["prefetch_wait_s"] for w in httpx.get(f"{url}/health", timeout=10).json()["workers"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start one here)")
    add_load_arguments(p, ranks=2, duration_s=30.0, window="rate (at most)", clients=True)
    p.add_argument("--rates", default="1,2,4", help="offered request rates per second, comma-separated")
    p.add_argument("--num-requests", type=int, default=40, help="most requests per rate (default 40)")
    p.add_argument("--out", help="JSON path (default bench/results/serve_load_cpu.json)")
    return p


def main() -> int:
    args = build_parser().parse_args()
    rates = [float(x) for x in args.rates.split(",")]

    load_before = load_average_1min()
    server = None
    url = args.url
    if url is None:
        server = ServerProcess(["--ranks", str(args.ranks), "--preset", "tiny", "--max-num-tokens",
                                str(args.max_num_tokens)], free_port(), startup_timeout_s=300).start()
        url = server.url
    rows = []
    try:
        ranks = len(httpx.get(f"{url}/health", timeout=10).json()["workers"])
        warm = arrivals(100.0, 2 * ranks, 10.0, args.clients, args.isl, args.isl_ratio, 0.0, args.max_num_tokens,
                        args.seed + 999)
        asyncio.run(run_rate(url, warm, args.timeout))  # first forwards touch buffers and build plans
        for i, rate in enumerate(rates):
            plan = arrivals(rate, args.num_requests, args.duration, args.clients, args.isl, args.isl_ratio, args.cv,
                            args.max_num_tokens, args.seed + i)
            wait_before = _prefetch_wait(url)
            results, makespan = asyncio.run(run_rate(url, plan, args.timeout))
            rows.append(summarise(rate, plan, results, makespan, ranks, _prefetch_wait(url) - wait_before))
    finally:
        if server is not None:
            server.stop()
    out = Path(args.out) if args.out else RESULTS / "serve_load_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": command_line("serve_load.py", args),
            "machine": f"{platform.machine()} {os.cpu_count()} cores, CPU only", "ranks": ranks,
            "model": "tiny preset (DeepSeek-V3-style, 16 experts x 4 MoE layers, fp32)",
            "ttft": "client-measured, request sent -> answer with the first token and KV artifact",
            "load_average_1min": {"before": load_before, "after": load_average_1min()}}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"serve_load: {ranks} ranks at {url}; isl {args.isl} ratio {args.isl_ratio}, {args.clients} clients with "
          f"share CV {args.cv}, seed {args.seed}; 1-min load average {load_before:.2f} before, "
          f"{meta['load_average_1min']['after']:.2f} after on {os.cpu_count()} CPUs; results in {out}")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
