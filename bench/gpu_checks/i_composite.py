"""gpu_check section i  composite views on CUDA (written; not yet run on a GPU): two ranks on one GPU map each
   other's experts with VMM and POSIX fds, and torch._grouped_mm runs on the composite [E, N, K] view.

Per rank (a gloo group, GPU 0):
  1. the mapping choice (dwdp.runtime.transport.cuda_vmm.choose_mapping: fabric, POSIX fd or IPC) and its line;
  2. its segment: cuMemCreate with POSIX-fd handles, exported, the fd sent to the peer over a Unix socket
     (SCM_RIGHTS) and the peer's imported and mapped into a reserved range to copy from;
  3. its CudaCompositeViews (local extents in place, the rest on pool pages, one set-access per layer),
     the local experts written through the segment, the remote ones copied from the peer's mapping
     (cudaMemcpyAsync per plan slice), then the view compared bit-exactly with the seeded experts;
  4. torch._grouped_mm(x, view.transpose(1, 2), offs) against the same call on one contiguous clone
     (target >= 0.98: the same kernel on the same bytes) and against dwdp's multi-buffer kernel
     (kernels.grouped_gemm over per-expert views), bf16, shapes of section e's first model.
"""
from __future__ import annotations

import os
import socket
import statistics

import torch

from .common import time_on

KEY = "i_composite"


def _exchange_fds(rank: int, group, fd: int) -> int:
    """Send our segment fd to the other rank and receive theirs, over abstract Unix sockets."""
    from dwdp.runtime.transport.cuda_vmm import recv_fds, send_fds

    name = f"\0dwdp-gpu-check-{os.getpid()}"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(name)
    server.listen(1)
    names = group.all_gather_object(name)
    peer_name = names[1 - rank]
    if rank == 0:
        conn, _ = server.accept()
        send_fds(conn, [fd])
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(peer_name)
        (got,) = recv_fds(client, 1)
    else:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(peer_name)
        (got,) = recv_fds(client, 1)
        conn, _ = server.accept()
        send_fds(conn, [fd])
    for s in (conn, client, server):
        s.close()
    return got


