"""The options every load bench against `dwdp serve` shares: `dwdp bench serve`, bench/serve_load.py and
bench/chaos.py start their servers and send their requests with these, so one flag means one thing in all.
"""
from __future__ import annotations

import argparse


def add_load_arguments(p: argparse.ArgumentParser, *, ranks: int, duration_s: float, window: str,
                       clients: bool = False) -> argparse.ArgumentParser:
    """The server the bench starts (--ranks, --max-num-tokens), how long it sends and waits (--duration,
    --timeout), --seed, and with `clients` the imbalanced request sources of dwdp.predict.workload
    (--clients, --isl, --isl-ratio, --cv). ranks, duration_s: this bench's defaults; window: what one
    --duration covers ("rate", "case")."""
    p.add_argument("--ranks", type=int, default=ranks, help=f"workers of each server started (default {ranks})")
    p.add_argument("--max-num-tokens", type=int, default=1024,
                   help="the servers' --max-num-tokens: tokens per forward, real ones when they pack (default 1024)")
    p.add_argument("--duration", type=float, default=duration_s,
                   help=f"seconds of arrivals per {window} (default {duration_s:g})")
    p.add_argument("--timeout", type=float, default=120.0, help="longest wait for one answer, s (default 120)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrivals and prompts (default 0)")
    if clients:
        p.add_argument("--clients", type=int, default=8, help="imbalanced request sources (default 8)")
        p.add_argument("--isl", type=int, default=256, help="longest prompt (default 256)")
        p.add_argument("--isl-ratio", type=float, default=0.25, help="shortest prompt / isl (default 0.25)")
        p.add_argument("--cv", type=float, default=0.2, help="CV of the clients' shares of arrivals (default 0.2)")
    return p
