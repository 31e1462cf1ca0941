"""gpu_check section h  `dwdp serve --device cuda` with two workers on the "small" preset: time to ready
   (model built, kernels compiled, warmed up), then a fixed open-loop load (Poisson arrivals, fixed
   prompt length) through the openai client: TTFT p50/p99 client-side, prompt tokens/s, failed
   requests, and the worst of each worker's first 50 forwards after ready against their median (a
   kernel compile in the middle of serving would show there)."""
from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time

KEY = "h_serve"
# Packages the GPU image lacks (GPU_NOTES): gpu_check skips this section without them.
REQUIRES = ("fastapi", "uvicorn", "openai", "httpx")
RANKS = 2
FIRST = 50
TARGET_WORST_OVER_MEDIAN = 1.5


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def _load(base_url: str, model: str, requests: int, rate_per_s: float, prompt_tokens: int, vocab: int,
          seed: int) -> list[dict]:
    """`requests` prompts of `prompt_tokens` ids, sent at Poisson times at `rate_per_s` (open loop: each
    on its own thread at its time, whatever the answers before it did); one dict per request, then one
    with the wall time."""
    import numpy as np
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", timeout=120.0, max_retries=0)
    rng = np.random.default_rng(seed)
    sends = np.cumsum(rng.exponential(1.0 / rate_per_s, requests))
    prompts = [rng.integers(3, vocab, prompt_tokens).tolist() for _ in range(requests)]
    out: list[dict] = [{} for _ in range(requests)]
    start = time.perf_counter()

    def one(i: int) -> None:
        sent = time.perf_counter()
        try:
            client.completions.create(model=model, prompt=prompts[i], max_tokens=1)
            out[i] = {"ok": True, "ttft_s": time.perf_counter() - sent, "sent_s": sent - start}
        except Exception as exc:  # a failed request is a figure of the check, not its end
            out[i] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300], "sent_s": sent - start}

    threads = []
    for i, at in enumerate(sends):
        delay = start + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # the arrival schedule itself, not a stand-in for work
        thread = threading.Thread(target=one, args=(i,), daemon=True)
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join(timeout=300)
    out.append({"wall_s": time.perf_counter() - start})
    return out


def run(sections: dict) -> dict:
    return serve_check("cuda", "small", requests=160, rate_per_s=40.0, prompt_tokens=512)


def serve_check(device: str, preset: str, *, requests: int, rate_per_s: float, prompt_tokens: int) -> dict:
    """Start `dwdp serve --device <device> --preset <preset>` with RANKS workers, load it, read its /health."""
    import httpx

    from dwdp.runtime.group import free_port
    from dwdp.serve.launch import ServerProcess

    root = tempfile.mkdtemp(prefix="dwdp-gpu-check-serve-")
    args = ["--device", device, "--ranks", str(RANKS), "--preset", preset, "--max-num-tokens", str(8 * prompt_tokens),
            "--max-queue-tokens", str(128 * prompt_tokens), "--kv-dir", root, "--stall-timeout", "30"]
    launched = time.perf_counter()
    server = ServerProcess(args, free_port(), startup_timeout_s=600.0, log_path=os.path.join(root, "serve.log"))
    with server:
        ready_s = time.perf_counter() - launched
        health = httpx.get(f"{server.url}/health", timeout=30).json()
        model = health["model"]["name"]
        samples = _load(server.url, model, requests, rate_per_s, prompt_tokens, health["model"]["vocab_size"], seed=0)
        after = httpx.get(f"{server.url}/health", timeout=30).json()
    wall_s = samples.pop()["wall_s"]
    ok = [s for s in samples if s.get("ok")]
    failed = [s for s in samples if not s.get("ok")]
    ttfts = [s["ttft_s"] for s in ok]
    workers = []
    for w in after["workers"]:
        first = w["first_forwards_ms"][:FIRST]
        per_token = [ms / n for ms, n in zip(first, w["first_forwards_tokens"][:FIRST])]
        workers.append({
            "rank": w["rank"], "device": w.get("device"), "experts_kernel": w.get("experts_kernel"),
            "ready_s": w.get("ready_s"), "warmup_s": w.get("warmup_s"), "forwards": w["forwards"],
            "first_forwards_ms": first, "first_forwards_tokens": w["first_forwards_tokens"][:FIRST],
            "worst_over_median": max(first) / statistics.median(first) if first else None,
            "worst_over_median_per_token": max(per_token) / statistics.median(per_token) if per_token else None,
        })
    failures = [f"serve: {len(failed)} of {len(samples)} requests failed (first: {failed[0]['error']})"] if failed else []
    return {
        "options": {"device": device, "ranks": RANKS, "preset": preset, "prompt_tokens": prompt_tokens,
                    "requests": requests, "rate_per_s": rate_per_s},
        "time_to_ready_s": ready_s, "wall_s": wall_s, "requests": len(samples), "failed": len(failed),
        "ttft_p50_ms": 1e3 * _percentile(ttfts, 50) if ttfts else None,
        "ttft_p99_ms": 1e3 * _percentile(ttfts, 99) if ttfts else None,
        "prompt_tokens_per_s": len(ok) * prompt_tokens / wall_s, "samples": samples, "workers": workers,
        "failures": failures,
    }


def summary(section: dict) -> list[tuple[str, str, str, str]]:
    """(check, measured, target, verdict) rows of this section for the table."""
    rows = [
        (f"h serve: time to ready ({RANKS} workers, {section['options']['preset']} preset)", f"{section['time_to_ready_s']:.1f} s", "", "info"),
        ("h serve: TTFT p50 / p99", f"{section['ttft_p50_ms']:.1f} / {section['ttft_p99_ms']:.1f} ms", "", "info"),
        ("h serve: prompt tokens/s", f"{section['prompt_tokens_per_s']:.0f}", "", "info"),
        ("h serve: failed requests", f"{section['failed']} of {section['requests']}", "0",
         "ok" if not section["failed"] else "FAIL"),
    ]
    for w in section["workers"]:
        ratio = w["worst_over_median"]
        rows.append((f"h worst / median of first {FIRST} forwards, rank {w['rank']}",
                     f"{ratio:.2f} (per token {w['worst_over_median_per_token']:.2f}; warmup {w['warmup_s']:.1f} s)"
                     if ratio is not None else "no forwards", f"<= {TARGET_WORST_OVER_MEDIAN}",
                     "ok" if ratio is not None and ratio <= TARGET_WORST_OVER_MEDIAN else "miss"))
    return rows
