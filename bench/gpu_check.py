"""The cuda backend meets a GPU: correctness and the figures that decide whether DWDP pays, on one GPU.

Run on a machine with one NVIDIA GPU and its own packages (no network needed):
    python3 -m pip install --no-deps --no-build-isolation -e . && python3 bench/gpu_check.py

Sections (two processes share the one GPU where ranks are needed, over a gloo group):
  a  copy bandwidth per slice size (256 KiB .. 8 MiB): one cudaMemcpyAsync per slice and one
     cudaMemcpyBatchAsync (the copy-engine API), and tensor.copy_ per slice (an SM kernel)
  b  CUDA IPC: each rank maps the other's segment through the cuda transport and pulls its seeded
     pattern bit-exactly; opening one's own handle must fail; the prefetch as DWDP issues it
     (sliced, round-robin, batches cut where experts complete) against one plain batch of the
     same bytes and against per-slice cudaMemcpyAsync
  c  overlap: a large bf16 GEMM alone, the prefetch alone, both at once (with and without the
     PreferOverlapWithCompute hint): share of the prefetch hidden, slowdown of each
  d  a 2-rank DWDPModel (cuda backend, Triton experts path) on a bf16 model with hundreds of MB
     of experts: logits against the unwrapped model, tokens/s against the same kernel with every
     expert local (one-rank group, no copies), and the compute stream's stall in prefetch waits
  e  the Triton kernel: against the reference (output poisoned first), TFLOP/s against
     F.grouped_mm and per-expert matmuls, multi-buffer / single-buffer, measured bf16 matmul peak
  f  write-after-read stress: many layers through two slots while compute is slowed, each
     'kernel' checksumming its slot on the device
  g  fp8 experts (128 x 128 block scales): the kernel's bf16 dots and fp8 x fp8 dots against their
     references, TFLOP/s of both next to the same experts in bf16
One GPU measures copies inside one device's memory, not NVLink: NVLink stays unmeasured here.

Prints versions first and a table last; writes bench/results/gpu_check_<gpu>.json; exits 1 on any
correctness failure, 2 at once on a machine without a GPU. Takes a few minutes.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
MiB = 1 << 20
SLICE_SIZES = [256 << 10, 512 << 10, 1 * MiB, 2 * MiB, 4 * MiB, 8 * MiB]


# -- helpers -------------------------------------------------------------------------------------
def _time_on(stream: torch.cuda.Stream, fn, *, warmup: int = 1, repeats: int = 5) -> float:
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


def _seeded_bytes(seed: int, nbytes: int, device="cuda") -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device, generator=gen)


def _code_version() -> str:
    """The commit of this checkout (plus '+changes' when the tree differs from it), or 'unknown'."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+changes" if dirty else "")


def _versions() -> dict:
    import triton
    import transformers

    from dwdp.transport import cuda_api

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


# -- a: copy bandwidth ---------------------------------------------------------------------------
def copy_bandwidth(total: int = 512 * MiB) -> dict:
    from dwdp.transport import cuda_api as api

    src = _seeded_bytes(1, total)
    dst = torch.empty_like(src)
    raw = api.stream_create()
    stream = torch.cuda.ExternalStream(raw)
    rows, failures = [], []
    for slice_bytes in SLICE_SIZES:
        count = total // slice_bytes
        dsts = [dst.data_ptr() + i * slice_bytes for i in range(count)]
        srcs = [src.data_ptr() + i * slice_bytes for i in range(count)]
        sizes = [slice_bytes] * count

        def per_slice():
            for d, s in zip(dsts, srcs):
                api.memcpy_async(d, s, slice_bytes, raw)

        def batch():
            api.memcpy_batch_async(dsts, srcs, sizes, raw)

        def sm_copy():
            for i in range(count):
                dst[i * slice_bytes:(i + 1) * slice_bytes].copy_(src[i * slice_bytes:(i + 1) * slice_bytes])

        for method, engine, fn in (("cudaMemcpyAsync per slice", "copy engine", per_slice),
                                   ("cudaMemcpyBatchAsync", "copy engine", batch),
                                   ("tensor.copy_ per slice", "SM", sm_copy)):
            dst.zero_()
            seconds = _time_on(stream, fn)
            if not torch.equal(dst, src):
                failures.append(f"copy {method} at {slice_bytes} B slices: bytes differ")
            rows.append({"slice_bytes": slice_bytes, "method": method, "engine": engine,
                         "GBps": total / seconds / 1e9, "ms": seconds * 1e3})
    api.stream_destroy(raw)
    return {"total_bytes": total, "rows": rows, "failures": failures,
            "note": "one GPU: device-memory copies (read + write on the same HBM), not NVLink"}


