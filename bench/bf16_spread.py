"""How far transformers' own experts paths disagree in bf16 on the model bench/gpu_check.py wraps.

A wrapped model can only be held to its unwrapped output within the spread that two correct bf16
implementations already show: here transformers' eager experts loop against its grouped_mm path,
on the gpu_check model (Qwen3-MoE shape, hidden 2048, 16 experts, top-4, 4 layers), at two init
scales. Runs on the CPU (slow: minutes).

Run: python bench/bf16_spread.py [--tokens 512]; writes bench/results/bf16_spread_<tag>.json and
prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from dwdp.models.tiny import build_tiny_model
from dwdp.observe.timing import device_tag

RESULTS = Path(__file__).resolve().parent / "results"


def spread(init: float, tokens: int, device: str) -> dict:
    model = build_tiny_model("qwen3_moe", hidden=2048, intermediate=1024, num_experts=16, top_k=4, num_layers=4,
                             vocab=4096, dtype=torch.bfloat16, seed=0, initializer_range=init).to(device)
    ids = torch.randint(3, 4096, (1, tokens), generator=torch.Generator().manual_seed(7)).to(device)
    logits, seconds = {}, {}
    for impl in ("eager", "grouped_mm"):
        model.set_experts_implementation(impl)
        start = time.perf_counter()
        with torch.no_grad():
            logits[impl] = model(input_ids=ids).logits.float()
        seconds[impl] = time.perf_counter() - start
    diff = (logits["grouped_mm"] - logits["eager"]).abs()
    scale = logits["eager"].abs().max().item()
    return {"initializer_range": init, "tokens": tokens, "max_abs_diff": diff.max().item(), "scale": scale,
            "test_tolerance": 2e-2 + 2e-2 * scale, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [spread(init, args.tokens, args.device) for init in (0.1, 0.02)]
    tag = device_tag(args.device)
    result = {"bench": "bf16_spread", "device": tag, "machine": platform.machine(), "threads": args.threads,
              "load_avg": os.getloadavg(), "torch": torch.__version__, "rows": rows}
    path = RESULTS / f"bf16_spread_{tag}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    print(f"{'init':>6} {'tokens':>6} {'max|grouped_mm - eager|':>24} {'max|logit|':>10} {'test tol':>9}")
    for r in rows:
        print(f"{r['initializer_range']:>6} {r['tokens']:>6} {r['max_abs_diff']:>24.3f} {r['scale']:>10.2f} "
              f"{r['test_tolerance']:>9.3f}")


if __name__ == "__main__":
    main()
