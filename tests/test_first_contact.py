"""What a new user meets first: the base install's commands, and every bad input refused in one line
with exit 2 (or the API's own error shape), leaving nothing behind (issue 32)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from dwdp.cli import EXTRA_MODULES, main

ROOT = Path(__file__).resolve().parent.parent
# What the extras install and the base install does not (checked against a base-only venv).
NOT_IN_BASE = tuple(m for modules in EXTRA_MODULES.values() for m in modules) + ("starlette", "httpcore", "jiter",
                                                                                  "sniffio")
SUBCOMMANDS = ([], ["demo"], ["families"], ["tune"], ["tune-kernel"], ["serve"], ["bench"], ["bench", "compare"],
               ["bench", "regimes"], ["bench", "serve"], ["trace"], ["trace", "breakdown"], ["trace", "contention"],
               ["trace", "bubbles"], ["trace", "timeline"])


def stderr_line(capfd) -> str:
    """The one line a refusal printed on stderr (fails when there is more, or a traceback)."""
    err = capfd.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# -- the base install ------------------------------------------------------------------------------
def _without_extras(code: str) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter where every module only the extras install fails to import."""
    block = f"import sys\nfor _m in {NOT_IN_BASE!r}:\n    sys.modules[_m] = None\n"
    return subprocess.run([sys.executable, "-c", block + code], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


@pytest.mark.timeout(150)
def test_every_help_and_every_missing_extra_without_the_extras():
    """`dwdp --help` and each subcommand's `--help` exit 0 with only the base install; a subcommand
    that needs an extra says which in one line and exits 2."""
    code = f"""
import contextlib, io
from dwdp.cli import main
try:
    import httpx
    raise SystemExit("httpx imports: the blocker does not work")
except ImportError:
    pass
for argv in {SUBCOMMANDS!r}:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            main(argv + ["--help"])
    except SystemExit as exc:
        assert exc.code == 0, (argv, exc.code)
    assert "usage: dwdp" in out.getvalue(), (argv, out.getvalue())
for argv in (["serve"], ["bench", "compare"], ["bench", "regimes"], ["bench", "serve"], ["trace", "timeline", "x"]):
    print(main(argv))
"""
    run = _without_extras(code)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["2"] * 5, run.stdout
    assert run.stderr.splitlines() == [
        "dwdp serve needs fastapi: pip install -e '.[serve]'",
        "dwdp bench compare needs matplotlib: pip install -e '.[bench]'",
        "dwdp bench regimes needs matplotlib: pip install -e '.[bench]'",
        "dwdp bench serve needs fastapi: pip install -e '.[serve,bench]'",
        "dwdp trace timeline needs matplotlib: pip install -e '.[bench]'",
    ], run.stderr


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


def test_extras_agree_across_cli_pyproject_constraints_and_readme():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for extra, modules in EXTRA_MODULES.items():
        names = _requirement_names(extras[extra])
        for module in modules:
            assert module.replace("_", "-") in names, (extra, module, names)
        assert names <= _requirement_names(extras["dev"]), (extra, names)  # the tests run every command
    pinned = _requirement_names([line for line in (ROOT / "constraints.txt").read_text().splitlines()
                                 if line and not line.startswith("#")])
    declared = _requirement_names(project["dependencies"] + [r for reqs in extras.values() for r in reqs])
    assert declared <= pinned, declared - pinned
    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))])
    for extra in EXTRA_MODULES:
        assert f"'.[{extra}" in docs or f",{extra}]'" in docs, f"no install line for the {extra} extra in the docs"


# -- dwdp tune / tune-kernel -----------------------------------------------------------------------
@pytest.mark.skipif(__import__("dwdp.runtime.transport.cuda_api", fromlist=["probe"]).probe().usable, reason="needs no GPU")
def test_tune_backend_cuda_without_a_gpu_is_one_line(tmp_path, capfd):
    out = tmp_path / "tuned.json"
    assert main(["tune", "--backend", "cuda", "--family", "mixtral", "--out", str(out)]) == 2
    line = stderr_line(capfd)
    assert line.startswith("dwdp tune: --backend cuda but this machine has no usable CUDA GPU") and \
        line.endswith("use --backend host"), line
    assert not out.exists()


