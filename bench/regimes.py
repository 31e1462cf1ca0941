"""DWDP against replicated and copy-then-compute across forward sizes: a thin entry point for
`dwdp bench regimes`.

    PYTHONPATH=. python bench/regimes.py                               # hiddens 64 and 512, 8..2048 tokens
    PYTHONPATH=. python bench/regimes.py --hiddens 64 --tokens 8 32    # a quick look

The logic lives in dwdp/benchmarks/regimes.py so the installed package has it too.
"""
import argparse
import sys

from dwdp.benchmarks.regimes import add_arguments, run_regimes

if __name__ == "__main__":
    formatter = argparse.RawDescriptionHelpFormatter
    parser = add_arguments(argparse.ArgumentParser(description=__doc__, formatter_class=formatter))
    sys.exit(run_regimes(parser.parse_args()))
