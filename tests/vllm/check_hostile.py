"""The KV hand-off attacked through vLLM's own port, as any client of it can: every attack leaves vLLM
serving (health 200, the next honest request equal to vLLM alone), reads and deletes nothing outside the
KV directory, and poisons no later request (a victim's prompt answers the same before and after).

This module's vLLM runs the deployment the docs call weakest: no KV key (so descriptors are checked by
name, prompt and file, not by dwdp's authenticator; tests/vllm/check_pair.py runs the keyed pair), and
prefix caching on (its default), so KV loaded for one request would serve later requests of the same
prompt. Its connector is tests/vllm/faulty_connector.py: the production connector, plus exceptions
planted on demand at the start of any entry point.

"vLLM alone" for a prompt is the same vLLM asked with a cache_salt of its own, so the answer is computed
afresh and shares no cached blocks with anyone (nor does the honest check poison the cache)."""
from __future__ import annotations

import json
import os
import random
import struct
import uuid
from pathlib import Path

import httpx
import pytest

from check_pair import external_tokens, model_name, prompt
from conftest import BLOCK_SIZE, FAULTY_CONNECTOR, VLLM_MODEL, start_dwdp, start_vllm
from faulty_connector import ENTRY_POINTS

from dwdp.serve.kv import artifact_metadata, prompt_digest, write_kv_artifact

NUM_TOKENS = 6
LINE_LIMIT = 600  # characters of one connector log line, prefix included


@pytest.fixture(scope="module")
def fault_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def hostile_vllm(checkpoint, kv_dir, fault_dir, tmp_path_factory):
    connector = {**FAULTY_CONNECTOR, "kv_connector_extra_config": {"kv_dir": str(kv_dir), "fault_dir": str(fault_dir)}}
    server = start_vllm(checkpoint, tmp_path_factory.mktemp("logs"), BLOCK_SIZE, kv_dir, key=None,
                        prefix_caching=True, connector=connector, cpu_env=False)  # vLLM's default reservation
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hostile_dwdp(checkpoint, hostile_vllm, kv_dir, tmp_path_factory):
    server = start_dwdp(checkpoint, hostile_vllm, kv_dir, tmp_path_factory.mktemp("logs"), key=None)
    yield server
    server.stop()


