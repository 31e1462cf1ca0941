"""The KV hand-off as a hostile client of the decode engine would try it, against the connector's transfer
half (dwdp.integrations.kv_transfer) without vLLM: every attack ends in `Refused` (the engine recomputes),
never another exception, a hang, a read or a removal outside the KV directory. The same attacks against a
live vLLM: tests/vllm/check_hostile.py.

Attacks: descriptors with counts that overflow or are not ints, names that are paths, NUL bytes, /proc
files; files in the KV directory that are symlinks, FIFOs, directories, hard links, writable by others
or another user's; crafted headers (not an object, entries without offsets, metadata that is not
strings, counts that are words, deep nesting, a header of 93 MiB, offsets past the end, unknown tensors);
a file cut short after its check or while it is read; 2,000 descriptors; forged and tampered descriptors
against a KV key; the release re-pointed at another directory or another file between check and release.
"""
from __future__ import annotations

import contextlib
import json
import os
import struct
import tempfile
import uuid
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dwdp.integrations import kv_transfer
from dwdp.integrations.kv_transfer import EngineKV, FileTransfer, Refused
from dwdp.serve.kv import artifact_metadata, prompt_digest, write_kv_artifact
from dwdp.serve.kv_handoff import authenticator, handoff_descriptor

ENGINE = EngineKV(model="tiny-moe", num_layers=2, num_kv_heads=2, key_dim=32, value_dim=32, dtype="float32")
PROMPT = [5, 17, 9, 300, 42, 7, 8]
KEY = b"k" * 32


def _private_dir(root: Path) -> Path:
    path = root / "kv"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def kv_dir(tmp_path):
    return _private_dir(tmp_path)


def honest(kv_dir: Path, ids=PROMPT, key: bytes | None = None) -> dict:
    """An honest artifact of `ids` and its descriptor, as dwdp serve hands it out."""
    gen = torch.Generator().manual_seed(len(ids))
    kv = [(torch.randn(1, 2, len(ids), 32, generator=gen), torch.randn(1, 2, len(ids), 32, generator=gen))
          for _ in range(2)]
    request_id = f"pf-{uuid.uuid4().hex}"
    desc = write_kv_artifact(kv_dir, request_id, kv, artifact_metadata(0, "tiny-moe", 11, (len(ids),), "packed", ids))
    return handoff_descriptor(request_id, desc, "tiny-moe", key)


def fresh_name() -> str:
    return f"pf-{uuid.uuid4().hex}.safetensors"


def params(*descriptors) -> dict:
    return {"kv_artifacts": list(descriptors)}


def refused(transfer: FileTransfer, p, prompt=PROMPT, engine=ENGINE, **kw) -> str:
    """The reason `transfer` refuses request params `p` (a test failure for anything else)."""
    with pytest.raises(Refused) as info:
        transfer.check(p, prompt, engine, **kw)
    return str(info.value)


# -- the descriptor: typed, bounded, a name and never a path ---------------------------------------
BAD_COUNTS = [float("inf"), float("nan"), 1e999, 7.0, "7", True, 0, -1, 2**64, None, [7], {"n": 7}]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("count", BAD_COUNTS, ids=[repr(c)[:20] for c in BAD_COUNTS])
def test_a_token_count_that_is_not_an_int_within_the_prompt_is_refused(kv_dir, count):
    desc = honest(kv_dir)
    why = refused(FileTransfer(str(kv_dir)), params(dict(desc, num_tokens=count)))
    assert "num_tokens=" in why and "expected an int in [1, 7]" in why, why


SECRET_NAME = "secret.txt"
PATH_NAMES = ["/etc/passwd", "../secret.txt", "../kv/" + "pf-" + "0" * 32 + ".safetensors",
              "pf-" + "0" * 32 + ".safetensors\x00", "pf-" + "0" * 32 + ".safetensors/..", "/proc/self/fd/3",
              "pf-" + "A" * 32 + ".safetensors", "pf-1.safetensors", "", 12, None, ["pf-x"]]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("name", PATH_NAMES, ids=[repr(n)[:30] for n in PATH_NAMES])
def test_a_name_that_is_not_dwdps_is_refused_before_any_file_is_touched(kv_dir, monkeypatch, name):
    desc = honest(kv_dir)
    opened = []
    monkeypatch.setattr(kv_transfer.os, "open", lambda *a, **kw: opened.append(a) or pytest.fail(f"opened {a}"))
    why = refused(FileTransfer(str(kv_dir)), params(dict(desc, name=name, path=name)))
    assert "is not dwdp's (pf-<32 hex>.safetensors; a name, never a path)" in why and opened == [], (why, opened)


