"""The time a `dwdp serve` rank spends outside its forwards on this machine, and the max load
dwdp.predict.serve_sim predicts with and without it beside the measured one (CPU; measured, then
simulated).

    PYTHONPATH=. python bench/serve_outside.py                       # the stored run (about 7 minutes)
    PYTHONPATH=. python bench/serve_outside.py --from bench/results/serve_outside_cpu.json   # recompute

One seeded open-loop sweep (Poisson arrivals, lengths uniform in [ratio x ISL, ISL], each request
through the `openai` client, as `dwdp bench serve` sends them) is served by `dwdp serve` in each
mode (DWDP, DEP; 2 ranks, tiny preset, packed forwards), in passes ordered DWDP, DEP, DEP, DWDP, ...
so that both modes meet the machine's other jobs alike. Before and after each rate the script reads
every worker's counters from /health: forwards, time in them, time between them while the worker had
work (dwdp.serve.worker.ForwardGaps: its answers, KV artifacts, the router's next requests, planning),
time writing KV artifacts, tokens. Per mode, over the rates it sustained:
- the forward line: seconds per forward = a + b x tokens of the forward, least squares over the
  requests answered by one forward (a packed request's prefill time runs to its answer, so its own
  KV write and, on average, half of the others' in its forward are taken off);
- the term outside the forward (dwdp.predict.costmodel.outside): KV hand-off = KV-write seconds per
  real token; host = time outside per forward - KV writes per forward; other = the rest of a
  request's TTFT that holds no rank (router, HTTP, client: TTFT - queue - prefill, whose packed
  prefill already holds the KV write), added to TTFT only.
serve_sim then replays the same arrival plans through the same router and batching rules on those
lines, with the term (a rank busy for it after each forward) and without it (the KV write added to
TTFT, as before), and the max load at the p99 TTFT bound (highest achieved prompt tokens/s per rank
among sustained rates within it) is set beside the measured one of each pass, and DWDP's over DEP's
(a pass of DWDP against the DEP pass beside it in time).

--stored-runs RUN.json ...: the same prediction for runs `dwdp bench serve` stored before the workers
counted their time outside forwards: forward lines from each run's own requests, its KV writes held
on the rank (the part of the term those runs measured), then also the host time per forward this
sweep measured for each mode; per mix the DWDP / DEP max-load gain predicted beside the measured one.

Prints a table last; writes bench/results/serve_outside_cpu.json with the samples and counters of every
rate, so `--from` recomputes every figure. The machine is shared: the 1-minute load average at each
rate and before and after each pass is recorded.
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

from dwdp.benchmarks.serving import SUSTAINED_SHARE, max_load_at_slo, send_plan, summarise
from dwdp.observe.timing import load_average_1min, machine
from dwdp.predict.costmodel import OutsideForward
from dwdp.predict.packing import RequestMix, arrival_plan
from dwdp.predict.serve_sim import line_service, simulate_dep_serving, simulate_dwdp_serving, summarise_ttft
from dwdp.runtime.group import free_port

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("dwdp", "dep")
COUNTERS = ("forwards", "forward_s", "outside_s", "outside_forwards", "kv_write_s", "computed_tokens", "real_tokens")


def counters(url: str) -> dict:
    """COUNTERS summed over the workers, now."""
    import httpx

    workers = httpx.get(f"{url}/health", timeout=10).json()["workers"]
    return {k: sum(w[k] for w in workers) for k in COUNTERS}


def plans(args) -> list[tuple[float, list]]:
    mix = RequestMix(args.isl, args.isl_ratio)
    return [(rate, arrival_plan(mix, rate, args.duration, args.max_num_tokens, args.seed + i))
            for i, rate in enumerate(args.rates)]


def pass_order(passes: int) -> list[str]:
    """DWDP, DEP, DEP, DWDP, DWDP, DEP, ...: each mode as often, neither always first."""
    return [MODES[(i + i // 2) % 2] for i in range(2 * passes)]


def serve_mode(mode: str, args, progress=print) -> dict:
    """One `dwdp serve --mode MODE` through every rate: {rows: [summary + counters + samples]}."""
    from dwdp.serve.launch import ServerProcess

    server_args = ["--mode", mode, "--ranks", str(args.ranks), "--preset", "tiny", "--max-num-tokens",
                   str(args.max_num_tokens), "--max-queue-tokens", str(1 << 30), "--threads-per-worker", "1"]
    rows, load_before = [], load_average_1min()
    with ServerProcess(server_args, free_port(), startup_timeout_s=600) as server:
        warm = arrival_plan(RequestMix(args.isl, 0.5), 50.0, 0.2, args.max_num_tokens, args.seed + 999)
        asyncio.run(send_plan(server.url, "dwdp-tiny", warm, args.timeout))  # first forwards touch every buffer
        for rate, plan in plans(args):
            load = load_average_1min()
            before = counters(server.url)
            samples, _ = asyncio.run(send_plan(server.url, "dwdp-tiny", plan, args.timeout))
            after = counters(server.url)
            row = summarise(samples, rate, args.ranks, args.slo, args.duration)
            row["counters"] = {k: after[k] - before[k] for k in COUNTERS}
            row["load_average_1min"] = load
            row["samples"] = samples
            rows.append(row)
            c = row["counters"]
            progress(f"  {mode:>4} {rate:>5g}/s (load {load:.1f}): {row['ok']}/{row['sent']} ok, p99 "
                     f"{1e3 * row['ttft_p99_s']:.0f} ms, "
                     f"{row['tokens_per_s_per_rank']:.0f} tok/s/rank, {c['forwards']} forwards, outside "
                     f"{1e3 * c['outside_s'] / max(1, c['outside_forwards']):.1f} ms each")
    return {"rows": rows, "load_average_1min": {"before": load_before, "after": load_average_1min()}}


def measured_term(rows: list[dict]) -> dict:
    """The forward line and the term outside the forward of one mode, from its sustained rates' counters
    and samples (every rate when none was sustained)."""
    used = [r for r in rows if r["sustained"]] or rows
    total = {k: sum(r["counters"][k] for r in used) for k in COUNTERS}
    ok = [s for r in used for s in r["samples"] if s["ok"]]
    one = [s for s in ok if s.get("chunks", 1) <= 1]
    x = np.array([s["batch_tokens"] for s in one], float)
    y = np.array([s["prefill_s"] - s["kv_write_s"] * (1 + (s["batch_size"] - 1) / 2) for s in one], float)
    b, a = np.polyfit(x, y, 1) if len(set(x.tolist())) > 1 else (0.0, float(np.mean(y)))
    outside_per_forward = total["outside_s"] / total["outside_forwards"]
    kv_per_forward = total["kv_write_s"] / total["forwards"]
    return {"rates_used": [r["offered_rps"] for r in used], "forwards": total["forwards"],
            "line_s": [max(float(a), 0.0), max(float(b), 0.0)],
            "tokens_per_forward": total["real_tokens"] / total["forwards"],
            "forward_ms": 1e3 * total["forward_s"] / total["forwards"],
            "outside_ms": 1e3 * outside_per_forward, "kv_write_ms_per_forward": 1e3 * kv_per_forward,
            "host_ms": 1e3 * max(0.0, outside_per_forward - kv_per_forward),
            "kv_write_us_per_token": 1e6 * total["kv_write_s"] / total["real_tokens"],
            "other_ms_per_request": 1e3 * float(np.mean([s["ttft_s"] - s["queue_s"] - s["prefill_s"] for s in ok])),
            "kv_write_ms_per_request": 1e3 * float(np.mean([s["kv_write_s"] for s in ok]))}


def predicted_rows(meta: dict, service, mode: str) -> list[dict]:
    """serve_sim's rows of `mode` on the measured run's own plans."""
    args = argparse.Namespace(**{k: meta[k] for k in ("isl", "isl_ratio", "duration", "max_num_tokens", "seed",
                                                       "rates")})
    run = simulate_dwdp_serving if mode == "dwdp" else simulate_dep_serving
    out = []
    for rate, plan in plans(args):
        lengths = [(t, len(ids)) for t, ids in plan]
        row = summarise_ttft(lengths, run(lengths, meta["ranks"], meta["max_num_tokens"], service),
                             service.overhead_s[mode], len(lengths) / meta["duration"], meta["ranks"],
                             SUSTAINED_SHARE)
        row["offered_rps"] = rate
        row["within_slo"] = row["sustained"] and row["ttft_p99_s"] <= meta["slo"]
        out.append(row)
    return out


def analyse(data: dict) -> dict:
    """Measured term per mode (every pass), and max load measured (each pass) and predicted (with and
    without the term)."""
    meta, passes = data["meta"], data["passes"]
    by_mode = {mode: [p for p in passes if p["mode"] == mode] for mode in MODES}
    terms = {mode: measured_term([r for p in by_mode[mode] for r in p["rows"]]) for mode in MODES}
    lines = {mode: tuple(terms[mode]["line_s"]) for mode in MODES}
    outside = {mode: OutsideForward(terms[mode]["host_ms"] / 1e3, terms[mode]["kv_write_us_per_token"] / 1e6)
               for mode in MODES}
    other = {mode: terms[mode]["other_ms_per_request"] / 1e3 for mode in MODES}
    with_term = line_service(lines, outside, other, True, "measured lines and time outside the forward")
    without = line_service(lines, {}, {m: other[m] + terms[m]["kv_write_ms_per_request"] / 1e3 for m in MODES}, True,
                           "measured lines, KV write added to TTFT, nothing else outside the forward")
    out = {"terms": terms, "max_load": {}, "predicted_rows": {}}
    load = lambda rows: (max_load_at_slo(rows) or {}).get("tokens_per_s_per_rank")  # noqa: E731
    for mode in MODES:
        rows = {"with term": predicted_rows(meta, with_term, mode), "without term": predicted_rows(meta, without, mode)}
        out["predicted_rows"][mode] = {k: [{f: r[f] for f in ("offered_rps", "tokens_per_s_per_rank", "ttft_p50_s",
                                                                "ttft_p99_s", "sustained", "within_slo")} for r in v]
                                       for k, v in rows.items()}
        out["max_load"][mode] = {"measured": [load(p["rows"]) for p in by_mode[mode]],
                                 **{k: load(v) for k, v in rows.items()}}
    ratio = lambda a, b: a / b - 1 if a and b else None  # noqa: E731
    out["gain"] = {"measured": [ratio(a, b) for a, b in zip(*(out["max_load"][m]["measured"] for m in MODES))],
                   **{k: ratio(out["max_load"]["dwdp"][k], out["max_load"]["dep"][k])
                      for k in ("with term", "without term")}}
    return out


def stored_run_gains(run: dict, host_s: dict) -> dict:
    """{mix: {pair: measured and predicted max load per mode and DWDP's gain}} of a stored `dwdp bench
    serve` run (fifo variants: dwdp/dep, dwdp/padded/dep/padded), on that run's own arrival plans;
    host_s[mode]: host seconds per forward to add in the last prediction."""
    meta, out = run["meta"], {}
    for m, (mix_name, variants) in enumerate(run["results"].items()):
        mix = RequestMix.from_description(mix_name)
        rates = meta.get("rates_by_mix", {}).get(mix_name, meta["rates"])
        for dwdp, dep in (("dwdp", "dep"), ("dwdp/padded", "dep/padded")):
            if dwdp not in variants or dep not in variants:
                continue
            packed = variants[dwdp].get("forwards", "padded") == "packed"
            lines, kv, other = {}, {}, {}
            for mode, name in (("dwdp", dwdp), ("dep", dep)):
                rows = [r for r in variants[name]["rows"] if r["sustained"]] or variants[name]["rows"]
                ok = [s for r in rows for s in r["samples"] if s["ok"]]
                one = [s for s in ok if s.get("chunks", 1) <= 1]
                held = lambda s: s["kv_write_s"] * (1 + (s["batch_size"] - 1) / 2) if packed else 0.0  # noqa: E731
                b, a = np.polyfit([s["batch_tokens"] for s in one], [s["prefill_s"] - held(s) for s in one], 1)
                lines[mode] = (max(float(a), 0.0), max(float(b), 0.0))
                kv[mode] = float(np.sum([s["kv_write_s"] for s in ok]) / np.sum([s["tokens"] for s in ok]))
                other[mode] = float(np.mean([s["ttft_s"] - s["queue_s"] - s["prefill_s"]
                                             - (0.0 if packed else s["kv_write_s"]) for s in ok]))
            kv_per_request = {mode: kv[mode] * float(np.mean(draw_mean(mix, meta["max_num_tokens"]))) for mode in MODES}
            services = {"with KV write held": line_service(lines, {k: OutsideForward(0.0, v) for k, v in kv.items()},
                                                            other, packed, "stored run, KV write held"),
                        "with KV write and host held": line_service(
                            lines, {k: OutsideForward(host_s[k], v) for k, v in kv.items()}, other, packed,
                            "stored run, KV write and this sweep's host time held"),
                        "without": line_service(lines, {}, {k: other[k] + kv_per_request[k] for k in MODES}, packed,
                                                "stored run, KV write in TTFT")}
            args = {"isl": mix.isl, "isl_ratio": mix.isl_ratio, "isl_std": mix.isl_std, "duration": meta["duration_s"],
                    "max_num_tokens": meta["max_num_tokens"], "ranks": meta["ranks"], "slo": meta["slo_p99_s"]}
            entry = {"measured": {mode: (variants[name]["max_load_at_slo"] or {}).get("tokens_per_s_per_rank")
                                  for mode, name in (("dwdp", dwdp), ("dep", dep))}}
            for label, service in services.items():
                seeds = [meta["seed"] + 1000 * m + i for i in range(len(rates))]
                entry[label] = {mode: (max_load_at_slo(stored_predicted_rows(args, rates, seeds, service, mode)) or {})
                                .get("tokens_per_s_per_rank") for mode in MODES}
            for label in list(entry):
                loads = entry[label]
                loads["gain"] = loads["dwdp"] / loads["dep"] - 1 if loads["dwdp"] and loads["dep"] else None
            out.setdefault(mix_name, {})[f"{dwdp} vs {dep}"] = entry
    return out


def draw_mean(mix: RequestMix, max_num_tokens: int) -> float:
    """Mean prompt length of a mix (what a request's KV write is charged on)."""
    if mix.isl_std is not None:
        return float(min(mix.isl, max_num_tokens))
    return (int(np.ceil(mix.isl_ratio * mix.isl)) + mix.isl) / 2


def stored_predicted_rows(args: dict, rates: list[float], seeds: list[int], service, mode: str) -> list[dict]:
    """serve_sim's rows of `mode` on a stored run's plans (its rates and per-rate seeds)."""
    mix = RequestMix(args["isl"], args["isl_ratio"], args["isl_std"])
    run = simulate_dwdp_serving if mode == "dwdp" else simulate_dep_serving
    out = []
    for rate, seed in zip(rates, seeds):
        plan = [(t, len(ids)) for t, ids in arrival_plan(mix, rate, args["duration"], args["max_num_tokens"], seed)]
        row = summarise_ttft(plan, run(plan, args["ranks"], args["max_num_tokens"], service), service.overhead_s[mode],
                             len(plan) / args["duration"], args["ranks"], SUSTAINED_SHARE)
        row["offered_rps"] = rate
        row["within_slo"] = row["sustained"] and row["ttft_p99_s"] <= args["slo"]
        out.append(row)
    return out


def report(data: dict, analysis: dict) -> None:
    meta = data["meta"]
    print(f"\n{meta['ranks']} ranks, tiny preset, packed, max-num-tokens {meta['max_num_tokens']}, lengths uniform in "
          f"[{meta['isl_ratio']} x {meta['isl']}, {meta['isl']}], rates {meta['rates']} req/s for {meta['duration']} s "
          f"each; 1-min load average by pass " + ", ".join(
              f"{p['mode']} {p['load_average_1min']['before']:.1f} -> {p['load_average_1min']['after']:.1f}"
              for p in data["passes"]) + f" on {meta['cpus']} CPUs")
    print(f"\n{'measured per mode':>24} " + " ".join(f"{m:>10}" for m in MODES))
    for key, label in (("tokens_per_forward", "tokens per forward"), ("forward_ms", "forward ms"),
                       ("outside_ms", "outside ms / forward"), ("kv_write_ms_per_forward", "  KV write ms"),
                       ("host_ms", "  host ms"), ("kv_write_us_per_token", "KV write us / token"),
                       ("other_ms_per_request", "other ms / request")):
        print(f"{label:>24} " + " ".join(f"{analysis['terms'][m][key]:>10.2f}" for m in MODES))
    print(f"\n{'max load, tok/s/rank':>24} " + " ".join(f"{m:>10}" for m in MODES) + f" {'DWDP gain':>10}")
    cell = lambda v, fmt: f"{v:{fmt}}" if v is not None else "none"  # noqa: E731
    passes = len(analysis["gain"]["measured"])
    lines = [(f"measured, pass {i + 1}", [analysis["max_load"][m]["measured"][i] for m in MODES],
              analysis["gain"]["measured"][i]) for i in range(passes)]
    lines += [(k, [analysis["max_load"][m][k] for m in MODES], analysis["gain"][k]) for k in ("with term", "without term")]
    for label, loads, gain in lines:
        print(f"{label:>24} " + " ".join(f"{cell(v, '.0f'):>10}" for v in loads)
              + f" {cell(None if gain is None else 100 * gain, '+.1f') + '%':>10}")
    for path, mixes in data.get("stored_runs", {}).items():
        print(f"\n{path}: max load at p99 TTFT <= its bound, tok/s/rank (DWDP / DEP, gain)")
        for mix, pairs in mixes.items():
            for pair, entry in pairs.items():
                print(f"  {mix:>30} {pair:>26}: " + "; ".join(
                    f"{label} {cell(v['dwdp'], '.0f')} / {cell(v['dep'], '.0f')} "
                    f"({cell(None if v['gain'] is None else 100 * v['gain'], '+.1f')}%)" for label, v in entry.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--max-num-tokens", type=int, default=512)
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--isl-ratio", type=float, default=0.8)
    p.add_argument("--rates", type=float, nargs="+", default=[8, 12, 16, 20, 24, 28])
    p.add_argument("--duration", type=float, default=4.0, help="seconds of arrivals per rate")
    p.add_argument("--slo", type=float, default=1.0, help="p99 TTFT bound of the max load, s")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--passes", type=int, default=2, help="times each mode serves the sweep (DWDP, DEP, DEP, DWDP, ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "serve_outside_cpu.json"))
    p.add_argument("--from", dest="stored", metavar="JSON", help="serve nothing: recompute a stored run")
    p.add_argument("--stored-runs", nargs="*", metavar="JSON", default=[],
                   help="also predict the max loads of these stored `dwdp bench serve` runs")
    args = p.parse_args()
    if args.stored:
        data = json.loads(Path(args.stored).read_text())
    else:
        started = time.time()
        meta = {"command": "python bench/serve_outside.py " + " ".join(
                    f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                    for k, v in vars(args).items() if k not in ("out", "stored")),
                "ranks": args.ranks, "max_num_tokens": args.max_num_tokens, "isl": args.isl,
                "isl_ratio": args.isl_ratio, "rates": args.rates, "duration": args.duration, "slo": args.slo,
                "seed": args.seed, "cpus": os.cpu_count(), "machine": {**machine(), "machine": platform.machine()},
                "model": "tiny preset (DeepSeek-V3-style: hidden 256, 16 experts, top-4, fp32)",
                "ttft": "client side: completion request sent -> completion with the first token received",
                "note": "measured on a shared machine: other jobs ran beside this sweep (see each mode's load "
                        "average); the client and the router share its cores with the workers"}
        data = {"meta": meta, "passes": [{"mode": mode, **serve_mode(mode, args)} for mode in pass_order(args.passes)]}
        meta["wall_s"] = time.time() - started
    analysis = analyse(data)
    data["analysis"] = analysis
    if args.stored_runs:
        host = {mode: analysis["terms"][mode]["host_ms"] / 1e3 for mode in MODES}
        data["stored_runs"] = {path: stored_run_gains(json.loads(Path(path).read_text()), host)
                               for path in args.stored_runs}
    out = Path(args.stored or args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"written {out}")
    report(data, analysis)


if __name__ == "__main__":
    main()
