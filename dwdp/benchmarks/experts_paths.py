"""`dwdp bench compare --experts-paths`: what each way of reading a rank's split experts costs a forward.

Legend: T = tokens per forward, E = experts, G = ranks, M = MoE layers.

One local group of 2 processes; every rank times, on the same model weights and the same prompt (so
the same routing), the forward of:
- replicated: the unwrapped model, every expert local (the model's own experts implementation);
- composite: DWDPModel with composite views, the model's own experts implementation on them;
- tables: DWDPModel's multi-buffer path (plain-PyTorch experts over per-expert views, local first);
- merge: composite, but each layer first copies its E experts into one contiguous [E, ...] tensor and
  runs the same stock call on it (the merge copy composite views avoid).
Copies cost nothing: every DWDP model has one prefetch slot per MoE layer (num_buffers = M), so after
the warm-up forward each layer's remote experts stay in place and no copy is issued while timing
(asserted: plans issued during timing must be 0). Ratios are against replicated, from the same run.
Prints a table last; writes <out-dir>/experts_paths_<device>.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dwdp.observe.timing import device_tag, load_average_1min, machine, time_fn

PATHS = ("replicated", "composite", "tables", "merge")
MODEL = dict(hidden=256, intermediate=256, num_experts=16, top_k=4, num_layers=4, vocab=256)


def _merged(own, tensors):
    """`own` behind a merge copy: the module's [E, ...] tensors copied into fresh contiguous ones first."""

    def run(self, hidden_states, top_k_index, top_k_weights):
        views = {t.name: t.stored(self) for t in tensors}
        for t in tensors:
            t.replace(self, views[t.name].clone())  # the merge copy: [E, *shape] contiguous
        try:
            return own(self, hidden_states, top_k_index, top_k_weights)
        finally:
            for t in tensors:
                t.replace(self, views[t.name])

    return run


def _build(path: str, family: str, seed: int, group, slots: int | None):
    from dwdp.models.adapters import find_experts
    from dwdp.models.tiny import build_tiny_model
    from dwdp.runtime.config import DWDPConfig
    from dwdp.runtime.model import DWDPModel

    model = build_tiny_model(family, seed=seed, **MODEL)
    if path == "replicated":
        return model, None
    kernel = "reference" if path == "tables" else "composite"
    # Default: one slot per MoE layer, so nothing is refilled after warm-up (copies cost nothing).
    num_buffers = slots or max(2, len(find_experts(model)))
    wrapped = DWDPModel(model, DWDPConfig(experts_kernel=kernel, num_buffers=num_buffers, slice_bytes=1 << 20), group)
    if path == "merge":
        for layer in wrapped.experts_layers:
            own = getattr(layer.module, "_dwdp_own_experts", None)
            if own is None:
                raise ValueError(f"{family}: {layer.name} has no stock experts implementation to merge for")
            layer.module._dwdp_own_experts = _merged(own, layer.spec.moving)
    return wrapped, wrapped


def _rank(rank: int, family: str, tokens: list[int], rounds: int, repeats: int, seed: int,
          slots: int | None = None) -> dict:
    from dwdp.runtime.group import init_group

    torch.set_num_threads(1)
    group = init_group(2)
    models = {p: _build(p, family, seed, group, slots) for p in PATHS}
    gen = torch.Generator().manual_seed(seed + 1)  # the same prompts on every rank: equal routing
    prompts = {t: torch.randint(3, MODEL["vocab"], (1, t), generator=gen) for t in tokens}
    samples = {t: {p: [] for p in PATHS} for t in tokens}
    plans_while_timed = {p: 0 for p in PATHS}
    with torch.no_grad():
        for t, ids in prompts.items():
            want = models["replicated"][0](input_ids=ids).logits
            for p in PATHS:  # warm-up forward: fills every slot once; checks the path is right
                got = models[p][0](input_ids=ids).logits
                if not torch.allclose(got, want, atol=1e-4, rtol=1e-4):
                    raise AssertionError(f"{p} at {t} tokens differs from replicated by "
                                         f"{(got - want).abs().max().item():.3g}")
            for _ in range(rounds):  # modes interleaved: load changes hit all of them alike
                for p in PATHS:
                    model, wrapped = models[p]
                    before = wrapped.stats.plans_issued if wrapped is not None else 0
                    timing = time_fn(lambda: model(input_ids=ids), warmup=1, repeats=repeats)
                    samples[t][p].append(timing.median_s)
                    if wrapped is not None:
                        plans_while_timed[p] += wrapped.stats.plans_issued - before
    group.barrier()
    for p in PATHS:
        if models[p][1] is not None:
            models[p][1].close()
    return dict(samples=samples, plans_while_timed=plans_while_timed)


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def run_experts_paths(args: argparse.Namespace) -> int:
    from dwdp.runtime.group import launch_local

    tokens = args.experts_tokens
    load_before = load_average_1min()
    slots = args.experts_slots
    ranks = launch_local(_rank, 2, (args.family, tokens, args.experts_rounds, args.experts_repeats, args.seed, slots),
                         timeout_s=args.timeout)
    load_after = load_average_1min()
    rows = []
    for t in tokens:
        # Per rank, the median over rounds; then the mean over ranks.
        per_path = {p: sum(_median(r["samples"][t][p]) for r in ranks) / len(ranks) for p in PATHS}
        rows.append(dict(tokens=t, seconds=per_path,
                         of_replicated={p: per_path["replicated"] / per_path[p] for p in PATHS}))
    plans = {p: sum(r["plans_while_timed"][p] for r in ranks) for p in PATHS}
    if slots is None and any(plans.values()):
        raise AssertionError(f"copies were issued while timing: {plans}; the comparison assumes none")
    result = dict(family=args.family, model=MODEL, ranks=2, rounds=args.experts_rounds,
                  repeats=args.experts_repeats, rows=rows, machine=machine(),
                  load_average_1min=dict(before=load_before, after=load_after),
                  slots=slots, plans_while_timed=plans,
                  note="one prefetch slot per MoE layer: no copy while timing (copies cost nothing)" if slots is None
                  else f"{slots} prefetch slots: layers are refilled while timing (copies cost what they cost)")
    name = "experts_paths" if slots is None else f"experts_paths_{slots}slots"
    out = Path(args.out_dir) / f"{name}_{device_tag('cpu')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"experts paths, {args.family} (H={MODEL['hidden']}, E={MODEL['num_experts']}, k={MODEL['top_k']}, "
          f"M={MODEL['num_layers']}), 2 ranks, load {load_before:.1f} -> {load_after:.1f}; wrote {out}")
    header = f"{'tokens':>6} " + " ".join(f"{p + ' ms':>14}" for p in PATHS) + "  " + \
        " ".join(f"{p + '/repl':>15}" for p in PATHS[1:])
    print(header)
    for row in rows:
        ms = " ".join(f"{row['seconds'][p] * 1e3:>14.3f}" for p in PATHS)
        ratio = " ".join(f"{row['of_replicated'][p]:>15.3f}" for p in PATHS[1:])
        print(f"{row['tokens']:>6} {ms}  {ratio}")
    return 0