@pytest.mark.timeout(10)
def test_a_path_alone_names_nothing(kv_dir):
    """The descriptor of an older release (a path, no name): the path is never read."""
    desc = honest(kv_dir)
    del desc["name"]
    assert "artifact name None is not dwdp's" in refused(FileTransfer(str(kv_dir)), params(desc))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("kv_artifacts", [{"name": "x"}, "pf-x", 7, [7], [["x"]], [None]])
def test_kv_artifacts_of_the_wrong_shape_are_refused(kv_dir, kv_artifacts):
    why = refused(FileTransfer(str(kv_dir)), {"kv_artifacts": kv_artifacts})
    assert "kv_artifacts" in why or "entry is" in why, why


@pytest.mark.timeout(10)
def test_two_thousand_descriptors_are_refused_at_once_in_a_short_line(kv_dir, monkeypatch):
    hashed = []
    monkeypatch.setattr(kv_transfer, "prompt_digest", lambda ids: hashed.append(len(ids)) or "0" * 64)
    desc = honest(kv_dir)
    why = refused(FileTransfer(str(kv_dir)), params(*[desc] * 2000), prompt=PROMPT * 1000)
    assert why == "kv_artifacts holds 2000 descriptors; a request loads exactly one" and hashed == [], why


@pytest.mark.timeout(10)
@pytest.mark.parametrize("digest", ["0" * 63, "g" * 64, "A" * 64, 7, None, "0" * 65])
def test_a_digest_that_is_not_64_hex_is_refused(kv_dir, digest):
    desc = honest(kv_dir)
    assert "is not 64 lowercase hex digits" in refused(FileTransfer(str(kv_dir)), params(dict(desc, prompt_sha256=digest)))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("what", ["a LoRA adapter", "multimodal inputs", "a cache_salt"])
def test_a_request_whose_kv_is_more_than_its_token_ids_is_refused(kv_dir, what):
    desc = honest(kv_dir)
    why = refused(FileTransfer(str(kv_dir)), params(desc), unsupported=what)
    assert why == f"the request has {what}: dwdp's KV covers token ids only"


# -- the KV key: only descriptors dwdp serve signed -------------------------------------------------
@pytest.mark.timeout(10)
def test_with_a_key_only_descriptors_dwdp_signed_for_this_prompt_and_model_load(kv_dir, monkeypatch):
    transfer = FileTransfer(str(kv_dir), key=KEY)
    desc = honest(kv_dir, key=KEY)
    assert transfer.check(params(desc), PROMPT, ENGINE).name == desc["name"]
    opened = []
    real_open = os.open
    monkeypatch.setattr(kv_transfer.os, "open", lambda *a, **kw: opened.append(a) or real_open(*a, **kw))
    unsigned = {k: v for k, v in desc.items() if k != "auth"}
    assert "no valid authenticator" in refused(transfer, params(unsigned))
    other_key = dict(desc, auth=authenticator(b"x" * 32, desc["name"], desc["prompt_sha256"], "tiny-moe", 7))
    assert "authenticator does not match" in refused(transfer, params(other_key))
    # A client who knows the prompt computes the digest of a shorter prefix and keeps dwdp's authenticator.
    shorter = dict(desc, num_tokens=3, prompt_sha256=prompt_digest(PROMPT[:3]))
    assert "authenticator does not match" in refused(transfer, params(shorter))
    another_model = EngineKV(**{**ENGINE.__dict__, "model": "other-model"})
    assert "authenticator does not match" in refused(transfer, params(desc), engine=another_model)
    assert opened == [], f"a descriptor without a valid authenticator opened {opened}"


# -- what the KV directory holds: regular files of its owner only ---------------------------------
def _outside_secret(tmp_path: Path) -> Path:
    secret = tmp_path / SECRET_NAME
    secret.write_text("not KV")
    return secret


@pytest.mark.timeout(10)
def test_a_symlink_under_an_artifact_name_is_neither_followed_nor_removed(kv_dir, tmp_path):
    secret = _outside_secret(tmp_path)
    desc = honest(kv_dir)
    os.remove(desc["path"])
    os.symlink(secret, desc["path"])
    transfer = FileTransfer(str(kv_dir))
    assert "is a symlink" in refused(transfer, params(desc))
    assert secret.read_text() == "not KV" and os.path.islink(desc["path"])


