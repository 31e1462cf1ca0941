"""Serving under load while one rank is lost: killed (SIGKILL), its memory made unreadable
(POST /admin/fault), or stopped for a few seconds (SIGSTOP, then SIGCONT), each mid-run on a
fresh `dwdp serve` whose every expert has two owners.

The load is bench/serve_load.py's open loop (Poisson arrivals, imbalanced clients). Per case:
The fault starts `--fault-at` seconds in, or up to 3 s later once the victim runs a forward.
- sent, correct (first token equal to the unwrapped model's, or tied with it within 1e-4 + 1e-4 x
  the largest logit), wrong, failed with a clear error (a 5xx whose message names the victim
  rank), failed otherwise, lost (no HTTP answer at all: must be 0), handed on (requests the router
  moved from the victim to a survivor);
- survivors' throughput (prompt tokens answered per second by the other ranks) before the fault
  and while it lasts (the stop window for a stall; fault to end otherwise), and their prefill time
  per 1k batch tokens in the same windows (a survivor slowed by the victim shows there);
- recovery: from the fault to the start t of the first 2-s window [t, t + 2) (t >= fault, in 0.1-s
  steps) in which the survivors answered, correctly, at least 90 % of the prompt tokens offered in
  the same window shifted back by the pre-fault median TTFT: the survivors carry the whole offered
  load again. 0 when they never fell behind.
- re-plans: per survivor, how many times it re-planned from the fault to the end of the case (/health's
  `replans` then, less before the fault). One loss is one re-plan: 1 after a kill or a memory fault, 0
  after a stall. More means the lost rank flapped: a survivor took the same living process back
  through its own board entry and lost it again. A case whose count differs fails the run (exit 1).
Prints the table last; writes bench/results/chaos_cpu.json (machine, load average, every request).

The healing cases (kill-restart, two-loss, loss-while-rejoining: bench/chaos_heal.py) run the server
with `--restart on-failure` and add redundancy before / during / after and the time until the group
is whole again; the cases above run it with `--restart never`, so a lost rank stays lost.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import time
from pathlib import Path

import httpx
import torch

from dwdp.benchmarks.load import add_load_arguments
from dwdp.runtime.group import free_port
from dwdp.serve.launch import ServerProcess
from dwdp.serve.presets import preset_model
from dwdp.observe.timing import load_average_1min, machine
from chaos_heal import HEAL_CASES, heal_summary, inject_heal, sample_health, wait_healed
from serve_load import arrivals, command_line, render_table, run_rate

RESULTS = Path(__file__).resolve().parent / "results"
CASES = ("kill", "unreadable", "stall") + HEAL_CASES
OVERLAPPING = ("two-loss", "loss-while-rejoining")  # run on --heal-ranks ranks, --heal-replicas owners
ATOL, RTOL = 1e-4, 1e-4           # first-token tie tolerance, as tests/test_serve.py
WINDOW_S, STEP_S, CARRIED = 2.0, 0.1, 0.9
EXPECTED_REPLANS = {"kill": 1, "unreadable": 1, "stall": 0}  # per survivor, from the fault to the end


async def _busy(url: str, victim: int, patience_s: float) -> bool:
    """Wait (at most `patience_s`) until the victim runs a forward, so the fault hits work in flight."""
    deadline = time.perf_counter() + patience_s
    async with httpx.AsyncClient(timeout=10) as http:
        while time.perf_counter() < deadline:
            if (await http.get(f"{url}/health")).json()["workers"][victim]["running"] > 0:
                return True
            await asyncio.sleep(0.02)
    return False


async def _inject(case: str, url: str, pid: int, victim: int, at_s: float, stall_s: float, start: float) -> dict:
    """Hit the victim `at_s` after `start` (or a little later, once it runs a forward); returns when
    the fault began and (stall) ended."""
    await asyncio.sleep(max(0.0, start + at_s - time.perf_counter()))  # the fault's moment in the run
    busy = await _busy(url, victim, patience_s=3.0)
    began = time.perf_counter() - start
    if case == "kill":
        os.kill(pid, signal.SIGKILL)
        return {"fault_s": began, "end_s": None, "victim_busy": busy}
    if case == "unreadable":
        async with httpx.AsyncClient(timeout=30) as http:
            r = await http.post(f"{url}/admin/fault", json={"rank": victim})
        r.raise_for_status()
        return {"fault_s": began, "end_s": None, "victim_busy": busy}
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(stall_s)  # the stall itself: the victim stays stopped this long
    finally:
        os.kill(pid, signal.SIGCONT)
    return {"fault_s": began, "end_s": time.perf_counter() - start, "victim_busy": busy}


async def _run_case(case: str, url: str, plan: list, pids: list[int], args, probe: list
                    ) -> tuple[list, list[dict], dict]:
    """(plan as sent, one result per request, the fault). probe: a short load sent, in the healing
    cases, once the group has healed if the main load ended before."""
    start = time.perf_counter() + 0.2
    if case in HEAL_CASES:
        stop, samples = asyncio.Event(), []
        sampler = asyncio.create_task(sample_health(url, start, stop, samples))
        (results, _), fault = await asyncio.gather(
            run_rate(url, plan, args.timeout, start),
            inject_heal(case, url, pids, args.victim, args.second, args.fault_at, start, _busy))
        healed = await wait_healed(samples, fault, args.heal_timeout)
        if healed is not None and healed > plan[-1][0]:  # the restarted ranks got no request yet
            offset = time.perf_counter() - start
            probe = [(at + offset, client, ids) for at, client, ids in probe]
            probe_results, _ = await run_rate(url, probe, args.timeout, start)
            plan, results = plan + probe, results + probe_results
        await asyncio.sleep(1.0)  # one more second of /health after the last answer
        stop.set()
        fault["samples"] = await sampler
    else:
        (results, _), fault = await asyncio.gather(
            run_rate(url, plan, args.timeout, start),
            _inject(case, url, pids[args.victim], args.victim, args.fault_at, args.stall, start))
        fault["hit"] = [args.victim]
    for r in results:
        r["done"] -= start
    return plan, results, fault


def first_token_ok(model, ids: list[int], token: int) -> bool:
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
    best = int(logits.argmax())
    return token == best or float(logits[best] - logits[token]) <= ATOL + RTOL * float(logits.abs().max())


def _tokens_ok(plan: list, results: list[dict], model) -> list[bool]:
    """Per request: answered with the unwrapped model's first token (False when not answered)."""
    return [r["status"] == 200 and first_token_ok(model, ids, r["first_token_id"])
            for (_, _, ids), r in zip(plan, results)]


