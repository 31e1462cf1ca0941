"""The `dwdp` command line."""
from __future__ import annotations

import argparse
import sys


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dwdp", description="Distributed Weight Data Parallelism for MoE serving")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run a local DWDP group on a tiny model and check it against the unwrapped model")
    demo.add_argument("--ranks", type=_positive_int, default=4, help="processes in the DWDP group (default 4)")
    demo.add_argument("--prompts", type=_positive_int, default=3, help="prompts per rank (default 3)")
    demo.add_argument("--max-len", type=_positive_int, default=64, help="longest prompt in tokens (default 64)")
    demo.add_argument("--slice-bytes", type=_positive_int, default=1 << 20, help="copy slice size (default 1 MiB)")
    demo.add_argument("--repeats", type=_positive_int, default=3, help="timed forwards per rank (default 3)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--timeout", type=float, default=300.0, help="seconds before the demo gives up on a rank")
    demo.add_argument("--trace", metavar="DIR", help="write each rank's trace_rank{r}.json into DIR")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        return run_demo(args.ranks, args.prompts, args.max_len, args.slice_bytes, args.repeats, args.seed, args.timeout,
                        args.trace)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
