"""gpu_check section a  copy bandwidth per slice size (256 KiB .. 8 MiB): one cudaMemcpyAsync per slice and one
   cudaMemcpyBatchAsync (the copy-engine API), and tensor.copy_ per slice (an SM kernel)."""
from __future__ import annotations

import torch

from .common import MiB, SLICE_SIZES, seeded_bytes, time_on

KEY = "a_copy_bandwidth"


def run(sections: dict, total: int = 512 * MiB) -> dict:
    from dwdp.runtime.transport import cuda_api as api

    src = seeded_bytes(1, total)
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
            seconds = time_on(stream, fn)
            if not torch.equal(dst, src):
                failures.append(f"copy {method} at {slice_bytes} B slices: bytes differ")
            rows.append({"slice_bytes": slice_bytes, "method": method, "engine": engine,
                         "GBps": total / seconds / 1e9, "ms": seconds * 1e3})
    api.stream_destroy(raw)
    return {"total_bytes": total, "rows": rows, "failures": failures,
            "note": "one GPU: device-memory copies (read + write on the same HBM), not NVLink"}


def summary(section: dict) -> list[tuple[str, str, str, str]]:
    """(check, measured, target, verdict) rows of this section for the table."""
    rows = []
    if "rows" in section:
        for r in section["rows"]:
            if r["slice_bytes"] in (MiB, 8 * MiB):
                rows.append((f"a copy {r['slice_bytes'] // 1024} KiB, {r['method']} [{r['engine']}]",
                             f"{r['GBps']:.0f} GB/s", "", "info"))
    return rows