# -- b: IPC and the prefetch as issued ------------------------------------------------------------
def _rank_transport(rank: int, opts: dict, seed: int):
    """This rank's cuda transport over a gloo group on GPU 0, its segment filled with seeded bytes and
    every peer mapped. Returns (group, placement, layout, transport, handles)."""
    from dwdp.group import init_group
    from dwdp.placement import build_placement
    from dwdp.plan import SegmentLayout
    from dwdp.transport.cuda import CudaTransport

    torch.cuda.set_device(0)
    group = init_group()
    placement = build_placement(opts["experts"], group.size)
    layout = SegmentLayout(opts["layers"], placement.num_local_experts, tuple(opts["tensor_nbytes"]))
    transport = CudaTransport(rank, torch.device("cuda", 0), copy_batches=opts["copy_batches"])
    transport.alloc_segment(layout.total_nbytes).copy_(_seeded_bytes(seed + rank, layout.total_nbytes))
    handles = group.all_gather_object(transport.register())
    transport.open(handles)
    group.barrier()
    transport.seal()
    return group, placement, layout, transport, handles


def _ipc_rank(rank: int, opts: dict) -> dict:
    from dwdp.plan import build_copy_plan, slot_layout
    from dwdp.transport import cuda_api
    from dwdp.transport.reference import execute_plan_reference

    group, placement, layout, transport, handles = _rank_transport(rank, opts, 100)
    tensor_nbytes = layout.tensor_nbytes
    try:
        cuda_api.ipc_open(handles[rank]["ipc"])
        own_handle = "opened (unexpected: CUDA refuses a process its own IPC handle)"
    except cuda_api.CudaError as exc:
        own_handle = str(exc)
    peers = [_seeded_bytes(100 + r, layout.total_nbytes) for r in range(group.size)]
    nbytes = slot_layout(placement, rank, tensor_nbytes).total_nbytes
    slot = transport.alloc_slot(nbytes)
    mismatched = []
    for layer in range(layout.num_layers):
        plan = build_copy_plan(placement, rank, layer, 0, layout, opts["slice_bytes"])
        poison = _seeded_bytes(900 + layer, nbytes)
        slot.copy_(poison)
        transport.release_slot(0)  # compute wrote the slot: the copy must come after that write
        transport.submit(plan, slot).synchronize(30.0)
        expected = execute_plan_reference(plan, peers, poison.clone())
        if not torch.equal(slot, expected):
            mismatched.append((layer, int((slot != expected).sum())))

    current = torch.cuda.current_stream()
    raw = cuda_api.stream_create()
    plain_stream = torch.cuda.ExternalStream(raw)
    ptrs = transport._peer_ptrs

    def plain_batch(slices):
        """The same copies through the bare API: one batch, no plan, no events, no waits."""
        dsts = [slot.data_ptr() + c.dst_offset for c in slices]
        srcs = [ptrs[c.peer] + c.src_offset for c in slices]
        sizes = [c.nbytes for c in slices]
        return lambda: cuda_api.memcpy_batch_async(dsts, srcs, sizes, raw)

    bandwidth = []
    whole = build_copy_plan(placement, rank, 0, 0, layout, 1 << 40)  # one copy per expert tensor
    group.barrier()
    unsliced = _time_on(plain_stream, plain_batch(whole.slices), repeats=7)
    for slice_bytes in opts["prefetch_slices"]:
        plan = build_copy_plan(placement, rank, 0, 0, layout, slice_bytes)
        row = {"slice_bytes": slice_bytes, "plan_bytes": plan.nbytes, "slices": len(plan.slices)}
        for method in ("batch", "memcpy"):
            transport.copy = method
            group.barrier()  # both ranks pull at once, as a DWDP group does
            seconds = _time_on(current, lambda: transport.submit(plan, slot).wait(30.0), repeats=7)
            row[f"prefetch_{method}_GBps"] = plan.nbytes / seconds / 1e9
        group.barrier()
        row["plain_batch_same_slices_GBps"] = plan.nbytes / _time_on(plain_stream, plain_batch(plan.slices),
                                                                     repeats=7) / 1e9
        row["plain_batch_unsliced_GBps"] = plan.nbytes / unsliced / 1e9
        bandwidth.append(row)
    torch.cuda.synchronize()
    cuda_api.stream_destroy(raw)
    transport.close()
    return {"rank": rank, "own_handle_open": own_handle, "mismatched_layers": mismatched, "bandwidth": bandwidth}


