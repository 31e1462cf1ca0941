"""The board in the world's store (dwdp.runtime.store_board): entries of this node read live by pid, of
another node by beat; hostile values read as none; a withdrawal never clears a newer entry; a replacement
finds a group that published in the store, and one that did not on its node."""
from __future__ import annotations

import json
import os

import pytest
import torch.distributed as dist

from dwdp.runtime.board import Board
from dwdp.runtime.group import DWDPGroup, LoopbackStore, free_port
from dwdp.runtime.store_board import MAX_ENTRY_BYTES, StoreBoard, board_key, find_board
from dwdp.runtime.store_liveness import StoreBeat

GID = "g-test"


def _record(beat: StoreBeat | None = None) -> dict:
    return {"path": "/proc/1/fd/3", "pid": os.getpid(), **({"beat": beat.handle()} if beat else {})}


@pytest.fixture
def store():
    return dist.HashStore()


def _on(monkeypatch, node: str):
    monkeypatch.setenv("DWDP_NODE", node)


def test_an_entry_of_this_node_reads_live_while_its_process_runs(store, monkeypatch):
    _on(monkeypatch, "node0")
    board = StoreBoard(GID, store)
    assert board.read(1) is None
    board.publish(1, {"seg": 1}, _record(), 77)
    entry = board.read(1)
    assert (entry["pid"], entry["host"], entry["segment"], entry["dense_checksum"]) == (os.getpid(), "node0", {"seg": 1}, 77)
    stale = dict(entry, pid=2**22 + 17, start_time=1)  # a process that is gone
    store.set(board_key(GID, 2), json.dumps(stale))
    assert board.read(2) is None
    board.sweep(2)
    assert bytes(store.get(board_key(GID, 2))) == b""


def test_an_entry_of_another_node_reads_live_by_its_beat(store, monkeypatch):
    _on(monkeypatch, "node1")
    beat = StoreBeat(store, GID, 3)
    StoreBoard(GID, store).publish(3, {"seg": 3}, _record(beat), 5)
    _on(monkeypatch, "node0")
    reader = StoreBoard(GID, store)
    assert reader.read(3)["host"] == "node1"
    reader.sweep(3)  # its beat names it: not swept
    assert reader.read(3) is not None
    StoreBeat(store, GID, 3)  # a new incarnation took the beat key: the entry's process is gone
    assert reader.read(3) is None
    reader.sweep(3)
    assert bytes(store.get(board_key(GID, 3))) == b""


@pytest.mark.parametrize("state", ["closed", "failed"])
def test_an_entry_of_another_node_whose_beat_says_closed_or_failed_is_gone(store, monkeypatch, state):
    _on(monkeypatch, "node1")
    beat = StoreBeat(store, GID, 2)
    StoreBoard(GID, store).publish(2, {}, _record(beat), 5)
    beat.set_state({"closed": 2, "failed": 3}[state])
    _on(monkeypatch, "node0")
    assert StoreBoard(GID, store).read(2) is None


@pytest.mark.parametrize("value", [b"not json", b"[1, 2]", json.dumps({"pid": "1"}).encode(),
                                   b"{" + b" " * MAX_ENTRY_BYTES + b"}", b"\xff\xfe"])
def test_a_value_that_is_not_an_entry_reads_as_none(store, monkeypatch, value):
    _on(monkeypatch, "node0")
    store.set(board_key(GID, 1), value)
    assert StoreBoard(GID, store).read(1) is None


def test_an_entry_naming_another_key_for_its_beat_is_not_read_there(store, monkeypatch):
    """The beat read is the rank's own key: an entry cannot point the reader at another rank's live beat."""
    _on(monkeypatch, "node1")
    live = StoreBeat(store, GID, 0)
    forged = {"pid": 1, "start_time": 1, "host": "node1", "segment": {}, "dense_checksum": 5,
              "record": {"path": "/x", "pid": 1, "beat": live.handle()}}  # rank 0's beat, on rank 3's key
    store.set(board_key(GID, 3), json.dumps(forged))
    _on(monkeypatch, "node0")
    assert StoreBoard(GID, store).read(3) is None


def test_withdrawing_clears_only_the_entry_this_process_wrote(store, monkeypatch):
    _on(monkeypatch, "node0")
    old = StoreBoard(GID, store)
    old.publish(1, {"seg": "old"}, _record(), 5)
    newer = StoreBoard(GID, store)
    newer.publish(1, {"seg": "new"}, _record(), 5)  # a replacement wrote over it
    old.withdraw(1)
    assert newer.read(1)["segment"] == {"seg": "new"}
    newer.withdraw(1)
    assert newer.read(1) is None


def test_an_unreachable_store_finds_nothing_and_loses_nothing(monkeypatch):
    class Gone:
        def check(self, keys):
            raise RuntimeError("Connection reset by peer")

        get = set = compare_set = check

    _on(monkeypatch, "node0")
    board = StoreBoard(GID, Gone())
    assert board.read(1) is None
    board.sweep(1)
    board.withdraw(1)


def test_a_replacement_finds_its_group_in_the_store_when_it_published_there_else_on_its_node(monkeypatch, tmp_path):
    monkeypatch.setenv("DWDP_SHM_DIR", str(tmp_path))
    _on(monkeypatch, "node1")
    group = DWDPGroup(rank=1, size=2, group_id=GID, rejoining=True)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert isinstance(find_board(group), Board)
    store = LoopbackStore(30)
    try:
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(store.port))
        assert isinstance(find_board(group), Board)  # a store with no entry of the group: one node's group
        StoreBoard(GID, store.store).publish(0, {}, _record(StoreBeat(store.store, GID, 0)), 5)
        found = find_board(group)
        assert isinstance(found, StoreBoard) and found.read(0) is not None
    finally:
        store.close()


def test_a_replacement_whose_group_is_on_no_local_board_and_whose_store_is_gone_is_told_why(monkeypatch, tmp_path):
    monkeypatch.setenv("DWDP_SHM_DIR", str(tmp_path))
    _on(monkeypatch, "node1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nobody listens there
    group = DWDPGroup(rank=1, size=2, group_id=GID, rejoining=True)
    with pytest.raises(RuntimeError, match=r"rank 1 cannot rejoin group 'g-test'.*127\.0\.0\.1:\d+.*store is back"):
        find_board(group)
    Board(GID).publish(0, {}, _record(), 5)  # a live peer on this node's board: a group on one node
    assert isinstance(find_board(group), Board)
