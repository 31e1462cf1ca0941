"""Per-iteration time by category for one run, or two runs side by side (e.g. DEP then DWDP).

    python traces/breakdown.py out/                       # one run
    python traces/breakdown.py dep_run/ dwdp_run/         # delta per category, % of the first run's iteration
    python traces/breakdown.py run.sqlite --json breakdown.json

Inputs: a directory of trace_rank*.json, an Nsight Systems .sqlite export, or a torch.profiler
JSON. Category rules: dwdp/observe/traces/categories.json (or --rules FILE). Prints the table last.
The same driver as `dwdp trace breakdown` (dwdp/observe/traces/commands.py), run by path.
"""
from __future__ import annotations

import sys

from dwdp.cli import main as dwdp_main


def main(argv: list[str] | None = None) -> int:
    return dwdp_main(["trace", "breakdown", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