@pytest.mark.parametrize("argv, says", [
    (["--shape", "1,2,3"], "--shape='1,2,3' must be four integers H,I,E,K"),
    (["--preset", "no-such-model"], "--preset"),
    (["--shape", "64,64,8,2", "--tokens", "12,x"], "--tokens='12,x'"),
    (["--model", "/no/such/dir"], "--model /no/such/dir is not a directory: expected a local model directory"),
], ids=["shape", "preset", "tokens", "model"])
def test_tune_kernel_bad_input_exits_2_in_one_line(argv, says, tmp_path, capfd):
    assert main(["tune-kernel", *argv, "--out-dir", str(tmp_path)]) == 2
    line = stderr_line(capfd)
    assert line.startswith("dwdp tune-kernel: ") and says in line, line
    assert list(tmp_path.iterdir()) == []


# -- dwdp serve: paths checked before any worker ---------------------------------------------------
@pytest.fixture(scope="module")
def bad_paths(tmp_path_factory):
    """A missing directory, a file, a dense (non-MoE) checkpoint and a directory without a tokenizer."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("bad_paths")
    dense = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1, num_attention_heads=2))
    dense.save_pretrained(str(root / "dense"))
    (root / "file").write_text("not a model\n")
    (root / "empty").mkdir()
    return root


SERVE_BAD_PATHS = [
    (["--model", "{root}/missing"], "--model {root}/missing does not exist: expected a checkpoint directory"),
    (["--model", "{root}/file"], "--model {root}/file is a file: expected a checkpoint directory"),
    (["--model", "{root}/empty"], "--model {root}/empty has no config.json: expected a checkpoint directory"),
    (["--model", "{root}/dense"], "--model {root}/dense: LlamaForCausalLM has no MoE experts modules"),
    (["--tokenizer", "/bad/path"], "--tokenizer /bad/path does not exist: expected a tokenizer directory"),
    (["--tokenizer", "{root}/empty"], "--tokenizer {root}/empty does not load as a tokenizer"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv, says", SERVE_BAD_PATHS, ids=["missing", "file", "no_config", "dense",
                                                             "bad_tokenizer", "no_tokenizer_there"])
def test_serve_bad_path_is_one_line_before_any_worker(argv, says, bad_paths, tmp_path, monkeypatch, capfd):
    from dwdp.serve.pool import WorkerPool

    def no_workers(self):
        raise AssertionError("a worker was started for a path the router could have refused")

    monkeypatch.setattr(WorkerPool, "start", no_workers)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a default dwdp-kv-* directory would go
    argv = [a.format(root=bad_paths) for a in argv]
    assert main(["serve", *argv, "--port", "0"]) == 2
    line = stderr_line(capfd)
    assert line.startswith("dwdp serve: " + says.format(root=bad_paths)), line
    assert list(tmp_path.iterdir()) == []


# -- the HTTP API, in process over a stand-in pool -------------------------------------------------
class _Pool:
    """What create_app reads from a WorkerPool; every prompt is answered by 'rank 0' with token 7."""

    def __init__(self, max_position_embeddings: int, forwards: str = "packed"):
        self.model_info = {"vocab_size": 512, "max_position_embeddings": max_position_embeddings,
                           "forwards": forwards, "padded_reason": "" if forwards == "packed" else "linear attention"}

    async def submit(self, ids):
        from dwdp.serve.protocol import PrefillResult

        return PrefillResult(request_id="pf-1", rank=0, first_token_id=7, prompt_tokens=len(ids), queue_s=0.0,
                             prefill_s=0.0, kv_write_s=0.0, batch_size=1, batch_tokens=len(ids), prefetch_wait_s=0.0,
                             kv={"path": "/dev/null"})


def _client(max_num_tokens: int, max_position_embeddings: int, forwards: str = "packed", **config):
    from fastapi.testclient import TestClient

    from dwdp.serve.api import create_app
    from dwdp.serve.config import ServeConfig

    serve = ServeConfig(max_num_tokens=max_num_tokens, max_queue_tokens=max(8192, max_num_tokens), **config)
    return TestClient(create_app(_Pool(max_position_embeddings, forwards), serve))


@pytest.mark.parametrize("max_num_tokens, positions, forwards, cap, reason", [
    (1024, 512, "padded", 512, "(the model's max_position_embeddings)"),
    (256, 512, "padded", 256, "(--max-num-tokens; this model's prompts are not chunked: linear attention)"),
    (256, 512, "packed", 512, "(the model's max_position_embeddings)"),
], ids=["positions_bound", "max_num_tokens_bound", "chunked"])
def test_prompt_too_long_names_the_bound_that_applied(max_num_tokens, positions, forwards, cap, reason):
    client = _client(max_num_tokens, positions, forwards)
    r = client.post("/v1/prefill", json={"input_ids": [5] * 600})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "input_ids" and error["message"] == (
        f"input_ids has 600 tokens; this server takes at most {cap} per prompt {reason}"), error
    assert client.post("/v1/prefill", json={"input_ids": [5] * cap}).status_code == 200


@pytest.mark.parametrize("method, path, status", [
    ("post", "/v1/embeddings", 404), ("get", "/v1/engines", 404), ("get", "/v1/completions", 405),
])
def test_unknown_route_answers_in_the_api_error_shape_naming_the_endpoints(method, path, status):
    r = getattr(_client(256, 512), method)(path, **({"json": {}} if method == "post" else {}))
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"].startswith(f"{method.upper()} {path} is not an endpoint"), error
    for endpoint in ("POST /v1/prefill", "POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health", "GET /metrics"):
        assert endpoint in error["message"], error
    assert "/admin/fault" not in error["message"], error  # off unless --fault-injection
    r = _client(256, 512, fault_injection=True).post("/v1/embeddings", json={})
    assert "POST /admin/fault" in r.json()["error"]["message"], r.text


COMPLETION = {"model": "dwdp-tiny", "prompt": [5, 6, 7], "max_tokens": 1}


@pytest.mark.parametrize("field, value", [
    ("temperature", 1.5), ("temperature", 1), ("top_p", 0.9), ("top_k", 40), ("presence_penalty", 0.5),
    ("frequency_penalty", -1), ("repetition_penalty", 1.2), ("min_p", 0.1), ("best_of", 2),
    ("logit_bias", {"5": 100}), ("temperature", True), ("top_p", "1"),
])
def test_sampling_field_is_refused_naming_it(field, value):
    r = _client(256, 512).post("/v1/completions", json={**COMPLETION, field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["message"].startswith(f"{field}={value!r}: this prefill server"), error


def test_sampling_fields_at_their_greedy_values_are_accepted():
    neutral = {"temperature": 0, "top_p": 1.0, "top_k": -1, "presence_penalty": 0, "frequency_penalty": 0.0,
               "repetition_penalty": 1, "min_p": 0, "best_of": 1, "logit_bias": {}, "seed": 3, "user": "u"}
    r = _client(256, 512).post("/v1/completions", json={**COMPLETION, **neutral})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == [7], r.text
    r = _client(256, 512).post("/v1/completions", json={**COMPLETION, "temperature": None})
    assert r.status_code == 200, r.text


# -- the model: weights that differ between ranks, a forward after close ---------------------------
def _wrap_with_seed(rank: int, seeds: tuple[int, ...], shm_dir: str) -> str:
    from dwdp.runtime.config import DWDPConfig
    from dwdp.runtime.group import init_group
    from dwdp.runtime.model import DWDPModel
    from dwdp.models.tiny import build_tiny_model

    os.environ["DWDP_SHM_DIR"] = shm_dir
    torch.set_num_threads(1)
    group = init_group()
    try:
        DWDPModel(build_tiny_model("mixtral", seed=seeds[rank]), DWDPConfig(), group).close()
    except ValueError as exc:
        return str(exc)
    return "wrapped"


@pytest.mark.timeout(120)
def test_ranks_with_different_dense_weights_are_refused_at_setup_naming_them(tmp_path):
    from dwdp.runtime.group import launch_local

    answers = launch_local(_wrap_with_seed, 2, ((1, 2), str(tmp_path)), timeout_s=100)
    for answer in answers:
        assert answer.startswith("ranks [1] hold different dense (non-expert) weights from ranks [0]"), answers
        assert "every rank of a DWDP group must load the same model" in answer, answers
    assert list(tmp_path.iterdir()) == []


def test_dense_checksum_sees_one_changed_weight_and_not_the_experts():
    from dwdp.models.adapters import find_experts
    from dwdp.models.tiny import build_tiny_model
    from dwdp.runtime.wrapping import dense_checksum

    def checksum(model):
        return dense_checksum(model, [layer.module for layer in find_experts(model)])

    model = build_tiny_model("mixtral", seed=1)
    experts = [layer.module for layer in find_experts(model)]
    before = checksum(model)
    assert checksum(build_tiny_model("mixtral", seed=1)) == before
    assert checksum(build_tiny_model("mixtral", seed=2)) != before
    with torch.no_grad():
        experts[0].down_proj[0, 0, 0] += 1.0
        assert checksum(model) == before, "an expert weight changed the dense checksum"
        model.model.norm.weight[3] += 1e-3
    assert checksum(model) != before


def test_forward_after_close_says_the_model_was_closed(tmp_path, monkeypatch):
    from dwdp.runtime.config import DWDPConfig
    from dwdp.runtime.group import DWDPGroup
    from dwdp.runtime.model import DWDPModel
    from dwdp.models.tiny import build_tiny_model

    monkeypatch.setenv("DWDP_SHM_DIR", str(tmp_path))
    wrapped = DWDPModel(build_tiny_model("mixtral", seed=1), DWDPConfig(), DWDPGroup(0, 1))
    ids = torch.randint(3, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    wrapped.close()
    for run in (lambda: wrapped(ids), lambda: wrapped.generate(ids, max_new_tokens=1, do_sample=False)):
        with pytest.raises(RuntimeError, match=r"^rank 0: this DWDPModel was closed \(close\(\) released its "
                                               r"experts' shared memory\)"), torch.no_grad():
            run()
    assert list(tmp_path.iterdir()) == []


def _touch_after_close(rank: int, shm_dir: str, seeds: tuple[int, int]) -> dict:
    """Wrap (ranks with different seeds: refused at setup after the fill), close, then use the model the
    way a user might: print it, take its state_dict, read every parameter, move it to the CPU. A view left
    over unmapped memory would end this process with SIGSEGV (the rank's result would never come)."""
    from dwdp.models.adapters import find_experts
    from dwdp.models.tiny import build_tiny_model
    from dwdp.runtime.config import DWDPConfig
    from dwdp.runtime.group import init_group
    from dwdp.runtime.model import DWDPModel

    os.environ["DWDP_SHM_DIR"] = shm_dir
    torch.set_num_threads(1)
    group = init_group()
    model = build_tiny_model("mixtral", seed=seeds[rank])
    experts = [layer.module for layer in find_experts(model)]
    try:
        wrapped = DWDPModel(model, DWDPConfig(), group)
        outcome = wrapped.experts_kernel
        wrapped.close()
    except ValueError as exc:
        outcome = f"refused: {str(exc)[:40]}"
    text = str(model)
    keys = len(model.state_dict())
    meta = sorted({name for m in experts for name, p in m.named_parameters() if p.device.type == "meta"})
    total = sum(float(p.float().sum()) for p in model.parameters() if p.device.type != "meta")  # reads them all
    try:
        model.cpu()
        moved = "moved"
    except NotImplementedError as exc:
        moved = str(exc)
    return dict(outcome=outcome, printed=bool(text), keys=keys, meta=meta, read=total == total, moved=moved)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("seeds", [(1, 1), (1, 2)], ids=["closed", "setup_refused"])
def test_after_close_or_a_failed_setup_the_experts_raise_a_python_error_instead_of_faulting(tmp_path, seeds):
    from dwdp.runtime.group import launch_local

    for r in launch_local(_touch_after_close, 2, (str(tmp_path), seeds), timeout_s=100):
        want = "composite" if seeds == (1, 1) else "refused: ranks [1] hold different dense (non-expe"
        assert r["outcome"] == want and r["printed"] and r["keys"] > 0 and r["read"], r
        assert r["meta"] == ["down_proj", "gate_up_proj"], r
        assert "meta" in r["moved"], r


# -- dwdp bench: results go where the user says, never over the stored runs ------------------------
@pytest.mark.parametrize("argv, option", [
    (["bench", "compare"], "out_dir"), (["bench", "regimes"], "out_dir"), (["bench", "serve"], "out"),
])
def test_bench_results_default_outside_the_stored_runs(argv, option):
    from dwdp.cli import build_parser

    where = Path(getattr(build_parser().parse_args(argv), option)).resolve()
    stored = (ROOT / "bench" / "results").resolve()
    assert stored not in [where, *where.parents], (argv, where)
    assert where.relative_to(Path.cwd()).parts[0] == "dwdp-bench-results", where
    ignored = subprocess.run(["git", "check-ignore", "-q", str(ROOT / "dwdp-bench-results" / "x.json")], cwd=ROOT)
    assert ignored.returncode == 0, "dwdp-bench-results/ is not in .gitignore"
