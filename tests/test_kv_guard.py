"""The connector's guard (dwdp.integrations.guard): an exception in a method vLLM calls becomes one bounded
log line and the method's fallback (recompute), never an exception in vLLM's engine; and every public
method of DWDPConnector carries it (read from its source: vLLM is not installed here; the vLLM stage
plants an exception in each against a live vLLM, tests/vllm/check_hostile.py)."""
from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from dwdp.integrations.guard import LINE_LIMIT, answer, guarded_by

CONNECTOR = Path(__file__).resolve().parents[1] / "dwdp" / "integrations" / "vllm_connector.py"
log = logging.getLogger("test.kv_guard")
never_raises = guarded_by(log)


class _Connector:
    def __init__(self):
        self.failed = []

    def _recompute(self, request):
        self.failed.append(request)
        return 0, False

    def _broken_fallback(self, request):
        raise KeyError("fallback broke too")

    _broken_fallback.default = (0, False)

    @never_raises(_recompute)
    def matched(self, request):
        if request == "hostile":
            raise OverflowError("cannot convert float infinity to integer " + "x" * 5000 + "\nsecond line")
        return 7, False

    @never_raises(_broken_fallback)
    def matched_badly(self, request):
        raise ValueError("first")

    @never_raises(answer(set()))
    def errors(self):
        raise RuntimeError("no")


@pytest.mark.timeout(10)
def test_an_exception_becomes_the_fallback_and_one_bounded_line(caplog):
    connector = _Connector()
    with caplog.at_level(logging.ERROR, logger="test.kv_guard"):
        assert connector.matched("honest") == (7, False)
        assert connector.matched("hostile") == (0, False)
        assert connector.matched_badly("x") == (0, False)
        assert connector.errors() == set() and connector.errors() is not connector.errors()
    assert connector.failed == ["hostile"]
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("dwdp connector: matched raised OverflowError: cannot convert"), lines[0][:80]
    assert all("\n" not in line and len(line) < LINE_LIMIT + 120 for line in lines), [len(x) for x in lines]
    assert "matched_badly's fallback raised KeyError" in lines[2], lines
    assert _Connector.matched.__wrapped__.__name__ == "matched" and _Connector.matched.fallback is _Connector._recompute


@pytest.mark.timeout(10)
def test_every_public_method_of_the_connector_is_guarded():
    tree = ast.parse(CONNECTOR.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DWDPConnector")
    methods = [f for f in cls.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")]
    assert {m.name for m in methods} >= {"get_num_new_matched_tokens", "update_state_after_alloc",
                                          "build_connector_meta", "request_finished", "start_load_kv",
                                          "wait_for_layer_load", "wait_for_save", "get_block_ids_with_load_errors"}
    unguarded = [m.name for m in methods
                 if not any(isinstance(d, ast.Call) and getattr(d.func, "id", None) == "never_raises"
                            for d in m.decorator_list)]
    assert unguarded == [], f"methods vLLM calls without the guard: {unguarded}"