def ipc_check() -> dict:
    from dwdp.group import launch_local

    opts = {"experts": 16, "layers": 3, "tensor_nbytes": [8 * MiB, 4 * MiB], "slice_bytes": 1 * MiB,
            "copy_batches": 4, "prefetch_slices": [1 * MiB, 4 * MiB, 8 * MiB]}
    ranks = launch_local(_ipc_rank, 2, (opts,), timeout_s=240)
    failures = []
    for r in ranks:
        if r["mismatched_layers"]:
            failures.append(f"IPC rank {r['rank']}: pulled bytes differ in (layer, bytes) {r['mismatched_layers']}")
        if "failed" not in r["own_handle_open"]:
            failures.append(f"IPC rank {r['rank']}: own handle {r['own_handle_open']}")
    return {"options": opts, "ranks": ranks, "failures": failures}


# -- c: overlap ----------------------------------------------------------------------------------
def overlap_check(copy_GBps: float) -> dict:
    from dwdp.transport import cuda_api as api

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    gemms = 8
    compute = torch.cuda.Stream()
    raw = api.stream_create()
    copy = torch.cuda.ExternalStream(raw)

    def gemm():
        for _ in range(gemms):
            torch.mm(a, b, out=out)

    t_gemm = _time_on(compute, gemm)
    # A prefetch that takes about as long as the GEMMs, in 1 MiB slices and batches of 16 MiB.
    nbytes = int(min(4 << 30, max(64 * MiB, copy_GBps * 1e9 * t_gemm))) // MiB * MiB
    src, dst = _seeded_bytes(5, nbytes), torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    slices = [(dst.data_ptr() + o, src.data_ptr() + o, MiB) for o in range(0, nbytes, MiB)]
    batches = [slices[i:i + 16] for i in range(0, len(slices), 16)]

    def prefetch(prefer_overlap):
        for batch in batches:
            api.memcpy_batch_async([d for d, _, _ in batch], [s for _, s, _ in batch], [m for _, _, m in batch], raw,
                                   prefer_overlap)

    def sm_copy(_prefer):
        for o in range(0, nbytes, 16 * MiB):
            dst[o:o + 16 * MiB].copy_(src[o:o + 16 * MiB])

    rows = []
    for label, prefer, issue in (("cudaMemcpyBatchAsync, hint on", True, prefetch),
                                 ("cudaMemcpyBatchAsync, hint off", False, prefetch),
                                 ("tensor.copy_ (SM)", None, sm_copy)):
        t_copy = _time_on(copy, lambda: issue(prefer))
        samples = []
        for i in range(6):
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            start.record(compute)
            copy.wait_event(start)
            with torch.cuda.stream(compute):
                gemm()
            with torch.cuda.stream(copy):
                issue(prefer)
            ends = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)]
            ends[0].record(compute)
            ends[1].record(copy)
            torch.cuda.synchronize()
            if i:
                samples.append((start.elapsed_time(ends[0]) / 1e3, start.elapsed_time(ends[1]) / 1e3))
        g_with = statistics.median(s[0] for s in samples)
        c_with = statistics.median(s[1] for s in samples)
        both = statistics.median(max(s) for s in samples)
        exposed = max(0.0, both - t_gemm)
        rows.append({"copy": label, "gemm_alone_ms": t_gemm * 1e3, "copy_alone_ms": t_copy * 1e3,
                     "gemm_with_copy_ms": g_with * 1e3, "copy_with_gemm_ms": c_with * 1e3, "both_ms": both * 1e3,
                     "copy_bytes": nbytes, "hidden_fraction": max(0.0, 1 - exposed / t_copy),
                     "gemm_slowdown": g_with / t_gemm - 1, "copy_slowdown": c_with / t_copy - 1,
                     "gemm_tflops_alone": 2 * n**3 * gemms / t_gemm / 1e12})
    api.stream_destroy(raw)
    return {"rows": rows, "failures": []}


