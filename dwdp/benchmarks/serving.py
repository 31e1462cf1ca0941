"""`dwdp bench serve`: DWDP serving against DEP serving under the same open-loop load.

Each variant (a mode, optionally with a batch order and `/padded`: `dwdp`, `dep`, `dwdp:shortest`,
`dwdp/padded`, ...) is served by its own `dwdp serve` on the same ranks, model and max-num-tokens,
one after the other: packed forwards (real tokens, long prompts in chunks) unless `/padded` (the
server's --forwards padded: left-padded batches, prompts past max-num-tokens refused). For each
prompt mix (lengths uniform in [ratio x ISL, ISL] for every --isl-ratios; normal around the first
one's mean, clipped to [1, max-num-tokens]; a long-prompt mix uniform in [--long-ratio x --long-isl,
--long-isl], past max-num-tokens for most) and each offered rate, the same seeded plan of Poisson
arrivals is sent to every variant, each request through the official `openai` client (completions,
max_tokens=1). The workers' computed and real prompt tokens (/health) before and after each point
give its padding waste (computed / real tokens).

Per variant, mix and rate: offered and achieved requests/s, prompt tokens/s per rank, TTFT
p50/p90/p99 measured by the client (request sent -> completion with the first token received), the
mean time queued at the worker, in the forward, and in the rest (KV write, router, HTTP, client),
the wait inside forwards (DWDP: exposed prefetch wait; DEP: time in all-to-alls), failed requests.
Every figure is computed from the per-request samples stored beside it (`samples`), so it can be
recomputed from the JSON. A rate is *sustained* when nothing failed and the achieved rate is at
least `SUSTAINED_SHARE` of the rate its plan drew (sent / duration); *max load at SLO* is the highest achieved prompt
tokens/s per rank among sustained rates whose p99 TTFT is within --slo.

Prints the table last; writes bench/results/serve_compare_<device>.json and a plot of TTFT p50 and
p99 against achieved tokens/s per rank (.png beside it). The 1-minute load average before and after
is recorded: on a shared machine other jobs run beside the sweep.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from dwdp.runtime.group import free_port
from dwdp.benchmarks.load import add_load_arguments
from dwdp.predict.packing import RequestMix, arrival_plan
from dwdp.observe.timing import USER_RESULTS_DIR, load_average_1min, machine
SUSTAINED_SHARE = 0.9       # achieved / offered requests/s at or above which a rate counts as sustained
PERCENTILES = (50, 90, 99)


def add_arguments(p: argparse.ArgumentParser, results_dir: str = USER_RESULTS_DIR) -> argparse.ArgumentParser:
    """The options of `dwdp bench serve` (the stored run: `--out bench/results/serve_compare_cpu.json`)."""
    p.add_argument("--variants", default="dwdp,dep,dwdp/padded,dep/padded",
                   help="comma-separated MODE[:ORDER][/padded] served one after the other, e.g. dwdp,dep,dwdp/padded "
                        "(ORDER: the server's --batch-order, default fifo; /padded: --forwards padded)")
    add_load_arguments(p, ranks=2, duration_s=12.0, window="rate")
    p.add_argument("--isl", type=int, default=512, help="longest prompt of the uniform mixes (default 512)")
    p.add_argument("--isl-ratios", default="0.5,0.8",
                   help="shortest / longest prompt, one uniform mix each, comma-separated (default 0.5,0.8)")
    p.add_argument("--long-isl", type=int, default=0,
                   help="longest prompt of the long-prompt mix, above --max-num-tokens for chunks (0: no such mix)")
    p.add_argument("--long-ratio", type=float, default=0.25, help="shortest / longest prompt of the long mix")
    p.add_argument("--long-rates", help="offered requests/s of the long mix (default: --rates scaled by the mixes' "
                   "mean prompt lengths, so each mix is offered the same tokens/s)")
    p.add_argument("--isl-cv", type=float, default=0.3,
                   help="normal mix: standard deviation / mean (its mean is the uniform mix's); 0 skips the mix")
    p.add_argument("--rates", default="2,4,6,8,10,12,14,16,18,20",
                   help="offered requests/s, comma-separated (default 2..20: past saturation of both modes on 2 cores)")
    p.add_argument("--slo", type=float, default=1.0, help="p99 TTFT bound in seconds for max load at SLO (default 1)")
    p.add_argument("--threads-per-worker", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--fairness", type=float, default=0.5, help="servers' --fairness for the shortest order, s")
    default_out = str(Path(results_dir) / "serve_compare_cpu.json")
    p.add_argument("--out", default=default_out, help=f"JSON path; its plot goes beside it (default {default_out})")
    p.add_argument("--from", dest="stored", metavar="JSON",
                   help="serve nothing: recompute a stored run's figures from its samples, rewrite it and its plot")
    return p


def parse_variants(text: str) -> list[tuple[str, str, str]]:
    """'dwdp,dep:shortest/padded' -> [('dwdp', 'fifo', 'auto'), ('dep', 'shortest', 'padded')]."""
    out = []
    for item in text.split(","):
        head, slash, forwards = item.strip().partition("/")
        mode, _, order = head.partition(":")
        order = order or "fifo"
        if mode not in ("dwdp", "dep") or order not in ("fifo", "shortest") or (slash and forwards != "padded"):
            raise ValueError(f"variant {item!r} must be MODE[:ORDER][/padded] with MODE dwdp|dep and ORDER "
                             "fifo|shortest")
        out.append((mode, order, "padded" if slash else "auto"))
    return out


def variant_name(mode: str, order: str, forwards: str = "auto") -> str:
    return (mode if order == "fifo" else f"{mode}:{order}") + ("/padded" if forwards == "padded" else "")


def mix_rates(args, name: str, rates: list[float]) -> list[float]:
    """The offered rates of mix `name`: --rates, or for the long mix --long-rates (default: --rates
    times the first uniform mix's mean length over the long mix's, rounded to 0.1 request/s)."""
    if not name.startswith("long:"):
        return rates
    if args.long_rates:
        return [float(x) for x in args.long_rates.split(",")]
    ratio = float(str(args.isl_ratios).split(",")[0])
    scale = (1 + ratio) * args.isl / ((1 + args.long_ratio) * args.long_isl)
    return [max(0.1, round(rate * scale, 1)) for rate in rates]


def mixes(args) -> list[tuple[str, RequestMix]]:
    """(name, mix) of every prompt mix the sweep runs."""
    ratios = [float(x) for x in str(args.isl_ratios).split(",")]
    out = []
    for ratio in ratios:
        uniform = RequestMix(args.isl, ratio)
        out.append((uniform.describe(), uniform))
    if args.isl_cv > 0:
        mean = (1 + ratios[0]) / 2 * args.isl
        normal = RequestMix(round(mean), isl_std=args.isl_cv * mean)
        out.append((normal.describe(), normal))
    if args.long_isl > 0:
        long = RequestMix(args.long_isl, args.long_ratio)
        out.append((f"long: {long.describe()}", long))
    return out



async def _one(client, model_name: str, ids: list[int], start: float) -> dict:
    sent = time.perf_counter()
    try:
        completion = await client.completions.create(model=model_name, prompt=ids, max_tokens=1)
    except Exception as exc:  # every failure is a sample: its type and message are kept
        body = getattr(exc, "body", None)
        kind = body.get("type") if isinstance(body, dict) else None
        return {"sent_s": sent - start, "ttft_s": time.perf_counter() - sent, "ok": False,
                "error": kind or type(exc).__name__, "message": str(exc)[:300], "tokens": len(ids)}
    ttft = time.perf_counter() - sent
    choice = completion.choices[0]
    extra = choice.model_extra
    for artifact in completion.model_extra["kv_transfer_params"]["kv_artifacts"]:
        try:
            os.unlink(artifact["path"])  # a generation server would consume it
        except OSError:
            pass
    timing = extra["timing"]
    return {"sent_s": sent - start, "ttft_s": ttft, "ok": True, "tokens": completion.usage.prompt_tokens,
            "rank": extra["rank"], "queue_s": timing["queue_s"], "prefill_s": timing["prefill_s"],
            "kv_write_s": timing["kv_write_s"], "wait_s": timing["prefetch_wait_s"],
            "batch_size": timing["batch_size"], "batch_tokens": timing["batch_tokens"],
            "chunks": timing.get("chunks", 1)}


async def send_plan(url: str, model_name: str, plan: list, timeout_s: float) -> tuple[list[dict], float]:
    """Send every request of `plan` at its time (open loop: whatever is still in flight); returns
    the samples in plan order and the seconds from the first send to the last answer."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0,
                                  timeout=timeout_s) as client:
        start = time.perf_counter()
        tasks = []
        for at, ids in plan:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # the arrival process, not a stand-in for work
            tasks.append(asyncio.create_task(_one(client, model_name, ids, start)))
        samples = await asyncio.gather(*tasks)
    first = min(s["sent_s"] for s in samples)
    last = max(s["sent_s"] + s["ttft_s"] for s in samples)
    return list(samples), last - first


