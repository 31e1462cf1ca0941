"""Composite views vs the tables path vs a merge copy vs replicated, at equal routing with copies that
cost nothing: a thin entry point for `dwdp bench compare --experts-paths`.

    PYTHONPATH=. python bench/experts_paths.py                       # 8 and 512 tokens per forward
    PYTHONPATH=. python bench/experts_paths.py --experts-tokens 8 64 --experts-rounds 3

The logic lives in dwdp/benchmarks/experts_paths.py so the installed package has it too.
"""
import argparse
import sys

from dwdp.benchmarks.compare import add_arguments, run_compare

if __name__ == "__main__":
    formatter = argparse.RawDescriptionHelpFormatter
    parser = add_arguments(argparse.ArgumentParser(description=__doc__, formatter_class=formatter))
    args = parser.parse_args()
    args.experts_paths = True
    sys.exit(run_compare(args))