@pytest.mark.timeout(10)
def test_a_fifo_under_an_artifact_name_is_refused_without_blocking(kv_dir):
    desc = honest(kv_dir)
    os.remove(desc["path"])
    os.mkfifo(desc["path"], 0o600)
    assert "is not a regular file" in refused(FileTransfer(str(kv_dir)), params(desc))


@pytest.mark.timeout(10)
def test_a_directory_under_an_artifact_name_is_refused(kv_dir):
    desc = honest(kv_dir)
    os.remove(desc["path"])
    os.mkdir(desc["path"], 0o700)
    assert "is not a regular file" in refused(FileTransfer(str(kv_dir)), params(desc))


@pytest.mark.timeout(10)
def test_a_hard_link_is_refused(kv_dir, tmp_path):
    desc = honest(kv_dir)
    os.link(desc["path"], tmp_path / "elsewhere")
    assert "has 2 links" in refused(FileTransfer(str(kv_dir)), params(desc))


@pytest.mark.timeout(10)
def test_a_file_others_may_write_is_refused(kv_dir):
    desc = honest(kv_dir)
    os.chmod(desc["path"], 0o666)
    assert "writable by others" in refused(FileTransfer(str(kv_dir)), params(desc))


@pytest.mark.timeout(10)
def test_a_kv_directory_others_may_write_or_that_is_a_symlink_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    desc = honest(shared)
    assert "writable by others" in refused(FileTransfer(str(shared)), params(desc))
    private = _private_dir(tmp_path)
    os.symlink(private, tmp_path / "link")
    desc = honest(private)
    assert "is a symlink" in refused(FileTransfer(str(tmp_path / "link")), params(desc))


@pytest.mark.timeout(10)
def test_files_of_another_user_are_refused(kv_dir):
    desc = honest(kv_dir)
    why = refused(FileTransfer(str(kv_dir), owner_uid=os.geteuid() + 1), params(desc))
    assert f"belongs to uid {os.geteuid()}, not {os.geteuid() + 1}" in why, why
    if os.geteuid() == 0:  # a file (not the directory) handed to another user
        os.chown(desc["path"], 4321, -1)
        assert "belongs to uid 4321" in refused(FileTransfer(str(kv_dir)), params(desc))


# -- crafted headers --------------------------------------------------------------------------------
def crafted(kv_dir: Path, header: bytes, body: bytes = b"", length: int | None = None) -> dict:
    """A file under a fresh artifact name: the 8-byte header length (`length`, default the header's),
    the header bytes, then `body`; and a descriptor that names it for PROMPT."""
    name = fresh_name()
    (kv_dir / name).write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + body)
    os.chmod(kv_dir / name, 0o600)
    return {"name": name, "num_tokens": len(PROMPT), "prompt_sha256": prompt_digest(PROMPT)}