def percentile(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else float("nan")


def summarise(samples: list[dict], offered_rps: float, ranks: int, slo_s: float, duration_s: float) -> dict:
    """Every figure of one point, from its samples alone (so tests and readers can recompute it).

    Times run from the plan's start; the makespan ends with the last answer. The plan's own rate
    (sent / duration_s) is what a Poisson draw actually offered; the point is sustained when nothing
    failed and the achieved rate reaches SUSTAINED_SHARE of it: the backlog drained within
    duration_s / SUSTAINED_SHARE."""
    ok = [s for s in samples if s["ok"]]
    makespan = max(s["sent_s"] + s["ttft_s"] for s in samples)
    ttft = [s["ttft_s"] for s in ok]
    mean = lambda key: float(np.mean([s[key] for s in ok])) if ok else float("nan")  # noqa: E731
    row = {"offered_rps": offered_rps, "plan_rps": len(samples) / duration_s, "sent": len(samples), "ok": len(ok),
           "failed": len(samples) - len(ok),
           "makespan_s": makespan, "achieved_rps": len(ok) / makespan,
           "tokens_per_s_per_rank": sum(s["tokens"] for s in ok) / makespan / ranks,
           **{f"ttft_p{q}_s": percentile(ttft, q) for q in PERCENTILES},
           "queue_mean_s": mean("queue_s"), "forward_mean_s": mean("prefill_s"),
           "other_mean_s": float(np.mean([s["ttft_s"] - s["queue_s"] - s["prefill_s"] for s in ok])) if ok else
           float("nan"),
           "wait_in_forward_mean_s": mean("wait_s"), "batch_mean": mean("batch_size"),
           "tokens_per_rank": [sum(s["tokens"] for s in ok if s["rank"] == r) for r in range(ranks)]}
    row["sustained"] = row["failed"] == 0 and row["achieved_rps"] >= SUSTAINED_SHARE * row["plan_rps"]
    row["within_slo"] = row["sustained"] and row["ttft_p99_s"] <= slo_s
    return row


def padding_waste(rows: list[dict]) -> float | None:
    """Tokens the forwards computed over the real prompt tokens, over `rows` (None: nothing ran)."""
    computed = sum(r.get("computed_tokens", 0) for r in rows)
    real = sum(r.get("real_tokens", 0) for r in rows)
    return computed / real if real else None


def max_load_at_slo(rows: list[dict]) -> dict | None:
    """The point with the highest achieved tokens/s per rank among those within the SLO (None: none)."""
    within = [r for r in rows if r["within_slo"]]
    if not within:
        return None
    best = max(within, key=lambda r: r["tokens_per_s_per_rank"])
    return {"offered_rps": best["offered_rps"], "achieved_rps": best["achieved_rps"],
            "tokens_per_s_per_rank": best["tokens_per_s_per_rank"], "ttft_p99_s": best["ttft_p99_s"]}


def compare(results: dict) -> dict:
    """Per mix, every DWDP variant against every DEP variant: max load at SLO over the DEP one's, and
    the rates both sustain where the DWDP variant's TTFT p50 or p99 is worse."""
    out = {}
    for mix, by_variant in results.items():
        for name, entry in by_variant.items():
            if not name.startswith("dwdp"):
                continue
            for base_name, base in by_variant.items():
                if not base_name.startswith("dep"):
                    continue
                load, base_load = entry["max_load_at_slo"], base["max_load_at_slo"]
                ratio = (load["tokens_per_s_per_rank"] / base_load["tokens_per_s_per_rank"]
                         if load and base_load else None)
                worse = []
                for mine, theirs in zip(entry["rows"], base["rows"]):
                    if mine["sustained"] and theirs["sustained"]:
                        for q in (50, 99):
                            if mine[f"ttft_p{q}_s"] > theirs[f"ttft_p{q}_s"]:
                                worse.append({"offered_rps": mine["offered_rps"], "percentile": q,
                                              "variant_s": mine[f"ttft_p{q}_s"], "baseline_s": theirs[f"ttft_p{q}_s"]})
                out.setdefault(mix, {})[f"{name} vs {base_name}"] = {"max_load_ratio": ratio, "ttft_worse_at": worse}
    return out


def resummarise(data: dict) -> dict:
    """A stored run's figures recomputed from its samples (after a change to how they are summarised)."""
    meta = data["meta"]
    for by_variant in data["results"].values():
        for entry in by_variant.values():
            rows = []
            for row in entry["rows"]:
                again = summarise(row["samples"], row["offered_rps"], meta["ranks"], meta["slo_p99_s"],
                                  meta["duration_s"])
                again["samples"] = row["samples"]
                rows.append(again)
            entry["rows"], entry["max_load_at_slo"] = rows, max_load_at_slo(rows)
    data["comparison"] = compare(data["results"])
    return data


def render_table(header: tuple[str, ...], lines: list[tuple[str, ...]]) -> str:
    """Right-aligned columns under `header`, with a rule below it."""
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*x) for x in lines])


