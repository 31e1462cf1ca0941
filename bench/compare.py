"""DWDP vs DEP vs replicated on one workload, one run: a thin entry point for `dwdp bench compare`.

    PYTHONPATH=. python bench/compare.py            # 2 ranks, CV 0, 0.1, 0.2, 0.4
    PYTHONPATH=. python bench/compare.py --quick    # smoke test

The logic lives in dwdp/benchmarks/compare.py so the installed package has it too.
"""
import argparse
import sys
from pathlib import Path

from dwdp.benchmarks.compare import add_arguments, run_compare

if __name__ == "__main__":
    formatter = argparse.RawDescriptionHelpFormatter
    parser = add_arguments(argparse.ArgumentParser(description=__doc__, formatter_class=formatter),
                           results_dir=str(Path(__file__).resolve().parent / "results"))
    sys.exit(run_compare(parser.parse_args()))