def complete(vllm, ids: list[int], num_tokens: int = NUM_TOKENS, raw: bytes | None = None, **fields) -> dict:
    """vLLM's greedy completion of `ids` (a 200 answer asserted); `raw`: the body as bytes, as sent."""
    body = {"model": VLLM_MODEL, "prompt": ids, "max_tokens": num_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **fields}
    if raw is None:
        r = httpx.post(f"{vllm.url}/v1/completions", json=body, timeout=120)
    else:
        r = httpx.post(f"{vllm.url}/v1/completions", content=raw, headers={"content-type": "application/json"},
                       timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def alone(vllm, ids: list[int]) -> list[int]:
    """vLLM's own tokens for `ids`, computed afresh (a cache_salt of its own)."""
    return complete(vllm, ids, cache_salt=uuid.uuid4().hex)["choices"][0]["token_ids"]


def assert_serving(vllm, seed: int) -> None:
    """Health 200, and an honest request (no kv_transfer_params) equal to vLLM alone."""
    assert httpx.get(f"{vllm.url}/health", timeout=10).status_code == 200
    ids = prompt(seed, 40)
    want = alone(vllm, ids)
    assert complete(vllm, ids)["choices"][0]["token_ids"] == want


def attack(vllm, ids: list[int], kv_transfer_params=None, raw_params: bytes | None = None,
           loads: int | None = 0) -> dict:
    """Send `ids` with hostile kv_transfer_params (raw JSON bytes for values json.dumps cannot write); vLLM
    must load `loads` prompt tokens through the connector (its external_kv_transfer counter: prefix-cache
    hits of vLLM's own, which its cached_tokens also counts, are not the connector's). None: not checked (a
    load that fails after vLLM counted it)."""
    before = external_tokens(vllm)
    if raw_params is None:
        got = complete(vllm, ids, kv_transfer_params=kv_transfer_params)
    else:
        body = json.dumps({"model": VLLM_MODEL, "prompt": ids, "max_tokens": NUM_TOKENS, "temperature": 0,
                           "ignore_eos": True, "return_token_ids": True, "kv_transfer_params": "PARAMS"}).encode()
        got = complete(vllm, ids, raw=body.replace(b'"PARAMS"', raw_params))
    loaded = external_tokens(vllm) - before
    assert loads is None or loaded == loads, f"the connector loaded {loaded} prompt tokens, expected {loads}"
    return got


def connector_lines(vllm, needle: str) -> list[str]:
    return [line for line in vllm.output().splitlines() if "dwdp connector" in line and needle in line]


def victim_unpoisoned(vllm, ids: list[int], want: list[int]) -> None:
    """Another user's request of the same prompt, carrying no kv_transfer_params, answers vLLM alone's."""
    got = complete(vllm, ids)
    assert got["choices"][0]["token_ids"] == want, (got["choices"][0]["token_ids"], want)


def forged(directory: Path, ids: list[int], name: str | None = None) -> Path:
    """An artifact an attacker made for `ids` (random KV of the right shape, the prompt's own digest)."""
    import torch

    layers = [(torch.randn(1, 2, len(ids), 32) * 50, torch.randn(1, 2, len(ids), 32) * 50) for _ in range(2)]
    request_id = (name or f"pf-{uuid.uuid4().hex}.safetensors").removesuffix(".safetensors")
    meta = artifact_metadata(0, "tiny-moe", 11, (len(ids),), "packed", ids)
    return Path(write_kv_artifact(directory, request_id, layers, meta)["path"])


def descriptor(name: str, ids: list[int], **extra) -> dict:
    return {"name": name, "num_tokens": len(ids), "prompt_sha256": prompt_digest(ids), **extra}


# -- descriptors -----------------------------------------------------------------------------------
RAW_COUNTS = [b"1e999", b"-1", b"0", b"9223372036854775807", b"7.0", b'"40"', b"true", b"null", b"[40]"]


@pytest.mark.timeout(600)
def test_counts_that_overflow_or_are_not_ints_leave_vllm_serving(hostile_vllm, hostile_dwdp):
    ids = prompt(101, 40)
    want = alone(hostile_vllm, ids)
    name = f"pf-{uuid.uuid4().hex}.safetensors"
    for count in RAW_COUNTS:
        raw = (b'{"kv_artifacts": [{"name": "%s", "num_tokens": %s, "prompt_sha256": "%s"}]}'
               % (name.encode(), count, prompt_digest(ids).encode()))
        attack(hostile_vllm, ids, raw_params=raw)
    assert len(connector_lines(hostile_vllm, "num_tokens=")) >= len(RAW_COUNTS)
    victim_unpoisoned(hostile_vllm, ids, want)
    assert_serving(hostile_vllm, 102)


@pytest.mark.timeout(600)
def test_paths_nul_bytes_and_proc_files_name_nothing(hostile_vllm, hostile_dwdp, tmp_path):
    ids = prompt(111, 40)
    want = alone(hostile_vllm, ids)
    outside = forged(tmp_path, ids)
    names = [str(outside), f"../{tmp_path.name}/{outside.name}", outside.name + "\x00", "/proc/self/fd/3",
             f"/proc/{os.getpid()}/fd/0", "../../../../etc/passwd"]
    for name in names:
        attack(hostile_vllm, ids, {"kv_artifacts": [descriptor(name, ids, path=name)]})
    assert outside.exists(), "a file outside the KV directory was removed"
    victim_unpoisoned(hostile_vllm, ids, want)
    assert_serving(hostile_vllm, 112)


@pytest.mark.timeout(600)
def test_a_forged_artifact_outside_the_kv_directory_poisons_no_one(hostile_vllm, hostile_dwdp, tmp_path):
    """The issue's attack: an artifact written where vLLM can read it, with the prompt's own digest, named by
    its bare name (looked up in the KV directory only: missing) and by its path (not a name)."""
    ids = prompt(121, 64)
    want = alone(hostile_vllm, ids)
    outside = forged(tmp_path, ids)
    for desc in (descriptor(outside.name, ids), descriptor(outside.name, ids, path=str(outside))):
        attack(hostile_vllm, ids, {"kv_artifacts": [desc]})
    assert len(connector_lines(hostile_vllm, f"{outside.name} is missing")) == 2
    assert outside.exists()
    victim_unpoisoned(hostile_vllm, ids, want)
    assert_serving(hostile_vllm, 122)


@pytest.mark.timeout(600)
def test_two_thousand_descriptors_are_refused_in_one_short_line(hostile_vllm, hostile_dwdp):
    ids = prompt(131, 1500)
    one = descriptor(f"pf-{uuid.uuid4().hex}.safetensors", ids)
    attack(hostile_vllm, ids, {"kv_artifacts": [one] * 2000})
    lines = connector_lines(hostile_vllm, "holds 2000 descriptors")
    assert len(lines) == 1 and len(lines[0]) < LINE_LIMIT, lines
    assert_serving(hostile_vllm, 132)


# -- files in the KV directory ---------------------------------------------------------------------
@pytest.mark.timeout(600)
def test_symlinks_fifos_and_crafted_headers_in_the_kv_directory_are_refused(hostile_vllm, hostile_dwdp, kv_dir,
                                                                             tmp_path):
    ids = prompt(141, 40)
    want = alone(hostile_vllm, ids)
    outside = forged(tmp_path, ids)
    cases = {}
    name = f"pf-{uuid.uuid4().hex}.safetensors"
    os.symlink(outside, kv_dir / name)
    cases[name] = "is a symlink"
    name = f"pf-{uuid.uuid4().hex}.safetensors"
    os.mkfifo(kv_dir / name, 0o600)
    cases[name] = "is not a regular file"
    headers = {b"[1, 2, 3]": "the header is a list", b"[" * 4000 + b"]" * 4000: "nests too deep",
               json.dumps({"__metadata__": "x"}).encode(): "__metadata__ is not an object of strings",
               json.dumps({"layers.0.keys": {"dtype": "F32", "shape": [1]}}).encode(): "entry is not {dtype"}
    for header, says in headers.items():
        name = f"pf-{uuid.uuid4().hex}.safetensors"
        (kv_dir / name).write_bytes(struct.pack("<Q", len(header)) + header)
        os.chmod(kv_dir / name, 0o600)
        cases[name] = says
    name = f"pf-{uuid.uuid4().hex}.safetensors"
    (kv_dir / name).write_bytes(struct.pack("<Q", 93 << 20) + b"{}")
    os.chmod(kv_dir / name, 0o600)
    cases[name] = "a header of 97517568 bytes"
    for name, says in cases.items():
        attack(hostile_vllm, ids, {"kv_artifacts": [descriptor(name, ids)]})
        lines = connector_lines(hostile_vllm, name)
        assert len(lines) == 1 and says in lines[0] and len(lines[0]) < LINE_LIMIT, (says, lines)
    assert outside.exists() and os.path.islink(kv_dir / next(iter(cases)))
    victim_unpoisoned(hostile_vllm, ids, want)
    assert_serving(hostile_vllm, 142)
    for name in cases:
        os.unlink(kv_dir / name)


@pytest.mark.timeout(600)
def test_a_forged_artifact_in_the_kv_directory_is_loaded_only_for_its_own_prompt(hostile_vllm, hostile_dwdp, kv_dir):
    """Someone who can write the KV directory is trusted (the docs say so); even then a file is loaded only
    for the prompt it names: another prompt's request with its digest recomputes."""
    ids, other = prompt(151, 40), prompt(152, 40)
    want = alone(hostile_vllm, other)
    path = forged(kv_dir, ids)
    attack(hostile_vllm, other, {"kv_artifacts": [dict(descriptor(path.name, ids), num_tokens=40)]})
    assert len(connector_lines(hostile_vllm, f"do not start with the prompt of {path.name}")) == 1
    victim_unpoisoned(hostile_vllm, other, want)
    os.unlink(path)


@pytest.mark.timeout(600)
def test_a_file_truncated_while_the_worker_reads_it_is_recomputed(hostile_vllm, hostile_dwdp, fault_dir):
    """The artifact is cut short between its check and the worker's reads (planted: the worker truncates it
    right after opening): the reads come back short, its blocks are reported failed, vLLM recomputes
    them. A memory-mapped reader would have died of SIGBUS."""
    ids = prompt(161, 70)
    want = alone(hostile_vllm, ids)
    r = httpx.post(f"{hostile_dwdp.url}/v1/prefill", json={"input_ids": ids}, timeout=300).json()
    (fault_dir / "truncate_on_open").touch()
    try:
        got = attack(hostile_vllm, ids, r["kv_transfer_params"], loads=None)
    finally:
        (fault_dir / "truncate_on_open").unlink()
    assert got["choices"][0]["token_ids"] == want, (got["choices"][0]["token_ids"], want)
    name = r["kv_transfer_params"]["kv_artifacts"][0]["name"]
    lines = connector_lines(hostile_vllm, f"loading {name} failed")
    assert len(lines) == 1 and "cut short" in lines[0], lines
    assert_serving(hostile_vllm, 162)


# -- release -------------------------------------------------------------------------------------
@pytest.mark.timeout(600)
def test_release_deletes_nothing_when_the_kv_directory_is_re_pointed_meanwhile(hostile_vllm, hostile_dwdp, kv_dir,
                                                                                 tmp_path):
    """Between the load and the request's end the KV directory's path is made a symlink to a victim's
    directory holding a file of the artifact's name: the release removes nothing there."""
    ids = prompt(171, 40)
    r = httpx.post(f"{hostile_dwdp.url}/v1/prefill", json={"input_ids": ids}, timeout=300).json()
    name = r["kv_transfer_params"]["kv_artifacts"][0]["name"]
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / name).write_text("the victim's file")
    moved = kv_dir.with_name(kv_dir.name + "-moved")
    body = {"model": VLLM_MODEL, "prompt": ids, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True, "kv_transfer_params": r["kv_transfer_params"]}
    try:
        with httpx.stream("POST", f"{hostile_vllm.url}/v1/completions", json=body, timeout=300) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))  # loaded and decoding
            os.rename(kv_dir, moved)
            os.symlink(victim, kv_dir)
            rest = [line for line in lines if line.startswith("data:")]
        assert rest[-1] == "data: [DONE]" and json.loads(first[5:])["choices"], (first, rest[-3:])
        assert (victim / name).read_text() == "the victim's file"
    finally:
        if kv_dir.is_symlink():
            kv_dir.unlink()
            os.rename(moved, kv_dir)
    assert_serving(hostile_vllm, 172)


