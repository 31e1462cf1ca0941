"""`dwdp demo`: a local DWDP group on a tiny random MoE model (DeepSeek-V3-style by default, any
family with --family), checked against the unwrapped model on every rank."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.devices import DTYPES as TORCH_DTYPES, bf16_logits_bound, check_device, rank_device, require_gpu, sharing_line, transformers_spread
from dwdp.runtime.group import init_group, launch_local
from dwdp.observe.timing import load_average_1min, machine
from dwdp.models.demo_model import DEMO_MODEL, demo_models

ATOL, RTOL = 1e-4, 1e-4
DTYPES = ("fp32", "bf16", "fp8", "mxfp4")  # of the experts; dense weights fp32 on CPU, bf16 on CUDA


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



def _demo_rank(rank: int, opts: dict) -> dict:
    device = rank_device(opts["device"], rank)
    on_gpu = device.type == "cuda"
    model, unwrapped = demo_models(opts["family"], opts["dtype"], opts["seed"], TORCH_DTYPES[opts["model_dtype"]])
    model, unwrapped = model.to(device), unwrapped.to(device)
    ids, mask, num_tokens = rank_prompts(rank, opts["seed"], opts["prompts"], opts["max_len"], DEMO_MODEL["vocab"])
    ids, mask = ids.to(device), mask.to(device)
    real = mask.bool()

    def logits_of(m):
        return _logits(m(input_ids=ids, attention_mask=mask))[real].float()  # [real tokens, V]

    with torch.no_grad():
        if on_gpu and hasattr(unwrapped, "set_experts_implementation"):
            unwrapped.set_experts_implementation("eager")  # the plain loop over experts as the reference
        reference = logits_of(unwrapped)
        # bf16 on a GPU: two correct paths of transformers disagree too, and that spread sets the bound.
        spread = transformers_spread(unwrapped, logits_of, reference) if on_gpu else 0.0
    config = DWDPConfig(slice_bytes=opts["slice_bytes"])  # backend "auto": the one for the model's device
    from dwdp.runtime.model import DWDPModel

    with DWDPModel(model, config, init_group(), trace=opts["trace"]) as wrapped, torch.no_grad():
        warmup_s = wrapped.warmup()  # kernel compiles and first-call costs, before anything is timed
        logits_of(wrapped)  # first touch of this batch's buffers and of the plan cache
        wrapped.stats.reset()
        start = time.perf_counter()
        for _ in range(opts["repeats"]):
            logits = logits_of(wrapped)
        if on_gpu:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        stats, memory, kernel = wrapped.stats, wrapped.memory, wrapped.experts_kernel
    diff = (logits - reference).abs().max().item()
    scale = reference.abs().max().item()
    bound = bf16_logits_bound(scale, spread) if opts["model_dtype"] != "fp32" else ATOL + RTOL * scale
    return {
        "rank": rank, "device": str(device), "experts_kernel": kernel, "tokens": num_tokens,
        "tokens_per_s": num_tokens * opts["repeats"] / elapsed, "warmup_s": warmup_s,
        "local_expert_bytes": memory.local_expert_bytes, "prefetch_buffer_bytes": memory.prefetch_buffer_bytes,
        "full_expert_bytes": memory.full_expert_bytes,
        "bytes_prefetched": stats.bytes_copied // opts["repeats"], "wait_ms": 1e3 * stats.wait_s / opts["repeats"],
        "max_abs_diff": diff, "bound": bound, "transformers_spread": spread, "ok": diff <= bound,
    }


def _logits(output) -> torch.Tensor:
    """The model's logits (a base model without a head: its last hidden state)."""
    return output.logits if getattr(output, "logits", None) is not None else output[0]


def format_table(rows: list[dict]) -> str:
    mib = 1 / 2**20
    header = ("rank", "device", "tokens", "tok/s", "local exp MiB", "prefetch buf MiB", "full exp MiB", "saved",
              "prefetched MiB/fwd", "exposed wait ms/fwd", "max |dlogits|", "match")
    lines = []
    for r in rows:
        resident = r["local_expert_bytes"] + r["prefetch_buffer_bytes"]
        lines.append((
            str(r["rank"]), r["device"], str(r["tokens"]), f"{r['tokens_per_s']:.0f}", f"{r['local_expert_bytes'] * mib:.2f}",
            f"{r['prefetch_buffer_bytes'] * mib:.2f}", f"{r['full_expert_bytes'] * mib:.2f}",
            f"{1 - resident / r['full_expert_bytes']:.0%}", f"{r['bytes_prefetched'] * mib:.2f}",
            f"{r['wait_ms']:.2f}", f"{r['max_abs_diff']:.2e}", "yes" if r["ok"] else "NO",
        ))
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    rule = fmt.format(*("-" * w for w in widths))
    return "\n".join([fmt.format(*header), rule] + [fmt.format(*line) for line in lines])


def run_demo(ranks: int = 4, prompts: int = 3, max_len: int = 64, slice_bytes: int | None = None, repeats: int = 3,
             seed: int = 0, timeout_s: float = 300.0, trace: str | None = None, json_path: str | None = None,
             family: str = "deepseek_v3", dtype: str | None = None, device: str = "cpu") -> int:
    """Run the demo on `ranks` local processes, print the per-rank table; returns the exit code.

    trace: a directory that receives one trace_rank{r}.json per rank.
    json_path: also write the per-rank figures, the machine and its load average there.
    family: the transformers MoE family of the tiny model (dwdp.models.families).
    dtype: the experts' dtype, one of DTYPES (default fp32 on CPU, bf16 on CUDA; fp8: 128 x 128 block
        scales; the unwrapped reference runs the dequantized values of the same quantized weights).
    device: "cpu" (host backend) or "cuda" (rank r on cuda:(r % GPUs), cuda backend, bf16 dense weights);
        NoGpu when there is no usable GPU.
    """
    check_device(device)
    dtype = dtype or ("bf16" if device == "cuda" else "fp32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {DTYPES}")
    gpus = require_gpu("dwdp demo") if device == "cuda" else 0
    dense = "bf16" if device == "cuda" or dtype == "bf16" else "fp32"
    opts = dict(prompts=prompts, max_len=max_len, slice_bytes=slice_bytes, repeats=repeats, seed=seed, trace=trace,
                family=family, dtype=dtype, device=device, model_dtype=dense)
    cfg = DEMO_MODEL
    experts = dtype if dtype in ("fp32", "bf16") else \
        f"{dtype} ({'128 x 128 block scales' if dtype == 'fp8' else 'e8m0 / 32'})"
    where = "cuda backend, CUDA" if device == "cuda" else "host backend, CPU"
    print(f"dwdp demo: {ranks} ranks, tiny {family} model (hidden {cfg['hidden']}, {cfg['num_experts']} experts per "
          f"MoE layer, {cfg['num_layers']} layers, top-{cfg['top_k']}, {experts} experts, {dense} dense), {where}, "
          f"seed {seed}")
    shared = sharing_line(ranks, gpus) if device == "cuda" else None
    if shared:
        print(shared)
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
    rule = (f"|diff| <= {ATOL} + {RTOL} * max|logit|" if dense == "fp32" else
            "|diff| <= max(2e-2 + 2e-2 * max|logit|, 2 x transformers' own eager/grouped_mm spread)")
    print(f"{len(rows) - len(bad)}/{len(rows)} ranks match the unwrapped model ({rule}); "
          f"{time.perf_counter() - start:.1f} s")
    return 1 if bad else 0
