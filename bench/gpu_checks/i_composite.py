"""gpu_check section i  composite views on CUDA through dwdp's own code: two ranks on one GPU (a gloo group).

Per rank:
  1. the mapping choice (cuda_vmm.choose_mapping: fabric, POSIX fd or IPC) and its one log line;
  2. transport level, twice (fds taken with pidfd_getfd, then with pidfd_getfd refused so they come over the
     exporter's SCM_RIGHTS socket): a CudaTransport with mapping 'vmm-posix-fd', its segment one cuMem
     allocation per local extent (experts of 2 MiB + 16 KiB: boundary pages shared with remote experts), its
     composite views (every allocation mapped whole at offset 0), handles exchanged, the composite copy plans
     submitted and waited on, and every layer's view compared bit-exactly with the seeded experts;
  3. torch._grouped_mm(x, view.transpose(1, 2), offs) against the same call on one contiguous clone (same
     result; speed target >= 0.98: the same kernel on the same bytes) and against dwdp's multi-buffer kernel;
  4. model level: a 2-rank DWDPModel (backend cuda, experts_kernel 'auto': composite over POSIX fds) on a bf16
     model whose experts are not multiples of 2 MiB, logits against the unwrapped model.
"""
from __future__ import annotations

import errno
import statistics

import torch

from .common import time_on

KEY = "i_composite"


def _refuse_pidfd_getfd(pid, fds):
    raise OSError(errno.EPERM, "pidfd_getfd refused (gpu_check: the socket path)")


def _transport_views(rank: int, group, opts: dict, stacked, refuse_pidfd: bool) -> dict:
    """One CudaTransport with composite views, filled and prefetched; returns what it saw (and keeps
    nothing: the transport is closed before returning unless `keep`)."""
    from dwdp.runtime.composite import build_composite_plan, composite_layouts
    from dwdp.runtime.placement import build_placement
    from dwdp.runtime.transport import cuda_vmm
    from dwdp.runtime.transport.cuda import CudaTransport

    E, N, K, layers = opts["experts"], opts["n"], opts["k"], opts["layers"]
    nb = N * K * 2  # bf16
    placement = build_placement(E, group.size)
    getfds = cuda_vmm.pidfd_getfds
    if refuse_pidfd:
        cuda_vmm.pidfd_getfds = _refuse_pidfd_getfd
    transport = CudaTransport(rank, torch.device("cuda", 0), mapping="vmm-posix-fd")
    try:
        layouts = composite_layouts(placement, layers, (nb,), transport.granularity(), num_slots=2)
        layout = layouts[rank]
        segment = transport.alloc_segment(layout.segment_nbytes, tuple(a.nbytes for a in layout.segment_allocations))
        views = transport.composite_views(layout)
        for layer in range(layers):
            for e in placement.owned[rank]:
                at = layout.segment_offset(layer, e, 0)
                segment[at:at + nb].copy_(stacked[layer][e].reshape(-1).view(torch.uint8))
        handles = group.all_gather_object(transport.register())
        transport.open(handles)
        group.barrier()
        transport.seal()
        mismatched = []
        for layer in range(layers):
            plan = build_composite_plan(layouts, rank, layer, opts["slice_bytes"])
            transport.submit(plan, views.layer_range(layer)).wait(60.0)
            transport.release_slot(plan.slot)
            torch.cuda.synchronize()
            view = views.view(layer, 0, torch.bfloat16, (E, N, K))
            if not torch.equal(view.view(torch.uint8), stacked[layer].view(torch.uint8)):
                mismatched.append(layer)
        result = {"fd_path": transport.fd_paths.get(1 - rank), "mismatched_layers": mismatched,
                  "allocations": len(layout.segment_allocations), "pool_gaps": len(layout.pool_allocations),
                  "peer_segment_zero_copy": transport.peer_segment(1 - rank).data_ptr() == transport._peer_ptrs[1 - rank]}
        if not refuse_pidfd:
            result.update(_grouped_mm_timing(views.view(0, 0, torch.bfloat16, (E, N, K)), opts))
        group.barrier()  # the peer is done reading our segment before we close it
        return result
    finally:
        cuda_vmm.pidfd_getfds = getfds
        transport.close()