# -- exceptions in every entry point ---------------------------------------------------------------
@pytest.mark.timeout(900)
def test_an_exception_in_any_entry_point_leaves_vllm_serving_and_the_request_recomputed(hostile_vllm, hostile_dwdp,
                                                                                       fault_dir):
    assert {"get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
            "start_load_kv", "wait_for_layer_load", "wait_for_save", "get_block_ids_with_load_errors"} <= set(
        ENTRY_POINTS), ENTRY_POINTS
    rng = random.Random(0)
    for method in ENTRY_POINTS:
        ids = prompt(rng.randrange(1 << 30), 70)
        want = alone(hostile_vllm, ids)
        r = httpx.post(f"{hostile_dwdp.url}/v1/prefill", json={"input_ids": ids}, timeout=300).json()
        (fault_dir / method).touch()
        try:
            got = attack(hostile_vllm, ids, r["kv_transfer_params"], loads=None)
        finally:
            (fault_dir / method).unlink()
        assert got["choices"][0]["token_ids"] == want, (method, got["choices"][0]["token_ids"], want)
        lines = connector_lines(hostile_vllm, f"{method} raised RuntimeError: planted in {method}")
        assert lines and all(len(line) < LINE_LIMIT for line in lines), (method, lines[:2])
        victim_unpoisoned(hostile_vllm, ids, want)
    assert_serving(hostile_vllm, 181)
    # With nothing planted the same hand-off loads again.
    ids = prompt(182, 70)
    r = httpx.post(f"{hostile_dwdp.url}/v1/prefill", json={"input_ids": ids}, timeout=300).json()
    got = attack(hostile_vllm, ids, r["kv_transfer_params"], loads=len(ids) - 1)
    assert got["choices"][0]["token_ids"] == alone(hostile_vllm, ids)


@pytest.mark.timeout(600)
def test_the_pair_still_answers_as_vllm_alone(hostile_vllm, hostile_dwdp):
    ids = prompt(191, 97)
    want = alone(hostile_vllm, ids)
    r = httpx.post(f"{hostile_dwdp.url}/v1/completions", json={"model": model_name(hostile_dwdp), "prompt": ids,
                                                                "max_tokens": NUM_TOKENS, "ignore_eos": True},
                   timeout=300)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == want, r.text
    assert r.json()["choices"][0]["decode"] == {"prompt_tokens_loaded": len(ids)}, r.json()["choices"][0]


@pytest.mark.timeout(600)
def test_without_the_reservation_setting_the_connector_says_how_to_keep_vllm_alones_cores(hostile_vllm):
    advice = [line for line in hostile_vllm.output().splitlines() if "VLLM_CPU_NUM_OF_RESERVED_CPU=1" in line]
    assert len(advice) == 1 and "dwdp connector" in advice[0], advice

