"""`dwdp tune`: measure this machine, then recommend slice bytes, copy batches, prefetch buffers and
local experts.

Two measurements, both on this machine with the backend the model would use (cuda on a CUDA node,
host elsewhere; dwdp.tune.copies):
  * copy bandwidth of the transport for each candidate slice size (and, on cuda, batch count), with
    a real sliced plan of rank 0 over a group of segments held by this process (it measures the copy
    path itself, not contention between ranks); on cuda also the cost of one more copy;
  * compute time of one MoE decoder layer at `max_num_tokens` on the model's device, as the
    difference between a model with k + 2 and k + 1 decoder layers (k = leading dense layers),
    random weights.
Then the slice size and batch count follow the measured bandwidth (copy_tuning.choose_copy_settings),
per layer T_prefetch(L) = (E - L) * expert_bytes / bandwidth, and the cost model's timeline
(dwdp.predict.costmodel.timeline: copies issued when a buffer is released, one copy engine) says whether a
forward of identical layers of T_compute each waits for it. The cuda measurement has not yet run on
a GPU.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

import torch

from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.transport.registry import auto_backend, transport_class
from dwdp.tune.copies import CopyMeasurement, choose_copy_settings, measure_cuda_copies, measure_host_copies
from dwdp.predict.costmodel.timeline import uniform_layers_wait
from dwdp.observe.timing import time_fn

__all__ = ["CopyMeasurement", "Recommendation", "recommend", "run_tune"]

# Candidates measured when the command line names none: (slice sizes, batch counts) per device type of
# the backend's copies (`copy_device`).
TUNE_DEFAULTS = {"cpu": ("65536,262144,1048576,4194304", "4"),
                 "cuda": ("262144,1048576,2097152,4194304,8388608,16777216", "1,2,4,8")}

MIB = 1 << 20


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

    from dwdp.models.adapters import find_experts
    from dwdp.models.quantization import ExpertsQuantization, relayout_experts
    from dwdp.runtime.wrapping import dense_bytes

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


def measure_layer_compute(model_config, max_num_tokens: int, repeats: int = 3, device: str = "cpu") -> float:
    """Seconds of one MoE decoder layer's forward (attention + router + experts) at `max_num_tokens`
    on `device` (cuda: in the config's dtype, timed with device events)."""
    from transformers import AutoModelForCausalLM

    dense_first = getattr(model_config, "first_k_dense_replace", 0) or 0
    dtype = _config_dtype(model_config) if torch.device(device).type == "cuda" else None
    times = []
    for extra in (1, 2):
        cfg = model_config.__class__(**{**model_config.to_dict(), "num_hidden_layers": dense_first + extra})
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, **({"dtype": dtype} if dtype else {})).to(device).eval()
        ids = torch.randint(3, cfg.vocab_size, (1, max_num_tokens)).to(device)
        with torch.no_grad():
            times.append(time_fn(lambda: model(ids), warmup=1, repeats=repeats, device=device).median_s)
        del model
    return max(times[1] - times[0], 1e-9)


def _config_dtype(model_config) -> torch.dtype:
    dtype = getattr(model_config, "dtype", None) or torch.bfloat16
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def copy_device(backend: str) -> str:
    """The device type whose copies `dwdp tune` measures for a registered backend: "cuda" (copy engines,
    dwdp.tune.copies.measure_cuda_copies) or "cpu" (the backend's own transports in this process)."""
    return transport_class(backend).device_types[0]


def tune_candidates(backend: str) -> tuple[str, str]:
    """The (slice sizes, batch counts) measured for `backend` when the command line names none."""
    return TUNE_DEFAULTS[copy_device(backend)]


def default_memory_budget(group_size: int, backend: str = "host") -> int:
    """80 % of the memory available now to one rank: host memory shared by the `group_size` ranks of
    this host, or on cuda the free memory of GPU 0 shared by the ranks that land on each GPU."""
    if copy_device(backend) == "cuda":
        free, _total = torch.cuda.mem_get_info(0)
        return int(0.8 * free / math.ceil(group_size / torch.cuda.device_count()))
    with open("/proc/meminfo") as f:
        available_kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable"))
    return int(0.8 * available_kib * 1024 / group_size)


def recommend(num_experts: int, expert_bytes: int, num_moe_layers: int, group_size: int, dense_bytes: int,
              copies: list[CopyMeasurement], t_compute_s: float, memory_budget: int,
              inflight: int, backend: str = "host") -> Recommendation:
    """Slice size and batch count from the measured copies (copy_tuning.choose_copy_settings: the
    smallest slice within 5 % of the best bandwidth, the most batches within 5 % at that slice);
    fewest local experts whose prefetch hides behind one layer's compute and that fit the budget;
    a third buffer when prefetch stays exposed."""
    choice = choose_copy_settings(copies)
    slice_bytes = choice.slice_bytes
    bandwidth = choice.gb_per_s * 1e9

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
                        num_buffers=buffers, backend=backend, inflight=inflight, copy_batches=choice.copy_batches)
    return Recommendation(config, t_compute_s, t_prefetch, resident(local, buffers), memory_budget, bool(hides),
                          f"{reason}; {choice.reason}")


