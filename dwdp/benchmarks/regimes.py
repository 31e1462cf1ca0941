"""`dwdp bench regimes`: where DWDP's overlap pays, measured, from tiny forwards to large ones.

For each expert size (`--hiddens`, intermediate = hidden) and each forward size (`--tokens`), one
local group of `--ranks` processes (one compute thread each) measures, interleaved repeat by repeat
(order rotated, a barrier before every timed piece, so a slow spell of a shared machine hits every
variant alike):
- replicated: one forward of ReplicatedModel (every expert local, no copies): the compute-only step;
- copy: one MoE layer's remote experts pulled through the DWDP model's own transport into a spare
  slot, with no compute beside it: the copy-only time of one layer;
- serial: one forward of ReplicatedModel that pulls each MoE layer's remote experts through the same
  transport, and waits for them, right before the layer: copy-then-compute, measured;
- dwdp: one forward of DWDPModel, whose copies overlap its compute.
Each timed forward follows an untimed one of the same model, so a DWDP forward starts as it does in
steady serving: layer 0's copy was issued at the previous forward's last MoE layer. Every rank has
glibc keep freed memory (`dwdp.observe.timing.keep_freed_memory`), so no variant pages its tensors in anew.

Derived, per rank and point: efficiency = replicated / dwdp (median of the repeat-by-repeat ratios),
serial bound = replicated / (replicated + M x copy) with M MoE layers (copy first, then compute, no
overlap, each costing what it costs alone), copy share = M x copy / replicated, and the measured
serial efficiency replicated / serial and gain over serial = serial / dwdp (medians of ratios too):
the copy-then-compute that the bound idealises, with what copies do to the compute beside them. Both models run the experts through the same reference
grouped path, so they differ only in where experts live and in the copies. The table (means over
ranks) is printed last; JSON and a plot (efficiency and serial bound against tokens per forward) go
to <out-dir>/regimes_<device>.json / .png.

Backend-agnostic: on a CUDA machine (`--device cuda`) each rank runs on GPU rank % count with the
cuda backend, forwards are timed with device events and the copy probe with the host clock around
submit + synchronize.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

from dwdp.runtime.baselines import ReplicatedModel
from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.group import init_group, launch_local
from dwdp.runtime.model import DWDPModel
from dwdp.observe.timing import USER_RESULTS_DIR, device_tag, keep_freed_memory, load_average_1min, machine, time_fn
from dwdp.models.tiny import FAMILIES, build_tiny_model
from dwdp.predict.workload import Forward, forward_inputs

VARIANTS = ("replicated", "copy", "serial", "dwdp")
DEFAULT_TOKENS = (8, 32, 128, 512, 2048)
DEFAULT_HIDDENS = (64, 512)
MODEL = dict(num_experts=16, top_k=4, num_layers=5, vocab=256)
TARGET_EFFICIENCY = 0.95  # where copies cost under COPY_SHARE_FREE of compute
COPY_SHARE_FREE = 0.05
MAX_REPEATS = 200


def add_arguments(p: argparse.ArgumentParser, results_dir: str = USER_RESULTS_DIR) -> argparse.ArgumentParser:
    """The options of `dwdp bench regimes` and `bench/regimes.py`."""
    p.add_argument("--ranks", type=int, default=2, help="processes in the group (default 2)")
    p.add_argument("--tokens", type=int, nargs="+", default=list(DEFAULT_TOKENS),
                   help=f"tokens per forward (default {' '.join(map(str, DEFAULT_TOKENS))})")
    p.add_argument("--hiddens", type=int, nargs="+", default=list(DEFAULT_HIDDENS),
                   help="model hidden sizes, expert intermediate = hidden: the expert sizes "
                   f"(default {' '.join(map(str, DEFAULT_HIDDENS))})")
    p.add_argument("--isl", type=int, default=128, help="tokens per request; a forward of T tokens holds "
                   "ceil(T / isl) requests (default 128)")
    p.add_argument("--family", choices=FAMILIES, default="deepseek_v3")
    p.add_argument("--num-layers", type=int, default=MODEL["num_layers"], help="decoder layers (default 5)")
    p.add_argument("--repeats", type=int, default=5, help="fewest timed repeats per point and variant (default 5)")
    p.add_argument("--min-seconds", type=float, default=2.0, help="repeat until each rank has timed this many "
                   f"seconds of DWDP forwards per point, at most {MAX_REPEATS} repeats (default 2)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repeats per point first (default 1)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--slice-bytes", type=int, default=1 << 20, help="DWDP copy slice size (default 1 MiB)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the models run (default cpu)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=results_dir, help=f"where the JSON and PNG go (default {results_dir})")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before giving up on the group")
    return p


def options_from_args(args: argparse.Namespace) -> dict:
    """Resolved, picklable settings of one sweep; ValueError names a bad option."""
    opts = dict(ranks=args.ranks, tokens=tuple(args.tokens), hiddens=tuple(args.hiddens), isl=args.isl,
                family=args.family, model=dict(MODEL, num_layers=args.num_layers), repeats=args.repeats,
                min_seconds=args.min_seconds,
                warmup=args.warmup, threads=args.threads, slice_bytes=args.slice_bytes, device=args.device,
                dtype=args.dtype, seed=args.seed)
    for name in ("ranks", "isl", "repeats", "threads", "slice_bytes"):
        if opts[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')}={opts[name]} must be >= 1")
    if opts["warmup"] < 0:
        raise ValueError(f"--warmup={opts['warmup']} must be >= 0")
    for name in ("tokens", "hiddens"):
        if min(opts[name]) < 1:
            raise ValueError(f"--{name} {list(opts[name])}: every value must be >= 1")
    if opts["device"] == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible here")
    return opts


def forward_lengths(tokens: int, isl: int) -> tuple[int, ...]:
    """Request lengths of a forward of `tokens` tokens: full requests of `isl`, the last one shorter."""
    full, rest = divmod(tokens, isl)
    return (isl,) * full + ((rest,) if rest else ())


# -- on every rank -----------------------------------------------------------------------------
def _device(rank: int, opts: dict) -> torch.device:
    if opts["device"] == "cuda":
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _models(hidden: int, group, device: torch.device, opts: dict):
    """(replicated, dwdp) copies of the same seeded model on `device`."""
    dtype = getattr(torch, opts["dtype"])
    kwargs = dict(opts["model"], hidden=hidden, intermediate=hidden)

    def build():
        return build_tiny_model(opts["family"], seed=opts["seed"], dtype=dtype, **kwargs).to(device)

    # Both run the reference experts path: the same math, so the ratio isolates the copies.
    config = DWDPConfig(slice_bytes=opts["slice_bytes"], backend="auto", experts_kernel="reference")
    return ReplicatedModel(build()), DWDPModel(build(), config, group)


def _copy_probe(dwdp: DWDPModel, layer: int = 0, pulled: list | None = None):
    """A callable that pulls MoE layer `layer`'s remote experts into a spare slot and waits for them
    (adding the bytes to pulled[0] if given), and the bytes it pulls.

    The plan is labelled with a slot index the prefetcher never uses, so the cuda backend's
    per-slot events of the running model are left alone."""
    prefetcher = dwdp.prefetcher
    spare_slot = prefetcher.num_buffers
    plan = prefetcher.plans.get(layer, spare_slot)
    buffer = dwdp.transport.alloc_slot(prefetcher.slots[0].buffer.numel())
    timeout = prefetcher.timeout_s

    def pull() -> None:
        dwdp.transport.submit(plan, buffer).synchronize(timeout)
        dwdp.transport.release_slot(spare_slot)
        if pulled is not None:
            pulled[0] += plan.nbytes

    return pull, plan.nbytes


def _copy_then_compute(replicated: ReplicatedModel, pulls: list, device: torch.device):
    """`with hooked() as model`: `replicated` with pulls[i] run before MoE layer i (hooks set up and
    removed outside the timed region). On CUDA the compute queued before a layer finishes before its
    pull starts, so the copy overlaps nothing there either."""

    def before_layer(pull) -> None:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        pull()

    @contextlib.contextmanager
    def hooked():
        handles = [module.register_forward_pre_hook(lambda *_, pull=pull: before_layer(pull))
                   for module, pull in zip(replicated.experts_modules, pulls, strict=True)]
        try:
            yield replicated
        finally:
            for handle in handles:
                handle.remove()

    return hooked


def _measure_point(group, models: dict, copy, serial, inputs: dict, device: torch.device, opts: dict) -> dict:
    """Seconds of each variant per timed repeat, interleaved and rotated, a barrier before each piece.

    At least `repeats` timed repeats, more until every rank has timed `min_seconds` of DWDP forwards
    (small forwards are noisy), at most MAX_REPEATS; the ranks agree on when to stop."""
    samples = {v: [] for v in VARIANTS}
    for repeat in range(opts["warmup"] + MAX_REPEATS):
        timed = repeat - opts["warmup"]
        if timed >= opts["repeats"]:
            timed_s = group.all_gather_object(sum(samples["dwdp"]))
            if min(timed_s) >= opts["min_seconds"]:
                break
        shift = repeat % len(VARIANTS)
        for variant in VARIANTS[shift:] + VARIANTS[:shift]:
            group.barrier()
            if variant == "copy":
                seconds = time_fn(copy, warmup=0, repeats=1).median_s  # host clock: the copy stream's work
            elif variant == "serial":
                with serial() as model:
                    seconds = time_fn(lambda: model(**inputs), warmup=1, repeats=1, device=device).median_s
            else:
                model = models[variant]
                seconds = time_fn(lambda: model(**inputs), warmup=1, repeats=1, device=device).median_s
            if repeat >= opts["warmup"]:
                samples[variant].append(seconds)
    return samples


def _rank_main(rank: int, opts: dict) -> list[dict]:
    allocator = keep_freed_memory()  # the same for every variant; see its docstring
    torch.set_num_threads(opts["threads"])
    group = init_group()
    device = _device(rank, opts)
    points = []
    for hidden in opts["hiddens"]:
        replicated, dwdp = _models(hidden, group, device, opts)
        try:
            copy, copy_bytes = _copy_probe(dwdp)
            num_moe_layers = len(dwdp.experts_modules)
            pulled = [0]  # bytes the copy-then-compute forwards pulled
            pulls = [_copy_probe(dwdp, layer, pulled)[0] for layer in range(num_moe_layers)]
            serial = _copy_then_compute(replicated, pulls, device)
            spec = dwdp.experts_layers[0].spec
            expert_bytes = sum(t.nbytes for t in spec.tensors)
            models = {"replicated": replicated, "dwdp": dwdp}
            with torch.no_grad():
                for tokens in opts["tokens"]:
                    lengths = forward_lengths(tokens, opts["isl"])
                    seed = opts["seed"] * 1_000_003 + rank * 10_007 + tokens
                    inputs = {k: v.to(device) for k, v in forward_inputs(Forward(lengths), opts["model"]["vocab"],
                                                                         seed).items()}
                    waited_before, pulled[0] = dwdp.stats.wait_s, 0
                    samples = _measure_point(group, models, copy, serial, inputs, device, opts)
                    dwdp_forwards = 2 * (opts["warmup"] + len(samples["dwdp"]))  # a timed one follows an untimed one
                    serial_forwards = 2 * (opts["warmup"] + len(samples["serial"]))
                    points.append(dict(rank=rank, hidden=hidden, tokens=tokens, requests=len(lengths),
                                       num_moe_layers=num_moe_layers, expert_bytes=expert_bytes,
                                       copy_bytes_per_layer=copy_bytes, samples_s=samples,
                                       repeats=len(samples["dwdp"]), allocator=allocator,
                                       wait_s_per_forward=(dwdp.stats.wait_s - waited_before) / dwdp_forwards,
                                       serial_bytes_per_forward=pulled[0] / serial_forwards))
        finally:
            group.barrier()  # peers keep reading this rank's segment until every rank is done
            dwdp.close()
    return points


# -- in the launcher ---------------------------------------------------------------------------
def derive(point: dict) -> dict:
    """One rank's figures at one point from its samples (see the module docstring)."""
    s = point["samples_s"]
    replicated, serial, dwdp, copy = (float(np.median(s[v])) for v in ("replicated", "serial", "dwdp", "copy"))
    copy_step = point["num_moe_layers"] * copy

    def ratio(a: str, b: str) -> float:
        return float(np.median([x / y for x, y in zip(s[a], s[b])]))

    return dict(replicated_ms=1e3 * replicated, serial_ms=1e3 * serial, dwdp_ms=1e3 * dwdp, copy_layer_ms=1e3 * copy,
                dwdp_wait_ms=1e3 * point["wait_s_per_forward"],
                copy_step_ms=1e3 * copy_step, copy_share=copy_step / replicated,
                efficiency=ratio("replicated", "dwdp"), serial_bound=replicated / (replicated + copy_step),
                serial_efficiency=ratio("replicated", "serial"), gain_over_serial=ratio("serial", "dwdp"))


