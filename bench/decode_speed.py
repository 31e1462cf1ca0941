"""Decode speed of the pair against vLLM alone, in turns, with a load generator light enough for a small
machine (one asyncio process; AIPerf's own processes take much of a 2-core machine's CPU):

    python bench/decode_speed.py --vllm-python .venv-vllm/bin/python [--endpoint-type chat] [--default-reservation]

Setups, as bench/aiperf_pair.py starts them (the same tiny checkpoint and prompts, prefix caching off):
"vllm" (vLLM alone), "vllm+connector" (vLLM with dwdp's connector and dwdp.integrations.vllm_cpu_env(),
asked directly: no kv_transfer_params), "dwdp+vllm" (dwdp serve --decode-url in front of it), "proxy"
(tests/vllm/pd_proxy.py: dwdp serve as the prefill pool, that vLLM as the decode pool) and, with
--default-reservation, "vllm+connector, default cores" (vLLM's own core reservation for connectors: the
before). Each turn starts every setup fresh and runs --requests streamed requests of --osl output tokens
(ignore_eos) at --concurrency after --warmup requests; output tokens are the servers' own counts
(stream_options.include_usage). Reports output tokens/s, TTFT and inter-token latency per run, and each
setup's output tokens/s over vLLM alone's of the same turn (median over turns); the 1-minute load
average is read before and after each run. Writes bench/results/decode_speed_cpu.json (or --out).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from aiperf_pair import MODEL, ROOT, STARTUP_S, against_vllm_alone, free_port, vllm_cmd, write_prompts  # noqa: E402

from dwdp.integrations import vllm_cpu_env  # noqa: E402
from dwdp.serve.launch import HttpServerProcess, ServerProcess  # noqa: E402


async def one_request(client: httpx.AsyncClient, url: str, text: str, args) -> dict:
    """One streamed request: {ttft_s, itl_s, tokens} (tokens: the server's completion_tokens)."""
    if args.endpoint_type == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}
    else:
        path, body = "/v1/completions", {"prompt": text}
    body.update({"model": MODEL, "max_tokens": args.osl, "ignore_eos": True, "temperature": 0, "stream": True,
                 "stream_options": {"include_usage": True}})
    started, stamps, tokens = time.perf_counter(), [], None
    async with client.stream("POST", f"{url}{path}", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}{path} answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or ():
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    stamps.append(time.perf_counter())
    if tokens is None or not stamps:
        raise RuntimeError(f"{url}{path}: a stream without usage or text")
    itl = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    return {"ttft_s": stamps[0] - started, "itl_s": itl, "tokens": tokens}


