"""examples/continue_from_kv.py: an artifact of a packed, chunked prefill, read into the model's own
cache type, continues generation token for token like the unwrapped model's generate()."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections import deque
from pathlib import Path

import pytest
import torch

from dwdp.models.tiny import build_tiny_model
from dwdp.serve.kv import artifact_metadata, to_host, write_kv_artifact
from dwdp.serve.presets import preset_model
from dwdp.serve.protocol import PrefillJob
from dwdp.serve.prefill import advance
from dwdp.serve.scheduling import take_pieces

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "continue_from_kv.py"
spec = importlib.util.spec_from_file_location("continue_from_kv", EXAMPLE)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


def prefill_to_artifacts(model, prompts, budget: int, directory, name: str) -> dict:
    """Packed, chunked prefill of `prompts` (`budget` tokens per forward); {request id: artifact path}."""
    pending = deque(PrefillJob(f"r{i}", tuple(p), 0.0) for i, p in enumerate(prompts))
    active, paths = [], {}
    while pending or active:
        for state, first, _ in advance(model, take_pieces(active, pending, budget)):
            kv = write_kv_artifact(directory, state.job.request_id, to_host(state.kv),
                                   artifact_metadata(0, name, first, tuple(state.chunks), "packed"))
            paths[state.job.request_id] = (kv["path"], state.chunks)
        active[:] = [s for s in active if not s.is_finished]
    return paths


@pytest.mark.timeout(60)
@pytest.mark.parametrize("family,overrides", [("deepseek_v3", {}), ("gpt_oss", {"sliding_window": 4}),
                                              ("qwen3_moe", {})])
def test_continuation_from_an_artifact_matches_generate(tmp_path, family, overrides):
    model = build_tiny_model(family, seed=3, **overrides)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (23, 4, 9)]
    paths = prefill_to_artifacts(model, prompts, budget=10, directory=tmp_path, name=family)
    assert paths["r0"][1] == [10, 10, 3], paths["r0"]  # the long prompt took three chunks
    for i, prompt in enumerate(prompts):
        got = example.continue_generation(model, paths[f"r{i}"][0], prompt, 6, family)
        want = example.generate_from_scratch(model, prompt, 6)
        assert got == want, (family, i, got, want)


@pytest.mark.timeout(30)
def test_an_artifact_of_another_model_is_refused_by_name(tmp_path):
    model = build_tiny_model("qwen3_moe", seed=3)
    paths = prefill_to_artifacts(model, [[5, 6, 7]], budget=8, directory=tmp_path, name="qwen3-tiny")
    with pytest.raises(ValueError, match="made by model 'qwen3-tiny', not 'other'"):
        example.load_cache(paths["r0"][0], model, "other")


@pytest.mark.timeout(90)
def test_the_example_runs_as_a_program(tmp_path):
    model = preset_model("tiny", seed=0)
    prompt = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    path, _ = prefill_to_artifacts(model, [prompt], budget=16, directory=tmp_path, name="dwdp-tiny")["r0"]
    done = subprocess.run([sys.executable, str(EXAMPLE), "--artifact", path, "--prompt-ids", ",".join(map(str, prompt)),
                           "--tokens", "5", "--check"], capture_output=True, text=True, timeout=80)
    assert done.returncode == 0 and "match" in done.stdout, done.stdout + done.stderr
