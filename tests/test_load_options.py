"""The load benches against `dwdp serve` (`dwdp bench serve`, bench/serve_load.py, bench/chaos.py) take
their shared options from one place, dwdp.benchmarks.load: the same flags, the same help, each bench
keeping its own defaults."""
import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

from dwdp.benchmarks.load import add_load_arguments
from dwdp.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
SERVER = ("--ranks", "--max-num-tokens", "--duration", "--timeout", "--seed")
CLIENTS = ("--clients", "--isl", "--isl-ratio", "--cv")


def _bench_parser(name: str) -> argparse.ArgumentParser:
    """bench/<name>.py's parser (the scripts import their neighbours by name, as run from bench/)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return module.build_parser()


def _options(parser: argparse.ArgumentParser) -> dict:
    return {s: a for a in parser._actions for s in a.option_strings}


def _bench_serve_parser() -> argparse.ArgumentParser:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            for inner in action.choices["bench"]._actions:
                if isinstance(inner, argparse._SubParsersAction):
                    return inner.choices["serve"]
    raise AssertionError("no dwdp bench serve")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bench,shared,defaults", [
    ("dwdp bench serve", SERVER, {"--ranks": 2, "--duration": 12.0}),
    ("serve_load", SERVER + CLIENTS, {"--ranks": 2, "--duration": 30.0}),
    ("chaos", SERVER + CLIENTS, {"--ranks": 3, "--duration": 24.0}),
])
def test_load_benches_share_their_options_from_one_place(bench, shared, defaults):
    parser = _bench_serve_parser() if bench.startswith("dwdp") else _bench_parser(bench)
    one_place = _options(add_load_arguments(argparse.ArgumentParser(), ranks=0, duration_s=0.0, window="rate",
                                            clients=True))
    got = _options(parser)
    for flag in shared:
        assert flag in got, (bench, flag)
        if flag not in defaults:  # help with the bench's own default in it differs by that default alone
            assert got[flag].help == one_place[flag].help, (bench, flag, got[flag].help)
            assert got[flag].default == one_place[flag].default, (bench, flag, got[flag].default)
    assert {f: got[f].default for f in defaults} == defaults, bench
