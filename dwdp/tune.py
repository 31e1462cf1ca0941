"""`dwdp tune`: measure this machine, then recommend slice bytes, prefetch buffers and local experts.

Two measurements, both on this machine with the backend the model would use (host on CPU):
  * copy bandwidth of the transport for each candidate slice size, with a real sliced plan over a
    real group of segments (one process holds every rank's segment, so it measures the copy
    path itself, not contention between ranks);
  * compute time of one MoE decoder layer at `max_num_tokens`, as the difference between a model
    with k + 2 and k + 1 decoder layers (k = leading dense layers), random weights.
Then, per layer, T_prefetch(L) = (E - L) * expert_bytes / bandwidth, and the cost model's timeline
(dwdp.costmodel.timeline: copies issued when a buffer is released, one copy engine) says whether a
forward of identical layers of T_compute each waits for it.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

import torch

from .config import DWDPConfig
from .costmodel.timeline import uniform_layers_wait
from .placement import build_placement
from .plan import PlanCache, SegmentLayout, slot_layout
from .timing import time_fn
from .transport.host import HostTransport, connect_in_process

MIB = 1 << 20


@dataclass(frozen=True)
class CopyMeasurement:
    slice_bytes: int
    bytes_per_plan: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.bytes_per_plan / self.seconds / 1e9


@dataclass(frozen=True)
class Recommendation:
    config: DWDPConfig
    t_compute_s: float
    t_prefetch_s: float
    resident_bytes: int
    memory_budget_bytes: int
    hidden: bool
    reason: str


def expert_geometry(model_config) -> tuple[int, int, int, int]:
    """(num_experts, bytes of one expert as a rank holds and moves it, MoE layer count, dense bytes).

    Read from the model built on the meta device (no memory) in the config's dtype, its experts laid
    out as the config's quantization_config says: an fp8 or MXFP4 expert counts its quantized values and
    their block scales, every named tensor at its own dtype (biases included).
    """
    from transformers import AutoModelForCausalLM

    from .adapters import find_experts
    from .quantization import ExpertsQuantization, relayout_experts
    from .wrapping import dense_bytes

    dtype = getattr(model_config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
    layers = find_experts(model)
    quantization = getattr(model_config, "quantization_config", None)
    if quantization is not None:
        quant = ExpertsQuantization.from_config(quantization, "model config")
        for layer in layers:
            relayout_experts(layer, quant)
        layers = find_experts(model)
    spec = layers[0].spec
    experts = [t.stored(layer.module) for layer in layers for t in layer.spec.tensors]
    return spec.num_experts, sum(t.nbytes for t in spec.tensors), len(layers), dense_bytes(model, experts)


def measure_copy_bandwidth(num_experts: int, group_size: int, expert_bytes: int, slice_sizes: list[int],
                           inflight: int, repeats: int = 3, cap_bytes: int = 256 * MIB) -> list[CopyMeasurement]:
    """Time one layer's sliced copy plan for rank 0 of `group_size` ranks, per slice size.

    Experts larger than `cap_bytes / num_experts` are scaled down to keep memory bounded; the
    bandwidth, not the absolute time, is what carries over.
    """
    expert_bytes = min(expert_bytes, max(cap_bytes // num_experts, 4096))
    tensor_nbytes = (expert_bytes * 2 // 3, expert_bytes - expert_bytes * 2 // 3)
    placement = build_placement(num_experts, group_size)
    layout = SegmentLayout(1, placement.num_local_experts, tensor_nbytes)
    transports = [HostTransport(r, inflight=inflight) for r in range(group_size)]
    try:
        for r, t in enumerate(transports):
            t.alloc_segment(layout.total_nbytes).fill_(r + 1)
        connect_in_process(transports)
        slot = transports[0].alloc_slot(slot_layout(placement, 0, tensor_nbytes).total_nbytes)
        slot.fill_(0)  # first-touch outside the timed region
        out = []
        for slice_bytes in slice_sizes:
            plan = PlanCache(placement, 0, layout, slice_bytes).get(0, 0)
            timing = time_fn(lambda: transports[0].submit(plan, slot).wait(120.0), warmup=1, repeats=repeats)
            out.append(CopyMeasurement(slice_bytes, plan.nbytes, timing.median_s))
        return out
    finally:
        for t in transports:
            t.close()


def measure_layer_compute(model_config, max_num_tokens: int, repeats: int = 3) -> float:
    """Seconds of one MoE decoder layer's forward (attention + router + experts) at `max_num_tokens`."""
    from transformers import AutoModelForCausalLM

    dense_first = getattr(model_config, "first_k_dense_replace", 0) or 0
    times = []
    for extra in (1, 2):
        cfg = model_config.__class__(**{**model_config.to_dict(), "num_hidden_layers": dense_first + extra})
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        ids = torch.randint(3, cfg.vocab_size, (1, max_num_tokens))
        with torch.no_grad():
            times.append(time_fn(lambda: model(ids), warmup=1, repeats=repeats).median_s)
    return max(times[1] - times[0], 1e-9)


def default_memory_budget(group_size: int) -> int:
    """80 % of the memory available now, shared by the `group_size` ranks of this host."""
    with open("/proc/meminfo") as f:
        available_kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable"))
    return int(0.8 * available_kib * 1024 / group_size)


