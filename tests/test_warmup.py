"""No kernel compiles after a model is ready: every experts-kernel launch a forward makes, over random
routings, batch shapes (so tile choices) and arrival orders of the copies, has a specialisation
`DWDPModel.warmup()` met. Launches are recorded as a GPU would see them (a pretend Hopper whose tuned
configuration file picks other tiles for other numbers of rows per expert), not run."""
import json
import os
import random
import tempfile

import pytest
import torch

pytest.importorskip("triton.backends.nvidia")

from dwdp.runtime.config import DWDPConfig  # noqa: E402
from dwdp.runtime.experts import _kernel_call  # noqa: E402
from dwdp.runtime.group import DWDPGroup, init_group, launch_local  # noqa: E402
from dwdp.kernels.tuned_configs import FORMAT, file_name  # noqa: E402
from dwdp.runtime.model import DWDPModel  # noqa: E402
from dwdp.models.tiny import build_tiny_model  # noqa: E402
from kernel_launches import LaunchRecorder, differing, launch_mod  # noqa: E402

BATCHES = [(1, 1), (1, 2), (1, 7), (2, 5), (3, 16), (1, 33), (4, 8), (2, 1), (4, 130)]  # (prompts, tokens)
DEVICE = launch_mod.DeviceInfo("Test Hopper", (9, 0), 232448, 132)
# Rows per expert -> tiles: three buckets, so the number of tokens of a forward selects among them.
BUCKETS = {2: (16, 32, 32), 16: (32, 32, 32), 128: (64, 64, 32)}


def _write_tuned_file(directory: str, wrapped: DWDPModel) -> None:
    """A configuration file for DEVICE with one entry per bucket for each GEMM of this model's experts."""
    tables = wrapped.experts_layers[0].module._dwdp_runtime.kernel_tables[0]
    gated = wrapped.experts_layers[0].module._dwdp_runtime.epilogue.gated
    entries = []
    for kind, table in (("bf16_gated" if gated else "bf16", tables.first), ("bf16", tables.down)):
        n, k = table.shape
        for rows, (bm, bn, bk) in BUCKETS.items():
            config = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=4, num_stages=2, programs_per_sm=1)
            entries.append(dict(kind=kind, n=n, k=k, rows_per_expert=rows, config=config))
    data = dict(format=FORMAT, device=DEVICE.name, entries=entries,
                measured=dict(date="2026-11-25", torch="test", triton="test", code="test"))
    with open(os.path.join(directory, file_name(DEVICE.name)), "w") as f:
        json.dump(data, f)


def _keys_rank(rank: int, family: str, forwards: int) -> dict:
    torch.manual_seed(0)
    os.environ["DWDP_KERNEL_CONFIGS"] = tempfile.mkdtemp(prefix=f"dwdp-tiles-{rank}-")
    group = init_group()
    model = build_tiny_model(family, seed=1, dtype=torch.bfloat16)  # bf16: the router's weights are not fp32
    recorder = LaunchRecorder().install(device=DEVICE)
    rng = random.Random(100 + rank)
    with DWDPModel(model, DWDPConfig(experts_kernel="triton", slice_bytes=4096), group) as wrapped, torch.no_grad():
        _write_tuned_file(os.environ["DWDP_KERNEL_CONFIGS"], wrapped)
        wrapped.warmup(forward=False)
        warmed = set(recorder.keys)
        recorder.launches.clear()
        # Whether a layer's copies have landed when it starts is the copies' timing on a GPU: drawn here.
        wrapped.prefetcher.landed = lambda layer, slot: rng.random() < 0.5
        tiles = set()
        for i in range(forwards):
            prompts, tokens = BATCHES[i % len(BATCHES)] if i < len(BATCHES) else rng.choice(BATCHES)
            ids = torch.randint(3, 128, (prompts, tokens), generator=torch.Generator().manual_seed(1000 * rank + i))
            wrapped(input_ids=ids)
        seen = set(recorder.keys)
        tiles = {launch["args"]["BLOCK_M"][1] for launch in recorder.launches}
    new = [differing(k, warmed) for k in seen - warmed]
    return dict(warmed=len(warmed), seen=len(seen), launches=len(recorder.launches), new=new[:3], num_new=len(new),
                tiles=sorted(tiles))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])  # plain SwiGLU; biases + interleaved clamped gate
def test_every_launch_after_warmup_has_a_warmed_specialisation(family):
    ranks = launch_local(_keys_rank, 2, (family, 24), timeout_s=140)
    for rank, r in enumerate(ranks):
        assert r["launches"] >= 24, (rank, r)
        assert r["num_new"] == 0, f"{family} rank {rank}: {r['num_new']} launch forms warmup() did not compile: {r['new']}"
        # The forwards met several tile buckets, so the check covers tile choice, not only the two forms.
        assert len(r["tiles"]) >= 2, (rank, r["tiles"])


def test_unaligned_or_bf16_inputs_launch_the_warmed_forms(monkeypatch):
    """A caller's hidden states that start off a 16-byte boundary, or bf16 routing weights, are brought
    to the one form the kernel is warmed for."""
    model = build_tiny_model("mixtral", seed=1, dtype=torch.bfloat16)
    with DWDPModel(model, DWDPConfig(experts_kernel="triton"), DWDPGroup(0, 1)) as wrapped:
        recorder = LaunchRecorder().install(monkeypatch, DEVICE)
        wrapped.warmup(forward=False)
        warmed = set(recorder.keys)
        runtime = wrapped.experts_layers[0].module._dwdp_runtime
        flat = torch.randn(5 * 32 + 1, dtype=torch.bfloat16)
        hidden = flat[1:].view(5, 32)  # data 2 bytes past an aligned start
        index = torch.randint(0, 8, (5, 2))
        weights = torch.rand(5, 2, dtype=torch.bfloat16)
        recorder.launches.clear()
        _kernel_call(runtime, 0, hidden, index, weights, split=False, on_local_done=lambda: None)
        assert set(recorder.keys) <= warmed, [differing(k, warmed) for k in set(recorder.keys) - warmed]