def summarize(opts: dict, rank_points: list[list[dict]]) -> list[dict]:
    """One row per (hidden, tokens): per-rank figures and their means, and whether the targets hold."""
    rows = []
    for hidden in opts["hiddens"]:
        for tokens in opts["tokens"]:
            per_rank = [next(p for p in points if (p["hidden"], p["tokens"]) == (hidden, tokens))
                        for points in rank_points]
            derived = [derive(p) for p in per_rank]
            mean = {k: float(np.mean([d[k] for d in derived])) for k in derived[0]}
            first = per_rank[0]
            copy_free = mean["copy_share"] < COPY_SHARE_FREE
            rows.append(dict(
                hidden=hidden, tokens=tokens, requests=first["requests"], num_moe_layers=first["num_moe_layers"],
                repeats=first["repeats"],
                expert_mib=first["expert_bytes"] / 2**20, copy_mib_per_layer=first["copy_bytes_per_layer"] / 2**20,
                **mean, per_rank=derived, efficiency_min=min(d["efficiency"] for d in derived),
                copy_nearly_free=copy_free,
                meets_free_target=(mean["efficiency"] >= TARGET_EFFICIENCY) if copy_free else None,
                meets_serial_bound=mean["efficiency"] >= mean["serial_bound"],
                not_slower_than_serial=mean["gain_over_serial"] >= 1.0,
            ))
    return rows