# -- d: DWDPModel on two ranks --------------------------------------------------------------------
def _model_rank(rank: int, opts: dict) -> dict:
    from dwdp import DWDPConfig, DWDPModel
    from dwdp.device_timing import DeviceWaitTimer
    from dwdp.group import DWDPGroup, init_group
    from dwdp.tiny import build_tiny_model

    torch.cuda.set_device(0)
    group = init_group()
    build = dict(hidden=opts["hidden"], intermediate=opts["intermediate"], num_experts=opts["experts"],
                 top_k=opts["top_k"], num_layers=opts["layers"], vocab=opts["vocab"], dtype=torch.bfloat16, seed=0,
                 initializer_range=opts["initializer_range"])
    gen = torch.Generator().manual_seed(7 + rank)
    ids = torch.randint(3, opts["vocab"], (opts["batch"], opts["seq"]), generator=gen).cuda()
    model = build_tiny_model(opts["family"], **build).cuda()
    experts = model.model.layers[0].mlp.experts
    seen = {}
    hook = experts.register_forward_hook(lambda m, args, out: seen.setdefault("layer0", (args, out)))
    with torch.no_grad():
        model.set_experts_implementation("eager")
        reference = model(input_ids=ids).logits.float()
        hook.remove()
        # Two correct bf16 paths of transformers disagree too: their spread scales the tolerance.
        model.set_experts_implementation("grouped_mm")
        spread = (model(input_ids=ids).logits.float() - reference).abs().max().item()
    expert_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    config = DWDPConfig(backend="cuda", slice_bytes=opts["slice_bytes"])
    dwdp = DWDPModel(model, config, group)
    local = DWDPModel(build_tiny_model(opts["family"], **build).cuda(), config, DWDPGroup(0, 1))
    result = {"rank": rank, "expert_bytes": expert_bytes, "experts_kernel": dwdp.experts_kernel,
              "transformers_spread": spread,
              "nvtx": type(dwdp.prefetcher.nvtx).__name__ + ":" + dwdp.prefetcher.nvtx.source}
    with torch.no_grad():
        args, out = seen["layer0"]
        dwdp(input_ids=ids[:, :8])  # a forward keeps the prefetcher's layer cycle in step
        layer0 = experts(*args).float()  # the same module, now running the dwdp experts function
        result["layer0_experts_rel_err"] = ((layer0 - out.float()).norm() / out.float().norm()).item()
        for name, wrapped in (("dwdp", dwdp), ("local", local)):
            logits = wrapped(input_ids=ids).logits.float()
            result[f"{name}_max_abs_diff"] = (logits - reference).abs().max().item()
        result["scale"] = reference.abs().max().item()
        again = dwdp(input_ids=ids).logits.float()
        result["dwdp_second_forward_diff"] = (again - reference).abs().max().item()
        tokens = ids.numel()
        timer = DeviceWaitTimer()
        for name, wrapped in (("dwdp", dwdp), ("local", local)):
            for _ in range(2):
                wrapped(input_ids=ids)
            torch.cuda.synchronize()
            group.barrier()  # both ranks run the same mode at the same time
            if name == "dwdp":
                dwdp.prefetcher.wait_timer = timer
                dwdp.stats.reset()
            start = time.perf_counter()
            for _ in range(opts["forwards"]):
                wrapped(input_ids=ids)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            result[f"{name}_tokens_per_s"] = opts["forwards"] * tokens / elapsed
            result[f"{name}_ms_per_forward"] = elapsed / opts["forwards"] * 1e3
        dwdp.prefetcher.wait_timer = None
        result["stall_ms_per_forward"] = timer.total_ms() / opts["forwards"]
        result["copied_MiB_per_forward"] = dwdp.stats.bytes_copied / opts["forwards"] / MiB
        result["host_wait_ms_per_forward"] = dwdp.stats.wait_s / opts["forwards"] * 1e3
    result["memory"] = {"local_expert_MiB": dwdp.memory.local_expert_bytes / MiB,
                        "prefetch_MiB": dwdp.memory.prefetch_buffer_bytes / MiB,
                        "full_expert_MiB": dwdp.memory.full_expert_bytes / MiB}
    dwdp.close()
    local.close()
    return result


def _logits_bound(r: dict) -> float:
    """The bf16 tolerance of the CPU tests, or twice the spread between transformers' own eager and
    grouped_mm experts paths on the same input when that is wider (bench/bf16_spread.py)."""
    return max(2e-2 + 2e-2 * r["scale"], 2 * r["transformers_spread"])


def model_check() -> dict:
    from dwdp.group import launch_local

    opts = {"family": "qwen3_moe", "hidden": 2048, "intermediate": 1024, "experts": 16, "top_k": 4, "layers": 4,
            "vocab": 4096, "batch": 4, "seq": 1024, "forwards": 10, "slice_bytes": MiB,
            "initializer_range": 0.02}
    ranks = launch_local(_model_rank, 2, (opts,), timeout_s=400)
    failures = []
    for r in ranks:
        if not r["layer0_experts_rel_err"] < 1e-2:
            failures.append(f"model rank {r['rank']}: first MoE layer's experts differ from transformers' by "
                            f"{r['layer0_experts_rel_err']:.3e} (relative)")
        bound = _logits_bound(r)
        for key in ("dwdp_max_abs_diff", "dwdp_second_forward_diff", "local_max_abs_diff"):
            if not r[key] <= bound:
                failures.append(f"model rank {r['rank']}: {key}={r[key]:.3e} > {bound:.3e}")
    return {"options": opts, "ranks": ranks, "failures": failures}