def report(copies: list[CopyMeasurement], rec: Recommendation, device: str = "cpu", where: dict | None = None) -> dict:
    return {
        "copies": [c.as_dict() for c in copies],
        "t_compute_s": rec.t_compute_s, "t_prefetch_s": rec.t_prefetch_s, "hidden": rec.hidden,
        "resident_bytes": rec.resident_bytes, "memory_budget_bytes": rec.memory_budget_bytes,
        "reason": rec.reason, "config": asdict(rec.config), "cpu_count": os.cpu_count(), "device": device,
        **({"copy_setup": where} if where else {}),
    }


def resolve_tune_backend(backend: str) -> str:
    """auto: the backend registered for CUDA models when this machine has a usable CUDA device (cuda),
    for CPU models otherwise (host); any other name must be registered (ValueError naming them)."""
    if backend == "auto":
        from dwdp.runtime.transport import cuda_api

        return auto_backend("cuda" if torch.cuda.is_available() and cuda_api.probe().usable else "cpu")
    return transport_class(backend).name


def run_tune(model_config, group_size: int, max_num_tokens: int, slice_sizes: list[int], inflight: int,
             memory_budget: int | None, out: str, repeats: int = 3, backend: str = "host",
             batch_counts: tuple[int, ...] = (4,)) -> dict:
    """Measure, recommend, print a table and write the recommended DWDPConfig to `out`."""
    num_experts, expert_bytes, num_moe_layers, dense = expert_geometry(model_config)
    where = None
    on_cuda = copy_device(backend) == "cuda"
    if on_cuda:
        copies, where = measure_cuda_copies(num_experts, group_size, expert_bytes, slice_sizes, batch_counts, repeats)
        t_compute = measure_layer_compute(model_config, max_num_tokens, repeats, device="cuda")
        from dwdp.observe.timing import device_tag

        device = device_tag("cuda")
    else:
        torch.set_num_threads(1)  # one rank's share of a host that runs `group_size` ranks
        copies = measure_host_copies(num_experts, group_size, expert_bytes, slice_sizes, inflight, repeats,
                                     batch_counts=batch_counts, backend=backend)
        t_compute = measure_layer_compute(model_config, max_num_tokens, repeats)
        device = "cpu"
    budget = memory_budget or default_memory_budget(group_size, backend)
    rec = recommend(num_experts, expert_bytes, num_moe_layers, group_size, dense, copies, t_compute, budget, inflight,
                    backend)
    rec.config.to_json(out)
    if on_cuda:
        per_copy = where["per_copy"]
        print(f"copy bandwidth (cuda backend, {where['link']}; one more copy in a batch costs "
              f"{per_copy['host_issue_us_per_copy']:.2f} us on the host and {per_copy['landed_us_per_copy']:.2f} us "
              f"until landed, {per_copy['copy_bytes'] // 1024} KiB copies):")
    else:
        print(f"copy bandwidth ({backend} backend, {os.cpu_count()} CPU cores, {inflight} copier threads):")
    print(f"{'slice':>10}  {'batches':>7}  {'copies':>6}  {'MiB/plan':>9}  {'ms/plan':>8}  {'issue ms':>8}  {'GB/s':>7}")
    for c in copies:
        print(f"{c.slice_bytes:>10}  {c.copy_batches:>7}  {c.copies:>6}  {c.bytes_per_plan / MIB:>9.2f}  "
              f"{1e3 * c.seconds:>8.2f}  {1e3 * c.issue_seconds:>8.3f}  {c.gb_per_s:>7.2f}")
    print(f"one MoE layer at {max_num_tokens} tokens: {1e3 * t_compute:.2f} ms compute; "
          f"prefetch of {num_experts - rec.config.num_local_experts} experts of {expert_bytes / 1024:.1f} KiB "
          f"({_experts_format(model_config)}): {1e3 * rec.t_prefetch_s:.2f} ms ({'hidden' if rec.hidden else 'exposed'})")
    print(f"resident per rank {rec.resident_bytes / MIB:.1f} MiB of a {budget / MIB:.0f} MiB budget; {rec.reason}")
    print(f"recommended: slice_bytes={rec.config.slice_bytes} copy_batches={rec.config.copy_batches} "
          f"num_buffers={rec.config.num_buffers} num_local_experts={rec.config.num_local_experts} -> {out} "
          f"(DWDPConfig.from_json)")
    return dict(report(copies, rec, device, where), expert_bytes=expert_bytes,
                experts_format=_experts_format(model_config))


def _experts_format(model_config) -> str:
    """What one expert is held as: the config's dtype, or its quantization with block scales."""
    quantization = getattr(model_config, "quantization_config", None)
    if quantization is None:
        return str(getattr(model_config, "dtype", None) or "float32").removeprefix("torch.")
    get = quantization.get if isinstance(quantization, dict) else lambda k, d=None: getattr(quantization, k, d)
    block = get("weight_block_size", None)
    return f"{get('quant_method')} values + {'x'.join(map(str, block)) + ' ' if block else ''}block scales"
