"""No kernel compiles after a model is ready: every experts-kernel launch a forward makes, over random
routings, batch shapes and arrival orders of the copies, has a specialisation `DWDPModel.warmup()` met."""
import random

import pytest
import torch

pytest.importorskip("triton.backends.nvidia")

from dwdp.config import DWDPConfig  # noqa: E402
from dwdp.experts import _kernel_call  # noqa: E402
from dwdp.group import DWDPGroup, init_group, launch_local  # noqa: E402
from dwdp.model import DWDPModel  # noqa: E402
from dwdp.tiny import build_tiny_model  # noqa: E402
from kernel_launches import LaunchKeys, differing  # noqa: E402

BATCHES = [(1, 1), (1, 2), (1, 7), (2, 5), (3, 16), (1, 33), (4, 8), (2, 1)]  # (prompts, tokens): rows 2 .. 132


def _keys_rank(rank: int, family: str, forwards: int) -> dict:
    torch.manual_seed(0)
    group = init_group()
    model = build_tiny_model(family, seed=1, dtype=torch.bfloat16)  # bf16: the router's weights are not fp32
    keys = LaunchKeys().install()
    rng = random.Random(100 + rank)
    with DWDPModel(model, DWDPConfig(experts_kernel="triton", slice_bytes=4096), group) as wrapped, torch.no_grad():
        wrapped.warmup(forward=False)
        warmed = set(keys.keys)
        keys.keys.clear()
        # Whether a layer's copies have landed when it starts is the copies' timing on a GPU: drawn here.
        wrapped.prefetcher.landed = lambda layer, slot: rng.random() < 0.5
        for i in range(forwards):
            prompts, tokens = rng.choice(BATCHES)
            ids = torch.randint(3, 128, (prompts, tokens), generator=torch.Generator().manual_seed(1000 * rank + i))
            wrapped(input_ids=ids)
        seen = set(keys.keys)
    new = [differing(k, warmed) for k in seen - warmed]
    return dict(warmed=len(warmed), seen=len(seen), launches=len(keys.keys), new=new[:3], num_new=len(new))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])  # plain SwiGLU; biases + interleaved clamped gate
def test_every_launch_after_warmup_has_a_warmed_specialisation(family):
    ranks = launch_local(_keys_rank, 2, (family, 24), timeout_s=110)
    for rank, r in enumerate(ranks):
        assert r["launches"] >= 24, (rank, r)
        assert r["num_new"] == 0, f"{family} rank {rank}: {r['num_new']} launch forms warmup() did not compile: {r['new']}"
    # Both forms (every expert at once, local experts first then the rest) were met, and warmed.
    assert all(r["warmed"] == 6 for r in ranks), ranks


def test_unaligned_or_bf16_inputs_launch_the_warmed_forms(monkeypatch):
    """A caller's hidden states that start off a 16-byte boundary, or bf16 routing weights, are brought
    to the one form the kernel is warmed for."""
    model = build_tiny_model("mixtral", seed=1, dtype=torch.bfloat16)
    with DWDPModel(model, DWDPConfig(experts_kernel="triton"), DWDPGroup(0, 1)) as wrapped:
        keys = LaunchKeys().install(monkeypatch)
        wrapped.warmup(forward=False)
        warmed = set(keys.keys)
        runtime = wrapped.experts_layers[0].module._dwdp_runtime
        flat = torch.randn(5 * 32 + 1, dtype=torch.bfloat16)
        hidden = flat[1:].view(5, 32)  # data 2 bytes past an aligned start
        index = torch.randint(0, 8, (5, 2))
        weights = torch.rand(5, 2, dtype=torch.bfloat16)
        keys.keys.clear()
        _kernel_call(runtime, 0, hidden, index, weights, split=False, on_local_done=lambda: None)
        assert set(keys.keys) <= warmed, [differing(k, warmed) for k in set(keys.keys) - warmed]