# -- e: the Triton kernel ------------------------------------------------------------------------
def _grouped_gemm_bench():
    path = Path(__file__).resolve().parent / "grouped_gemm.py"
    spec = importlib.util.spec_from_file_location("dwdp_bench_grouped_gemm", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def kernel_check(tokens: int = 4096) -> dict:
    from dwdp.kernels import grouped_gemm, grouped_gemm_reference, moe_experts, moe_experts_reference

    failures, accuracy = [], {}
    gen = torch.Generator(device="cuda").manual_seed(3)
    num_tokens, hidden, inter, experts, top_k = 777, 1024, 384, 12, 4
    x = torch.randn(num_tokens, hidden, device="cuda", generator=gen).bfloat16()
    gate_up = [(torch.randn(2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5).bfloat16()
               for _ in range(experts)]
    down = [(torch.randn(hidden, inter, device="cuda", generator=gen) / inter**0.5).bfloat16() for _ in range(experts)]
    index = torch.stack([torch.randperm(experts, device="cuda", generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.softmax(torch.randn(num_tokens, top_k, device="cuda", generator=gen), -1)
    want = moe_experts_reference(x, index, weights, gate_up, down).float()
    for name, kwargs in (("moe sum", {}), ("moe atomic", {"combine": "atomic"}),
                         ("moe local-first", {"split_at": 5, "on_local_done": lambda: None})):
        got = moe_experts(x, index, weights, gate_up, down, **kwargs).float()
        accuracy[name] = ((got - want).norm() / want.norm()).item()
    counts = torch.bincount(index.reshape(-1), minlength=experts)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    x_sorted = torch.randn(int(offsets[-1]), hidden, device="cuda", generator=gen).bfloat16()
    out = torch.full((x_sorted.shape[0], 2 * inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = grouped_gemm(x_sorted, offsets, gate_up, out=out).float()
    want_gemm = grouped_gemm_reference(x_sorted, offsets, gate_up).float()
    accuracy["grouped_gemm (poisoned out)"] = ((got - want_gemm).norm() / want_gemm.norm()).item()
    if torch.isnan(got).any():
        failures.append("grouped_gemm left rows of a NaN-poisoned output unwritten")
    for name, err in accuracy.items():
        if not err < 1e-2:
            failures.append(f"kernel {name}: relative error {err:.3e} >= 1e-2 against the reference")

    n = 8192
    pair = (torch.randn(n, n, device="cuda").bfloat16(), torch.randn(n, n, device="cuda").bfloat16())
    peak = 2 * n**3 / _time_on(torch.cuda.current_stream(), lambda: torch.mm(*pair), warmup=3, repeats=10) / 1e12
    pair = None  # frees the two matrices before the kernel benchmark
    bench = _grouped_gemm_bench()
    args = argparse.Namespace(buffers=4, warmup=5, repeats=20, tokens=tokens)
    has_grouped_mm = bench._grouped_mm_supported("cuda", torch.bfloat16)
    rows, notes = [], {}
    for shape in bench.SHAPES:
        if shape.name in ("qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b"):
            shape_rows, notes[shape.name] = bench.bench_model(shape, args, "cuda", torch.bfloat16, True, has_grouped_mm)
            rows += shape_rows
            torch.cuda.empty_cache()
    return {"accuracy": accuracy, "matmul_peak_tflops": peak, "tokens": tokens, "rows": rows, "notes": notes,
            "grouped_mm": has_grouped_mm, "failures": failures}


# -- g: fp8 experts ---------------------------------------------------------------------------------
def fp8_check(tokens: int = 4096) -> dict:
    """fp8 experts with 128 x 128 block scales (DeepSeek-V3's format, gate and up blocked apart) through
    the Triton kernel: bf16 dots (tiles dequantized in the K loop) and fp8 x fp8 dots (tokens quantized
    per row and 128 columns) against their references, and their speed next to bf16 weights."""
    from dwdp.kernels import BlockQuant, moe_experts, moe_experts_reference, quantize_fp8

    gen = torch.Generator(device="cuda").manual_seed(4)
    hidden, inter, experts, top_k = 2048, 768, 16, 8
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    first_quant, down_quant = BlockQuant("fp8", (128, 128), halves=2), BlockQuant("fp8", (128, 128))
    gate_up, gate_up_scales = quantize_fp8(torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen)
                                           / hidden**0.5, first_quant)
    down, down_scales = quantize_fp8(torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5,
                                     down_quant)
    index = torch.stack([torch.randperm(experts, device="cuda", generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, device="cuda", generator=gen), -1)
    fp8 = dict(first_scales=list(gate_up_scales), down_scales=list(down_scales), first_quant=first_quant,
               down_quant=down_quant)
    accuracy, timing, failures = {}, {}, []
    for name, extra in (("bf16 dots", {}), ("fp8 dots", {"fp8_activations": True})):
        want = moe_experts_reference(x[:512], index[:512], weights[:512], list(gate_up), list(down), **fp8,
                                     **extra).float()
        got = moe_experts(x[:512], index[:512], weights[:512], list(gate_up), list(down), **fp8, **extra).float()
        accuracy[name] = ((got - want).norm() / want.norm()).item()
        if not accuracy[name] < 1e-2:
            failures.append(f"fp8 kernel {name}: relative error {accuracy[name]:.3e} >= 1e-2 against the reference")
        timing[name] = _time_on(torch.cuda.current_stream(), lambda extra=extra: moe_experts(
            x, index, weights, list(gate_up), list(down), **fp8, **extra), warmup=3, repeats=10)
    dense_gate_up = [w.bfloat16() for w in gate_up.float()]
    dense_down = [w.bfloat16() for w in down.float()]
    timing["bf16 weights"] = _time_on(torch.cuda.current_stream(), lambda: moe_experts(
        x, index, weights, dense_gate_up, dense_down), warmup=3, repeats=10)
    flops = 2 * tokens * top_k * (2 * inter * hidden + hidden * inter)
    return {"accuracy": accuracy, "ms": {k: 1e3 * v for k, v in timing.items()},
            "tflops": {k: flops / v / 1e12 for k, v in timing.items()}, "tokens": tokens, "failures": failures}


# -- f: write-after-read stress -------------------------------------------------------------------
def _war_rank(rank: int, opts: dict) -> dict:
    from dwdp.plan import PlanCache, slot_layout
    from dwdp.prefetch import Prefetcher
    from dwdp.transport.reference import execute_plan_reference

    group, placement, layout, transport, _ = _rank_transport(rank, opts, 300)
    tensor_nbytes = layout.tensor_nbytes
    nbytes = slot_layout(placement, rank, tensor_nbytes).total_nbytes
    plans = PlanCache(placement, rank, layout, opts["slice_bytes"])
    peers = [_seeded_bytes(300 + r, layout.total_nbytes) for r in range(group.size)]
    zeros = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    expected = torch.stack([execute_plan_reference(plans.get(layer, 0), peers, zeros.clone()).view(torch.int32)
                            .sum(dtype=torch.int64) for layer in range(layout.num_layers)])
    buffers = [transport.alloc_slot(nbytes) for _ in range(2)]
    for buf in buffers:
        buf.copy_(_seeded_bytes(77, nbytes))
    prefetcher = Prefetcher(transport, plans, buffers, layout.num_layers, timeout_s=60.0)
    sums = torch.zeros(opts["visits"], dtype=torch.int64, device="cuda")
    want = torch.empty_like(sums)
    torch.cuda.synchronize()
    group.barrier()
    prefetcher.start_forward()
    for visit in range(opts["visits"]):
        layer = visit % layout.num_layers
        slot = prefetcher.begin(layer)
        prefetcher.wait(layer, slot)
        # A slow reader lets the next layers' copies race ahead unless they wait for this read; a
        # fast one (every third visit) reaches its slot before its copies unless it waits for them.
        torch.cuda._sleep(opts["sleep_cycles"] if visit % 3 else 1000)
        sums[visit] = buffers[slot].view(torch.int32).sum(dtype=torch.int64)
        want[visit] = expected[layer]
        prefetcher.release(slot)
    prefetcher.drain()
    bad = (sums != want).nonzero().flatten().tolist()
    transport.close()
    return {"rank": rank, "visits": opts["visits"], "bad_visits": bad[:20], "num_bad": len(bad)}


def war_check() -> dict:
    from dwdp.group import launch_local

    opts = {"experts": 16, "layers": 5, "tensor_nbytes": [MiB, MiB // 2], "slice_bytes": 256 << 10, "visits": 300,
            "sleep_cycles": 200_000, "copy_batches": 4}
    ranks = launch_local(_war_rank, 2, (opts,), timeout_s=240)
    failures = [f"WAR rank {r['rank']}: {r['num_bad']} of {r['visits']} reads saw the wrong bytes "
                f"(visits {r['bad_visits']})" for r in ranks if r["num_bad"]]
    return {"options": opts, "ranks": ranks, "failures": failures}


# -- report --------------------------------------------------------------------------------------
def _summary(sections: dict) -> list[tuple[str, str, str, str]]:
    """(check, measured, target, verdict) rows for the table."""
    rows = []
    a = sections.get("a_copy_bandwidth")
    if isinstance(a, dict) and "rows" in a:
        for r in a["rows"]:
            if r["slice_bytes"] in (MiB, 8 * MiB):
                rows.append((f"a copy {r['slice_bytes'] // 1024} KiB, {r['method']} [{r['engine']}]",
                             f"{r['GBps']:.0f} GB/s", "", "info"))
    b = sections.get("b_ipc")
    if isinstance(b, dict) and "ranks" in b:
        for r in b["ranks"]:
            rows.append((f"b IPC pull bit-exact, rank {r['rank']}", "yes" if not r["mismatched_layers"] else "NO",
                         "yes", "ok" if not r["mismatched_layers"] else "FAIL"))
            for bw in r["bandwidth"]:
                kib = bw["slice_bytes"] // 1024
                ratio = bw["prefetch_batch_GBps"] / bw["plain_batch_same_slices_GBps"]
                rows.append((f"b prefetch / bare batch of its slices, {kib} KiB, rank {r['rank']}",
                             f"{ratio:.2f} ({bw['prefetch_batch_GBps']:.0f} / "
                             f"{bw['plain_batch_same_slices_GBps']:.0f} GB/s)", ">= 0.90",
                             "ok" if ratio >= 0.9 else "miss"))
                rows.append((f"b prefetch / unsliced batch, {kib} KiB, rank {r['rank']}",
                             f"{bw['prefetch_batch_GBps'] / bw['plain_batch_unsliced_GBps']:.2f} "
                             f"(memcpy path {bw['prefetch_memcpy_GBps']:.0f} GB/s)", "", "info"))
    c = sections.get("c_overlap")
    if isinstance(c, dict) and "rows" in c:
        for r in c["rows"]:
            tag = r["copy"]
            contrast = "SM" in tag  # the SM copy is there for comparison, not a target
            rows.append((f"c GEMM slowdown with prefetch ({tag})", f"{r['gemm_slowdown'] * 100:.1f}%",
                         "" if contrast else "<= 10%",
                         "info" if contrast else "ok" if r["gemm_slowdown"] <= 0.10 else "miss"))
            rows.append((f"c prefetch hidden ({tag})", f"{r['hidden_fraction'] * 100:.1f}%",
                         "" if contrast else ">= 90%",
                         "info" if contrast else "ok" if r["hidden_fraction"] >= 0.9 else "miss"))
            rows.append((f"c prefetch slowdown with GEMM ({tag})", f"{r['copy_slowdown'] * 100:.1f}%", "", "info"))
    d = sections.get("d_model")
    if isinstance(d, dict) and "ranks" in d:
        for r in d["ranks"]:
            bound = _logits_bound(r)
            ok = r["dwdp_max_abs_diff"] <= bound
            rows.append((f"d first MoE layer vs transformers, rank {r['rank']}",
                         f"{r['layer0_experts_rel_err']:.2e} rel", "< 1e-2",
                         "ok" if r["layer0_experts_rel_err"] < 1e-2 else "FAIL"))
            rows.append((f"d DWDPModel logits vs unwrapped, rank {r['rank']}",
                         f"{r['dwdp_max_abs_diff']:.2e} (transformers' own spread {r['transformers_spread']:.2e})",
                         f"<= {bound:.2e}", "ok" if ok else "FAIL"))
            rows.append((f"d DWDP / all-local tokens/s, rank {r['rank']}",
                         f"{r['dwdp_tokens_per_s'] / r['local_tokens_per_s']:.3f}", "", "info"))
            rows.append((f"d compute stall in waits, rank {r['rank']}",
                         f"{r['stall_ms_per_forward']:.3f} of {r['dwdp_ms_per_forward']:.2f} ms/fwd", "", "info"))
    e = sections.get("e_kernel")
    if isinstance(e, dict) and "rows" in e:
        worst = max(e["accuracy"].values())
        rows.append(("e kernel vs reference (worst rel err)", f"{worst:.2e}", "< 1e-2", "ok" if worst < 1e-2 else "FAIL"))
        rows.append(("e measured bf16 matmul peak", f"{e['matmul_peak_tflops']:.0f} TFLOP/s", "", "info"))
        by = {(r["section"], r["model"], r["variant"]): r for r in e["rows"]}
        for (section, model, variant), r in by.items():
            if section == "moe" and variant == "fused (sum)":
                share = r["tflops"] / e["matmul_peak_tflops"]
                rows.append((f"e moe {model} T={e['tokens']}", f"{r['tflops']:.0f} TFLOP/s ({share * 100:.0f}% peak)",
                             ">= 60% peak", "ok" if share >= 0.6 else "miss"))
            if section == "gemm" and variant == "multi-buffer":
                contiguous = by[(section, model, "contiguous")]
                ratio = contiguous["median_ms"] / r["median_ms"]
                rows.append((f"e multi/single-buffer speed {model}", f"{ratio:.3f}", ">= 0.98",
                             "ok" if ratio >= 0.98 else "miss"))
    g = sections.get("g_fp8")
    if isinstance(g, dict) and "accuracy" in g:
        for name, err in g["accuracy"].items():
            rows.append((f"g fp8 experts, {name} vs reference", f"{err:.2e} rel", "< 1e-2",
                         "ok" if err < 1e-2 else "FAIL"))
        for name, tf in g["tflops"].items():
            rows.append((f"g moe T={g['tokens']}, {name}", f"{tf:.0f} TFLOP/s ({g['ms'][name]:.2f} ms)", "", "info"))
    f = sections.get("f_war_stress")
    if isinstance(f, dict) and "ranks" in f:
        for r in f["ranks"]:
            rows.append((f"f WAR stress, rank {r['rank']}", f"{r['num_bad']} bad of {r['visits']}", "0",
                         "ok" if not r["num_bad"] else "FAIL"))
    for key, value in sections.items():
        if isinstance(value, dict) and "error" in value:
            rows.append((f"{key} raised", value["error"].splitlines()[-1][:60], "", "FAIL"))
    return rows


def _table(rows) -> str:
    widths = [max(len(r[i]) for r in rows + [("check", "measured", "target", "verdict")]) for i in range(4)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(("check", "measured", "target", "verdict"), widths))]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default="abcdefg", help="which sections to run, e.g. 'ab' (default all)")
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/gpu_check_<gpu>.json)")
    args = parser.parse_args()
    from dwdp.transport import cuda_api

    info = cuda_api.probe()
    if not info.usable or not torch.cuda.is_available():
        print(f"gpu_check: no CUDA GPU on this machine ({info.error or 'torch has no CUDA'}); nothing was checked")
        return 2
    from dwdp.timing import device_tag

    versions = _versions()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), flush=True)
    started = time.perf_counter()
    sections: dict = {}
    steps = [("a", "a_copy_bandwidth", copy_bandwidth), ("b", "b_ipc", ipc_check),
             ("c", "c_overlap", None), ("d", "d_model", model_check), ("e", "e_kernel", kernel_check),
             ("f", "f_war_stress", war_check), ("g", "g_fp8", fp8_check)]
    for letter, key, fn in steps:
        if letter not in args.sections:
            continue
        t0 = time.perf_counter()
        try:
            if letter == "c":
                batch_rows = [r for r in sections.get("a_copy_bandwidth", {}).get("rows", [])
                              if r["slice_bytes"] == MiB and r["method"] == "cudaMemcpyBatchAsync"]
                sections[key] = overlap_check(batch_rows[0]["GBps"] if batch_rows else 200.0)
            else:
                sections[key] = fn()
        except Exception:
            sections[key] = {"error": traceback.format_exc()}
            print(sections[key]["error"], file=sys.stderr, flush=True)
        sections.setdefault(key, {})["seconds"] = time.perf_counter() - t0
        print(f"section {letter} done in {sections[key]['seconds']:.1f} s", flush=True)
        torch.cuda.empty_cache()
    failures = [f for s in sections.values() for f in s.get("failures", [])]
    failures += [f"{k}: raised {v['error'].splitlines()[-1]}" for k, v in sections.items() if "error" in v]
    result = {"bench": "gpu_check", "date": time.strftime("%Y-%m-%d"), "code": _code_version(), "versions": versions,
              "seconds": time.perf_counter() - started, "sections": sections, "failures": failures}
    path = args.out or RESULTS / f"gpu_check_{device_tag('cuda')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(f"wrote {path} ({result['seconds']:.0f} s)")
    for f in failures:
        print(f"FAILED: {f}")
    print(_table(_summary(sections)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