def _entry(dtype="F32", shape=(1, 2, 7, 32), offsets=(0, 1792)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


META = {"format": "dwdp-kv-v1", "prompt_sha256": prompt_digest(PROMPT), "model": "tiny-moe", "num_layers": "2",
        "num_tokens": "7"}
HEADERS = {
    "a list": (b"[1, 2, 3]", "the header is a list"),
    "a number": (b"7", "the header is a int"),
    "not JSON": (b"{\"a\": ", "the header is not JSON"),
    "not UTF-8": (b"\xff\xfe{}", "the header is not JSON"),
    "nested deep": (b"[" * 4000 + b"]" * 4000, "nests too deep"),
    "metadata a string": (json.dumps({"__metadata__": "x"}).encode(), "__metadata__ is not an object of strings"),
    "metadata of numbers": (json.dumps({"__metadata__": {"num_layers": 2}}).encode(),
                            "__metadata__ is not an object of strings"),
    "entry without offsets": (json.dumps({"layers.0.keys": {"dtype": "F32", "shape": [1]}}).encode(),
                              "entry is not {dtype, shape, data_offsets}"),
    "entry a list": (json.dumps({"layers.0.keys": [1, 2]}).encode(), "entry is not {dtype, shape, data_offsets}"),
    "unknown tensor": (json.dumps({"weights": _entry()}).encode(), "tensor 'weights' is not one an artifact holds"),
    "a dtype of another size": (json.dumps({"layers.0.keys": _entry(dtype="F64")}).encode(), "has dtype 'F64'"),
    "a shape of bools": (json.dumps({"layers.0.keys": _entry(shape=(True, 2))}).encode(), "has shape [True, 2]"),
    "negative offsets": (json.dumps({"layers.0.keys": _entry(offsets=(-8, 1784))}).encode(), "has data_offsets"),
    "offsets not the shape's bytes": (json.dumps({"layers.0.keys": _entry(offsets=(0, 8))}).encode(),
                                      "spans 8 bytes, its shape [1, 2, 7, 32] needs 1792"),
    "layers a word": (json.dumps({"__metadata__": dict(META, num_layers="two")}).encode(),
                      "metadata num_layers='two' is not a count"),
    "offsets past the end": (json.dumps({"__metadata__": META, "layers.0.keys": _entry()}).encode(), "is truncated"),
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("case", list(HEADERS))
def test_a_crafted_header_is_refused_naming_why(kv_dir, case):
    header, says = HEADERS[case]
    why = refused(FileTransfer(str(kv_dir)), params(crafted(kv_dir, header)))
    assert says in why, why


@pytest.mark.timeout(10)
@pytest.mark.parametrize("length", [93 << 20, 1 << 63])
def test_a_huge_header_is_refused_before_it_is_read(kv_dir, monkeypatch, length):
    desc = crafted(kv_dir, b"{}", length=length)
    reads = []
    real_pread = os.pread
    monkeypatch.setattr(kv_transfer.os, "pread", lambda fd, n, at: reads.append(n) or real_pread(fd, n, at))
    why = refused(FileTransfer(str(kv_dir)), params(desc))
    assert f"a header of {length} bytes, above the {ENGINE.header_cap}" in why and reads == [8], (why, reads)


@pytest.mark.timeout(10)
def test_a_file_cut_after_its_check_is_refused_by_the_reader_never_mapped(kv_dir):
    """Cut between the scheduler's check and the worker's open: refused at open (another size). Cut
    after the worker opened it: the pread comes back short, an error the connector reports as failed
    blocks; a memory-mapped reader would have died of SIGBUS."""
    transfer = FileTransfer(str(kv_dir))
    desc = honest(kv_dir)
    ref = transfer.check(params(desc), PROMPT, ENGINE)
    os.truncate(desc["path"], ref.size - 100)
    with pytest.raises(Refused, match="is not the file that was checked"):
        transfer.open(ref)
    desc = honest(kv_dir)
    ref = transfer.check(params(desc), PROMPT, ENGINE)
    reader = transfer.open(ref)
    reader.layer(0)
    os.truncate(desc["path"], 200)
    with pytest.raises(Refused, match=r"layers\.1\.keys cut short at 0 of 1792 bytes"):
        reader.layer(1)
    reader.close()


# -- release: only the file that was loaded, only in the KV directory -----------------------------
@pytest.mark.timeout(10)
def test_release_removes_nothing_when_the_directory_path_was_re_pointed(kv_dir, tmp_path):
    """The issue's race: the KV directory's path re-pointed (a symlink) at a victim's directory holding a
    file of the same name between the load and the release."""
    transfer = FileTransfer(str(kv_dir))
    desc = honest(kv_dir)
    ref = transfer.check(params(desc), PROMPT, ENGINE)
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / desc["name"]).write_text("the victim's")
    os.rename(kv_dir, tmp_path / "moved")
    os.symlink(victim, kv_dir)
    assert not transfer.release(ref)
    assert (victim / desc["name"]).read_text() == "the victim's"
    assert (tmp_path / "moved" / desc["name"]).exists()


@pytest.mark.timeout(10)
def test_release_leaves_another_file_under_the_loaded_name(kv_dir):
    transfer = FileTransfer(str(kv_dir))
    desc, other = honest(kv_dir), honest(kv_dir, ids=[1, 2, 3])
    ref = transfer.check(params(desc), PROMPT, ENGINE)
    os.replace(other["path"], desc["path"])
    assert not transfer.release(ref) and os.path.exists(desc["path"])


@pytest.mark.timeout(10)
def test_a_directory_made_anew_under_the_same_path_is_opened_again(kv_dir, tmp_path):
    """dwdp serve may make its directory anew (a restart): the connector follows the path, not the old one."""
    transfer = FileTransfer(str(kv_dir))
    transfer.check(params(honest(kv_dir)), PROMPT, ENGINE)
    os.rename(kv_dir, tmp_path / "old")
    kv_dir.mkdir(mode=0o700)
    desc = honest(kv_dir)
    assert transfer.check(params(desc), PROMPT, ENGINE).name == desc["name"]


# -- any descriptor, any header: Refused or a load, and nothing opened outside the directory -------
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                   max_size=4), max_leaves=12)
_names = st.sampled_from(["../x", "/etc/passwd", "pf-" + "0" * 32 + ".safetensors", "x\x00y"]) | st.text(max_size=40)
# Mostly well-formed counts and digests, so that drawn descriptors reach the file as often as not.
_descriptor = st.fixed_dictionaries({"num_tokens": st.just(len(PROMPT)) | st.integers(-3, 10) | _json,
                                     "prompt_sha256": st.just(prompt_digest(PROMPT)) | st.just(prompt_digest(PROMPT))
                                     | _json},
                                    optional={"name": _names | _json, "auth": _json, "path": _names})
