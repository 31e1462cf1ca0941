"""What `dwdp serve` holds on its machine: a KV directory of its own (0700, refused when another user or
anyone else could write there, held by one server, cleared of an earlier server's artifacts) and its
workers' rendezvous store, reachable from this host only."""
from __future__ import annotations

import os
import uuid

import pytest
import torch.distributed as dist

from dwdp.runtime.group import LoopbackStore
from dwdp.serve.kv_dir import LOCK_NAME, KVDirError, claim_kv_dir
from sockets import is_loopback, listening


@pytest.mark.timeout(10)
def test_a_new_kv_directory_is_0700_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        claim = claim_kv_dir(str(tmp_path / "a" / "kv"))
    finally:
        os.umask(old)
    assert oct(os.stat(claim.path).st_mode & 0o777) == oct(0o700)
    claim.release()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702])
def test_an_existing_directory_others_may_write_is_refused_in_one_line(tmp_path, mode):
    path = tmp_path / "kv"
    path.mkdir()
    os.chmod(path, mode)
    with pytest.raises(KVDirError) as info:
        claim_kv_dir(str(path))
    assert str(info.value) == (f"--kv-dir {path} has mode {mode:o}: others may write there; chmod 700 it or give "
                               "a new path")
    os.chmod(path, 0o755)  # readable by others, writable by its owner only: taken
    claim_kv_dir(str(path)).release()


@pytest.mark.timeout(10)
def test_a_symlink_or_another_users_directory_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    os.symlink(real, tmp_path / "link")
    with pytest.raises(KVDirError, match="is a symlink; give the directory itself"):
        claim_kv_dir(str(tmp_path / "link"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(KVDirError, match="is not a directory"):
        claim_kv_dir(str(tmp_path / "file"))
    if os.geteuid() != 0:
        pytest.skip("handing a directory to another user needs root")
    os.chown(real, 4321, -1)
    with pytest.raises(KVDirError, match=f"belongs to uid 4321, not this user \\({os.geteuid()}\\)"):
        claim_kv_dir(str(real))


@pytest.mark.timeout(10)
def test_one_server_holds_a_kv_directory_and_sweeps_what_an_earlier_one_left(tmp_path):
    path = tmp_path / "kv"
    path.mkdir(mode=0o700)
    left = [f"pf-{uuid.uuid4().hex}.safetensors", f".pf-{uuid.uuid4().hex}.safetensors.tmp"]
    kept = ["notes.txt", "pf-x.safetensors", f"pf-{uuid.uuid4().hex}.safetensors.bak"]
    for name in left + kept:
        (path / name).write_bytes(b"kv")
    os.mkdir(path / f"pf-{uuid.uuid4().hex}.safetensors")  # not a regular file: left alone
    claim = claim_kv_dir(str(path))
    assert claim.swept == 2
    assert sorted(p.name for p in path.iterdir() if p.is_file()) == sorted(kept + [LOCK_NAME])
    with pytest.raises(KVDirError, match="is held by another running dwdp serve"):
        claim_kv_dir(str(path))
    claim.release()
    claim_kv_dir(str(path)).release()


@pytest.mark.timeout(30)
def test_the_group_store_listens_on_loopback_only_and_serves_its_ranks(tmp_path):
    store = LoopbackStore(timeout_s=10)
    try:
        sockets = [s for s in listening([os.getpid()]) if s[1] == store.port]
        assert sockets and all(is_loopback(address) for address, _, _ in sockets), sockets
        env = store.env()
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["TORCHELASTIC_USE_AGENT_STORE"] == "True", env
        client = dist.TCPStore("127.0.0.1", store.port, None, False)
        client.set("k", "v")
        assert store.store.get("k") == b"v"
    finally:
        store.close()