def _grouped_mm_timing(view, opts: dict) -> dict:
    from dwdp.kernels import grouped_gemm

    E, N, K, T = opts["experts"], opts["n"], opts["k"], opts["tokens"]
    gen = torch.Generator().manual_seed(opts["seed"] + 1)
    contiguous = view.clone()
    counts = torch.full((E,), T // E, dtype=torch.int32)
    counts[: T % E] += 1
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(counts, 0)]).to(torch.int32).cuda()
    x = torch.randn(T, K, generator=gen).to(torch.bfloat16).cuda()
    cur = torch.cuda.current_stream()
    same = torch.equal(torch._grouped_mm(x, view.transpose(1, 2), offs=offs),
                       torch._grouped_mm(x, contiguous.transpose(1, 2), offs=offs))
    composite_s = time_on(cur, lambda: torch._grouped_mm(x, view.transpose(1, 2), offs=offs), repeats=20)
    contiguous_s = time_on(cur, lambda: torch._grouped_mm(x, contiguous.transpose(1, 2), offs=offs), repeats=20)
    experts = list(view.unbind(0))
    ours_s = time_on(cur, lambda: grouped_gemm(x, offsets, experts), repeats=20)
    return {"composite_s": composite_s, "contiguous_s": contiguous_s, "multi_buffer_s": ours_s, "same_result": same,
            "flops": 2 * T * N * K}


def _model(rank: int, group, opts: dict) -> dict:
    """A 2-rank DWDPModel on the cuda backend in composite mode against the unwrapped model."""
    from dwdp import DWDPConfig, DWDPModel
    from dwdp.models.tiny import build_tiny_model

    m = opts["model"]
    build = dict(hidden=m["hidden"], intermediate=m["intermediate"], num_experts=m["experts"], top_k=m["top_k"],
                 num_layers=m["layers"], vocab=m["vocab"], dtype=torch.bfloat16, seed=0, initializer_range=0.02)
    gen = torch.Generator().manual_seed(17 + rank)
    ids = torch.randint(3, m["vocab"], (2, m["seq"]), generator=gen).cuda()
    model = build_tiny_model(m["family"], **build).cuda()
    with torch.no_grad():
        want = model(input_ids=ids).logits.float()
    wrapped = DWDPModel(model, DWDPConfig(backend="cuda", slice_bytes=opts["slice_bytes"]), group)
    try:
        with torch.no_grad():
            got = [wrapped(input_ids=ids).logits.float() for _ in range(2)]
        return {"experts_kernel": wrapped.experts_kernel, "mapping": wrapped.transport.mapping,
                "fd_path": wrapped.transport.fd_paths.get(1 - rank),
                "max_abs_diff": max((g - want).abs().max().item() for g in got), "scale": want.abs().max().item()}
    finally:
        group.barrier()
        wrapped.close()


def _composite_rank(rank: int, opts: dict) -> dict:
    from dwdp.runtime.group import init_group
    from dwdp.runtime.transport.cuda_vmm import Vmm, choose_mapping

    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")
    group = init_group()
    vmm = Vmm(0)
    mapping = choose_mapping(vmm, rank)
    vmm.close()
    E, N, K, layers = opts["experts"], opts["n"], opts["k"], opts["layers"]
    gen = torch.Generator().manual_seed(opts["seed"])
    stacked = [torch.randn(E, N, K, generator=gen).to(torch.bfloat16).cuda() for _ in range(layers)]  # [E, N, K]
    out = {"rank": rank, "mapping": mapping, "transport": {}, "errors": {}}
    for label, refuse in (("pidfd_getfd", False), ("socket", True)):
        try:
            out["transport"][label] = _transport_views(rank, group, opts, stacked, refuse)
        except Exception as exc:  # noqa: BLE001 - the other path and the model still run
            out["errors"][f"transport {label}"] = f"{type(exc).__name__}: {exc}"
    try:
        out["model"] = _model(rank, group, opts)
    except Exception as exc:  # noqa: BLE001
        out["errors"]["model"] = f"{type(exc).__name__}: {exc}"
    return out


