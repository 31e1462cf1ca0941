"""bench/gpu_check.py's section runner, on the CPU with stand-in sections: a section whose optional packages
are missing is skipped with their names and how to carry them, and the exit status counts only the
sections that ran (the GPU image has no FastAPI, uvicorn or openai: section h must not fail the run)."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_check  # noqa: E402
from gpu_checks import h_serve  # noqa: E402

MISSING = "dwdp_no_such_package_for_gpu_check"


def _section(key: str, *, failures=(), requires=(), raises: bool = False):
    def run(sections):
        if raises:
            raise RuntimeError(f"{key} broke")
        return {"failures": list(failures), "value": 1}

    return SimpleNamespace(KEY=key, REQUIRES=requires, run=run,
                           summary=lambda section: [(f"{key} value", str(section["value"]), "", "ok")])


def test_a_section_without_its_packages_is_skipped_naming_them_and_the_run_passes():
    modules = {"a": _section("a_ok"), "h": _section("h_serve", requires=("json", MISSING))}
    sections = gpu_check.run_sections("ah", modules)
    assert sections["a_ok"]["value"] == 1 and sections["a_ok"]["seconds"] >= 0, sections["a_ok"]
    skipped = sections["h_serve"]
    assert skipped["missing"] == [MISSING], skipped  # json imports: only the missing one is named
    assert MISSING in skipped["skipped"] and "bench/gpu_wheels.sh" in skipped["skipped"], skipped["skipped"]
    assert "--target /tmp/site" in skipped["skipped"] and "PYTHONPATH" in skipped["skipped"], skipped["skipped"]
    assert gpu_check.failures_of(sections) == [], gpu_check.failures_of(sections)
    rows = gpu_check._summary(sections, modules)
    assert ("h_serve skipped", f"missing {MISSING}", "", "skip") in rows, rows
    assert not [r for r in rows if r[3] == "FAIL"], rows


@pytest.mark.parametrize("broken", ["failure", "raises"])
def test_a_section_that_ran_and_failed_fails_the_run(broken):
    bad = _section("b_bad", failures=["b: wrong bytes"]) if broken == "failure" else _section("b_bad", raises=True)
    sections = gpu_check.run_sections("ab", {"a": _section("a_ok"), "b": bad})
    failures = gpu_check.failures_of(sections)
    expected = ["b: wrong bytes"] if broken == "failure" else ["b_bad: raised RuntimeError: b_bad broke"]
    assert failures == expected, failures


def test_sections_not_selected_do_not_run():
    sections = gpu_check.run_sections("a", {"a": _section("a_ok"), "b": _section("b_bad", raises=True)})
    assert list(sections) == ["a_ok"], sections


def test_serve_section_names_the_packages_the_gpu_image_lacks():
    assert {"fastapi", "uvicorn", "openai"} <= set(h_serve.REQUIRES), h_serve.REQUIRES
    assert gpu_check.SECTIONS["h"] is h_serve


def _bench_row(section: str, variant: str, tflops: float) -> dict:
    return {"section": section, "model": "m", "variant": variant, "tflops": tflops, "median_ms": 1.0}


@pytest.mark.parametrize("default", ["pointers", "tma"])
def test_kernel_section_reports_tma_and_pointers_side_by_side_on_the_same_tiles(default):
    """Section e: whichever path is the default, both paths' TFLOP/s of the same tiles land in one row, and
    TMA only 'ok' when at least as fast as pointers."""
    from gpu_checks import e_kernel

    other = "TMA" if default == "pointers" else "pointers"
    label = "64x128x64 w4 s3 p1 g0 " + ("tma(w,a)" if default == "tma" else "pointers") + " [built-in]"
    rows = [_bench_row("gemm", "multi-buffer", 100.0), _bench_row("gemm", f"multi-buffer ({other})", 80.0),
            _bench_row("moe", "fused (sum)", 50.0), _bench_row("moe", f"fused (sum, {other})", 60.0)]
    notes = {"m": {"gemm_launch": label, "moe_launches": {"gate_up": label, "down": label}}}
    shape = e_kernel.per_shape(rows, notes, peak=500.0)["m"]
    tma_gemm, pointers_gemm = (100.0, 80.0) if default == "tma" else (80.0, 100.0)
    assert (shape["gemm"]["tma_tflops"], shape["gemm"]["pointers_tflops"]) == (tma_gemm, pointers_gemm), shape
    tma_moe, pointers_moe = (50.0, 60.0) if default == "tma" else (60.0, 50.0)
    assert (shape["moe"]["tma_tflops"], shape["moe"]["pointers_tflops"]) == (tma_moe, pointers_moe), shape
    table = e_kernel.summary({"accuracy": {"x": 0.0}, "matmul_peak_tflops": 500.0, "tokens": 64, "rows": rows,
                              "per_shape": {"m": shape}})
    paths = [r for r in table if "TMA / pointers" in r[0]]
    assert [r[1] for r in paths] == [f"{tma_gemm:.0f} / {pointers_gemm:.0f} TFLOP/s = {tma_gemm / pointers_gemm:.2f}x",
                                     f"{tma_moe:.0f} / {pointers_moe:.0f} TFLOP/s = {tma_moe / pointers_moe:.2f}x"], paths
    assert [r[3] for r in paths] == ["ok" if tma_gemm >= pointers_gemm else "miss",
                                     "ok" if tma_moe >= pointers_moe else "miss"], paths


def _halves(key: str, calls: list):
    def run(sections, part="all"):
        calls.append((key, part))
        return {"failures": [f"{key} {part} failed"] if part == "timing" and key == "e_kernel" else [],
                "accuracy" if part == "correctness" else "speed": {part: 1}}

    return SimpleNamespace(KEY=key, REQUIRES=(), run=run, summary=lambda section: [])


def test_quick_runs_every_correctness_check_before_any_timing():
    steps = list(gpu_check.QUICK)
    timing = [i for i, (_, part) in enumerate(steps) if part not in gpu_check.CORRECTNESS_PARTS]
    correctness = [i for i, (_, part) in enumerate(steps) if part in gpu_check.CORRECTNESS_PARTS]
    assert max(correctness) < min(timing), steps
    assert [letter for letter, _ in steps[:6]] == list("bdfieg") and "h" not in dict(steps), steps


def test_the_halves_of_a_section_merge_and_the_json_is_written_after_every_step():
    calls, written = [], []
    modules = {"a": _section("a_ok"), "e": _halves("e_kernel", calls)}
    sections = gpu_check.run_steps([("e", "correctness"), ("a", "all"), ("e", "timing")], modules,
                                   after_each=lambda s: written.append(sorted(s)))
    assert calls == [("e_kernel", "correctness"), ("e_kernel", "timing")]
    assert sections["e_kernel"]["accuracy"] == {"correctness": 1} and sections["e_kernel"]["speed"] == {"timing": 1}
    assert gpu_check.failures_of(sections) == ["e_kernel timing failed"]
    assert written == [["e_kernel"], ["a_ok", "e_kernel"], ["a_ok", "e_kernel"]]


def test_timing_steps_past_the_budget_are_skipped_and_correctness_steps_never_are():
    calls = []
    modules = {"e": _halves("e_kernel", calls), "g": _halves("g_fp8", calls)}
    sections = gpu_check.run_steps([("e", "correctness"), ("g", "correctness"), ("e", "timing")], modules,
                                   budget_s=-1.0)
    assert calls == [("e_kernel", "correctness"), ("g_fp8", "correctness")]
    assert "budget" in sections["e_kernel"]["skipped"] and sections["e_kernel"]["accuracy"]