async def run_load(url: str, prompts: list[str], args) -> dict:
    limit = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(text):
            async with limit:
                return await one_request(client, url, text, args)

        await asyncio.gather(*(one(p) for p in prompts[:args.warmup]))
        started = time.perf_counter()
        results = await asyncio.gather(*(one(p) for p in prompts[args.warmup:args.warmup + args.requests]))
        elapsed = time.perf_counter() - started
    return {"output_tokens_per_s": sum(r["tokens"] for r in results) / elapsed, "seconds": elapsed,
            "ttft_ms_avg": 1e3 * statistics.mean(r["ttft_s"] for r in results),
            "ttft_ms_p50": 1e3 * statistics.median(r["ttft_s"] for r in results),
            "itl_ms_avg": 1e3 * statistics.mean(r["itl_s"] for r in results),
            "output_tokens": sum(r["tokens"] for r in results)}


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` so far (Linux /proc; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(name: str, url: str, prompts: list[str], args, runs: list, repeat: int,
            watch: dict[str, int] | None = None) -> None:
    """One run; `watch`: {name: pid} of processes whose CPU time per output token is recorded (the relay's
    HTTP process, vLLM's API server)."""
    before = os.getloadavg()[0]
    cpu_before = {k: cpu_seconds(pid) for k, pid in (watch or {}).items()}
    row = asyncio.run(run_load(url, prompts, args))
    for k, pid in (watch or {}).items():
        after = cpu_seconds(pid)
        if after is not None and cpu_before[k] is not None:  # warm-up requests included: a slight overcount
            row[f"{k}_cpu_us_per_token"] = 1e6 * (after - cpu_before[k]) / row["output_tokens"]
    row.update({"setup": name, "repeat": repeat, "load": f"concurrency:{args.concurrency}",
                "load_avg_before": round(before, 2), "load_avg_after": round(os.getloadavg()[0], 2)})
    runs.append(row)
    print(f"turn {repeat + 1} {name:30s} {row['output_tokens_per_s']:7.1f} output tok/s, TTFT avg "
          f"{row['ttft_ms_avg']:.1f} ms, ITL {row['itl_ms_avg']:.2f} ms (load average {before:.2f})", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, help="python of the venv with vllm-cpu and dwdp (no deps)")
    parser.add_argument("--endpoint-type", choices=("completions", "chat"), default="chat")
    parser.add_argument("--ranks", type=int, default=2, help="dwdp serve --ranks")
    parser.add_argument("--isl", type=int, default=96)
    parser.add_argument("--isl-stddev", type=int, default=16)
    parser.add_argument("--osl", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="turns of the setups")
    parser.add_argument("--default-reservation", action="store_true",
                        help="also measure vLLM with the connector at vLLM's default core reservation (the before)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "decode_speed_cpu.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dwdp-decode-speed-"))
    checkpoint = work / MODEL
    subprocess.run([sys.executable, str(ROOT / "examples" / "save_tiny_checkpoint.py"), str(checkpoint)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    write_prompts(work / "prompts.jsonl", args.isl, args.isl_stddev)
    prompts = [json.loads(line)["text"] for line in (work / "prompts.jsonl").read_text().splitlines()]
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "DWDP_KV_KEY": secrets.token_hex(32)}
    kv_dir = Path("/dev/shm") / f"dwdp-decode-speed-kv-{os.getpid()}"
    runs: list[dict] = []
    for repeat in range(args.repeats):
        port = free_port()
        with HttpServerProcess(vllm_cmd(args, checkpoint, port, None), port, env, STARTUP_S,
                               str(work / f"vllm_alone_{repeat}.log"), name="vllm") as alone:
            measure("vllm", f"http://127.0.0.1:{port}", prompts, args, runs, repeat, {"vllm_api": alone.proc.pid})
        try:
            if args.default_reservation:
                port = free_port()
                with HttpServerProcess(vllm_cmd(args, checkpoint, port, kv_dir), port, env, STARTUP_S,
                                       str(work / f"vllm_connector_default_{repeat}.log"), name="vllm"):
                    measure("vllm+connector, default cores", f"http://127.0.0.1:{port}", prompts, args, runs, repeat)
            vport, dport, pport = free_port(), free_port(), free_port()
            dwdp_args = ["--ranks", str(args.ranks), "--model", str(checkpoint), "--kv-dir", str(kv_dir),
                         "--decode-url", f"http://127.0.0.1:{vport}"]
            proxy = [args.vllm_python, str(ROOT / "tests" / "vllm" / "pd_proxy.py"), "--prefill",
                     f"http://127.0.0.1:{dport}", "--decode", f"http://127.0.0.1:{vport}", "--port", str(pport)]
            with HttpServerProcess(vllm_cmd(args, checkpoint, vport, kv_dir), vport, {**env, **vllm_cpu_env()},
                                   STARTUP_S, str(work / f"vllm_connector_{repeat}.log"), name="vllm") as vllm, \
                    ServerProcess(dwdp_args, dport, env=env, startup_timeout_s=STARTUP_S,
                                  log_path=str(work / f"dwdp_{repeat}.log")) as dwdp, \
                    HttpServerProcess(proxy, pport, env, STARTUP_S, str(work / f"proxy_{repeat}.log"),
                                      name="proxy") as relay:
                api = {"vllm_api": vllm.proc.pid}
                measure("vllm+connector", f"http://127.0.0.1:{vport}", prompts, args, runs, repeat, api)
                measure("dwdp+vllm", f"http://127.0.0.1:{dport}", prompts, args, runs, repeat,
                        {**api, "relay": dwdp.proc.pid})
                measure("proxy", f"http://127.0.0.1:{pport}", prompts, args, runs, repeat, {**api, "relay": relay.proc.pid})
        finally:
            for leftover in kv_dir.glob("*"):
                leftover.unlink()
            if kv_dir.exists():
                kv_dir.rmdir()

    ratios = against_vllm_alone(runs)
    result = {"what": f"decode speed, streamed {args.endpoint_type}, concurrency {args.concurrency}: the pair, the "
                      "pair behind a vLLM-protocol proxy and vLLM with the connector against vLLM alone, in turns, on "
                      "one CPU machine", "device": "cpu", "cpus": os.cpu_count(), "ranks": args.ranks,
              "isl": args.isl, "isl_stddev": args.isl_stddev, "osl": args.osl, "requests": args.requests,
              "warmup": args.warmup, "repeats": args.repeats, "prefix_caching": False, "runs": runs,
              "against_vllm_alone": ratios, "logs": str(work)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n| setup | turn | load average (before / after) | output tokens/s | TTFT avg / p50 (ms) | ITL avg (ms) | "
          "CPU per output token: relay / vLLM's API server (us) |")
    print("|---|---|---|---|---|---|---|")
    us = lambda r, k: f"{r[k]:.0f}" if k in r else "-"  # noqa: E731
    for r in sorted(runs, key=lambda r: (r["setup"], r["repeat"])):
        print(f"| {r['setup']} | {r['repeat'] + 1} | {r['load_avg_before']} / {r['load_avg_after']} | "
              f"{r['output_tokens_per_s']:.1f} | {r['ttft_ms_avg']:.1f} / {r['ttft_ms_p50']:.1f} | "
              f"{r['itl_ms_avg']:.2f} | {us(r, 'relay_cpu_us_per_token')} / {us(r, 'vllm_api_cpu_us_per_token')} |")
    print("\n| setup | output tokens/s over vLLM alone's, same turn: median (each turn) |")
    print("|---|---|")
    for row in ratios:
        print(f"| {row['setup']} | {row['median']:.2f} ({', '.join(f'{x:.2f}' for x in row['turns'])}) |")
    print(f"\nwrote {args.out}; server logs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