def run(sections: dict) -> dict:
    from dwdp.runtime.group import launch_local

    # 2048 x 1032 bf16 = 2 MiB + 16 KiB per expert: neighbouring experts share boundary pages.
    opts = {"experts": 16, "n": 2048, "k": 1032, "layers": 3, "tokens": 8192, "seed": 0, "slice_bytes": 1 << 20,
            # Experts of 2,939,136 and 1,469,568 bytes (not multiples of 2 MiB); rows of 2064 and 1424 bytes,
            # multiples of 16 as torch._grouped_mm (transformers' default experts path) requires.
            "model": {"family": "qwen3_moe", "hidden": 1032, "intermediate": 712, "experts": 8, "top_k": 2,
                      "layers": 3, "vocab": 2048, "seq": 64}}
    ranks = launch_local(_composite_rank, 2, (opts,), timeout_s=400)
    failures = []
    for r in ranks:
        for what, error in r["errors"].items():
            failures.append(f"composite rank {r['rank']}: {what} raised {error}")
        for label, t in r["transport"].items():
            if t["mismatched_layers"]:
                failures.append(f"composite rank {r['rank']} ({label}): views differ from the seeded experts in layers "
                                f"{t['mismatched_layers']}")
            if not t["peer_segment_zero_copy"]:
                failures.append(f"composite rank {r['rank']} ({label}): peer_segment is a copy, not the mapping")
            if "same_result" in t and not t["same_result"]:
                failures.append(f"composite rank {r['rank']}: grouped_mm on the view differs from the contiguous clone")
        if r["transport"].get("socket") and not str(r["transport"]["socket"]["fd_path"]).startswith("socket"):
            failures.append(f"composite rank {r['rank']}: fds did not come over the socket when pidfd_getfd was refused")
        model = r.get("model")
        if model is not None:
            bound = 2e-2 + 2e-2 * model["scale"]
            if model["experts_kernel"] != "composite" or not model["max_abs_diff"] <= bound:
                failures.append(f"composite rank {r['rank']}: DWDPModel {model['experts_kernel']} over "
                                f"{model['mapping']}: max |dlogits| {model['max_abs_diff']:.3e} (bound {bound:.3e})")
    ratios = [r["transport"]["pidfd_getfd"]["contiguous_s"] / r["transport"]["pidfd_getfd"]["composite_s"]
              for r in ranks if "composite_s" in r["transport"].get("pidfd_getfd", {})]
    return {"options": opts, "ranks": ranks, "failures": failures,
            "ratio_composite_over_contiguous": statistics.median(ratios) if ratios else None}


def summary(section: dict) -> list[tuple[str, str, str, str]]:
    rows = []
    for r in section.get("ranks", []):
        for label, t in r["transport"].items():
            ok = not t["mismatched_layers"] and t["peer_segment_zero_copy"]
            rows.append((f"i composite views ({r['mapping']}, fds {t['fd_path']}), rank {r['rank']}",
                         f"{'bit-exact' if not t['mismatched_layers'] else 'MISMATCH'}, {t['allocations']} allocations",
                         "bit-exact", "ok" if ok else "FAIL"))
            if "composite_s" in t:
                ratio = t["contiguous_s"] / t["composite_s"]
                rows.append((f"i grouped_mm composite / contiguous, rank {r['rank']}", f"{ratio:.3f}", ">= 0.98",
                             "ok" if ratio >= 0.98 else "below"))
                rows.append((f"i grouped_mm composite / multi-buffer kernel, rank {r['rank']}",
                             f"{t['multi_buffer_s'] / t['composite_s']:.2f}x", "report", "info"))
        for what, error in r["errors"].items():
            rows.append((f"i {what}, rank {r['rank']}", error[:60], "", "FAIL"))
        model = r.get("model")
        if model is not None:
            bound = 2e-2 + 2e-2 * model["scale"]
            rows.append((f"i DWDPModel {model['experts_kernel']} over {model['mapping']}, rank {r['rank']}",
                         f"{model['max_abs_diff']:.2e}", f"<= {bound:.2e}",
                         "ok" if model["max_abs_diff"] <= bound and model["experts_kernel"] == "composite" else "FAIL"))
    return rows