def _rate(answers: list[dict], lo: float, hi: float, ranks) -> float:
    """Prompt tokens per second answered by `ranks` in [lo, hi)."""
    if hi <= lo:
        return float("nan")
    return sum(r["tokens"] for r in answers if r["rank"] in ranks and lo <= r["done"] < hi) / (hi - lo)


def _prefill_ms_per_1k(answers: list[dict], lo: float, hi: float, ranks) -> float:
    """Median prefill ms per 1000 batch tokens of `ranks`' forwards answered in [lo, hi)."""
    per = [1e6 * r["prefill_s"] / r["batch_tokens"] for r in answers
           if r["rank"] in ranks and lo <= r["done"] < hi]
    return statistics.median(per) if per else float("nan")


def replans_since(before: dict, after: dict, ranks) -> dict[int, int]:
    """Per rank of `ranks`: re-plans counted in /health `after`, less those in /health `before`."""
    count = lambda health: {w["rank"]: w["replans"] for w in health["workers"]}
    was, now = count(before), count(after)
    return {r: now[r] - was[r] for r in ranks}


def unexpected_replans(row: dict) -> str | None:
    """Why `row`'s survivors re-planned other than once per loss (a flap), or None."""
    want = EXPECTED_REPLANS.get(row["case"])
    wrong = {r: n for r, n in row["survivor_replans"].items() if want is not None and n != want}
    if not wrong:
        return None
    rejoins = {r: w["peer_rejoins"] for r, w in row["survivors_after"].items()}
    return (f"{row['case']}: survivors re-planned {wrong} times (rank: re-plans), expected {want} each; their rejoins "
            f"seen (rank: {{peer: times}}): {rejoins}")


