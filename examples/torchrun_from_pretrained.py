"""Build each DWDP rank from a checkpoint directory under torchrun, reading only what the rank keeps.

    python examples/torchrun_from_pretrained.py --make-tiny /tmp/tiny-moe      # write a checkpoint
    python examples/torchrun_from_pretrained.py --make-tiny /tmp/tiny-fp8 --family deepseek_v3 --dtype fp8
    torchrun --nproc-per-node 2 examples/torchrun_from_pretrained.py /tmp/tiny-moe

Each rank loads the dense weights and its local experts only, runs a forward on its own batch and
prints its load report (bytes read, dense / local experts / prefetch buffers, RSS at the load
peak and after the forward). `--check` also loads the full model normally on every rank and
compares logits (only sensible for a model that fits in memory many times over).
"""
import argparse
import os

import torch

from dwdp import DWDPConfig, DWDPModel
from dwdp.models.tiny import FAMILIES, build_tiny_model

# Experts dominate, as in real MoE models: 4 MoE layers of 32 experts, 192 MiB of experts in fp32.
TINY = dict(hidden=256, intermediate=512, num_experts=32, top_k=2, num_layers=4, vocab=256)


def rss_split() -> dict:
    """Resident MiB by kind (/proc/self/status): anonymous, file-backed, shared memory. On the host
    backend the shared part holds this rank's segment and the pages of peers' segments it has read
    for prefetch; the latter are the peers' memory, mapped, not a second copy."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("RssAnon", "RssFile", "RssShmem")))
    return {k: int(v.split()[0]) / 1024 for k, v in fields.items()}


def make_tiny(directory: str, family: str, dtype: str) -> None:
    if dtype == "fp32":
        model = build_tiny_model(family, seed=0, **TINY)
        model.save_pretrained(directory, max_shard_size="50MB")  # several shards + model.safetensors.index.json
    else:
        # Quantized: values + block scales and the quantization_config, as DeepSeek-V3 (fp8) or gpt-oss (MXFP4) ship.
        from dwdp.models.quantization import ExpertsQuantization
        from dwdp.models.tiny_quantized import save_quantized_checkpoint

        quant = ExpertsQuantization("fp8", (128, 128)) if dtype == "fp8" else ExpertsQuantization("mxfp4")
        save_quantized_checkpoint(directory, family, quant, seed=0, num_shards=4, **TINY)
    print(f"wrote a {dtype} {family} checkpoint to {directory}: {sorted(os.listdir(directory))}")


def run_rank(directory: str, check: bool) -> int:
    torch.set_num_threads(1)
    with DWDPModel.from_pretrained(directory, config=DWDPConfig()) as model:  # joins the torchrun world
        rank, report = model.group.rank, model.load_report
        vocab = model.config.vocab_size
        ids = torch.randint(3, vocab, (2, 16 + rank), generator=torch.Generator().manual_seed(rank))  # own batch
        with torch.no_grad():
            logits = model(input_ids=ids).logits  # [B, T, V]
        after_forward = rss_split()
        ok = True
        if check:
            from transformers import AutoModelForCausalLM

            full = AutoModelForCausalLM.from_pretrained(directory).eval()
            with torch.no_grad():
                reference = full(input_ids=ids).logits
            diff = (logits - reference).abs().max().item()
            ok = diff <= 1e-4 + 1e-4 * reference.abs().max().item()
    split = ", ".join(f"{k} {v:.1f}" for k, v in after_forward.items())
    lines = [report.table(), f"  RSS after a forward (MiB): {split}"]
    if check:
        lines.append(f"  max|dlogits| vs the full model: {diff:.2e} {'ok' if ok else 'MISMATCH'}")
    print("\n".join(lines), flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", help="checkpoint directory to load on every rank")
    parser.add_argument("--make-tiny", metavar="DIR", help="write a tiny random checkpoint to DIR and exit")
    parser.add_argument("--family", choices=FAMILIES + ("gpt_oss",), default="qwen3_moe", help="family of --make-tiny")
    parser.add_argument("--dtype", choices=("fp32", "fp8", "mxfp4"), default="fp32",
                        help="experts of --make-tiny: fp32, fp8 with 128x128 block scales (dense linears fp8 too), "
                             "or MXFP4 (gpt_oss)")
    parser.add_argument("--check", action="store_true", help="compare logits with the fully loaded model")
    args = parser.parse_args()
    if args.make_tiny:
        make_tiny(args.make_tiny, args.family, args.dtype)
        return 0
    if not args.directory:
        parser.error("give a checkpoint directory, or --make-tiny DIR")
    return run_rank(args.directory, args.check)


if __name__ == "__main__":
    raise SystemExit(main())
