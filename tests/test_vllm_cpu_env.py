"""The environment dwdp gives a vLLM CPU server with its connector: the core reservation vLLM alone makes
(vLLM's CPU build doubles it for any KV connector), and the connector's advice when it is missing."""
from __future__ import annotations

import pytest

from dwdp.integrations import RESERVED_CPU_VARIABLE, reserved_cpu_advice, vllm_cpu_env


@pytest.mark.parametrize("ranks", [1, 2, 8])
def test_the_environment_reserves_one_core_per_local_rank(ranks):
    assert vllm_cpu_env(ranks) == {RESERVED_CPU_VARIABLE: str(ranks)} and RESERVED_CPU_VARIABLE == \
        "VLLM_CPU_NUM_OF_RESERVED_CPU"


@pytest.mark.parametrize("ranks", [0, -1, 1.0, True, "2"])
def test_a_rank_count_that_is_not_a_positive_integer_is_refused_naming_it(ranks):
    with pytest.raises(ValueError, match=f"local_ranks={ranks!r} must be an integer >= 1"):
        vllm_cpu_env(ranks)


def test_the_connector_advises_the_reservation_only_on_a_cpu_without_it():
    advice = reserved_cpu_advice({}, on_cpu=True, local_ranks=2)
    assert advice is not None and "VLLM_CPU_NUM_OF_RESERVED_CPU=2" in advice, advice
    assert reserved_cpu_advice({RESERVED_CPU_VARIABLE: "2"}, on_cpu=True, local_ranks=2) is None
    assert reserved_cpu_advice({RESERVED_CPU_VARIABLE: "0"}, on_cpu=True, local_ranks=1) is None  # the user's call
    assert reserved_cpu_advice({}, on_cpu=False, local_ranks=1) is None


def test_the_aiperf_bench_compares_each_setup_with_vllm_alone_of_the_same_turn():
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "aiperf_pair.py"
    spec = importlib.util.spec_from_file_location("aiperf_pair", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    run = lambda setup, repeat, tps, load="concurrency:8": {"setup": setup, "repeat": repeat, "load": load,  # noqa: E731
                                                            "output_tokens_per_s": tps}
    runs = [run("vllm", 0, 100.0), run("dwdp+vllm", 0, 80.0), run("vllm", 1, 200.0), run("dwdp+vllm", 1, 190.0),
            run("vllm", 2, 150.0), run("dwdp+vllm", 2, 30.0), run("proxy", 0, 50.0), run("proxy", 1, 50.0, "rate:2")]
    rows = {(r["load"], r["setup"]): r for r in module.against_vllm_alone(runs)}
    assert rows[("concurrency:8", "dwdp+vllm")]["turns"] == [0.8, 0.95, 0.2]
    assert rows[("concurrency:8", "dwdp+vllm")]["median"] == 0.8
    assert rows[("concurrency:8", "proxy")]["turns"] == [0.5] and ("rate:2", "proxy") not in rows  # no vLLM alone run
