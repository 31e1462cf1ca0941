"""The cuda backend from a user's side on a CPU machine: clear refusals, the control-plane backend,
the config knobs, and bench/gpu_check.py's one-line answer."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dwdp import DWDPConfig
from dwdp.runtime.group import default_backend
from dwdp.runtime.transport import make_transport, resolve_backend
from dwdp.runtime.transport.cuda_api import NoCudaDriverError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("available, devices, local_ranks, want", [
    (False, 0, "2", "gloo"),
    (True, 1, "2", "gloo"),                  # two ranks on one GPU: NCCL would refuse the duplicate device
    (True, 8, "8", "cpu:gloo,cuda:nccl"),    # a GPU each: gloo for objects, nccl for the DEP all-to-all
    (True, 4, "8", "gloo"),
])
def test_control_plane_backend(monkeypatch, available, devices, local_ranks, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    assert default_backend() == want


def test_cuda_backend_needs_a_cuda_model():
    with pytest.raises(ValueError, match="backend='cuda' needs the model on a CUDA device, found it on cpu"):
        resolve_backend("cuda", "cpu")
    with pytest.raises(ValueError, match="backend='host' needs the model on the CPU, found it on cuda:0"):
        resolve_backend("host", "cuda:0")
    assert resolve_backend("auto", "cuda:0") == "cuda" and resolve_backend("auto", "cpu") == "host"


@pytest.mark.no_cuda_driver
def test_cuda_transport_on_a_machine_without_a_driver_is_one_clear_error():
    with pytest.raises(NoCudaDriverError, match="no usable CUDA device .*backend='host'"):
        make_transport("cuda", 0, DWDPConfig(backend="cuda"), device=torch.device("cuda", 0))


@pytest.mark.parametrize("field, value", [("cuda_copy", "dma"), ("copy_batches", 0), ("cuda_mapping", "nvshmem")])
def test_cuda_config_knobs_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        DWDPConfig(**{field: value})


@pytest.mark.no_cuda_driver
@pytest.mark.parametrize("command", ["demo", "serve"])
def test_device_cuda_without_a_gpu_is_one_line_and_exit_2(command):
    done = subprocess.run([sys.executable, "-m", "dwdp", command, "--device", "cuda"], capture_output=True, text=True,
                          timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith(f"dwdp {command}: --device cuda but this machine has no usable "
                                                   "CUDA GPU") and "use --device cpu" in lines[0], lines


@pytest.mark.no_cuda_driver
def test_gpu_check_on_a_cpu_machine_says_so_in_one_line():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py")], capture_output=True, text=True,
                          timeout=120)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA GPU on this machine"), lines