_header = st.binary(max_size=300) | _json.map(lambda v: json.dumps(v).encode()) | st.fixed_dictionaries(
    {"__metadata__": st.dictionaries(st.sampled_from(sorted(META)), st.text(max_size=8) | st.sampled_from(
        list(META.values()))), "layers.0.keys": st.fixed_dictionaries(
        {"dtype": st.sampled_from(["F32", "BF16", "F64", 1]), "shape": st.lists(st.integers(-1, 40), max_size=5),
         "data_offsets": st.lists(st.integers(-2, 4000), max_size=3)})}).map(lambda v: json.dumps(v).encode())


@contextlib.contextmanager
def _opens_recorded():
    """Every os.open / os.stat the transfer makes, as (path, dir_fd)."""
    calls, real_open, real_stat = [], os.open, os.stat

    def recording_open(path, flags, mode=0o777, *, dir_fd=None):
        calls.append((path, dir_fd))
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def recording_stat(path, *, dir_fd=None, follow_symlinks=True):
        calls.append((path, dir_fd))
        return real_stat(path, dir_fd=dir_fd, follow_symlinks=follow_symlinks)

    kv_transfer.os.open, kv_transfer.os.stat = recording_open, recording_stat
    try:
        yield calls
    finally:
        kv_transfer.os.open, kv_transfer.os.stat = real_open, real_stat


_PROPERTY_ROOT = Path(tempfile.mkdtemp(prefix="dwdp-kv-property-"))
_PROPERTY_DIR = _private_dir(_PROPERTY_ROOT)


@pytest.mark.timeout(120)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(descriptor=_descriptor, header=_header, use_file=st.booleans(), well_formed=st.booleans(),
       count=st.sampled_from([1, 1, 1, 0, 2, 3]))
def test_any_descriptor_and_header_is_refused_or_loaded_and_nothing_is_opened_outside(descriptor, header, use_file,
                                                                                       well_formed, count):
    transfer = FileTransfer(str(_PROPERTY_DIR))
    if use_file:  # the descriptor names a file in the directory holding the drawn header
        name = fresh_name()
        path = _PROPERTY_DIR / name
        path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(64))
        os.chmod(path, 0o600)
        descriptor = dict(descriptor, name=name)
        if well_formed:  # the descriptor passes, so the file's header is what is drawn against the checks
            descriptor.update(num_tokens=len(PROMPT), prompt_sha256=prompt_digest(PROMPT))
    with _opens_recorded() as calls:
        try:
            transfer.check(params(*[descriptor] * count), PROMPT, ENGINE)
        except Refused:
            pass
    assert_inside(calls, _PROPERTY_DIR)


def assert_inside(calls, directory: Path) -> None:
    """Every recorded (path, dir_fd): the directory itself, or a bare artifact name relative to its descriptor."""
    for path, dir_fd in calls:
        assert dir_fd is not None or path == str(directory), f"opened {path!r} outside the KV directory"
        assert dir_fd is None or (isinstance(path, str) and "/" not in path and path.startswith("pf-")), path


@pytest.mark.timeout(10)
def test_an_honest_load_opens_nothing_but_the_directory_and_names_in_it(kv_dir):
    transfer = FileTransfer(str(kv_dir))
    desc = honest(kv_dir)
    with _opens_recorded() as calls:
        ref = transfer.check(params(desc), PROMPT, ENGINE)
        transfer.open(ref).close()
        assert transfer.release(ref)
    assert len(calls) >= 3, calls
    assert_inside(calls, kv_dir)
