"""The board of a group spanning nodes, in the world's store (torchrun's agent store, or the store `dwdp
serve` hosts on its first node): what dwdp.runtime.board keeps in one node's directory, reachable from
every node, so that a replacement on any node finds its group and its peers find it again.

The key `dwdp/<group id>/board/<rank>` holds the same JSON entry as a board file, with the node it runs on
("host") and its liveness handle's beat (dwdp.runtime.store_liveness). Whether an entry's process lives
is read the way its node allows: a process on this node by its pid and start time, one on another node by
its beat (the key `dwdp/<group id>/beat/<rank>` still naming the entry's incarnation, not closed or
failed). A process killed on another node keeps its last beat: its entry reads as live until a peer
that watches its beats declares it lost and sweeps it, or a replacement writes over it.

Keys are never deleted (a reader's `get` of a deleted key would wait for the store's timeout): an
entry withdrawn or swept is overwritten with an empty value, and only if it still holds what the
withdrawing rank read (compare-and-set), so no rank removes another's newer entry. Entries are
untrusted input: one that is too long, not JSON, or not shaped like an entry reads as none.
"""
from __future__ import annotations

import json
import logging
import os

from dwdp import envs
from dwdp.runtime.board import Board, _entry_alive, _start_time
from dwdp.runtime.store_liveness import CLOSED, FAILED, beat_key, parse_beat

log = logging.getLogger("dwdp")

MAX_ENTRY_BYTES = 4 << 20  # handles of a few hundred allocations (fabric: 128 hex digits each); longer is not ours
FIND_TIMEOUT_S = 5.0         # how long a replacement tries to reach the store before it looks on its node


def board_key(group_id: str, rank: int) -> str:
    return f"dwdp/{group_id}/board/{rank}"


def _is_entry(entry) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("pid"), int) and isinstance(entry.get("segment"), dict)
            and isinstance(entry.get("record"), dict) and isinstance(entry.get("dense_checksum"), int)
            and isinstance(entry.get("host"), str))


class StoreBoard:
    """The board of group `group_id` in `store` (a torch.distributed store client of this process)."""

    def __init__(self, group_id: str, store):
        if not group_id or "/" in group_id:
            raise ValueError(f"group_id={group_id!r} must be a non-empty name without '/'")
        self.group_id, self.store = group_id, store
        self.node = envs.node_name()
        self._written: dict[int, bytes] = {}  # rank -> the value this process published
        self._unreachable = False

    def __repr__(self) -> str:
        return f"StoreBoard({self.group_id!r})"

    def _get(self, key: str) -> bytes | None:
        """The value under `key`, None when there is none or the store does not answer (its host is gone:
        nobody is found, nobody is lost by it)."""
        try:
            raw = bytes(self.store.get(key)) if self.store.check([key]) else None
        except Exception as exc:
            if not self._unreachable:
                log.warning("%s unreadable: the store is unreachable (%s: %s)", key, type(exc).__name__, exc)
            self._unreachable = True
            return None
        self._unreachable = False
        return raw

    def _raw(self, rank: int) -> bytes | None:
        return self._get(board_key(self.group_id, rank))

    @staticmethod
    def _parse(raw: bytes | None) -> dict | None:
        if not raw or len(raw) > MAX_ENTRY_BYTES:
            return None
        try:
            entry = json.loads(raw)
        except (UnicodeDecodeError, ValueError):
            return None
        return entry if _is_entry(entry) else None

    def _alive(self, rank: int, entry: dict) -> bool:
        if entry["host"] == self.node:
            return _entry_alive(entry)
        beat = entry["record"].get("beat")
        if not isinstance(beat, dict):
            return False
        raw = self._get(beat_key(self.group_id, rank))  # ours to compute: an entry never names what is read
        seen = parse_beat(raw) if raw is not None else None
        return seen is not None and seen[0] == beat.get("incarnation") and seen[1] not in (CLOSED, FAILED)

    def publish(self, rank: int, segment: dict, record: dict, dense_checksum: int) -> None:
        """Write this process's entry for `rank`, replacing any earlier incarnation's."""
        entry = {"pid": os.getpid(), "start_time": _start_time(os.getpid()), "host": self.node, "segment": segment,
                 "record": record, "dense_checksum": dense_checksum}
        value = json.dumps(entry).encode()
        if len(value) > MAX_ENTRY_BYTES:
            raise ValueError(f"rank {rank}'s board entry is {len(value)} bytes; at most {MAX_ENTRY_BYTES} fit")
        self.store.set(board_key(self.group_id, rank), value)
        self._written[rank] = value

    def read(self, rank: int) -> dict | None:
        """`rank`'s entry, or None when it has none, it is not an entry, or its process is gone."""
        entry = self._parse(self._raw(rank))
        return entry if entry is not None and self._alive(rank, entry) else None

    def _clear(self, rank: int, expected: bytes) -> None:
        try:
            self.store.compare_set(board_key(self.group_id, rank), expected, b"")
        except Exception as exc:
            log.warning("board entry of rank %d not cleared: the store is unreachable (%s: %s)", rank,
                        type(exc).__name__, exc)

    def sweep(self, rank: int) -> None:
        """Clear `rank`'s entry when its process is gone (a survivor cleans up after a loss); a peer on
        another node whose beat still names it stays until it is replaced."""
        raw = self._raw(rank)
        entry = self._parse(raw)
        if entry is not None and not self._alive(rank, entry):
            self._clear(rank, raw)

    def withdraw(self, rank: int) -> None:
        """Clear `rank`'s entry if it is still the one this process published (a rank closing)."""
        value = self._written.pop(rank, None)
        if value is not None:
            self._clear(rank, value)

    def has_entries(self, size: int) -> bool:
        """Some rank of the group has published here (a replacement's test for where its group is)."""
        return any(self._raw(r) for r in range(size))


def find_board(group) -> Board | StoreBoard:
    """Where a replacement finds its running group: this node's board in DWDP_SHM_DIR when a live peer is on
    it (a group on one node), else the world's store when the group published there (it spans nodes).
    Raises naming the store when neither has the group and the store cannot be reached: the group may
    span nodes, and until its store is back nobody can rejoin it (serving goes on meanwhile)."""
    from dwdp.runtime.group import connect_store

    local = Board(group.group_id)
    if any(local.read(r) is not None for r in range(group.size) if r != group.rank):
        return local
    if not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        return local
    try:
        board = StoreBoard(group.group_id, connect_store(FIND_TIMEOUT_S))
    except RuntimeError as exc:
        raise RuntimeError(f"rank {group.rank} cannot rejoin group {group.group_id!r}: no live peer on this node's "
                           f"board, and {exc}; a group over nodes heals again only once its store is back") from None
    return board if board.has_entries(group.size) else local
