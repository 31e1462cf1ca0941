"""Copy measurements for `dwdp tune`, and the choice of slice size and batch count they imply.

Legend: s = slice_bytes, b = copy_batches; `bytes_per_plan`: bytes of one layer's copy plan for rank 0.

Measuring (on the machine the model will run on, with the backend it will use):
  * host (any backend whose copies run on the CPU): its transports' copies, every rank's segment in this process;
  * cuda: CudaTransport copies of rank 0 of a group held by this process (mapping="process"): the
    peers' segments on GPUs 1, 2, ... when the node has them (their link: NVLink or PCIe), else on
    the same GPU (copies inside one device's memory, which says nothing about NVLink). Each point is
    timed on the host from the submit to the last byte landed, so it holds the host's issue cost,
    the copy engine's per-copy cost and the bandwidth; the issue time alone is kept beside it.
    Separately, one bare batch of n small copies for two n gives the cost of one more copy.
Choosing (pure functions, tested on synthetic tables): the smallest slice whose best bandwidth is
within `tolerance` of the best of all (smaller slices interleave sources more finely), then the
most batches whose bandwidth at that slice is within `tolerance` of that slice's best (more batches
let compute start on experts that have landed sooner).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from dwdp.runtime.placement import build_placement
from dwdp.runtime.plan import SegmentLayout, build_copy_plan, coalesce, cut_batches, slot_layout

MIB = 1 << 20


@dataclass(frozen=True)
class CopyMeasurement:
    """One layer's copy plan of `bytes_per_plan`, cut in `slice_bytes` slices and `copy_batches`
    batches, landed `seconds` after its submit began; `copies` issued (after coalescing, cuda),
    `issue_seconds` of them on the host in submit (0 where not measured)."""

    slice_bytes: int
    bytes_per_plan: int
    seconds: float
    copy_batches: int = 1
    copies: int = 0
    issue_seconds: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.bytes_per_plan / self.seconds / 1e9

    def as_dict(self) -> dict:
        return dict(asdict(self), gb_per_s=self.gb_per_s)


@dataclass(frozen=True)
class CopyChoice:
    slice_bytes: int
    copy_batches: int
    gb_per_s: float
    reason: str


def choose_copy_settings(copies: list[CopyMeasurement], tolerance: float = 0.05) -> CopyChoice:
    """Slice size and batch count from a table of measurements (any grid of slice sizes x batch counts)."""
    if not copies:
        raise ValueError("no copy measurements to choose slice_bytes and copy_batches from")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tolerance={tolerance} must be in [0, 1)")
    best_per_slice: dict[int, float] = {}
    for c in copies:
        best_per_slice[c.slice_bytes] = max(best_per_slice.get(c.slice_bytes, 0.0), c.gb_per_s)
    best = max(best_per_slice.values())
    slice_bytes = min(s for s, gbs in best_per_slice.items() if gbs >= (1 - tolerance) * best)
    at_slice = [c for c in copies if c.slice_bytes == slice_bytes]
    slice_best = best_per_slice[slice_bytes]
    chosen = max((c for c in at_slice if c.gb_per_s >= (1 - tolerance) * slice_best), key=lambda c: c.copy_batches)
    reason = (f"{slice_bytes} B slices: the smallest within {tolerance:.0%} of the best bandwidth "
              f"({slice_best:.3g} of {best:.3g} GB/s); {chosen.copy_batches} batches: the most within {tolerance:.0%} "
              f"of that slice's best ({chosen.gb_per_s:.3g} GB/s)")
    return CopyChoice(slice_bytes, chosen.copy_batches, chosen.gb_per_s, reason)


def per_copy_cost(points: list[tuple[int, float]]) -> tuple[float, float]:
    """(fixed seconds, seconds per copy) of a least-squares line through (copies, seconds) points."""
    if len({n for n, _ in points}) < 2:
        raise ValueError(f"a per-copy cost needs points at two copy counts at least, got {points}")
    mean_n = sum(n for n, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in points) / sum((n - mean_n) ** 2 for n, _ in points)
    return mean_t - slope * mean_n, slope


def _layout(num_experts: int, group_size: int, expert_bytes: int, cap_bytes: int):
    """Placement and a one-layer segment layout; experts larger than `cap_bytes / num_experts` are
    scaled down to keep memory bounded (the bandwidth, not the absolute time, carries over)."""
    expert_bytes = min(expert_bytes, max(cap_bytes // num_experts, 4096))
    tensor_nbytes = (expert_bytes * 2 // 3 // 16 * 16, (expert_bytes - expert_bytes * 2 // 3) // 16 * 16)
    placement = build_placement(num_experts, group_size)
    return placement, SegmentLayout(1, placement.num_local_experts, tensor_nbytes)


def measure_host_copies(num_experts: int, group_size: int, expert_bytes: int, slice_sizes: list[int], inflight: int,
                        repeats: int = 3, cap_bytes: int = 256 * MIB,
                        batch_counts: tuple[int, ...] = (4,), backend: str = "host") -> list[CopyMeasurement]:
    """Time one layer's sliced copy plan of rank 0 through `backend`'s transports (a backend whose
    segments live in host memory), per slice size and batch count."""
    from dwdp.observe.timing import time_fn
    from dwdp.runtime.config import DWDPConfig
    from dwdp.runtime.transport import connect_in_process, transport_class

    placement, layout = _layout(num_experts, group_size, expert_bytes, cap_bytes)
    cls = transport_class(backend)
    out = []
    for batches in batch_counts:
        config = DWDPConfig(backend=backend, inflight=inflight, copy_batches=batches)
        transports = [cls.from_config(r, config) for r in range(group_size)]
        try:
            for r, t in enumerate(transports):
                t.alloc_segment(layout.total_nbytes).fill_(r + 1)
            connect_in_process(transports)
            slot = transports[0].alloc_slot(slot_layout(placement, 0, layout.tensor_nbytes).total_nbytes)
            slot.fill_(0)  # first-touch outside the timed region
            for slice_bytes in slice_sizes:
                plan = build_copy_plan(placement, 0, 0, 0, layout, slice_bytes)
                timing = time_fn(lambda: transports[0].submit(plan, slot).wait(120.0), warmup=1, repeats=repeats)
                out.append(CopyMeasurement(slice_bytes, plan.nbytes, timing.median_s, batches, len(plan.slices)))
        finally:
            for t in transports:
                t.close()
    return out


def measure_cuda_copies(num_experts: int, group_size: int, expert_bytes: int, slice_sizes: list[int],
                        batch_counts: tuple[int, ...], repeats: int = 5,
                        cap_bytes: int = 2048 * MIB) -> tuple[list[CopyMeasurement], dict]:
    """Time rank 0's layer plan on the cuda backend, per slice size and batch count (GPU only; not
    yet run on a GPU). Returns the measurements and where the peers' segments were (the link)."""
    from dwdp.runtime.transport import cuda_api
    from dwdp.runtime.transport.cuda import CudaTransport
    from dwdp.runtime.transport.reference import execute_plan_reference

    cuda_api.require()  # no GPU here: one clear error before anything is allocated
    placement, layout = _layout(num_experts, group_size, expert_bytes, cap_bytes)
    num_devices = torch.cuda.device_count()
    devices = [r % num_devices for r in range(group_size)]
    peers = [CudaTransport(r, torch.device("cuda", d), mapping="process") for r, d in enumerate(devices) if r]
    own = CudaTransport(0, torch.device("cuda", 0), mapping="process")  # last: its device stays current
    segments = [t.alloc_segment(layout.total_nbytes) for t in (own, *peers)]
    for r, segment in enumerate(segments):
        gen = torch.Generator(device=segment.device).manual_seed(r)
        segment.copy_(torch.randint(0, 256, segment.shape, dtype=torch.uint8, device=segment.device, generator=gen))
    for device in sorted(set(devices)):
        torch.cuda.synchronize(device)  # every segment filled before rank 0's copy stream reads it
    handles = [own.register()] + [t.register() for t in peers]
    own.open(handles)
    where = {"devices": devices, "link": "copies inside one GPU" if num_devices == 1 else
             f"GPU 0 pulls from GPUs {sorted(set(devices[1:]))}"}
    slot = own.alloc_slot(slot_layout(placement, 0, layout.tensor_nbytes).total_nbytes)
    slot.zero_()
    stream = torch.cuda.current_stream(0)
    out = []
    try:
        for batches in batch_counts:
            own.copy_batches = batches
            for slice_bytes in slice_sizes:
                plan = build_copy_plan(placement, 0, 0, 0, layout, slice_bytes)  # a new plan: prepared anew
                issued = sum(len(coalesce(plan.slices[b.start:b.stop])) for b in cut_batches(plan, batches))
                totals, issues = [], []
                for i in range(repeats + 1):  # the first submit prepares the plan: untimed
                    stream.synchronize()
                    t0 = time.perf_counter()
                    ticket = own.submit(plan, slot)
                    t1 = time.perf_counter()
                    ticket.wait(60.0)  # the compute stream waits for the last batch
                    stream.synchronize()
                    if i:
                        totals.append(time.perf_counter() - t0)
                        issues.append(t1 - t0)
                if batches == batch_counts[0]:  # a copy path that moves the wrong bytes measures nothing
                    expected = execute_plan_reference(plan, segments, torch.zeros_like(slot))
                    if not torch.equal(slot, expected):
                        raise RuntimeError(f"dwdp tune: the cuda copies of a {slice_bytes} B slice plan landed "
                                           f"{int((slot != expected).sum())} wrong bytes; nothing was recommended")
                out.append(CopyMeasurement(slice_bytes, plan.nbytes, sorted(totals)[len(totals) // 2], batches,
                                           issued, sorted(issues)[len(issues) // 2]))
        where["per_copy"] = measure_cuda_per_copy_cost()
    finally:
        own.close()
        for t in peers:
            t.close()
    return out, where


def measure_cuda_per_copy_cost(counts: tuple[int, ...] = (8, 32, 128), nbytes: int = 64 << 10,
                               repeats: int = 7) -> dict:
    """Cost of one more copy in a bare batch of `nbytes` copies inside GPU 0 (GPU only; not yet run
    on a GPU): host seconds of the call and seconds until the batch landed, as (fixed, per copy)."""
    from dwdp.runtime.transport import cuda_api

    stream = cuda_api.stream_create()
    src = torch.empty(max(counts) * nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty_like(src)
    event = cuda_api.event_create()
    host, landed = [], []
    try:
        for n in counts:
            batch = cuda_api.prepare_batch([dst.data_ptr() + i * nbytes for i in range(n)],
                                           [src.data_ptr() + i * nbytes for i in range(n)], [nbytes] * n)
            for i in range(repeats + 1):
                torch.cuda.synchronize(0)
                t0 = time.perf_counter()
                cuda_api.memcpy_prepared_batch(batch, stream)
                t1 = time.perf_counter()
                cuda_api.event_record(event, stream)
                while not cuda_api.event_query(event):
                    pass  # spin: a sleeping poll would add its own latency to a few microseconds of copies
                if i:
                    host.append((n, t1 - t0))
                    landed.append((n, time.perf_counter() - t0))
    finally:
        torch.cuda.synchronize(0)
        cuda_api.event_destroy(event)
        cuda_api.stream_destroy(stream)
    host_fixed, host_per_copy = per_copy_cost(host)
    landed_fixed, landed_per_copy = per_copy_cost(landed)
    return {"copy_bytes": nbytes, "counts": list(counts), "host_issue_us_per_copy": host_per_copy * 1e6,
            "host_issue_us_fixed": host_fixed * 1e6, "landed_us_per_copy": landed_per_copy * 1e6,
            "landed_us_fixed": landed_fixed * 1e6}
