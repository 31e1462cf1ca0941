"""Tuned kernel configurations as data: the shipped files, the rules that pick a launch's tiles
(device, shape, fallback), bad files, and what `dwdp tune-kernel` writes.

Legend: N = output features (of an expert's weight [N, K]), K = input features, Re = rows per expert.
Nothing here runs on a GPU: devices are DeviceInfo values as torch reports them (name, compute capability, shared memory, SMs).
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from dwdp.kernels import Epilogue, GroupedGemmConfig, KernelConfigError, KernelProblem, candidate_tiles, launch_config
from dwdp.kernels import tuned_configs
from dwdp.kernels.launch import (DEFAULT_TILES, DeviceInfo, choose_tiles, fits, fp8_block_k, shared_memory_bytes,
                                 tma_blocker)

pytestmark = pytest.mark.timeout(60)

H100 = DeviceInfo("NVIDIA H100 80GB HBM3", (9, 0), 232448, 132)
OTHER = DeviceInfo("Test GPU 7", (9, 0), 232448, 100)
SWIGLU = Epilogue()


def _problem(n=1536, k=2048, rows=256, **changes) -> KernelProblem:
    base = dict(a_dtype=torch.bfloat16, w_dtype=torch.bfloat16, n=n, k=k, num_experts=128, rows_per_expert=rows)
    base.update(changes)
    return KernelProblem(**base)


def _config(bm=64, bn=64, bk=64, w=4, s=3, **extra) -> dict:
    return dict(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s, programs_per_sm=1, **extra)


def _file(device=OTHER.name, entries=(), defaults=None, measured=None) -> dict:
    return {"format": tuned_configs.FORMAT, "device": device,
            "measured": measured or {"date": "2026-01-02", "torch": "2.11", "triton": "3.6", "code": "abc1234"},
            "defaults": defaults or {}, "entries": list(entries)}


@pytest.fixture
def configs_dir(tmp_path, monkeypatch):
    """An empty DWDP_KERNEL_CONFIGS directory; write(name, content) puts a file there."""
    monkeypatch.setenv("DWDP_KERNEL_CONFIGS", str(tmp_path))

    def write(name: str, content) -> None:
        (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return write


def test_shipped_files_state_device_versions_date_and_fit_their_device():
    paths = sorted(tuned_configs.PACKAGE_DIR.glob("*.json"))
    assert [p.name for p in paths] == ["NVIDIA_H100_80GB_HBM3.json"], paths  # no file for an unmeasured device
    for path in paths:
        tuned = tuned_configs.load(path)
        assert path.name == tuned_configs.file_name(tuned.device), (path.name, tuned.device)
        for field in ("date", "torch", "triton", "code", "how", "not_measured"):
            assert tuned.measured.get(field), (path.name, field, tuned.measured)
        assert tuned.entries and all("tflops" in e.extra or "pair_tflops" in e.extra for e in tuned.entries), path
        for entry in tuned.entries:  # every shipped tile fits the shared memory of the device it names
            problem = _problem(entry.n, entry.k, entry.rows_per_expert,
                               **_kind_changes(entry.kind, entry.k))
            assert fits(GroupedGemmConfig(**entry.config), problem, H100), (entry, shared_memory_bytes(
                GroupedGemmConfig(**entry.config), problem))
    h100 = tuned_configs.load(tuned_configs.PACKAGE_DIR / "NVIDIA_H100_80GB_HBM3.json")
    assert (h100.measured["torch"], h100.measured["triton"], h100.measured["code"]) == ("2.11.0+cu130", "3.6.0",
                                                                                         "ed3ed31")


def _kind_changes(kind: str, k: int) -> dict:
    changes = {"epilogue": SWIGLU} if kind.endswith("_gated") else {}
    if kind.startswith("fp8"):
        changes.update(w_dtype=torch.float8_e4m3fn, scale_format="fp32", scale_block=(128, 128))
        if not kind.startswith("fp8w"):
            changes["a_dtype"] = torch.float8_e4m3fn
    return changes


def test_device_match_takes_the_h100_entry_and_another_device_the_built_in_default():
    tiles, source = choose_tiles(_problem(), H100)
    assert source.startswith("NVIDIA_H100_80GB_HBM3.json: bf16 n=1536 k=2048 rows=256"), source
    assert (tiles.block_m, tiles.block_n, tiles.block_k, tiles.num_warps, tiles.num_stages) == (128, 256, 64, 8, 4)
    # The same GPU under another name (PCIe part, H200) has no measurements: built-in default.
    for name in ("NVIDIA H100 PCIe", "NVIDIA H200"):
        tiles, source = choose_tiles(_problem(), replace(H100, name=name))
        assert source == "built-in default bf16" and tiles == DEFAULT_TILES["bf16"], (name, source)


def test_shape_match_takes_the_nearest_rows_of_the_same_n_and_k(configs_dir):
    configs_dir("mine.json", _file(entries=[
        {"kind": "bf16", "n": 512, "k": 256, "rows_per_expert": 64, "config": _config(bm=64)},
        {"kind": "bf16", "n": 512, "k": 256, "rows_per_expert": 1024, "config": _config(bm=128)},
        {"kind": "bf16", "n": 512, "k": 512, "rows_per_expert": 100, "config": _config(bm=32)},
    ], defaults={"bf16": _config(bm=16, bn=16, bk=16)}))
    for rows, block_m in ((1, 64), (100, 64), (300, 128), (600, 128), (10 ** 6, 128)):
        tiles, source = choose_tiles(_problem(512, 256, rows), OTHER)
        assert tiles.block_m == block_m, (rows, tiles, source)
    # Another N or K: the file's default for the kind; a kind the file lacks: the built-in default.
    assert choose_tiles(_problem(512, 128, 100), OTHER) == (GroupedGemmConfig(16, 16, 16, 4, 3), "mine.json: default bf16")
    assert choose_tiles(_problem(512, 256, 64, epilogue=SWIGLU), OTHER)[1] == "built-in default bf16_gated"


def test_tiles_that_do_not_fit_shared_memory_fall_back(configs_dir):
    big = _config(bm=128, bn=256, bk=64, w=8, s=4)  # 196,608 bytes plain, 327,680 gated
    configs_dir("mine.json", _file(entries=[{"kind": "bf16_gated", "n": 512, "k": 256, "rows_per_expert": 64,
                                             "config": big}], defaults={"bf16_gated": big}))
    tiles, source = choose_tiles(_problem(512, 256, 64, epilogue=SWIGLU), OTHER)
    assert source == "built-in default bf16_gated" and fits(tiles, _problem(512, 256, 64, epilogue=SWIGLU), OTHER)
    small = replace(OTHER, shared_memory=100_000)  # e.g. a smaller part: the defaults step down until one fits
    tiles, source = choose_tiles(_problem(512, 256, 64), small)
    assert source.startswith("built-in step-down") and shared_memory_bytes(tiles, _problem()) + 1024 <= 100_000


def test_given_tiles_win_and_fp8_dots_take_a_k_tile_that_divides_the_scale_block():
    given = GroupedGemmConfig(32, 32, 32, num_warps=2, num_stages=2)
    assert choose_tiles(_problem(), H100, given) == (given, "given")
    fp8 = _problem(**_kind_changes("fp8", 2048))
    assert choose_tiles(fp8, H100)[0].block_k == 128
    assert choose_tiles(replace(fp8, scale_block=(128, 64)), H100)[0].block_k == 64
    assert choose_tiles(replace(fp8, scale_block=(128, 64)), H100, given)[0].block_k == 32  # 32 divides 64: kept
    assert [fp8_block_k(c) for c in (128, 384, 64, 96, 48, 16)] == [128, 128, 64, 32, None, None]
    with pytest.raises(ValueError, match="fp8 x fp8 dots need scale blocks whose 48 columns"):
        choose_tiles(replace(fp8, scale_block=(128, 48)), H100)


@pytest.mark.parametrize("content,match", [
    ("{not json", "is not valid JSON"),
    (_file(measured={"date": "2026-01-02", "torch": "2.11", "triton": "3.6"}), "measured must be an object"),
    (_file(entries=[{"kind": "bf16", "n": 4, "k": 4, "rows_per_expert": 8, "config": _config(bm=24)}]),
     r"entries\[0\]\.config: block_m=24 must be a power of two"),
    (_file(entries=[{"kind": "bf17", "n": 4, "k": 4, "rows_per_expert": 8, "config": _config()}]),
     r"entries\[0\]\.kind='bf17'"),
    (_file(entries=[{"kind": "bf16", "n": 4, "k": 4, "rows_per_expert": 0, "config": _config()}]),
     r"entries\[0\]\.rows_per_expert=0 must be an int >= 1"),
    (_file(defaults={"bf16": {"block_m": 64}}), r"defaults\.bf16: missing fields"),
    (dict(_file(), format="other/1"), "format='other/1'"),
])
def test_malformed_file_is_one_error_naming_the_file(configs_dir, tmp_path, content, match):
    configs_dir("broken.json", content)
    with pytest.raises(KernelConfigError, match=match) as info:
        launch_config(_problem(), OTHER)
    assert str(info.value).startswith(str(tmp_path / "broken.json")), str(info.value)


def test_configs_directory_is_read_before_the_shipped_files(configs_dir):
    configs_dir("h100_retuned.json", _file(device=H100.name, entries=[
        {"kind": "bf16", "n": 1536, "k": 2048, "rows_per_expert": 256, "config": _config(bm=32)}]))
    tiles, source = choose_tiles(_problem(), H100)
    assert tiles.block_m == 32 and source.startswith("h100_retuned.json"), source


def test_candidate_tiles_lists_every_choice_for_a_layer():
    problem = _problem(4096, 7168, 128)
    listed = candidate_tiles(problem, H100)
    for rows in (1, 64, 128, 129, 5000, 10 ** 6):
        assert choose_tiles(replace(problem, rows_per_expert=rows), H100)[0] in listed, rows
    assert [(t.block_m, t.block_n, t.block_k) for t in listed] == [(128, 128, 128)], listed  # the DeepSeek-V3 entry
    other = candidate_tiles(_problem(4096, 1024, 128), H100)
    assert [(t.block_m, t.block_n, t.block_k, t.num_stages) for t in other] == [(128, 256, 64, 4)], other


def test_interpreter_takes_the_pointer_path_unless_tiles_ask_for_tma():
    interp = DeviceInfo("interpreter", None, None, 4)
    assert tma_blocker(_problem(), interp, GroupedGemmConfig()) is not None
    config = launch_config(_problem(), interp)
    assert not config.w_tma and dict(config.constexprs)["FP32_DOT"] is True, config


def test_build_file_keeps_the_best_and_the_older_entries(tmp_path):
    from dwdp.tune.kernel import TuneShape, build_file, sweep

    shapes = [TuneShape("bf16", 64, 32, 8, 4, "a"), TuneShape("bf16", 64, 32, 64, 4, "b")]
    fast, slow, broken = (GroupedGemmConfig(32, 32, 32), GroupedGemmConfig(64, 64, 32), GroupedGemmConfig(16, 16, 16))
    speed = {(fast, 8): 5.0, (slow, 8): 7.0, (fast, 64): 9.0, (slow, 64): 2.0}

    def measure(shape, config):
        if config == broken:
            return {"error": "OutOfResources"}
        return {"tflops": speed[(config, shape.rows_per_expert)], "rel_err": 1e-3, "path": "pointers"}

    swept = sweep(shapes, lambda kind: [fast, slow, broken], measure, log=lambda line: None)
    older = {"kind": "bf16", "n": 8, "k": 8, "rows_per_expert": 4, "config": _config()}
    existing = _file(device="Test GPU 7", entries=[older], measured={"date": "2025-01-01", "torch": "2.9",
                                                                      "triton": "3.4", "code": "old"})
    measured = {"date": "2026-02-03", "torch": "2.11", "triton": "3.6", "code": "new"}
    content = build_file("Test GPU 7", swept, measured, existing)
    (tmp_path / "f.json").write_text(json.dumps(content))
    tuned = tuned_configs.load(tmp_path / "f.json")
    by_rows = {e.rows_per_expert: e for e in tuned.entries}
    assert by_rows[8].config["block_m"] == 64 and by_rows[64].config["block_m"] == 32, by_rows
    assert by_rows[8].config["tma"] is False and by_rows[8].extra["measured"]["code"] == "new"
    assert by_rows[4].extra["measured"]["code"] == "old", by_rows[4]  # kept with its own provenance
    # Default: best geometric mean over both shapes (sqrt(5 * 9) > sqrt(7 * 2)).
    assert tuned.defaults["bf16"]["block_m"] == 32 and tuned.defaults["bf16"]["tma"] is None, tuned.defaults


def test_tune_kernel_writes_a_file_the_launch_reads(tmp_path):
    """The real sweep on the interpreter (timings meaningless there): both GEMMs of a tiny layer, two
    candidates each; the file it writes loads and names the interpreter."""
    from dwdp.tune.kernel import model_gemms, run_tune_kernel

    shapes = model_gemms(32, 16, 4, 2, [6])
    configs = [GroupedGemmConfig(16, 16, 16, num_warps=1, num_stages=1), GroupedGemmConfig(32, 32, 32, num_stages=1)]
    path = run_tune_kernel(shapes, torch.device("cpu"), warmup=0, repeats=1, out_dir=str(tmp_path),
                           candidates=lambda kind: configs, log=lambda line: None)
    tuned = tuned_configs.load(path)
    assert path.name == "interpreter.json" and tuned.device == "interpreter"
    kinds = sorted((e.kind, e.n, e.k, e.rows_per_expert) for e in tuned.entries)
    assert kinds == [("bf16", 32, 16, 3), ("bf16_gated", 32, 32, 3)], kinds
    assert all(e.extra["rel_err"] < 1e-2 for e in tuned.entries), tuned.entries


@pytest.mark.parametrize("argv,message", [
    (["--shape", "64,32,4"], "--shape='64,32,4' must be four integers H,I,E,K"),
    (["--shape", "64,32,4,2", "--tokens", "8,0"], "tokens=0 must be >= 1"),
    (["--preset", "NoSuchModel"], "unknown model preset 'NoSuchModel'"),
    (["--shape", "64,32,4,2"], "no CUDA device here"),
])
def test_tune_kernel_command_refuses_bad_input_in_one_line(argv, message, capfd):
    from dwdp.cli import main

    assert main(["tune-kernel", *argv]) == 2
    err = capfd.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
