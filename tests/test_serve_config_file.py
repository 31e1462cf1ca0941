"""`dwdp serve --config FILE`: a DWDPConfig JSON (what `dwdp tune` writes) reaches every worker, the
serve flags that overlap it win and the server says so once, /health reports what the workers run
with, and a bad file is refused in one line naming the field, before any worker starts."""
from __future__ import annotations

import dataclasses
import json

import httpx
import pytest

from dwdp.cli import main
from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.group import free_port
from dwdp.serve.config import ServeConfig, load_dwdp_config, override_notice
from dwdp.serve.launch import ServerProcess

# Not the defaults (1 MiB slices on the host backend, 2 buffers, 4 batches, 60 s), so each one seen
# on /health came from the file.
TUNED = DWDPConfig(group_size=2, num_local_experts=12, slice_bytes=65536, num_buffers=3, backend="host",
                   copy_batches=2, wait_timeout_s=45.0)


def stderr_line(capfd) -> str:
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_the_files_settings_reach_the_workers_config_and_flags_left_out_take_its_values():
    config = ServeConfig(dwdp=TUNED)
    assert (config.ranks, config.device, config.slice_bytes) == (2, "cpu", 65536), config
    assert config.worker_dwdp == TUNED, config.worker_dwdp
    assert config.dwdp_overrides == () and override_notice(config, "tuned.json") is None


def test_given_flags_win_over_the_file_and_each_is_named_once():
    config = ServeConfig(dwdp=TUNED, ranks=3, peer_timeout_s=5.0, slice_bytes=65536)  # slice_bytes: same as file
    assert config.worker_dwdp == TUNED.replace(group_size=3, peer_timeout_s=5.0), config.worker_dwdp
    assert config.dwdp_overrides == (("ranks", "group_size", 2, 3), ("peer_timeout_s", "peer_timeout_s", 2.0, 5.0))
    assert override_notice(config, "tuned.json") == (
        "flags override tuned.json: --ranks 3 over group_size=2, --peer-timeout 5.0 over peer_timeout_s=2.0")


def test_the_files_backend_picks_the_device_and_a_device_flag_overrides_it():
    assert ServeConfig(dwdp=TUNED.replace(backend="auto")).device == "cpu"
    assert ServeConfig(dwdp=TUNED.replace(backend="cuda")).device == "cuda"  # a GPU is asked for at serve time
    config = ServeConfig(dwdp=TUNED.replace(backend="cuda"), device="cpu")
    assert config.worker_dwdp.backend == "host" and config.dwdp_overrides == (("device", "backend", "cuda", "cpu"),)


def test_without_a_file_the_workers_config_is_what_it_was():
    """The three settings serve always passed, the device's backend and its default slice size."""
    config = ServeConfig(ranks=3, expert_replicas=2, peer_timeout_s=1.0)
    assert config.worker_dwdp == DWDPConfig(group_size=3, expert_replicas=2, peer_timeout_s=1.0, backend="host",
                                            slice_bytes=1 << 20), config.worker_dwdp


def test_dep_mode_takes_no_dwdp_config():
    assert ServeConfig(mode="dep").worker_dwdp is None
    with pytest.raises(ValueError, match="mode='dep' runs none"):
        ServeConfig(mode="dep", dwdp=TUNED)


@pytest.mark.timeout(60)
def test_what_dwdp_tune_writes_is_a_file_serve_takes(tmp_path, capfd):
    out = tmp_path / "tuned.json"
    assert main(["tune", "--backend", "host", "--group-size", "2", "--max-num-tokens", "32", "--memory-gib", "64",
                 "--slice-sizes", "4096,65536", "--copy-batches", "1", "--repeats", "1", "--out", str(out)]) == 0
    tuned = load_dwdp_config(str(out))
    assert ServeConfig(dwdp=tuned).worker_dwdp == tuned, tuned


@pytest.mark.timeout(30)
@pytest.mark.parametrize("content,named", [
    ({"slice_bytes": 0}, "--config {path}: slice_bytes=0 is out of range"),
    ({"num_buffers": "3"}, "--config {path}: num_buffers='3' must be an int"),
    ({"backend": "nccl"}, "--config {path}: backend='nccl' is not one of"),
    ({"slice_byte": 4096}, "--config {path}: unknown DWDPConfig field 'slice_byte'"),
    ({"group_size": 2, "expert_replicas": 3}, "--config {path}: expert_replicas=3 is more than group_size=2"),
    ([4096], "--config {path}: expected a JSON object of DWDPConfig fields"),
    ("{slice_bytes: 4096}", "--config {path} is not JSON"),
    (None, "--config {path}: No such file or directory"),
])
def test_a_bad_file_is_refused_in_one_line_naming_the_field(tmp_path, capfd, content, named):
    path = tmp_path / "tuned.json"
    if content is not None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
    assert main(["serve", "--config", str(path), "--port", "0"]) == 2
    line = stderr_line(capfd)
    assert line.startswith("dwdp serve: " + named.format(path=path)), line


@pytest.mark.timeout(30)
def test_a_file_with_dep_mode_is_refused_in_one_line(tmp_path, capfd):
    path = tmp_path / "tuned.json"
    TUNED.to_json(path)
    assert main(["serve", "--config", str(path), "--mode", "dep", "--port", "0"]) == 2
    assert "mode='dep' runs none" in stderr_line(capfd)


@pytest.mark.timeout(300)
def test_health_shows_the_files_slice_size_and_buffers(tmp_path):
    """The server started with the file and one overlapping flag: /health's dwdp_config is the file with
    that flag's value, every worker's prefetch runs with the file's slices and buffers, the server
    named the override once, and a prompt is served."""
    path = tmp_path / "tuned.json"
    TUNED.to_json(path)  # what `dwdp tune` writes
    server = ServerProcess(["--config", str(path), "--peer-timeout", "3", "--preset", "tiny",
                            "--max-num-tokens", "64"], free_port(), startup_timeout_s=240,
                           log_path=str(tmp_path / "log"))
    with server:
        health = httpx.get(f"{server.url}/health", timeout=10).json()
        answer = httpx.post(f"{server.url}/v1/prefill", json={"input_ids": [5, 6, 7, 8]}, timeout=60)
        output = server.output()
    assert health["dwdp_config"] == dataclasses.asdict(TUNED.replace(peer_timeout_s=3.0)), health["dwdp_config"]
    workers = [(w["rank"], w["slice_bytes"], w["num_buffers"]) for w in health["workers"]]
    assert workers == [(0, 65536, 3), (1, 65536, 3)], workers
    assert answer.status_code == 200, answer.text
    notice = f"dwdp serve: flags override {path}: --peer-timeout 3.0 over peer_timeout_s=2.0"
    assert output.count("flags override") == 1 and notice in output, output
