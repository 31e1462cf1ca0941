"""One prefill forward three ways, on the serve preset's model: padded rows (what a padded worker
runs), one packed row under the dense block-diagonal mask, and one packed row attended piece by
piece (dwdp.serve.varlen, what a packed worker runs now).

    python bench/packed_forward.py [--preset tiny] [--threads 1] [--reps 7] [--out bench/results/packed_forward_cpu.json]

Each case is a list of prompt lengths; the three variants run the same prompts in turn within each
repetition, and the table gives each one's median time and the ratios within the run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from dwdp.serve import prefill
from dwdp.serve.packed import Piece
from dwdp.serve.presets import preset_model
from dwdp.serve.worker import pad_left

CASES = {
    "4 x 128": [128] * 4,
    "8 x 64": [64] * 8,
    "mixed 32..128 (ratio 0.5 of the budget's mean)": [32, 128, 64, 96, 40, 120, 32],
    "1 x 384 + 2 x 64": [384, 64, 64],
    "16 x 32": [32] * 16,
}


def padded(model, prompts):
    ids, mask, positions, _ = pad_left(prompts)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)


def packed(model, prompts, piecewise: bool):
    pieces = [Piece(i, p, 0) for i, p in enumerate(prompts)]
    original = prefill.piecewise
    if not piecewise:
        prefill.piecewise = lambda layout: contextlib.nullcontext()
    try:
        prefill.packed_forward(model, pieces, [None] * len(pieces))
    finally:
        prefill.piecewise = original


VARIANTS = {"padded": padded,
            "packed, dense mask": lambda m, p: packed(m, p, piecewise=False),
            "packed, piece by piece": lambda m, p: packed(m, p, piecewise=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a serve worker's default is 1)")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default="bench/results/packed_forward_cpu.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = preset_model(args.preset, seed=0).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    rows = []
    for name, lengths in CASES.items():
        prompts = [tuple(torch.randint(1, vocab, (n,), generator=gen).tolist()) for n in lengths]
        times = {v: [] for v in VARIANTS}
        for fn in VARIANTS.values():
            fn(model, prompts)  # warm
        for _ in range(args.reps):
            for variant, fn in VARIANTS.items():  # in turn, so a disturbance hits all of them alike
                start = time.perf_counter()
                fn(model, prompts)
                times[variant].append(time.perf_counter() - start)
        ms = {v: 1e3 * statistics.median(t) for v, t in times.items()}
        rows.append({"case": name, "tokens": sum(lengths), "padded_tokens": len(lengths) * max(lengths),
                     "ms": ms, "piecewise_over_padded": ms["padded"] / ms["packed, piece by piece"],
                     "piecewise_over_dense": ms["packed, dense mask"] / ms["packed, piece by piece"]})
    print(f"preset {args.preset}, {args.threads} thread(s), median of {args.reps}; ratio > 1: piece by piece faster")
    print(f"{'case':48} {'tokens':>6} {'padded':>10} {'dense':>10} {'piecewise':>10} {'vs padded':>9} {'vs dense':>9}")
    for r in rows:
        ms = r["ms"]
        print(f"{r['case']:48} {r['tokens']:6d} {ms['padded']:8.1f}ms {ms['packed, dense mask']:8.1f}ms "
              f"{ms['packed, piece by piece']:8.1f}ms {r['piecewise_over_padded']:8.2f}x {r['piecewise_over_dense']:8.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"preset": args.preset, "threads": args.threads, "reps": args.reps,
                               "torch": torch.__version__, "machine": platform.machine(),
                               "cpu_count": __import__("os").cpu_count(), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
