"""Test-wide settings: the same suite on a CPU machine and on a GPU machine.

Triton kernels run compiled wherever a CUDA GPU is usable and in the CPU interpreter only without one
(TRITON_INTERPRET must be set before any Triton kernel is defined, so it is decided here). Markers
(declared in pyproject.toml):
  gpu             needs a CUDA GPU (`pytest -m gpu` runs these alone); skipped without one
  interpreter     runs Triton kernels on CPU tensors, which only the interpreter can; on a GPU machine
                  the gpu tests run the same kernels compiled instead
  no_cuda_driver  checks what a machine without a usable CUDA driver answers; skipped where one exists
"""
import atexit
import os
import shutil
import tempfile

import pytest
import torch

HAS_GPU = torch.cuda.is_available()
if not HAS_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Local groups (launch_local) fork their ranks from a server that imported these once per test process,
# instead of spawning ranks that each import torch, transformers and the tests' model families again:
# that import was most of a small group's start, and the suite starts hundreds of ranks.
os.environ.setdefault("DWDP_FORKSERVER_PRELOAD", ",".join([
    "transformers", "dwdp.runtime.model", "dwdp.runtime.baselines.dep", "dwdp.models.tiny",
    *(f"transformers.models.{family}.modeling_{family}" for family in ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")),
]))

# Each test process (each pytest-xdist worker) keeps its segments and boards in a directory of its own,
# so a test that checks /dev/shm for leaks never sees what a test running beside it holds.
if "DWDP_SHM_DIR" not in os.environ:
    _shm_root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    os.environ["DWDP_SHM_DIR"] = tempfile.mkdtemp(prefix="dwdp-tests-", dir=_shm_root)
    atexit.register(shutil.rmtree, os.environ["DWDP_SHM_DIR"], ignore_errors=True)

# Modules whose kernel tests run Triton on CPU tensors.
INTERPRETER_MODULES = {"test_grouped_gemm.py", "test_moe_kernel.py", "test_fp8_kernel.py", "test_experts_kernel.py",
                       "test_local_first.py", "test_experts_groups.py", "test_tma_path.py"}


def _has_cuda_driver() -> bool:
    from dwdp.runtime.transport import cuda_api

    return cuda_api.probe().usable


def pytest_collection_modifyitems(config, items):
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    has_driver = _has_cuda_driver()
    for item in items:
        if item.path.name in INTERPRETER_MODULES:
            item.add_marker(pytest.mark.interpreter)
        if "gpu" in item.keywords and not HAS_GPU:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "interpreter" in item.keywords and not interpreting:
            item.add_marker(pytest.mark.skip(reason="runs Triton on CPU tensors (interpreter); with a GPU the gpu "
                                                    "tests run these kernels compiled"))
        if "no_cuda_driver" in item.keywords and has_driver:
            item.add_marker(pytest.mark.skip(reason="checks a machine without a CUDA driver; this one has one"))
