"""DEP serving ranks stepping together, driven directly (spawned ranks, their queues filled here):
every prompt's logits and KV equal the unwrapped model's whatever the other ranks hold in the same
step (more prompts, fewer, none), packed and chunked (prompts longer than what a forward has left);
a peer that exits or stops mid-step fails the others' prompts
with a named error, within a bounded time."""
from __future__ import annotations

import os
import queue
import signal
import time

import pytest
import torch

from dwdp.runtime.group import launch_local
from dwdp.serve.config import ServeConfig
from dwdp.serve.kv import read_kv_artifact
from dwdp.serve.presets import preset_model
from dwdp.serve.protocol import STOP, PrefillError, PrefillJob, PrefillResult

VOCAB = 512
ATOL, RTOL = 1e-4, 1e-4


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _serve_rank(rank: int, ranks: int, held: list[list[list[int]]], max_num_tokens: int, kv_dir: str,
                step_timeout_s: float, fault: str | None) -> dict:
    """Serve `held[rank]` (then STOP) as one DEP rank; `fault` on rank 1: 'exit' or 'stop' itself in
    its second forward, inside the experts of the second MoE layer (its peers wait in an all-to-all)."""
    from dwdp.serve.dep_worker import DEPGroupBroken, build_dep_model, serve_dep_queue

    config = ServeConfig(ranks=ranks, mode="dep", max_num_tokens=max_num_tokens, step_timeout_s=step_timeout_s)
    model, step_group, pids = build_dep_model(config, rank)
    requests, results = queue.Queue(), queue.Queue()
    for i, ids in enumerate(held[rank]):
        requests.put(PrefillJob(f"r{rank}-{i}", tuple(ids), time.monotonic()))
    requests.put(STOP)
    if fault is not None and rank == 1:
        forwards = []

        def pull_the_plug(module, args):
            forwards.append(1)
            if len(forwards) == 2:
                if fault == "exit":
                    os._exit(17)
                os.kill(os.getpid(), signal.SIGSTOP)

        model.experts_modules[1].register_forward_pre_hook(pull_the_plug)
    steps, broken, failed_at = [], None, None

    def on_step(plan, finished):
        # numpy, not a tensor: a tensor would travel to the parent as a shared-memory handle that this
        # process must still serve when the parent unpickles it (after rank 0 may have exited).
        steps.append(([(state.job.request_id, n) for state, n in plan],
                      {state.job.request_id: row.numpy().copy() for state, row in finished or ()}))

    started = time.monotonic()
    try:
        serve_dep_queue(model, rank, config, kv_dir, requests, results, step_group, pids, is_packed=True,
                        on_step=on_step)
    except DEPGroupBroken as exc:
        broken, failed_at = str(exc), time.monotonic() - started
        if fault == "stop":
            os.kill(pids[1], signal.SIGKILL)  # it would never finish: the test harness waits for every rank
    messages = []
    while not results.empty():
        messages.append(results.get_nowait())
    return {"steps": steps, "messages": messages, "broken": broken, "failed_after_s": failed_at, "pids": pids}


@pytest.fixture(scope="module")
def reference():
    model = preset_model("tiny", seed=0)

    def run(ids):
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids]), use_cache=True)
        return out.logits[0, -1], [(layer.keys, layer.values) for layer in out.past_key_values.layers]

    return run


@pytest.mark.timeout(120)
def test_every_prompt_matches_the_unwrapped_model_whatever_the_peers_hold(tmp_path, reference):
    """Rank 0 holds five prompts, packed 64 real tokens per forward, two of them chunked (three
    forwards: 40 + 9 + 15 of 33 | 18 + 1 + 45 of 64 | 19), rank 1 one, rank 2 none: rank 0's later
    forwards run beside two idle steps, its first beside one forward and one idle step."""
    held = [prompts(0, [40, 9, 33, 1, 64]), prompts(1, [17]), []]
    out = launch_local(_serve_rank, 3, (3, held, 64, str(tmp_path), 60.0, None), timeout_s=110)
    counts = [len(o["steps"]) for o in out]
    assert len(set(counts)) == 1, f"ranks ran different numbers of steps (not in lockstep): {counts}"
    plans = [[[n for _, n in plan] for plan, _ in o["steps"]] for o in out]
    assert plans[0] == [[40, 9, 15], [18, 1, 45], [19]], plans[0]
    assert plans[1] == [[17], [], []] and plans[2] == [[], [], []], plans
    for rank, o in enumerate(out):
        assert o["broken"] is None, o["broken"]
        answers = {m.request_id: m for m in o["messages"] if isinstance(m, (PrefillResult, PrefillError))}
        assert sorted(answers) == sorted(f"r{rank}-{i}" for i in range(len(held[rank]))), sorted(answers)
        logits = {rid: torch.from_numpy(row) for _, rows in o["steps"] for rid, row in rows.items()}
        for i, ids in enumerate(held[rank]):
            rid = f"r{rank}-{i}"
            result = answers[rid]
            assert isinstance(result, PrefillResult), result
            assert sum(result.chunks) == len(ids) and max(result.chunks) <= 64, (rid, result.chunks)
            want_logits, want_layers = reference(ids)
            torch.testing.assert_close(logits[rid], want_logits, atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"{rid} ({len(ids)} tokens) logits: {m}")
            assert result.first_token_id == int(want_logits.argmax()) or \
                float(want_logits.max() - want_logits[result.first_token_id]) <= ATOL, (rid, result.first_token_id)
            got_layers, _ = read_kv_artifact(result.kv["path"])
            for layer, ((k, v), (rk, rv)) in enumerate(zip(got_layers, want_layers)):
                for name, got, want in (("keys", k, rk), ("values", v, rv)):
                    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL,
                                               msg=lambda m: f"{rid} layer {layer} {name}: {m}")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("fault,step_timeout_s,bound_s", [
    ("exit", 60.0, 30.0),   # closed connections end the wait long before the 60 s timeout
    ("stop", 3.0, 13.0),    # a stopped peer keeps its connections open: the step timeout ends the wait
])
def test_a_peer_lost_mid_step_fails_the_others_prompts_by_name(tmp_path, fault, step_timeout_s, bound_s):
    """Rank 0's first forward finishes r0-0 and starts r0-1 (30 + 2 of 30); the second one breaks:
    r0-1 (half prefilled) and the queued r0-2, r0-3 are failed by name."""
    held = [prompts(2, [30, 30, 30, 30]), prompts(3, [30, 30, 30])]
    out = launch_local(_serve_rank, 2, (2, held, 32, str(tmp_path), step_timeout_s, fault), timeout_s=80,
                       may_die=(1,))
    survivor = out[0]
    assert survivor["broken"] is not None, "rank 0 finished although its peer left mid-step"
    pid = survivor["pids"][1]
    state = "exited" if fault == "exit" else "stopped"
    assert f"rank 1 (pid {pid}) {state}" in survivor["broken"], survivor["broken"]
    assert survivor["failed_after_s"] < bound_s, (survivor["failed_after_s"], survivor["broken"])
    answers = [m for m in survivor["messages"] if isinstance(m, (PrefillResult, PrefillError))]
    assert sorted(m.request_id for m in answers) == [f"r0-{i}" for i in range(4)], answers
    errors = [m for m in answers if isinstance(m, PrefillError)]
    assert errors, answers
    assert all(e.error_type == "dep_group_broken" and e.message == survivor["broken"] for e in errors), errors
    assert len(survivor["steps"]) == 1, "rank 0 answered more forwards than ran before the fault"
