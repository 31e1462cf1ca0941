"""The context server's pieces in-process: batching, left padding, routing, KV artifacts, config."""
from __future__ import annotations

from collections import deque

import pytest
import torch

from dwdp.serve.config import ServeConfig
from dwdp.serve.kv import read_kv_artifact, write_kv_artifact
from dwdp.serve.protocol import PrefillJob
from dwdp.serve.routing import NoHealthyWorker, Overloaded, WorkerLoad, pick_worker
from dwdp.serve.worker import pad_left, take_batch


def jobs(*lengths):
    return deque(PrefillJob(f"r{i}", tuple(range(3, 3 + n)), 0.0) for i, n in enumerate(lengths))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("lengths,budget,first_batch", [
    ((5,), 8, ["r0"]),
    ((4, 4, 4), 8, ["r0", "r1"]),              # 3 x 4 = 12 padded tokens would pass 8
    ((2, 6), 8, ["r0"]),                       # padding to 6 makes 2 x 6 = 12
    ((8, 1), 8, ["r0"]),                       # a prompt of the whole budget rides alone
    ((1, 1, 1, 1, 1, 1, 1, 1, 1), 8, [f"r{i}" for i in range(8)]),
])
def test_take_batch_keeps_padded_tokens_within_budget(lengths, budget, first_batch):
    pending = jobs(*lengths)
    batch = take_batch(pending, budget)
    assert [j.request_id for j in batch] == first_batch
    assert len(batch) * max(len(j.input_ids) for j in batch) <= budget or len(batch) == 1
    assert len(pending) == len(lengths) - len(first_batch)


@pytest.mark.timeout(10)
def test_pad_left_puts_last_tokens_in_the_last_column():
    ids, mask, positions, pads = pad_left([(7,), (4, 5, 6)])
    assert ids.tolist() == [[0, 0, 7], [4, 5, 6]]
    assert mask.tolist() == [[0, 0, 1], [1, 1, 1]]
    assert positions.tolist() == [[0, 0, 0], [0, 1, 2]]
    assert pads == [2, 0]


def load(rank, outstanding, last=-1, alive=True):
    return WorkerLoad(rank, alive, outstanding, last)


@pytest.mark.timeout(10)
def test_router_picks_fewest_outstanding_tokens_not_round_robin():
    loads = [load(0, 300, last=0), load(1, 10, last=2), load(2, 50, last=1)]
    assert pick_worker(loads, 20, 1000) == 1
    assert pick_worker(loads, 20, 1000, exclude=frozenset({1})) == 2


@pytest.mark.timeout(10)
def test_router_breaks_ties_by_least_recently_assigned():
    assert pick_worker([load(0, 0, last=5), load(1, 0, last=3), load(2, 0, last=4)], 1, 10) == 1


@pytest.mark.timeout(10)
def test_router_skips_dead_and_full_workers():
    assert pick_worker([load(0, 0, alive=False), load(1, 90)], 10, 100) == 1
    with pytest.raises(Overloaded, match="max_queue_tokens=100"):
        pick_worker([load(0, 95), load(1, 91), load(2, 0, alive=False)], 10, 100)
    with pytest.raises(NoHealthyWorker):
        pick_worker([load(0, 0, alive=False)], 1, 100)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_artifact_round_trip_is_bit_exact(tmp_path, dtype):
    gen = torch.Generator().manual_seed(0)
    layers = [(torch.randn(1, 2, 5, 12, generator=gen).to(dtype), torch.randn(1, 2, 5, 8, generator=gen).to(dtype))
              for _ in range(3)]
    desc = write_kv_artifact(tmp_path, "req-1", layers, {"rank": 1})
    assert desc["num_layers"] == 3 and desc["num_tokens"] == 5 and desc["dtype"] == str(dtype).removeprefix("torch.")
    assert [t["shape"] for t in desc["tensors"][:2]] == [[1, 2, 5, 12], [1, 2, 5, 8]]
    got, meta = read_kv_artifact(desc["path"])
    assert meta["rank"] == "1" and meta["request_id"] == "req-1"
    for (k, v), (rk, rv) in zip(got, layers):
        assert torch.equal(k, rk) and torch.equal(v, rv)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["req-1.safetensors"]  # no temporary file left


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kwargs,field", [
    ({"ranks": 0}, "ranks"), ({"port": 70000}, "port"), ({"preset": "huge"}, "preset"),
    ({"max_num_tokens": 0}, "max_num_tokens"), ({"max_num_tokens": 64, "max_queue_tokens": 32}, "max_queue_tokens"),
    ({"drain_timeout_s": 0}, "drain_timeout_s"),
])
def test_serve_config_rejects_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ServeConfig(**kwargs)