def summary_table(results: dict, slo_s: float) -> str:
    """Per mix and variant: padding waste (computed / real tokens) and max load at the p99 bound."""
    header = ("mix", "variant", "padding waste", f"max load at p99<={slo_s:g}s (tok/s/rank)", "at req/s", "p99 ms",
              "vs padded", "vs dep")
    lines = []
    for mix, by_variant in results.items():
        loads = {name: (entry["max_load_at_slo"] or {}).get("tokens_per_s_per_rank") for name, entry in by_variant.items()}
        for name, entry in by_variant.items():
            waste = padding_waste(entry["rows"])
            best = entry["max_load_at_slo"]
            base = name.split("/")[0]
            padded = loads.get(f"{base}/padded") if not name.endswith("/padded") else None
            dep = loads.get(name.replace("dwdp", "dep", 1)) if name.startswith("dwdp") else None
            ratio = lambda other: f"{loads[name] / other:.2f}x" if loads[name] and other else "-"  # noqa: E731
            lines.append((mix, name, "-" if waste is None else f"{waste:.3f}",
                           "none" if best is None else f"{best['tokens_per_s_per_rank']:.0f}",
                           "-" if best is None else f"{best['achieved_rps']:.2f}",
                           "-" if best is None else f"{1e3 * best['ttft_p99_s']:.0f}", ratio(padded), ratio(dep)))
    return render_table(header, lines)


