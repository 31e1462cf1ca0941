"""gpu_check section f  write-after-read stress: many layers through two slots while compute is slowed, each 'kernel'
   checksumming its slot on the device."""
from __future__ import annotations

import torch

from .common import MiB, rank_transport, seeded_bytes

KEY = "f_war_stress"


def _war_rank(rank: int, opts: dict) -> dict:
    from dwdp.runtime.plan import PlanCache, slot_layout
    from dwdp.runtime.prefetch import Prefetcher
    from dwdp.runtime.transport.reference import execute_plan_reference

    group, placement, layout, transport, _ = rank_transport(rank, opts, 300)
    tensor_nbytes = layout.tensor_nbytes
    nbytes = slot_layout(placement, rank, tensor_nbytes).total_nbytes
    plans = PlanCache(placement, rank, layout, opts["slice_bytes"])
    peers = [seeded_bytes(300 + r, layout.total_nbytes) for r in range(group.size)]
    zeros = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    expected = torch.stack([execute_plan_reference(plans.get(layer, 0), peers, zeros.clone()).view(torch.int32)
                            .sum(dtype=torch.int64) for layer in range(layout.num_layers)])
    buffers = [transport.alloc_slot(nbytes) for _ in range(2)]
    for buf in buffers:
        buf.copy_(seeded_bytes(77, nbytes))
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


def run(sections: dict) -> dict:
    from dwdp.runtime.group import launch_local

    opts = {"experts": 16, "layers": 5, "tensor_nbytes": [MiB, MiB // 2], "slice_bytes": 256 << 10, "visits": 300,
            "sleep_cycles": 200_000, "copy_batches": 4}
    ranks = launch_local(_war_rank, 2, (opts,), timeout_s=240)
    failures = [f"WAR rank {r['rank']}: {r['num_bad']} of {r['visits']} reads saw the wrong bytes "
                f"(visits {r['bad_visits']})" for r in ranks if r["num_bad"]]
    return {"options": opts, "ranks": ranks, "failures": failures}


def summary(section: dict) -> list[tuple[str, str, str, str]]:
    """(check, measured, target, verdict) rows of this section for the table."""
    rows = []
    if "ranks" in section:
        for r in section["ranks"]:
            rows.append((f"f WAR stress, rank {r['rank']}", f"{r['num_bad']} bad of {r['visits']}", "0",
                         "ok" if not r["num_bad"] else "FAIL"))
    return rows
