"""Timeline PNG of a run: one block per rank, a compute row coloured by category with exposed
prefetch waits in red, and its copy lanes with each copy coloured by source rank.

    python traces/timeline.py out/ -o out/timeline.png [--skip 1] [--iterations 2]

Prints the PNG path and each rank's wait share.
The same driver as `dwdp trace timeline` (dwdp/observe/traces/commands.py), run by path.
"""
from __future__ import annotations

import sys

from dwdp.cli import main as dwdp_main


def main(argv: list[str] | None = None) -> int:
    return dwdp_main(["trace", "timeline", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
