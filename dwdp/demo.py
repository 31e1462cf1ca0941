"""`dwdp demo`: a local DWDP group on a tiny random MoE model (DeepSeek-V3-style by default, any
family with --family), checked against the unwrapped model on every rank."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from .config import DWDPConfig
from .group import init_group, launch_local
from .timing import load_average_1min, machine
from .tiny import build_tiny_model

DEMO_MODEL = dict(hidden=256, intermediate=256, num_experts=16, top_k=4, num_layers=5, vocab=512)
ATOL, RTOL = 1e-4, 1e-4
DTYPES = ("fp32", "fp8", "mxfp4")  # of the experts; dense weights stay fp32
FP8_BLOCK = (128, 128)


def rank_prompts(rank: int, seed: int, num_prompts: int, max_len: int, vocab: int):
    """This rank's own batch: `num_prompts` prompts of different lengths, left-padded.

    Returns input_ids [P, Tmax], attention_mask [P, Tmax], and the number of real tokens.
    """
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    lengths = torch.randint(max(1, max_len // 4), max_len + 1, (num_prompts,), generator=gen)
    t_max = int(lengths.max())
    ids = torch.zeros(num_prompts, t_max, dtype=torch.long)
    mask = torch.zeros(num_prompts, t_max, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        ids[i, t_max - n:] = torch.randint(3, vocab, (n,), generator=gen)
        mask[i, t_max - n:] = 1
    return ids, mask, int(lengths.sum())


def demo_models(family: str, dtype: str, seed: int, **shape):
    """(model to wrap, unwrapped reference) of the demo: the same model twice for "fp32"; for "fp8" /
    "mxfp4" its experts quantized (fp8: 128 x 128 block scales, DeepSeek-V3's) next to the model holding
    the dequantized values of those quantized weights (what the unwrapped model computes on them).
    shape: tiny model sizes (default DEMO_MODEL)."""
    shape = shape or DEMO_MODEL
    if dtype == "fp32":
        model = build_tiny_model(family, seed=seed, **shape)
        return model, model
    from .quantization import ExpertsQuantization
    from .tiny_quantized import build_tiny_quantized

    quant = ExpertsQuantization("fp8", FP8_BLOCK) if dtype == "fp8" else ExpertsQuantization(dtype)
    return build_tiny_quantized(family, quant, seed=seed, **shape)


def _demo_rank(rank: int, opts: dict) -> dict:
    model, unwrapped = demo_models(opts["family"], opts["dtype"], opts["seed"])
    ids, mask, num_tokens = rank_prompts(rank, opts["seed"], opts["prompts"], opts["max_len"], DEMO_MODEL["vocab"])
    with torch.no_grad():
        reference = _logits(unwrapped(input_ids=ids, attention_mask=mask))  # [P, Tmax, V]
    config = DWDPConfig(slice_bytes=opts["slice_bytes"], backend="host")
    from .model import DWDPModel

    with DWDPModel(model, config, init_group(), trace=opts["trace"]) as wrapped, torch.no_grad():
        wrapped(input_ids=ids, attention_mask=mask)  # warm-up: first-touch of buffers, plan cache
        wrapped.stats.reset()
        start = time.perf_counter()
        for _ in range(opts["repeats"]):
            logits = _logits(wrapped(input_ids=ids, attention_mask=mask))
        elapsed = time.perf_counter() - start
        stats, memory = wrapped.stats, wrapped.memory
    real = mask.bool()
    diff = (logits[real] - reference[real]).abs().max().item()
    scale = reference[real].abs().max().item()
    return {
        "rank": rank, "tokens": num_tokens, "tokens_per_s": num_tokens * opts["repeats"] / elapsed,
        "local_expert_bytes": memory.local_expert_bytes, "prefetch_buffer_bytes": memory.prefetch_buffer_bytes,
        "full_expert_bytes": memory.full_expert_bytes,
        "bytes_prefetched": stats.bytes_copied // opts["repeats"], "wait_ms": 1e3 * stats.wait_s / opts["repeats"],
        "max_abs_diff": diff, "ok": diff <= ATOL + RTOL * scale,
    }


def _logits(output) -> torch.Tensor:
    """The model's logits (a base model without a head: its last hidden state)."""
    return output.logits if getattr(output, "logits", None) is not None else output[0]


def format_table(rows: list[dict]) -> str:
    mib = 1 / 2**20
    header = ("rank", "tokens", "tok/s", "local exp MiB", "prefetch buf MiB", "full exp MiB", "saved",
              "prefetched MiB/fwd", "exposed wait ms/fwd", "max |dlogits|", "match")
    lines = []
    for r in rows:
        resident = r["local_expert_bytes"] + r["prefetch_buffer_bytes"]
        lines.append((
            str(r["rank"]), str(r["tokens"]), f"{r['tokens_per_s']:.0f}", f"{r['local_expert_bytes'] * mib:.2f}",
            f"{r['prefetch_buffer_bytes'] * mib:.2f}", f"{r['full_expert_bytes'] * mib:.2f}",
            f"{1 - resident / r['full_expert_bytes']:.0%}", f"{r['bytes_prefetched'] * mib:.2f}",
            f"{r['wait_ms']:.2f}", f"{r['max_abs_diff']:.2e}", "yes" if r["ok"] else "NO",
        ))
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    rule = fmt.format(*("-" * w for w in widths))
    return "\n".join([fmt.format(*header), rule] + [fmt.format(*line) for line in lines])


def run_demo(ranks: int = 4, prompts: int = 3, max_len: int = 64, slice_bytes: int = 1 << 20, repeats: int = 3,
             seed: int = 0, timeout_s: float = 300.0, trace: str | None = None, json_path: str | None = None,
             family: str = "deepseek_v3", dtype: str = "fp32") -> int:
    """Run the demo on `ranks` local processes, print the per-rank table; returns the exit code.

    trace: a directory that receives one trace_rank{r}.json per rank.
    json_path: also write the per-rank figures, the machine and its load average there.
    family: the transformers MoE family of the tiny model (dwdp.families).
    dtype: the experts' dtype, one of DTYPES (fp8: 128 x 128 block scales; the unwrapped reference runs
        the dequantized values of the same quantized weights).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {DTYPES}")
    opts = dict(prompts=prompts, max_len=max_len, slice_bytes=slice_bytes, repeats=repeats, seed=seed, trace=trace,
                family=family, dtype=dtype)
    cfg = DEMO_MODEL
    experts = "fp32" if dtype == "fp32" else f"{dtype} ({'128 x 128 block scales' if dtype == 'fp8' else 'e8m0 / 32'})"
    print(f"dwdp demo: {ranks} ranks, tiny {family} model (hidden {cfg['hidden']}, {cfg['num_experts']} experts per "
          f"MoE layer, {cfg['num_layers']} layers, top-{cfg['top_k']}, {experts} experts), host backend, CPU, seed {seed}")
    start = time.perf_counter()
    load_before = load_average_1min()
    rows = launch_local(_demo_rank, ranks, (opts,), timeout_s=timeout_s)
    if json_path:
        report = dict(argv=sys.argv, options=dict(opts, ranks=ranks), model=DEMO_MODEL, machine=machine(),
                      load_average_1min=dict(before=load_before, after=load_average_1min()), rows=rows)
        Path(json_path).write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(rows))
    bad = [r["rank"] for r in rows if not r["ok"]]
    if trace:
        print(f"traces: {trace}/trace_rank{{0..{ranks - 1}}}.json")
    print(f"{len(rows) - len(bad)}/{len(rows)} ranks match the unwrapped model "
          f"(|diff| <= {ATOL} + {RTOL} * max|logit|); {time.perf_counter() - start:.1f} s")
    return 1 if bad else 0