def format_table(rows: list[dict]) -> str:
    header = ("hidden", "expert MiB", "tokens", "repeats", "replicated ms", "copy ms/layer", "copy/compute %",
              "serial ms", "dwdp ms", "wait ms", "efficiency", "rank min", "serial bound", "serial eff", "dwdp gain",
              "target", "met")
    lines = []
    for r in rows:
        target = f">={TARGET_EFFICIENCY:.2f}" if r["copy_nearly_free"] else ">=bound"
        met = r["meets_free_target"] if r["copy_nearly_free"] else r["meets_serial_bound"]
        lines.append((str(r["hidden"]), f"{r['expert_mib']:.3f}", str(r["tokens"]), str(r["repeats"]),
                      f"{r['replicated_ms']:.2f}", f"{r['copy_layer_ms']:.3f}", f"{100 * r['copy_share']:.1f}",
                      f"{r['serial_ms']:.2f}", f"{r['dwdp_ms']:.2f}", f"{r['dwdp_wait_ms']:.2f}",
                      f"{r['efficiency']:.3f}", f"{r['efficiency_min']:.3f}", f"{r['serial_bound']:.3f}",
                      f"{r['serial_efficiency']:.3f}", f"{r['gain_over_serial']:.3f}", target, "yes" if met else "NO"))
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*x) for x in lines])