def summarise(case: str, plan: list, results: list[dict], fault: dict, model, args, ranks: int, health: dict,
              health_before: dict) -> dict:
    victim, hit = args.victim, fault["hit"]
    survivors = [r for r in range(ranks) if r not in hit]
    ok = [r for r in results if r["status"] == 200]
    checked = _tokens_ok(plan, results, model)
    correct = [c for c, r in zip(checked, results) if r["status"] == 200]
    clear = [r for r in results if isinstance(r["status"], int) and r["status"] >= 500
             and any(f"rank {h}" in r["message"] for h in hit)]
    lost = [r for r in results if r["status"] == "transport"]
    t0, t1 = fault["fault_s"], fault["end_s"] or max(r["done"] for r in results)
    lag = statistics.median(r["ttft_s"] for (at, _, _), r in zip(plan, results) if r["status"] == 200 and at < t0)
    answered = [(r["done"], r["tokens"]) for r, good in zip(results, checked) if good and r["rank"] in survivors]
    recovery, t, end = None, t0, max(r["done"] for r in results) - WINDOW_S
    while t <= end:
        offered = sum(len(ids) for at, _, ids in plan if t - lag <= at < t + WINDOW_S - lag)
        carried = sum(n for done, n in answered if t <= done < t + WINDOW_S)
        if offered and carried >= CARRIED * offered:
            recovery = t - t0
            break
        t += STEP_S
    heal = heal_summary(fault["samples"], fault, results) if "samples" in fault else {}
    return {
        **heal, "hit": hit, "ranks": ranks,
        "case": case, "victim": victim, "sent": len(plan), "correct": sum(correct),
        "wrong": len(correct) - sum(correct), "failed_clear": len(clear),
        "failed_other": len(results) - len(ok) - len(clear) - len(lost), "lost": len(lost),
        "errors": sorted({f"{r['status']} {r['error']}: {r['message'][:160]}" for r in results if r["status"] != 200}),
        "fault_s": t0, "fault_end_s": fault["end_s"], "victim_busy_at_fault": fault["victim_busy"],
        "recovery_s": recovery,
        "ttft_median_before_s": lag,
        "survivor_tok_s_before": _rate(ok, 0.0, t0, survivors), "survivor_tok_s_during": _rate(ok, t0, t1, survivors),
        "survivor_prefill_ms_per_1k_before": _prefill_ms_per_1k(ok, 0.0, t0, survivors),
        "survivor_prefill_ms_per_1k_during": _prefill_ms_per_1k(ok, t0, t1, survivors),
        "survivor_replans": replans_since(health_before, health, survivors),
        "survivors_after": {w["rank"]: {k: w[k] for k in ("lost_peers", "replans", "retried_slices", "routable",
                                                          "unservable_experts", "peer_rejoins", "restarts")}
                            for w in health["workers"] if w["rank"] not in hit},
        "server_retried_requests": health["retried"], "server_failed_requests": health["failed"],
        "requests": results,
    }


def format_table(rows: list[dict]) -> str:
    header = ("case", "sent", "correct", "wrong", "failed (names rank)", "failed other", "lost", "handed on",
              "re-plans", "recovery s",
              "survivor tok/s before", "during", "ratio", "prefill ms/1k tok before", "during")

    def num(x, fmt):
        return "n/a" if x is None or x != x else format(x, fmt)

    lines = [(r["case"], str(r["sent"]), str(r["correct"]), str(r["wrong"]), str(r["failed_clear"]),
              str(r["failed_other"]), str(r["lost"]), str(r["server_retried_requests"]),
              ",".join(str(n) for _, n in sorted(r["survivor_replans"].items())), num(r["recovery_s"], ".2f"),
              num(r["survivor_tok_s_before"], ".0f"), num(r["survivor_tok_s_during"], ".0f"),
              num(r["survivor_tok_s_during"] / r["survivor_tok_s_before"], ".2f"),
              num(r["survivor_prefill_ms_per_1k_before"], ".0f"), num(r["survivor_prefill_ms_per_1k_during"], ".0f"))
             for r in rows]
    return render_table(header, lines)


