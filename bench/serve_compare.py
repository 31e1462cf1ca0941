"""DWDP serving against DEP serving under the same open-loop load: a thin entry point for
`dwdp bench serve`.

    PYTHONPATH=. python bench/serve_compare.py                          # the sweep of docs/dwdp-or-dep.md
    PYTHONPATH=. python bench/serve_compare.py --rates 2,4 --duration 5 --isl-cv 0   # a quick look

The logic lives in dwdp/benchmarks/serving.py so the installed package has it too.
"""
import argparse
import sys
from pathlib import Path

from dwdp.benchmarks.serving import add_arguments, run_bench_serve

if __name__ == "__main__":
    formatter = argparse.RawDescriptionHelpFormatter
    parser = add_arguments(argparse.ArgumentParser(description=__doc__, formatter_class=formatter),
                           results_dir=str(Path(__file__).resolve().parent / "results"))
    sys.exit(run_bench_serve(parser.parse_args()))
