"""One timing helper for every benchmark: warm-up, then repeated timed calls, median and spread.

Setup belongs outside `fn`; on CUDA the calls are timed with device events, elsewhere with
perf_counter_ns. `machine()` and `load_average_1min()` describe where and under what load a
result was taken, for its JSON.
"""
from __future__ import annotations

import ctypes
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Timing:
    median_s: float
    p10_s: float
    p90_s: float
    repeats: int

    def as_dict(self) -> dict:
        return asdict(self)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def time_fn(fn, *, warmup: int = 2, repeats: int = 5, device: str | torch.device = "cpu") -> Timing:
    """Run `fn()` `warmup` times untimed, then `repeats` timed times."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    device = torch.device(device)
    for _ in range(warmup):
        fn()
    samples = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter_ns()
            fn()
            samples.append((time.perf_counter_ns() - t0) / 1e9)
    return Timing(statistics.median(samples), _quantile(samples, 0.1), _quantile(samples, 0.9), repeats)


# Where `dwdp bench ...` writes unless told: a folder of the user's own under the current directory,
# never the repository's bench/results/, whose stored runs the README quotes.
USER_RESULTS_DIR = "dwdp-bench-results"


def device_tag(device: str | torch.device = "cpu") -> str:
    """Short name of where a benchmark ran, for result file names: cpu, h100, h200, ..."""
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    # Longer names first: "gb200" contains "b200" and "gh200" contains "h200".
    for tag in ("gb200", "gh200", "b200", "h200", "h100", "a100", "l40s"):
        if tag in name:
            return tag
    return name.replace(" ", "_")


def machine() -> dict:
    """Where a benchmark runs: CPU count, platform, processor, Python and torch versions."""
    return dict(cpu_count=os.cpu_count(), platform=platform.platform(), processor=platform.processor(),
                python=platform.python_version(), torch=torch.__version__)


def load_average_1min() -> float:
    """The 1-minute load average: on a shared machine, how many runnable jobs the run competed with."""
    return os.getloadavg()[0]


def keep_freed_memory() -> str | None:
    """Have glibc's malloc keep freed memory (mmap threshold 32 MiB, no trimming) in this process.

    Otherwise a tensor of a few MiB allocated anew in every forward is mapped and paged in anew:
    thousands of page faults per forward at 2048 tokens, microseconds each on a VM, in numbers that
    vary from run to run and swamp the differences a benchmark looks for. Returns what was set, or
    None where the C library is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    m_trim_threshold, m_mmap_threshold = -1, -3
    if not (mallopt(m_mmap_threshold, 32 << 20) and mallopt(m_trim_threshold, 2**31 - 1)):
        return None
    return "glibc malloc: mmap threshold 32 MiB, trim threshold 2 GiB"