def format_heal_table(rows: list[dict]) -> str:
    header = ("case", "ranks", "hit", "sent", "correct", "failed (names rank)", "lost", "redundancy before",
              "during", "after", "rejoined s", "full capacity s")

    def num(x, fmt):
        return "n/a" if x is None or x != x else format(x, fmt)

    lines = [(r["case"], str(r["ranks"]), ",".join(map(str, r["hit"])), str(r["sent"]), str(r["correct"]),
              str(r["failed_clear"]), str(r["lost"]), num(r["redundancy_before"], "d"),
              num(r["redundancy_during"], "d"), num(r["redundancy_after"], "d"), num(r["rejoined_s"], ".2f"),
              num(r["full_capacity_s"], ".2f")) for r in rows if "rejoined_s" in r]
    return render_table(header, lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    add_load_arguments(p, ranks=3, duration_s=24.0, window="case", clients=True)
    p.add_argument("--expert-replicas", type=int, default=2, help="owners of every expert (default 2)")
    p.add_argument("--victim", type=int, default=1, help="the rank hit (default 1)")
    p.add_argument("--second", type=int, default=2, help="the second rank hit in the overlapping cases (default 2)")
    p.add_argument("--heal-ranks", type=int, default=4, help="workers in the overlapping cases (default 4)")
    p.add_argument("--heal-replicas", type=int, default=3, help="owners per expert in the overlapping cases (default 3)")
    p.add_argument("--heal-timeout", type=float, default=180.0, help="healing cases: longest wait after the load "
                   "for the group to heal (default 180)")
    p.add_argument("--restart-backoff", type=float, default=0.2, help="server's --restart-backoff in the healing "
                   "cases (default 0.2)")
    p.add_argument("--rate", type=float, default=6.0, help="offered requests per second (default 6)")
    p.add_argument("--fault-at", type=float, default=8.0, help="seconds into the window the fault starts (default 8)")
    p.add_argument("--stall", type=float, default=4.0, help="seconds the stalled rank stays stopped (default 4)")
    p.add_argument("--peer-timeout", type=float, default=1.0, help="server's --peer-timeout (default 1)")
    p.add_argument("--stall-timeout", type=float, default=1.0, help="server's --stall-timeout (default 1)")
    p.add_argument("--out", help="JSON path (default bench/results/chaos_cpu.json)")
    return p


def main() -> int:
    p = build_parser()
    args = p.parse_args()
    cases = args.cases.split(",")
    bad = [c for c in cases if c not in CASES]
    if bad or not 0 <= args.victim < args.ranks or not 0 < args.fault_at < args.duration:
        p.error(f"cases {bad} not in {CASES}, or victim {args.victim} not in [0, {args.ranks}), or fault-at "
                f"{args.fault_at} not inside the duration {args.duration}")

    model = preset_model("tiny", seed=0)  # the unwrapped model every answer is checked against

    def server_args(case: str) -> tuple[int, list[str]]:
        ranks, replicas = ((args.heal_ranks, args.heal_replicas) if case in OVERLAPPING
                           else (args.ranks, args.expert_replicas))
        restart = (["--restart", "on-failure", "--restart-backoff", str(args.restart_backoff)] if case in HEAL_CASES
                   else ["--restart", "never"])
        return ranks, ["--ranks", str(ranks), "--expert-replicas", str(replicas), "--preset", "tiny",
                       "--max-num-tokens", str(args.max_num_tokens), "--peer-timeout", str(args.peer_timeout),
                       "--stall-timeout", str(args.stall_timeout), "--fault-injection", *restart]

    load_before = load_average_1min()
    rows, servers = [], {}
    for i, case in enumerate(cases):
        plan = arrivals(args.rate, 10_000, args.duration, args.clients, args.isl, args.isl_ratio, args.cv,
                        args.max_num_tokens, args.seed + i)
        ranks, case_args = server_args(case)
        servers[case] = "dwdp serve " + " ".join(case_args)
        with ServerProcess(case_args, free_port(), startup_timeout_s=300) as server:
            health = httpx.get(f"{server.url}/health", timeout=10).json()
            pids = [w["pid"] for w in health["workers"]]
            warm = arrivals(100.0, 2 * ranks, 10.0, args.clients, args.isl, args.isl_ratio, 0.0,
                            args.max_num_tokens, args.seed + 999)
            asyncio.run(run_rate(server.url, warm, args.timeout))  # first forwards touch buffers, build plans
            before = httpx.get(f"{server.url}/health", timeout=10).json()
            probe = arrivals(args.rate, 3 * ranks, 3 * ranks / args.rate, args.clients, args.isl, args.isl_ratio,
                             args.cv, args.max_num_tokens, args.seed + 500 + i)
            plan, results, fault = asyncio.run(_run_case(case, server.url, plan, pids, args, probe))
            time.sleep(args.stall_timeout / 2)  # workers report 4 times per stall bound: their latest reach /health
            health = httpx.get(f"{server.url}/health", timeout=10).json()
        rows.append(summarise(case, plan, results, fault, model, args, ranks, health, before))
        print(f"{case}: {rows[-1]['errors'] or 'no errors'}", flush=True)
    out = Path(args.out) if args.out else RESULTS / "chaos_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": command_line("chaos.py", args),
            "machine": machine(), "device": "cpu",
            "load_average_1min": {"before": load_before, "after": load_average_1min()},
            "server": servers,
            "model": "tiny preset (DeepSeek-V3-style, 16 experts x 4 MoE layers, fp32)",
            "definitions": __doc__.split("\n\n")[1]}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"chaos: {args.ranks} ranks, every expert on {args.expert_replicas}; rank {args.victim} hit {args.fault_at:g} s "
          f"into {args.duration:g} s at {args.rate:g} req/s; CPU only, {os.cpu_count()} cores, 1-min load average "
          f"{load_before:.2f} before, {meta['load_average_1min']['after']:.2f} after; results in {out}")
    print(format_table(rows))
    if any("rejoined_s" in r for r in rows):
        print(format_heal_table(rows))
    flaps = [why for why in map(unexpected_replans, rows) if why]
    for why in flaps:
        print(f"chaos: FLAP {why}")
    return 1 if flaps else 0


if __name__ == "__main__":
    raise SystemExit(main())