def recommend(num_experts: int, expert_bytes: int, num_moe_layers: int, group_size: int, dense_bytes: int,
              copies: list[CopyMeasurement], t_compute_s: float, memory_budget: int,
              inflight: int) -> Recommendation:
    """Smallest slice within 5 % of the best bandwidth; fewest local experts whose prefetch hides
    behind one layer's compute and that fit the budget; a third buffer when prefetch stays exposed."""
    best = max(c.gb_per_s for c in copies)
    slice_bytes = min(c.slice_bytes for c in copies if c.gb_per_s >= 0.95 * best)
    bandwidth = next(c for c in copies if c.slice_bytes == slice_bytes).gb_per_s * 1e9

    def resident(local: int, buffers: int) -> int:
        return dense_bytes + num_moe_layers * local * expert_bytes + buffers * (num_experts - local) * expert_bytes

    lowest = math.ceil(num_experts / group_size)
    fitting = [n for n in range(lowest, num_experts + 1) if resident(n, 2) <= memory_budget]
    if not fitting:
        raise ValueError(
            f"even num_local_experts={lowest} needs {resident(lowest, 2) / 2**30:.2f} GiB per rank, over the "
            f"budget of {memory_budget / 2**30:.2f} GiB: use a larger group or a larger budget"
        )
    hides = [n for n in fitting
             if uniform_layers_wait(t_compute_s, (num_experts - n) * expert_bytes / bandwidth, num_moe_layers) <= 0]
    local = hides[0] if hides else fitting[-1]
    t_prefetch = (num_experts - local) * expert_bytes / bandwidth
    buffers = 2
    if hides:
        reason = f"{local} local experts is the fewest whose prefetch hides behind one layer's compute"
    else:
        reason = f"prefetch stays exposed even with {local} local experts (memory bound)"
        if resident(local, 3) <= memory_budget:
            buffers, reason = 3, reason + "; a third buffer absorbs per-layer jitter"
    config = DWDPConfig(group_size=group_size, num_local_experts=local, slice_bytes=slice_bytes,
                        num_buffers=buffers, backend="host", inflight=inflight)
    return Recommendation(config, t_compute_s, t_prefetch, resident(local, buffers), memory_budget, bool(hides), reason)


def report(copies: list[CopyMeasurement], rec: Recommendation) -> dict:
    return {
        "copies": [dict(asdict(c), gb_per_s=c.gb_per_s) for c in copies],
        "t_compute_s": rec.t_compute_s, "t_prefetch_s": rec.t_prefetch_s, "hidden": rec.hidden,
        "resident_bytes": rec.resident_bytes, "memory_budget_bytes": rec.memory_budget_bytes,
        "reason": rec.reason, "config": asdict(rec.config), "cpu_count": os.cpu_count(), "device": "cpu",
    }


def run_tune(model_config, group_size: int, max_num_tokens: int, slice_sizes: list[int], inflight: int,
             memory_budget: int | None, out: str, repeats: int = 3) -> dict:
    """Measure, recommend, print a table and write the recommended DWDPConfig to `out`."""
    num_experts, expert_bytes, num_moe_layers, dense = expert_geometry(model_config)
    torch.set_num_threads(1)  # one rank's share of a host that runs `group_size` ranks
    copies = measure_copy_bandwidth(num_experts, group_size, expert_bytes, slice_sizes, inflight, repeats)
    t_compute = measure_layer_compute(model_config, max_num_tokens, repeats)
    budget = memory_budget or default_memory_budget(group_size)
    rec = recommend(num_experts, expert_bytes, num_moe_layers, group_size, dense, copies, t_compute, budget, inflight)
    rec.config.to_json(out)
    print(f"copy bandwidth (host backend, {os.cpu_count()} CPU cores, {inflight} copier threads):")
    print(f"{'slice':>10}  {'MiB/plan':>9}  {'ms/plan':>8}  {'GB/s':>6}")
    for c in copies:
        print(f"{c.slice_bytes:>10}  {c.bytes_per_plan / MIB:>9.2f}  {1e3 * c.seconds:>8.2f}  {c.gb_per_s:>6.2f}")
    print(f"one MoE layer at {max_num_tokens} tokens: {1e3 * t_compute:.2f} ms compute; "
          f"prefetch of {num_experts - rec.config.num_local_experts} experts of {expert_bytes / 1024:.1f} KiB "
          f"({_experts_format(model_config)}): {1e3 * rec.t_prefetch_s:.2f} ms ({'hidden' if rec.hidden else 'exposed'})")
    print(f"resident per rank {rec.resident_bytes / MIB:.1f} MiB of a {budget / MIB:.0f} MiB budget; {rec.reason}")
    print(f"recommended: slice_bytes={rec.config.slice_bytes} num_buffers={rec.config.num_buffers} "
          f"num_local_experts={rec.config.num_local_experts} -> {out} (DWDPConfig.from_json)")
    return dict(report(copies, rec), expert_bytes=expert_bytes, experts_format=_experts_format(model_config))


def _experts_format(model_config) -> str:
    """What one expert is held as: the config's dtype, or its quantization with block scales."""
    quantization = getattr(model_config, "quantization_config", None)
    if quantization is None:
        return str(getattr(model_config, "dtype", None) or "float32").removeprefix("torch.")
    get = quantization.get if isinstance(quantization, dict) else lambda k, d=None: getattr(quantization, k, d)
    block = get("weight_block_size", None)
    return f"{get('quant_method')} values + {'x'.join(map(str, block)) + ' ' if block else ''}block scales"
