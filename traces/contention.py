"""Many-to-one source contention of the prefetch copies, against the random-pull expectation,
and the layers whose exposed wait coincided with it.

    python traces/contention.py out/ [--threshold-ms 0.05] [--json contention.json]

C = distinct destination ranks pulling from one source at once (the pull itself included).
Random-pull expectation for group size N: C = 1 + Binomial(N-2, 1/(N-1)). Prints the tables last.
The same driver as `dwdp trace contention` (dwdp/observe/traces/commands.py), run by path.
"""
from __future__ import annotations

import sys

from dwdp.cli import main as dwdp_main


def main(argv: list[str] | None = None) -> int:
    return dwdp_main(["trace", "contention", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
