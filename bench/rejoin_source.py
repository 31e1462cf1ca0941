"""Where a rejoining rank should get its local experts: from a live peer's segment, or from the
checkpoint on disk (page cache warm, the usual case for a restart on the same host).

Builds a random-weight Mixtral-style model of the given size, saves it as a safetensors checkpoint,
fills the segments of ranks 0 and 2 of a 3-rank group (every expert on 2 ranks) in this process, and
times filling rank 1's segment (every layer, every moving tensor of its local experts) both ways:
`CheckpointLoad.expert_source` and `dwdp.runtime.rejoin.peer_source`. The dense weights are read from
the checkpoint either way and are not timed. Both fills are compared byte for byte.
Prints the table last; writes bench/results/rejoin_source_cpu.json.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from dwdp.models.adapters import find_experts
from dwdp.models.loading import CheckpointLoad
from dwdp.models.tiny import build_tiny_model
from dwdp.observe.timing import load_average_1min, machine, time_fn
from dwdp.runtime.placement import build_placement
from dwdp.runtime.plan import SegmentLayout
from dwdp.runtime.rejoin import live_owner_of_each, peer_source

RESULTS = Path(__file__).resolve().parent / "results"
RANK, LIVE = 1, (0, 2)


def fill(segment: torch.Tensor, layers, layout: SegmentLayout, ids: torch.Tensor, source) -> None:
    """What DWDPModel._fill_local does for the moving tensors, without touching the modules."""
    for index, layer in enumerate(layers):
        for t_index, tensor in enumerate(layer.spec.moving):
            view = tensor.views_in(segment, layout.tensor_offset(index, t_index), len(ids))  # [L, *shape]
            view.copy_(source(layer.name, tensor.name, ids))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", help="JSON path (default bench/results/rejoin_source_cpu.json)")
    args = p.parse_args()
    model = build_tiny_model("mixtral", seed=0, num_experts=args.experts, top_k=2, num_layers=args.layers,
                             hidden=args.hidden, intermediate=args.intermediate)
    layers = find_experts(model)
    placement = build_placement(args.experts, 3, replicas=2)
    layout = SegmentLayout(len(layers), placement.num_local_experts, tuple(t.stride_bytes for t in layers[0].spec.moving))
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        load = CheckpointLoad(tmp)
        segments = {}
        for r in LIVE:
            segments[r] = torch.empty(layout.total_nbytes, dtype=torch.uint8)
            fill(segments[r], layers, layout, torch.tensor(placement.local_experts(r)), load.expert_source)
        owner_of = live_owner_of_each(placement, RANK, LIVE)
        def offset_in_peer(peer, layer, expert, tensor):
            return layout.offset(layer, placement.local_experts(peer).index(expert), tensor)

        from_peers = peer_source(layers, offset_in_peer, owner_of, segments.__getitem__, load.expert_source)
        ids = torch.tensor(placement.local_experts(RANK))
        out = {name: torch.empty(layout.total_nbytes, dtype=torch.uint8) for name in ("checkpoint", "peers")}
        load_before = load_average_1min()
        timings = {
            "checkpoint": time_fn(lambda: fill(out["checkpoint"], layers, layout, ids, load.expert_source),
                                  repeats=args.repeats),
            "peers": time_fn(lambda: fill(out["peers"], layers, layout, ids, from_peers), repeats=args.repeats),
        }
        load.close()
    if not torch.equal(out["checkpoint"], out["peers"]):
        raise SystemExit("the two fills differ: peer_source reads the wrong bytes")
    mib = layout.total_nbytes / 2**20
    rows = [{"source": name, "local_expert_mib": mib, **t.as_dict()} for name, t in timings.items()]
    result = {"meta": {"machine": machine(), "device": "cpu", "load_average_1min": {"before": load_before,
                       "after": load_average_1min()}, "args": vars(args)}, "rows": rows}
    path = Path(args.out) if args.out else RESULTS / "rejoin_source_cpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"rank {RANK}'s local experts, {mib:.1f} MiB over {len(layers)} layers; 1-min load average "
          f"{load_before:.2f}; results in {path}")
    print(f"{'source':>10}  {'median ms':>9}  {'p10 ms':>7}  {'p90 ms':>7}  {'MiB/s':>7}")
    for r in rows:
        print(f"{r['source']:>10}  {1e3 * r['median_s']:9.1f}  {1e3 * r['p10_s']:7.1f}  {1e3 * r['p90_s']:7.1f}  "
              f"{mib / r['median_s']:7.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
