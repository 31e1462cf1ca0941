"""Memory per rank of quantized experts, measured on the CPU: the same tiny random models written as
checkpoints four ways and each loaded per rank by a fresh 2-rank group (`DWDPModel.from_pretrained`).

- deepseek_v3, bf16 experts vs fp8 experts with 128 x 128 fp32 block scales (DeepSeek-V3/R1's format);
- gpt_oss, MXFP4 experts kept packed (dwdp's choice: dequantized one expert at a time on use) vs the
  same experts dequantized to bf16 at load (what a bf16 gpt-oss checkpoint costs).

Each pair holds the same values (the bf16 checkpoint stores the dequantized quantized weights). Per rank:
bytes the rank allocated (local experts, prefetch slots, dense) and its resident set from
/proc/self/status: added at the load peak, after the load, and after one forward (the prefetch slots
are touched by then). Prints a table last; writes bench/results/quantized_memory_cpu.json.

    python bench/quantized_memory.py
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.group import init_group, launch_local
from dwdp.models.loading import rss_bytes, write_shards
from dwdp.runtime.model import DWDPModel
from dwdp.models.quantization import ExpertsQuantization
from dwdp.observe.timing import load_average_1min, machine
from dwdp.models.tiny_quantized import save_quantized_checkpoint

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 1 << 20
# Experts dominate, as in real MoE models (dense weights: a few MiB).
SHAPES = {
    "deepseek_v3": dict(hidden=256, intermediate=512, num_experts=32, top_k=4, num_layers=4, vocab=512),
    "gpt_oss": dict(hidden=256, intermediate=512, num_experts=32, top_k=4, num_layers=4, vocab=512),
}
CASES = (  # name, family, quantization of its experts (None: bf16 holding the dequantized values)
    ("deepseek_v3 bf16", "deepseek_v3", None),
    ("deepseek_v3 fp8", "deepseek_v3", ExpertsQuantization("fp8", (128, 128))),
    ("gpt_oss bf16 (dequantized at load)", "gpt_oss", None),
    ("gpt_oss mxfp4 (packed)", "gpt_oss", ExpertsQuantization("mxfp4")),
)


def write_checkpoints(root: Path, seed: int) -> dict[str, str]:
    """The four checkpoints; each bf16 one holds the dequantized values of its quantized twin."""
    paths = {}
    for family in SHAPES:
        quant = next(q for _, f, q in CASES if f == family and q is not None)
        quantized = root / f"{family}-{quant.format}"
        reference = save_quantized_checkpoint(quantized, family, quant, seed=seed, quantize_dense=False,
                                              dtype=torch.bfloat16, num_shards=4, **SHAPES[family])
        dense = root / f"{family}-bf16"
        reference.config.save_pretrained(dense)
        reference.generation_config.save_pretrained(dense)
        write_shards({k: v.detach().clone() for k, v in reference.state_dict().items()}, dense, 4)
        for name, f, q in CASES:
            if f == family:
                paths[name] = str(quantized if q is not None else dense)
    return paths


def _rank(rank: int, path: str) -> dict:
    torch.set_num_threads(1)
    group = init_group()
    with DWDPModel.from_pretrained(path, DWDPConfig(), group) as model:
        report = model.load_report
        ids = torch.randint(3, 512, (1, 128), generator=torch.Generator().manual_seed(rank))
        with torch.no_grad():
            model(input_ids=ids)
        rss_forward = rss_bytes()[0]
    return dict(rank=rank, expert_bytes=report.expert_bytes, experts_format=report.experts_format,
                local_expert_bytes=report.local_expert_bytes, prefetch_buffer_bytes=report.prefetch_buffer_bytes,
                dense_bytes=report.dense_bytes, full_expert_bytes=report.full_expert_bytes,
                bytes_read=report.bytes_read, load_peak_bytes=report.load_peak_bytes,
                steady_bytes=report.steady_bytes, forward_bytes=rss_forward - report.rss_before,
                peak_is_load_only=report.peak_is_load_only)


def format_table(rows: list[dict]) -> str:
    header = ("case", "rank", "KiB/expert", "local exp MiB", "prefetch MiB", "dense MiB", "read MiB",
              "RSS peak MiB", "RSS load MiB", "RSS fwd MiB")
    lines = [(r["case"], str(r["rank"]), f"{r['expert_bytes'] / 1024:.1f}", f"{r['local_expert_bytes'] / MIB:.2f}",
              f"{r['prefetch_buffer_bytes'] / MIB:.2f}", f"{r['dense_bytes'] / MIB:.2f}", f"{r['bytes_read'] / MIB:.2f}",
              f"{r['load_peak_bytes'] / MIB:.1f}", f"{r['steady_bytes'] / MIB:.1f}", f"{r['forward_bytes'] / MIB:.1f}")
             for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{widths[0]}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*x) for x in lines])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS / "quantized_memory_cpu.json"))
    args = p.parse_args()
    load_before = load_average_1min()
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_checkpoints(Path(tmp), args.seed)
        for name, _, _ in CASES:
            for r in launch_local(_rank, 2, (paths[name],), timeout_s=600):
                rows.append(dict(case=name, **r))
    report = dict(argv=sys.argv, machine=machine(), shapes=SHAPES, group_size=2,
                  load_average_1min=dict(before=load_before, after=load_average_1min()),
                  elapsed_s=time.perf_counter() - start, rows=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"2 ranks per case, host backend, CPU; 1-min load average {load_before:.2f} before, "
          f"{report['load_average_1min']['after']:.2f} after; wrote {args.out}")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
