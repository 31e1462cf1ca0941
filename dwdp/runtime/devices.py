"""Where the ranks of `dwdp demo` and `dwdp serve` run: CPU, or one CUDA device per local rank.

Local rank r runs on `cuda:(r % GPUs)`, so a machine with fewer GPUs than ranks puts several ranks on
one GPU (how a one-GPU machine runs a DWDP group: CUDA IPC between processes on one device works,
NCCL does not, so the group's control plane is gloo there). Models are bf16 on CUDA, fp32 on CPU,
unless asked otherwise.
"""
from __future__ import annotations

import torch

DEVICES = ("cpu", "cuda")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class NoGpu(RuntimeError):
    """`--device cuda` on a machine without a usable CUDA GPU; the message is one line."""


def check_device(device: str) -> str:
    if device not in DEVICES:
        raise ValueError(f"device={device!r} must be one of {DEVICES}")
    return device


def require_gpu(command: str, flag: str = "--device cuda", instead: str = "--device cpu") -> int:
    """The number of usable CUDA GPUs, or NoGpu naming what is missing (driver, device, CUDA torch),
    the `flag` that asked for one and the option to use `instead`."""
    from dwdp.runtime.transport import cuda_api

    info = cuda_api.probe()
    if not info.usable:
        raise NoGpu(f"{command}: {flag} but this machine has no usable CUDA GPU ({info.error}); use {instead}")
    if not torch.cuda.is_available():
        raise NoGpu(f"{command}: {flag} but torch {torch.__version__} has no CUDA support; install a CUDA "
                    f"build of torch or use {instead}")
    return torch.cuda.device_count()


def rank_device(device: str, local_rank: int) -> torch.device:
    """This local rank's device: cpu, or cuda:(local_rank % visible GPUs), made current."""
    if check_device(device) == "cpu":
        return torch.device("cpu")
    index = local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def model_dtype(device: str, dtype: str | None) -> torch.dtype:
    """The requested dtype, or bf16 on CUDA and fp32 on CPU."""
    if dtype is None:
        return torch.bfloat16 if check_device(device) == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} must be one of {tuple(DTYPES)}")
    return DTYPES[dtype]


def sharing_line(ranks: int, gpus: int) -> str | None:
    """One line saying how ranks share GPUs when there are more ranks than GPUs, else None."""
    if ranks <= gpus:
        return None
    by_gpu = {g: [r for r in range(ranks) if r % gpus == g] for g in range(gpus)}
    where = "; ".join(f"cuda:{g}: ranks {', '.join(map(str, rs))}" for g, rs in by_gpu.items())
    return (f"{ranks} ranks share {gpus} GPU{'s' if gpus > 1 else ''} ({where}): copies between ranks on one GPU "
            "stay in its memory (no NVLink), and the control plane is gloo")


def bf16_logits_bound(scale: float, spread: float) -> float:
    """How far bf16 logits may sit from the unwrapped model's: the bf16 tolerance of the tests
    (2e-2 + 2e-2 x the largest logit), or twice the spread between transformers' own two correct
    experts paths (eager and grouped_mm) on the same input when that is wider."""
    return max(2e-2 + 2e-2 * scale, 2 * spread)


def transformers_spread(model: torch.nn.Module, logits_of, reference: torch.Tensor) -> float:
    """max |logits| difference between transformers' grouped_mm and eager experts paths on the same input
    (`logits_of(model)` runs it; `reference` are the eager logits), or 0 for a model without that switch."""
    switch = getattr(model, "set_experts_implementation", None)
    if switch is None:
        return 0.0
    try:
        switch("grouped_mm")
        other = logits_of(model)
    except (ValueError, NotImplementedError, RuntimeError):  # a family or device without that path
        return 0.0
    finally:
        switch("eager")
    return (other.float() - reference.float()).abs().max().item()
