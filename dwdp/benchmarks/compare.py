"""`dwdp bench compare`: DWDP, DEP and replicated on the same model, requests and machine, one run.

One local group of `--ranks` processes (spawned on loopback, one compute thread each) holds all
three models at once and, for each CV of per-rank total tokens, runs the same seeded workload
(dwdp.predict.workload) under each mode, interleaved step by step (see `_run_cv`):
- dwdp: DWDPModel; a rank's forwards never wait for a peer.
- dep: DEPModel; ranks advance in lockstep steps (all-to-alls in every MoE layer); a rank out of
  work runs `idle_step()` until the busiest rank has run all its forwards.
- replicated: ReplicatedModel; every expert local, no communication.

Per rank: tokens/s = own real tokens / own busy time (the sum of its timed forwards, DEP idle steps
included, warm-up excluded); the total is the sum over ranks (steady-state serving, where a rank
that finishes takes new requests). Wait = DWDPModel.stats.wait_s (exposed prefetch) or, for DEP,
time blocked in all-to-alls beyond the last-arriving rank's time for the same call. Prints a table
last, writes <out-dir>/compare_<device>.json and .png.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from dwdp.models.adapters import find_experts
from dwdp.runtime.baselines import DEPModel, ReplicatedModel
from dwdp.runtime.config import DWDPConfig
from dwdp.models.demo_model import DEMO_MODEL
from dwdp.runtime.group import init_group, launch_local
from dwdp.runtime.model import DWDPModel
from dwdp.observe.timing import USER_RESULTS_DIR, device_tag, load_average_1min, machine, time_fn
from dwdp.models.tiny import FAMILIES, build_tiny_model
from dwdp.predict.workload import Forward, WorkloadConfig, forward_inputs, make_workload

MODES = ("dwdp", "dep", "replicated")
EXPERT_DTYPES = ("fp32", "fp8")
DEFAULT_CVS = (0.0, 0.1, 0.2, 0.4)
DEFAULTS = dict(tokens_per_rank=8192, isl=256, max_num_tokens=1024, cvs=DEFAULT_CVS, rounds=2, model=dict(DEMO_MODEL))
QUICK = dict(tokens_per_rank=384, isl=48, max_num_tokens=128, cvs=(0.0, 0.2), rounds=1,
             model=dict(hidden=64, intermediate=64, num_experts=8, top_k=2, num_layers=4, vocab=256))


def add_arguments(p: argparse.ArgumentParser, results_dir: str = USER_RESULTS_DIR) -> argparse.ArgumentParser:
    """The options of `dwdp bench compare` (the stored runs: `--out-dir bench/results`)."""
    p.add_argument("--ranks", type=int, default=2, help="processes in the group (default 2)")
    p.add_argument("--cvs", type=float, nargs="+", help=f"CVs of per-rank total tokens (default {list(DEFAULT_CVS)})")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--tokens-per-rank", type=int, help="mean real tokens per rank per run (default 8192)")
    p.add_argument("--isl", type=int, help="longest request; lengths uniform in [ratio*isl, isl] (default 256)")
    p.add_argument("--isl-ratio", type=float, default=0.8, help="shortest / longest request (default 0.8)")
    p.add_argument("--max-num-tokens", type=int, help="padded tokens per forward (default 1024)")
    p.add_argument("--family", choices=FAMILIES, default="deepseek_v3")
    p.add_argument("--dtype", choices=EXPERT_DTYPES, default="fp32",
                   help="experts' weights: fp32, or fp8 with 128x128 block scales, held and moved as fp8 (default fp32)")
    p.add_argument("--hidden", type=int, help=f"model hidden size (default {DEMO_MODEL['hidden']})")
    p.add_argument("--num-layers", type=int, help=f"decoder layers (default {DEMO_MODEL['num_layers']})")
    p.add_argument("--rounds", type=int, help="passes over each CV's workload; throughput is the median over "
                   "passes (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--slice-bytes", type=int, default=1 << 20, help="DWDP copy slice size (default 1 MiB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny model and workload, CVs 0 and 0.2 (smoke test)")
    p.add_argument("--out-dir", default=results_dir, help=f"where the JSON and PNG go (default {results_dir})")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before giving up on the group")
    p.add_argument("--experts-paths", action="store_true",
                   help="instead: time the forward with composite views, the tables path, a merge copy and "
                        "replicated at equal routing with copies that cost nothing (dwdp.benchmarks.experts_paths)")
    p.add_argument("--experts-tokens", type=int, nargs="+", default=[8, 512],
                   help="tokens per forward for --experts-paths (default 8 512)")
    p.add_argument("--experts-rounds", type=int, default=5, help="interleaved rounds for --experts-paths (default 5)")
    p.add_argument("--experts-repeats", type=int, default=5, help="timed forwards per round (default 5)")
    p.add_argument("--experts-slots", type=int, default=None,
                   help="prefetch slots for --experts-paths (default: one per MoE layer, no copies while timing; "
                        "2: every layer refilled, so the tables path's local-first compute can overlap the copies)")
    return p


def options_from_args(args: argparse.Namespace) -> dict:
    """Resolved, picklable settings of one comparison run."""
    base = QUICK if args.quick else DEFAULTS
    model = dict(base["model"])
    if args.hidden is not None:
        model.update(hidden=args.hidden, intermediate=args.hidden)
    if args.num_layers is not None:
        model.update(num_layers=args.num_layers)

    def pick(value, key):
        return base[key] if value is None else value

    opts = dict(
        ranks=args.ranks, cvs=tuple(pick(args.cvs, "cvs")), modes=tuple(args.modes), family=args.family,
        model=model, tokens_per_rank=pick(args.tokens_per_rank, "tokens_per_rank"), isl=pick(args.isl, "isl"),
        isl_ratio=args.isl_ratio, max_num_tokens=pick(args.max_num_tokens, "max_num_tokens"),
        rounds=pick(args.rounds, "rounds"), threads=args.threads, slice_bytes=args.slice_bytes, seed=args.seed,
        quick=args.quick, dtype=args.dtype,
    )
    for name in ("ranks", "threads", "rounds"):
        if opts[name] < 1:
            raise ValueError(f"--{name}={opts[name]} must be >= 1")
    for cv in opts["cvs"]:
        _workload(opts, cv)  # validates every workload before any process starts
    return opts


def _workload(opts: dict, cv: float):
    return make_workload(WorkloadConfig(opts["ranks"], opts["tokens_per_rank"], opts["isl"], opts["isl_ratio"], cv,
                                        opts["max_num_tokens"], opts["seed"]))


# -- on every rank -----------------------------------------------------------------------------
def _model(opts: dict):
    """The compared model: experts fp32, or fp8 with 128 x 128 block scales (its bytes per expert, moved
    and held, are the fp8 values plus their scales)."""
    if opts.get("dtype", "fp32") == "fp32":
        return build_tiny_model(opts["family"], seed=opts["seed"], **opts["model"])
    from dwdp.models.demo_model import demo_models

    return demo_models(opts["family"], opts["dtype"], opts["seed"], **opts["model"])[0]


def _wrap(mode: str, model, group, opts: dict):
    if mode == "dwdp":
        return DWDPModel(model, DWDPConfig(slice_bytes=opts["slice_bytes"], backend="host"), group)
    if mode == "dep":
        return DEPModel(model, group)
    return ReplicatedModel(model)


def _run_cv(group, workload, inputs: list[dict], opts: dict, progress) -> list[dict]:
    """Every mode on this rank's forwards, interleaved step by step; one record per mode.

    Step s runs, in an order rotated every step, each mode's share of step s after a barrier:
    dwdp and replicated their forward s (if this rank has one), dep its forward s or an idle step.
    A mode's busy time is the sum of its own timed pieces, so a slow spell of a shared machine
    hits every mode alike. DWDP ranks never wait for a peer, so summing a rank's forward times
    measures what it would take running alone; DEP's pieces include its waits at the all-to-alls.
    """
    modes = list(opts["modes"])
    wrapped = {m: _wrap(m, _model(opts), group, opts) for m in modes}
    rec = {m: dict(busy_ns=0, cpu_s=0.0, latencies_s=[]) for m in modes}
    try:
        with torch.no_grad():
            for m in modes:  # warm-up outside the timed region: first touch, plan cache, allocator
                group.barrier()
                wrapped[m](**inputs[0])
                if m != "replicated":
                    wrapped[m].stats.reset()
            for step in range(workload.num_steps):
                shift = step % len(modes)
                for m in modes[shift:] + modes[:shift]:
                    group.barrier()  # untimed: every piece starts with both ranks free
                    has_work = step < len(inputs)
                    if not has_work and m != "dep":
                        continue
                    cpu, t0 = time.process_time(), time.perf_counter_ns()
                    if has_work:
                        wrapped[m](**inputs[step])
                    else:
                        wrapped[m].idle_step()  # DEP: out of work, but the all-to-alls need this rank
                    elapsed = time.perf_counter_ns() - t0
                    # CPU seconds of every thread of this rank: far below wall time = blocked or descheduled.
                    rec[m]["cpu_s"] += time.process_time() - cpu
                    rec[m]["busy_ns"] += elapsed
                    if has_work:
                        rec[m]["latencies_s"].append(elapsed / 1e9)
                if progress is not None and group.rank == 0:
                    progress.put((workload.config.cv, step + 1, workload.num_steps))
        out = []
        stream = workload.streams[group.rank]
        for m in modes:
            busy_s = rec[m]["busy_ns"] / 1e9
            memory = wrapped[m].memory
            r = dict(mode=m, rank=group.rank, tokens=stream.num_tokens, forwards=len(inputs), busy_s=busy_s,
                     cpu_s=rec[m]["cpu_s"], tokens_per_s=stream.num_tokens / busy_s, latencies_s=rec[m]["latencies_s"],
                     resident_bytes=memory.dense_bytes + memory.resident_expert_bytes,
                     expert_bytes=memory.resident_expert_bytes, wait_s=0.0, comm_s=0.0, call_s=[], bytes_prefetched=0)
            if m == "dwdp":
                r.update(wait_s=wrapped[m].stats.wait_s, bytes_prefetched=wrapped[m].stats.bytes_copied)
            elif m == "dep":
                r.update(comm_s=wrapped[m].stats.comm_s, call_s=list(wrapped[m].stats.call_s))
            out.append(r)
        return out
    finally:
        for w in wrapped.values():
            w.close()
        group.barrier()


def _regime(opts: dict, group) -> dict:
    """One layer's compute in a full forward against one thread copying a MoE layer's remote experts
    (the experts a rank with ceil(E / ranks) local ones pulls)."""
    model = _model(opts)
    experts = find_experts(model)
    num_experts = experts[0].spec.num_experts
    layer_bytes = num_experts * sum(t.nbytes for t in experts[0].spec.tensors)
    remote = layer_bytes * (num_experts - -(-num_experts // opts["ranks"])) // num_experts
    src, dst = torch.ones(max(remote, 1), dtype=torch.uint8), torch.empty(max(remote, 1), dtype=torch.uint8)
    copy = time_fn(lambda: dst.copy_(src), warmup=2, repeats=5)
    lengths = [opts["isl"]] * max(1, opts["max_num_tokens"] // opts["isl"])
    inputs = forward_inputs(Forward(tuple(lengths)), opts["model"]["vocab"], opts["seed"])
    wrapped = ReplicatedModel(model)
    group.barrier()  # both ranks measure at once: the machine is as loaded as in the runs
    with torch.no_grad():
        fwd = time_fn(lambda: wrapped(**inputs), warmup=1, repeats=2)
    return dict(remote_bytes_per_layer=remote, t_prefetch_layer_ms=1e3 * copy.median_s,
                t_compute_layer_ms=1e3 * fwd.median_s / opts["model"]["num_layers"],
                tokens_per_forward=sum(lengths), num_moe_layers=len(experts))


def _rank_main(rank: int, opts: dict, progress) -> dict:
    torch.set_num_threads(opts["threads"])
    group = init_group()
    out = dict(rank=rank, regime=_regime(opts, group), runs=[])
    for cv in opts["cvs"]:
        workload = _workload(opts, cv)
        stream = workload.streams[rank]
        # Token ids depend on (seed, rank, forward) only: every mode sees the same requests.
        inputs = [forward_inputs(f, opts["model"]["vocab"], opts["seed"] * 1_000_003 + rank * 10_007 + i)
                  for i, f in enumerate(stream.forwards)]
        for round_index in range(opts["rounds"]):
            for result in _run_cv(group, workload, inputs, opts, progress):
                result.update(cv=cv, round=round_index)
                out["runs"].append(result)
    return out


# -- in the launcher ---------------------------------------------------------------------------
def _waits_dep(per_rank_runs: list[dict]) -> list[float]:
    from dwdp.runtime.baselines.dep import waits_from_calls

    return waits_from_calls([r["call_s"] for r in per_rank_runs])


def _aggregate(opts: dict, cv: float, mode: str, rounds: list[list[dict]]) -> dict:
    """One (cv, mode) row from `rounds[i][rank]` run records: medians over rounds, pooled latencies."""
    waits = [_waits_dep(runs) if mode == "dep" and opts["ranks"] > 1 else [r["wait_s"] for r in runs]
             for runs in rounds]
    totals = [sum(r["tokens_per_s"] for r in runs) for runs in rounds]

    def per_rank(key: str) -> list[float]:
        return [float(np.median([runs[k][key] for runs in rounds])) for k in range(opts["ranks"])]

    lat = np.array([x for runs in rounds for r in runs for x in r["latencies_s"]])
    first = rounds[0]
    return dict(
        cv=cv, mode=mode,
        total_tokens_per_s=float(np.median(totals)), total_tokens_per_s_rounds=totals,
        tokens_per_s_per_rank=per_rank("tokens_per_s"),
        tokens_per_rank=[r["tokens"] for r in first], forwards_per_rank=[r["forwards"] for r in first],
        busy_s_per_rank=per_rank("busy_s"), cpu_s_per_rank=per_rank("cpu_s"),
        step_p50_ms=float(1e3 * np.percentile(lat, 50)), step_p99_ms=float(1e3 * np.percentile(lat, 99)),
        wait_s_per_rank=[float(np.median([w[k] for w in waits])) for k in range(opts["ranks"])],
        wait_share=float(np.median([np.mean([w[k] / runs[k]["busy_s"] for k in range(opts["ranks"])])
                                    for w, runs in zip(waits, rounds)])),
        comm_s_per_rank=per_rank("comm_s"), bytes_prefetched_per_rank=[r["bytes_prefetched"] for r in first],
        resident_bytes_per_rank=[r["resident_bytes"] for r in first],
        expert_bytes_per_rank=[r["expert_bytes"] for r in first],
    )


def summarize(opts: dict, rank_outputs: list[dict]) -> dict:
    """Per (cv, mode) aggregates, the dwdp ratios and the memory comparison, ready for JSON."""
    results = []
    for cv in opts["cvs"]:
        for mode in opts["modes"]:
            rounds = [[next(r for r in o["runs"] if (r["cv"], r["mode"], r["round"]) == (cv, mode, i))
                       for o in rank_outputs] for i in range(opts["rounds"])]
            results.append(_aggregate(opts, cv, mode, rounds))
    by = {(r["cv"], r["mode"]): r for r in results}
    ratios = []
    for cv in opts["cvs"]:
        row = dict(cv=cv)
        for other in ("dep", "replicated"):
            if (cv, "dwdp") in by and (cv, other) in by:
                row[f"dwdp_over_{other}"] = by[cv, "dwdp"]["total_tokens_per_s"] / by[cv, other]["total_tokens_per_s"]
        ratios.append(row)
    memory = {m: max(by[opts["cvs"][0], m]["resident_bytes_per_rank"]) for m in opts["modes"]}
    if "dwdp" in memory and "replicated" in memory:
        memory["replicated_over_dwdp"] = memory["replicated"] / memory["dwdp"]
    regimes = [o["regime"] for o in rank_outputs]
    regime = {k: (float(np.mean([g[k] for g in regimes])) if isinstance(regimes[0][k], float) else regimes[0][k])
              for k in regimes[0]}
    return dict(results=results, ratios=ratios, resident_bytes_per_rank=memory, regime=regime)


def format_table(summary: dict) -> str:
    ratio = {r["cv"]: r for r in summary["ratios"]}
    header = ("cv", "mode", "tok/s total", "rounds min-max", "tok/s per rank", "p50 ms", "p99 ms", "wait %",
              "wait s/rank", "cpu/busy %", "resident MiB/rank", "dwdp/this")
    lines = []
    for r in summary["results"]:
        rel = {"dwdp": 1.0}.get(r["mode"], ratio[r["cv"]].get(f"dwdp_over_{r['mode']}", float("nan")))
        lines.append((
            f"{r['cv']:.2f}", r["mode"], f"{r['total_tokens_per_s']:.0f}",
            f"{min(r['total_tokens_per_s_rounds']):.0f}-{max(r['total_tokens_per_s_rounds']):.0f}",
            "/".join(f"{x:.0f}" for x in r["tokens_per_s_per_rank"]), f"{r['step_p50_ms']:.0f}",
            f"{r['step_p99_ms']:.0f}", f"{100 * r['wait_share']:.1f}",
            "/".join(f"{x:.2f}" for x in r["wait_s_per_rank"]),
            f"{100 * sum(r['cpu_s_per_rank']) / sum(r['busy_s_per_rank']):.0f}",
            f"{max(r['resident_bytes_per_rank']) / 2**20:.1f}", f"{rel:.3f}",
        ))
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*x) for x in lines])


def plot(summary: dict, opts: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, marker in zip(MODES, "os^"):
        rows = [r for r in summary["results"] if r["mode"] == mode]
        if rows:
            left.plot([r["cv"] for r in rows], [r["total_tokens_per_s"] for r in rows], marker + "-", label=mode)
    left.set_xlabel("CV of per-rank total tokens")
    left.set_ylabel("tokens/s (sum over ranks)")
    left.legend()
    for key, marker in (("dwdp_over_dep", "s"), ("dwdp_over_replicated", "^")):
        rows = [r for r in summary["ratios"] if key in r]
        if rows:
            label = key.replace("_over_", " / ")
            right.plot([r["cv"] for r in rows], [r[key] for r in rows], marker + "-", label=label)
    right.axhline(1.0, color="grey", lw=0.8, ls=":")
    right.set_xlabel("CV of per-rank total tokens")
    right.set_ylabel("throughput ratio")
    right.legend()
    fig.suptitle(f"{opts['ranks']} ranks, {opts['family']} hidden {opts['model']['hidden']}, "
                 f"{opts['tokens_per_rank']} tokens/rank, isl {opts['isl']}, mnt {opts['max_num_tokens']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _launch_with_progress(opts: dict, timeout_s: float, show: bool) -> list[dict]:
    """launch_local in a thread while the main thread draws a progress bar from rank 0's events."""
    import multiprocessing as mp
    import queue

    events = mp.get_context("spawn").Queue()
    box: dict = {}

    def target():
        try:
            box["value"] = launch_local(_rank_main, opts["ranks"], (opts, events), timeout_s=timeout_s)
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    runner = threading.Thread(target=target, daemon=True)
    runner.start()
    total = sum(_workload(opts, cv).num_steps for cv in opts["cvs"]) * opts["rounds"]
    progress = None
    if show:
        try:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        except ImportError:
            show = False
        else:
            progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), transient=False)
    task = progress.add_task("starting ranks", total=total) if progress else None
    if progress:
        progress.start()
    try:
        while runner.is_alive():
            try:
                cv, step, steps = events.get(timeout=0.2)
            except queue.Empty:
                continue
            if progress:
                progress.update(task, advance=1, description=f"cv={cv:.2f} step {step}/{steps}")
        runner.join()
    finally:
        if progress:
            progress.stop()
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_compare(args: argparse.Namespace) -> int:
    """Run the comparison described by parsed `args`; prints the table last, returns the exit code."""
    if getattr(args, "experts_paths", False):
        from dwdp.benchmarks.experts_paths import run_experts_paths

        return run_experts_paths(args)
    try:
        opts = options_from_args(args)
    except ValueError as exc:
        print(f"dwdp bench compare: {exc}", file=sys.stderr)
        return 2
    workloads = [_workload(opts, cv) for cv in opts["cvs"]]
    m = opts["model"]
    print(f"dwdp bench compare: {opts['ranks']} ranks x {opts['threads']} thread(s), modes {', '.join(opts['modes'])}; "
          f"{opts['family']} hidden {m['hidden']}, {m['num_experts']} experts top-{m['top_k']}, "
          f"{m['num_layers']} layers, {opts['dtype']} experts")
    for w in workloads:
        print(w.describe())
    load_before = load_average_1min()
    start = time.perf_counter()
    rank_outputs = _launch_with_progress(opts, args.timeout, not args.no_progress)
    elapsed = time.perf_counter() - start
    summary = summarize(opts, rank_outputs)
    device = device_tag("cpu")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"compare_{device}" + ("" if opts["dtype"] == "fp32" else f"_{opts['dtype']}") + ("_quick" if opts["quick"] else "")
    report = dict(
        argv=list(sys.argv),
        device=device, machine=machine(),
        options={k: (list(v) if isinstance(v, tuple) else v) for k, v in opts.items()},
        load_average_1min=dict(before=load_before, after=load_average_1min()),
        workloads=[w.as_dict() for w in workloads], elapsed_s=elapsed, **summary,
    )
    (out_dir / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    plot(summary, opts, out_dir / f"{stem}.png")
    reg = summary["regime"]
    print(f"regime: one layer's compute {reg['t_compute_layer_ms']:.1f} ms at {reg['tokens_per_forward']} tokens vs "
          f"copying its remote experts {reg['t_prefetch_layer_ms']:.2f} ms "
          f"({reg['remote_bytes_per_layer'] / 2**20:.1f} MiB)")
    mem = summary["resident_bytes_per_rank"]
    if "replicated_over_dwdp" in mem:
        print(f"memory: replicated holds {(mem['replicated'] - mem['dwdp']) / 2**20:.1f} MiB more per rank than dwdp "
              f"({mem['replicated_over_dwdp']:.2f}x); wrote {out_dir / stem}.json/.png in {elapsed:.0f} s")
    print(f"machine: {os.cpu_count()} CPUs, 1-min load average {load_before:.1f} before and "
          f"{report['load_average_1min']['after']:.1f} after (this run adds about {opts['ranks']})")
    print(format_table(summary))
    return 0
