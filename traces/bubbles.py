"""Prefetch bubbles: compute idle time explained by a prefetch wait, per iteration and per layer.

    python traces/bubbles.py out/ [--skip 1] [--json bubbles.json]

Prefetch is hidden when the bubble share is ~0. Prints the tables last.
The same driver as `dwdp trace bubbles` (dwdp/observe/traces/commands.py), run by path.
"""
from __future__ import annotations

import sys

from dwdp.cli import main as dwdp_main


def main(argv: list[str] | None = None) -> int:
    return dwdp_main(["trace", "bubbles", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