def plot(rows: list[dict], opts: dict, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for index, hidden in enumerate(opts["hiddens"]):
        mine = [r for r in rows if r["hidden"] == hidden]
        color = f"C{index}"
        label = f"hidden {hidden} ({mine[0]['copy_mib_per_layer']:.1f} MiB copied per layer)"
        ax.plot([r["tokens"] for r in mine], [r["efficiency"] for r in mine], "o-", color=color,
                label=f"efficiency, {label}")
        ax.plot([r["tokens"] for r in mine], [r["serial_bound"] for r in mine], "s--", color=color, alpha=0.7,
                label=f"serial bound, hidden {hidden}")
        ax.plot([r["tokens"] for r in mine], [r["serial_efficiency"] for r in mine], "x:", color=color, alpha=0.7,
                label=f"copy-then-compute measured, hidden {hidden}")
    ax.axhline(TARGET_EFFICIENCY, color="grey", lw=0.8, ls=":")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(opts["tokens"]), [str(t) for t in opts["tokens"]])
    ax.minorticks_off()
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("replicated step / step (1: copies cost nothing)")
    shown = [r[k] for r in rows for k in ("efficiency", "serial_bound", "serial_efficiency")]
    ax.set_ylim(max(0.0, min(shown) - 0.05), max(1.05, max(shown) + 0.02))  # differences of a few % stay visible
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_regimes(args: argparse.Namespace) -> int:
    """Run the sweep described by parsed `args`; prints the table last, returns the exit code."""
    try:
        opts = options_from_args(args)
    except ValueError as exc:
        print(f"dwdp bench regimes: {exc}", file=sys.stderr)
        return 2
    m = opts["model"]
    where = device_tag(opts["device"]) if opts["device"] == "cpu" else device_tag(torch.device("cuda", 0))
    print(f"dwdp bench regimes: {opts['ranks']} ranks x {opts['threads']} thread(s) on {where}; {opts['family']} "
          f"{m['num_experts']} experts top-{m['top_k']}, {m['num_layers']} layers, {opts['dtype']}; hiddens "
          f"{list(opts['hiddens'])}, tokens per forward {list(opts['tokens'])}, {opts['repeats']} repeats")
    load_before = load_average_1min()
    start = time.perf_counter()
    rank_points = launch_local(_rank_main, opts["ranks"], (opts,), timeout_s=args.timeout)
    elapsed = time.perf_counter() - start
    load_after = load_average_1min()
    rows = summarize(opts, rank_points)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"regimes_{where}"
    report = dict(argv=list(sys.argv), device=where, machine=machine(), options=opts,
                  load_average_1min=dict(before=load_before, after=load_after), elapsed_s=elapsed,
                  target=dict(efficiency=TARGET_EFFICIENCY, where_copy_share_below=COPY_SHARE_FREE),
                  rows=rows, points=[p for points in rank_points for p in points])
    Path(f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    title = (f"{opts['ranks']} ranks on {where} ({os.cpu_count()} CPUs, load {load_before:.1f}/{load_after:.1f}), "
             f"{opts['family']} {m['num_experts']} experts top-{m['top_k']}")
    plot(rows, opts, title, Path(f"{stem}.png"))
    free = [r for r in rows if r["copy_nearly_free"]]
    print(f"wrote {stem}.json/.png in {elapsed:.0f} s; machine: {os.cpu_count()} CPUs, 1-min load average "
          f"{load_before:.1f} before and {load_after:.1f} after (this run adds about {opts['ranks']})")
    if free:
        worst = min(free, key=lambda r: r["efficiency"])
        print(f"copies under {100 * COPY_SHARE_FREE:.0f}% of compute at {len(free)} points: lowest efficiency "
              f"{worst['efficiency']:.3f} (hidden {worst['hidden']}, {worst['tokens']} tokens)")
    for key, what in (("meets_serial_bound", "efficiency below the serial bound"),
                      ("not_slower_than_serial", "DWDP slower than copy-then-compute measured")):
        below = [r for r in rows if not r[key]]
        print(f"{what} at {len(below)} of {len(rows)} points"
              + ("" if not below else ": " + ", ".join(f"hidden {r['hidden']} / {r['tokens']} tokens" for r in below)))
    print(format_table(rows))
    return 0

