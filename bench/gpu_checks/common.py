"""What every gpu_check section shares: timing on a stream, seeded bytes, versions, a rank's transport."""
from __future__ import annotations

import platform
import statistics
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent.parent / "results"
MiB = 1 << 20
SLICE_SIZES = [256 << 10, 512 << 10, 1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB]

def time_on(stream: torch.cuda.Stream, fn, *, warmup: int = 1, repeats: int = 5) -> float:
    """Median seconds of fn() enqueued on `stream`, timed with events on that stream."""
    samples = []
    for i in range(warmup + repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        with torch.cuda.stream(stream):
            fn()
        end.record(stream)
        end.synchronize()
        if i >= warmup:
            samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def seeded_bytes(seed: int, nbytes: int, device="cuda") -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)


def code_version() -> str:
    """The commit of this checkout (plus '+changes' when the tree differs from it), or 'unknown'."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+changes" if dirty else "")


def versions() -> dict:
    import triton
    import transformers

    from dwdp.runtime.transport import cuda_api

    info = cuda_api.probe()
    try:
        import nvtx

        nvtx_source = nvtx.__name__
    except ImportError:
        nvtx_source = "torch.cuda.nvtx (nvtx not installed)"
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__,
        "triton": triton.__version__, "transformers": transformers.__version__,
        "cuda_bindings": info.bindings_version, "cuda_runtime": info.runtime_version,
        "cuda_driver": info.driver_version, "python": platform.python_version(), "nvtx": nvtx_source,
    }


def rank_transport(rank: int, opts: dict, seed: int):
    """This rank's cuda transport over a gloo group on GPU 0, its segment filled with seeded bytes and
    every peer mapped. Returns (group, placement, layout, transport, handles)."""
    from dwdp.runtime.group import init_group
    from dwdp.runtime.placement import build_placement
    from dwdp.runtime.plan import SegmentLayout
    from dwdp.runtime.transport.cuda import CudaTransport

    torch.cuda.set_device(0)
    group = init_group()
    placement = build_placement(opts["experts"], group.size)
    layout = SegmentLayout(opts["layers"], placement.num_local_experts, tuple(opts["tensor_nbytes"]))
    transport = CudaTransport(rank, torch.device("cuda", 0), copy_batches=opts["copy_batches"])
    transport.alloc_segment(layout.total_nbytes).copy_(seeded_bytes(seed + rank, layout.total_nbytes))
    handles = group.all_gather_object(transport.register())
    transport.open(handles)
    group.barrier()
    transport.seal()
    return group, placement, layout, transport, handles