def format_table(results: dict) -> str:
    header = ("mix", "variant", "offered/s", "sent", "failed", "achieved/s", "tok/s/rank", "TTFT p50", "p90", "p99",
              "queue", "forward", "other", "wait in fwd", "batch", "waste", "sustained")
    lines = []
    for mix, by_variant in results.items():
        for name, entry in by_variant.items():
            for r in entry["rows"]:
                ms = lambda key: f"{1e3 * r[key]:.0f}"  # noqa: E731
                lines.append((mix, name, f"{r['offered_rps']:g}", str(r["sent"]), str(r["failed"]),
                              f"{r['achieved_rps']:.2f}", f"{r['tokens_per_s_per_rank']:.0f}", ms("ttft_p50_s"),
                              ms("ttft_p90_s"), ms("ttft_p99_s"), ms("queue_mean_s"), ms("forward_mean_s"),
                              ms("other_mean_s"), ms("wait_in_forward_mean_s"), f"{r['batch_mean']:.1f}",
                              "-" if padding_waste([r]) is None else f"{padding_waste([r]):.2f}",
                              "yes" if r["sustained"] else "no"))
    return render_table(header, lines) + "\n(times in ms; queue / forward / other are means over answered requests)"


def plot(results: dict, slo_s: float, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(6.2 * len(results), 4.6), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (mix, by_variant) in zip(axes[0], results.items()):
        for color, (name, entry) in zip(colors, by_variant.items()):
            rows = [r for r in entry["rows"] if r["failed"] == 0]
            x = [r["tokens_per_s_per_rank"] for r in rows]
            ax.plot(x, [1e3 * r["ttft_p50_s"] for r in rows], "o-", color=color, label=f"{name} p50")
            ax.plot(x, [1e3 * r["ttft_p99_s"] for r in rows], "s--", color=color, label=f"{name} p99")
        ax.axhline(1e3 * slo_s, color="grey", lw=0.8, ls=":", label=f"p99 bound {slo_s:g} s")
        ax.set_yscale("log")
        ax.set_xlabel("achieved prompt tokens/s per rank")
        ax.set_ylabel("TTFT, ms (client side)")
        ax.set_title(mix, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _health(url: str) -> dict:
    import httpx  # the serve extra: imported when a sweep runs, so `dwdp --help` works without it

    return httpx.get(f"{url}/health", timeout=10).json()


def _tokens(url: str) -> tuple[int, int]:
    """(tokens computed, real prompt tokens) of every worker's forwards so far."""
    workers = _health(url)["workers"]
    return sum(w["computed_tokens"] for w in workers), sum(w["real_tokens"] for w in workers)


def run_variant(mode: str, order: str, args, plans: dict, progress=print, forwards: str = "auto") -> dict:
    """Serve `plans` ({mix: [(rate, plan)]}) with one server of this variant; {mix: rows}."""
    from dwdp.serve.launch import ServerProcess  # needs the serve extra (httpx)

    server_args = ["--mode", mode, "--batch-order", order, "--fairness", str(args.fairness), "--ranks",
                   str(args.ranks), "--preset", "tiny", "--max-num-tokens", str(args.max_num_tokens),
                   "--max-queue-tokens", str(1 << 30), "--threads-per-worker", str(args.threads_per_worker),
                   "--forwards", forwards]
    name = variant_name(mode, order, forwards)
    out = {}
    with ServerProcess(server_args, free_port(), startup_timeout_s=600) as server:
        model_name = "dwdp-tiny"
        warm = arrival_plan(RequestMix(args.isl, 0.5), 50.0, 0.2, args.max_num_tokens, args.seed + 999)
        asyncio.run(send_plan(server.url, model_name, warm, args.timeout))  # first forwards touch every buffer
        for mix, points in plans.items():
            rows = []
            for rate, plan in points:
                computed, real = _tokens(server.url)
                samples, _ = asyncio.run(send_plan(server.url, model_name, plan, args.timeout))
                row = summarise(samples, rate, args.ranks, args.slo, args.duration)
                after = _tokens(server.url)
                row["computed_tokens"], row["real_tokens"] = after[0] - computed, after[1] - real
                row["samples"] = samples
                rows.append(row)
                progress(f"  {name:>14} {mix:>28} {rate:>5g}/s: {row['ok']}/{row['sent']} ok, p50 "
                         f"{1e3 * row['ttft_p50_s']:.0f} ms, p99 {1e3 * row['ttft_p99_s']:.0f} ms, "
                         f"{row['tokens_per_s_per_rank']:.0f} tok/s/rank")
            out[mix] = {"rows": rows, "max_load_at_slo": max_load_at_slo(rows)}
        health = _health(server.url)
        out["_health"] = health["mode"]
        for mix in plans:
            out[mix]["forwards"] = health.get("forwards")
    return out


def command_line(args: argparse.Namespace) -> str:
    return "dwdp bench serve " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                          if v is not None and k not in ("out", "command", "bench", "stored"))


def rewrite_stored(path: Path) -> int:
    data = resummarise(json.loads(path.read_text()))
    path.write_text(json.dumps(data, indent=1) + "\n")
    meta = data["meta"]
    load = meta["load_average_1min"]
    plot(data["results"], meta["slo_p99_s"], path.with_suffix(".png"),
         f"{meta['ranks']} ranks, tiny preset, max-num-tokens {meta['max_num_tokens']}, CPU (1-min load "
         f"{load['before']:.1f} before, {load['after']:.1f} after)")
    report(data)
    return 0


def run_bench_serve(args: argparse.Namespace) -> int:
    if args.stored:
        return rewrite_stored(Path(args.stored))
    variants = parse_variants(args.variants)
    rates = [float(x) for x in args.rates.split(",")]
    if min(rates) <= 0 or args.duration <= 0 or args.slo <= 0:
        raise SystemExit(f"--rates={args.rates}, --duration={args.duration} and --slo={args.slo} must be > 0")
    load_before = load_average_1min()
    started = time.time()
    plans = {name: [(rate, arrival_plan(mix, rate, args.duration, args.max_num_tokens, args.seed + 1000 * m + i))
                    for i, rate in enumerate(mix_rates(args, name, rates))] for m, (name, mix) in enumerate(mixes(args))}
    results: dict = {name: {} for name in plans}
    for mode, order, forwards in variants:
        served = run_variant(mode, order, args, plans, forwards=forwards)
        assert served.pop("_health") == mode, f"the server did not run in {mode} mode"
        for mix, entry in served.items():
            results[mix][variant_name(mode, order, forwards)] = entry
    load_after = load_average_1min()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": command_line(args), "machine": {**machine(), "machine": platform.machine()},
            "device": "cpu", "ranks": args.ranks, "max_num_tokens": args.max_num_tokens,
            "model": "tiny preset (DeepSeek-V3-style: hidden 256, 16 experts, top-4, fp32)",
            "threads_per_worker": args.threads_per_worker, "slo_p99_s": args.slo,
            "sustained_share": SUSTAINED_SHARE, "duration_s": args.duration, "rates": rates, "seed": args.seed,
            "rates_by_mix": {name: [rate for rate, _ in points] for name, points in plans.items()},
            "ttft": "client side: completion request sent -> completion with the first token received",
            "load_average_1min": {"before": load_before, "after": load_after},
            "wall_s": time.time() - started,
            "note": "the machine is shared: other jobs ran beside this sweep (see the load average); the "
                    "client and the router share its cores with the workers"}
    data = {"meta": meta, "results": results, "comparison": compare(results)}
    out.write_text(json.dumps(data, indent=1) + "\n")
    png = out.with_suffix(".png")
    plot(results, args.slo, png, f"{args.ranks} ranks, tiny preset, max-num-tokens {args.max_num_tokens}, CPU "
         f"(1-min load {load_before:.1f} before, {load_after:.1f} after)")
    print(f"\ndwdp bench serve: {args.ranks} ranks, max-num-tokens {args.max_num_tokens}; 1-min load average "
          f"{load_before:.2f} before, {load_after:.2f} after on {os.cpu_count()} CPUs; {out} and {png}")
    report(data)
    return 0


def report(data: dict) -> None:
    """The comparison lines and the table of a run."""
    slo = data["meta"]["slo_p99_s"]
    for mix, pairs in data["comparison"].items():
        for pair, c in pairs.items():
            ratio = "n/a (one of them meets the bound at no rate)" if c["max_load_ratio"] is None else \
                f"{c['max_load_ratio']:.2f}x"
            worse = ", ".join(f"{w['offered_rps']:g}/s p{w['percentile']}" for w in c["ttft_worse_at"]) or "none"
            print(f"{mix}: {pair}: max load at p99 <= {slo:g} s {ratio}; TTFT worse at rates both sustain: {worse}")
    print(format_table(data["results"]))
    print()
    print(summary_table(data["results"], slo))