def _composite_rank(rank: int, opts: dict) -> dict:
    from dwdp.kernels import grouped_gemm
    from dwdp.runtime.composite import build_composite_plan, composite_layouts
    from dwdp.runtime.group import init_group
    from dwdp.runtime.placement import build_placement
    from dwdp.runtime.transport import cuda_api
    from dwdp.runtime.transport.cuda_vmm import CudaCompositeViews, Vmm, choose_mapping

    torch.cuda.set_device(0)
    group = init_group()
    vmm = Vmm(0)
    mapping = choose_mapping(vmm, rank)
    E, N, K, layers = opts["experts"], opts["n"], opts["k"], opts["layers"]
    nb = N * K * 2  # bf16
    placement = build_placement(E, group.size)
    g = vmm.granularity("posix_fd")
    layouts = composite_layouts(placement, layers, (nb,), g, num_slots=2)
    layout = layouts[rank]
    seg_bytes = max(layout.segment_nbytes, g)
    segment = vmm.create(seg_bytes, "posix_fd")
    fd = vmm.export(segment, "posix_fd")
    peer_fd = _exchange_fds(rank, group, fd)
    os.close(fd)
    peer_handle = vmm.import_(peer_fd, "posix_fd")
    os.close(peer_fd)
    peer_bytes = max(layouts[1 - rank].segment_nbytes, g)
    # Our own segment and the peer's, each mapped whole into a range of their own (copy source / loading).
    own_ptr, peer_ptr = vmm.reserve(seg_bytes, g), vmm.reserve(peer_bytes, g)
    vmm.map(own_ptr, seg_bytes, 0, segment)
    vmm.set_access(own_ptr, seg_bytes)
    vmm.map(peer_ptr, peer_bytes, 0, peer_handle)
    vmm.set_access(peer_ptr, peer_bytes)
    views = CudaCompositeViews(layout, segment, vmm)

    gen = torch.Generator().manual_seed(opts["seed"])
    stacked = [torch.randn(E, N, K, generator=gen).to(torch.bfloat16).cuda() for _ in range(layers)]  # [E, N, K]
    seg = torch.as_tensor(_Array(own_ptr, seg_bytes), device="cuda")
    for layer in range(layers):
        for e in placement.owned[rank]:
            at = layout.segment_offset(layer, e, 0)
            seg[at:at + nb].copy_(stacked[layer][e].reshape(-1).view(torch.uint8))
    torch.cuda.synchronize()
    group.barrier()  # both segments loaded before anyone copies
    stream = torch.cuda.current_stream().cuda_stream
    mismatched = []
    for layer in range(layers):
        for s in build_composite_plan(layouts, rank, layer, 1 << 20).slices:
            cuda_api.memcpy_async(views.layer_pointer(layer) + s.dst_offset, peer_ptr + s.src_offset, s.nbytes, stream)
        torch.cuda.synchronize()
        view = torch.as_tensor(views.array(layer), device="cuda")[:E * nb].view(torch.bfloat16).view(E, N, K)
        if not torch.equal(view.view(torch.uint8), stacked[layer].view(torch.uint8)):
            mismatched.append(layer)

    view = torch.as_tensor(views.array(0), device="cuda")[:E * nb].view(torch.bfloat16).view(E, N, K)
    contiguous = view.clone()
    T = opts["tokens"]
    counts = torch.full((E,), T // E, dtype=torch.int32)
    counts[: T % E] += 1
    offs = torch.cumsum(counts, 0).to(torch.int32).cuda()
    offsets = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(counts, 0)]).to(torch.int32).cuda()
    x = torch.randn(T, K, generator=gen).to(torch.bfloat16).cuda()
    cur = torch.cuda.current_stream()
    composite_s = time_on(cur, lambda: torch._grouped_mm(x, view.transpose(1, 2), offs=offs), repeats=20)
    contiguous_s = time_on(cur, lambda: torch._grouped_mm(x, contiguous.transpose(1, 2), offs=offs), repeats=20)
    experts = list(view.unbind(0))
    ours_s = time_on(cur, lambda: grouped_gemm(x, offsets, experts), repeats=20)
    same = torch.equal(torch._grouped_mm(x, view.transpose(1, 2), offs=offs),
                       torch._grouped_mm(x, contiguous.transpose(1, 2), offs=offs))
    group.barrier()
    views.close()
    for ptr, n in ((own_ptr, seg_bytes), (peer_ptr, peer_bytes)):
        vmm.unmap(ptr, n)
        vmm.address_free(ptr, n)
    vmm.release(peer_handle)
    vmm.release(segment)
    return {"rank": rank, "mapping": mapping, "granularity": g, "mismatched_layers": mismatched,
            "composite_s": composite_s, "contiguous_s": contiguous_s, "multi_buffer_s": ours_s,
            "same_result": same, "flops": 2 * T * N * K}


class _Array:
    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = dict(shape=(nbytes,), typestr="|u1", data=(ptr, False), version=3,
                                             strides=None)


def run(sections: dict) -> dict:
    from dwdp.runtime.group import launch_local

    opts = {"experts": 16, "n": 4096, "k": 7168, "layers": 3, "tokens": 8192, "seed": 0}
    ranks = launch_local(_composite_rank, 2, (opts,), timeout_s=400)
    failures = []
    for r in ranks:
        if r["mismatched_layers"]:
            failures.append(f"composite rank {r['rank']}: views differ from the seeded experts in layers "
                            f"{r['mismatched_layers']}")
        if not r["same_result"]:
            failures.append(f"composite rank {r['rank']}: grouped_mm on the view differs from the contiguous clone")
    return {"options": opts, "ranks": ranks, "failures": failures,
            "ratio_composite_over_contiguous": statistics.median(r["contiguous_s"] / r["composite_s"] for r in ranks)}


def summary(section: dict) -> list[tuple[str, str, str, str]]:
    rows = []
    for r in section.get("ranks", []):
        ratio = r["contiguous_s"] / r["composite_s"]
        rows.append((f"i composite views ({r['mapping']}), rank {r['rank']}",
                     "bit-exact" if not r["mismatched_layers"] else "MISMATCH", "bit-exact",
                     "ok" if not r["mismatched_layers"] else "FAIL"))
        rows.append((f"i grouped_mm composite / contiguous, rank {r['rank']}", f"{ratio:.3f}", ">= 0.98",
                     "ok" if ratio >= 0.98 else "below"))
        rows.append((f"i grouped_mm composite / multi-buffer kernel, rank {r['rank']}",
                     f"{r['multi_buffer_s'] / r['composite_s']:.2f}x", "report", "-"))
    return rows
