"""Liveness of peers on other nodes, through a torch.distributed store that outlives any rank (torchrun's
agent store, or the router's in `dwdp serve`), keyed by group id.

Peers on one node read each other's shared-memory record and pidfd (dwdp.runtime.liveness); a peer on
another node has neither, so each rank also writes a beat to the store: the key
`dwdp/<group id>/beat/<rank>` holds "<incarnation> <state> <count>", the count raised every period. A
reader never compares clocks across nodes: it notes, on its own monotonic clock, when it last saw a
peer's count change, and calls the peer `stalled` once that is older than the stall bound and `exited`
(lost) once it is older than the lost bound; a new incarnation under the key means the one it watched is
gone. A store it cannot reach makes every remote peer `unknown`, never lost: serving goes on (a failing
copy still declares a peer lost) and losses wait for the store to come back. So does a store that
answers too slowly: a reader whose last read is older than the stall bound does not know, and says so.
Beats are written from a thread of their own, so a store that hangs never holds up the shared-memory
record node-mates read.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass

log = logging.getLogger("dwdp")

STARTING, SERVING, CLOSED, FAILED = 0, 1, 2, 3  # the same states as dwdp.runtime.liveness's records
STATE_NAMES = {STARTING: "starting", SERVING: "serving", CLOSED: "closed", FAILED: "failed"}
MAX_BEAT_BYTES = 128  # a beat longer than this is not one of ours


def beat_key(group_id: str, rank: int) -> str:
    return f"dwdp/{group_id}/beat/{rank}"


def parse_beat(raw: bytes) -> tuple[str, int, int] | None:
    """(incarnation, state, count) of a stored beat, or None for anything else."""
    if len(raw) > MAX_BEAT_BYTES:
        return None
    try:
        incarnation, state, count = raw.decode("ascii").split(" ")
        state_value, count_value = int(state), int(count)
    except (UnicodeDecodeError, ValueError):
        return None
    if state_value not in STATE_NAMES or count_value < 0 or not incarnation.isalnum():
        return None
    return incarnation, state_value, count_value


class StoreBeat:
    """This rank's beat in the store: `set_state` and `beat` write it (the heartbeat thread beats)."""

    def __init__(self, store, group_id: str, rank: int):
        self.store, self.key = store, beat_key(group_id, rank)
        self.incarnation = uuid.uuid4().hex
        self.state, self.count = STARTING, 0
        self.failed_writes = 0
        self._write()

    def handle(self) -> dict:
        """What a peer needs to watch this beat (goes with the liveness record's handle)."""
        return {"key": self.key, "incarnation": self.incarnation}

    def _write(self) -> None:
        try:
            self.store.set(self.key, f"{self.incarnation} {self.state} {self.count}")
        except Exception as exc:  # the store's host is gone: this rank serves on, its remote peers see silence
            self.failed_writes += 1
            if self.failed_writes == 1:
                log.warning("liveness beat %s not written: the store is unreachable (%s: %s); serving goes on",
                            self.key, type(exc).__name__, exc)

    def set_state(self, state: int) -> None:
        self.state = state
        self._write()

    def beat(self) -> None:
        self.count += 1
        self._write()

    def start(self, period_s: float) -> None:
        """Beat every `period_s` from a daemon thread until `stop`."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), name="dwdp-store-beat", daemon=True)
        self._thread.start()

    def _run(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            self.beat()

    def stop(self) -> None:
        thread = getattr(self, "_thread", None)
        if thread is not None:
            self._stop.set()
            thread.join(timeout=5)
            self._thread = None


@dataclass
class _Watched:
    key: str
    incarnation: str
    pid: int
    count: int = -1
    state: int = STARTING
    changed_at: float = 0.0  # the reader's monotonic seconds when the count last changed
    replaced: bool = False   # another incarnation took the key: the watched one is gone


@dataclass(frozen=True)
class RemoteStatus:
    state: str   # "alive", "stalled", "exited", "failed", "closed" or "unknown"
    beat_age_s: float | None


class RemotePeers:
    """One rank's view of its peers on other nodes: `poll(now)` reads their beats (a daemon thread calls it
    every `period_s` once `start`ed); `status(peer, now)` classifies one from what was last read.
    stall_after_s: silent this long -> stalled; lost_after_s: silent this long -> exited (lost)."""

    def __init__(self, store, stall_after_s: float, lost_after_s: float, period_s: float, clock=time.monotonic):
        if not 0 < stall_after_s <= lost_after_s:
            raise ValueError(f"stall_after_s={stall_after_s} and lost_after_s={lost_after_s}: expected "
                             "0 < stall_after_s <= lost_after_s")
        self.store, self.stall_after_s, self.lost_after_s, self.period_s = store, stall_after_s, lost_after_s, period_s
        self.clock = clock
        self.reachable = True
        self.read_at: float | None = None  # the reader's time of its last complete read of the beats
        self._peers: dict[int, _Watched] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, peer: int, pid: int, beat: dict) -> None:
        with self._lock:
            self._peers[peer] = _Watched(str(beat["key"]), str(beat["incarnation"]), pid, changed_at=self.clock())

    def forget(self, peer: int) -> None:
        with self._lock:
            self._peers.pop(peer, None)

    @property
    def peers(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(self._peers))

    def __contains__(self, peer: int) -> bool:
        return peer in self._peers

    def pid(self, peer: int) -> int:
        return self._peers[peer].pid

    def poll(self, now: float | None = None) -> None:
        """Read every watched peer's beat once; a count that moved restarts its silence at `now`."""
        now = self.clock() if now is None else now
        with self._lock:
            watched = list(self._peers.values())
        try:
            values = self.store.multi_get([w.key for w in watched]) if watched else []
        except Exception as exc:
            if self.reachable:
                log.warning("liveness of remote peers unknown: the store is unreachable (%s: %s); a failing copy "
                            "still declares a peer lost", type(exc).__name__, exc)
            self.reachable = False
            return
        if not self.reachable:
            log.warning("the store answers again: remote peers' liveness is read again")
            for w in watched:  # silence while the store was away is not the peers'
                w.changed_at = now
        self.reachable = True
        for w, raw in zip(watched, values):
            beat = parse_beat(bytes(raw))
            if beat is None:
                continue
            incarnation, state, count = beat
            if incarnation != w.incarnation:
                w.replaced = True
                continue
            if count != w.count or state != w.state:
                w.count, w.state, w.changed_at = count, state, now
        self.read_at = now

    def status(self, peer: int, now: float | None = None) -> RemoteStatus:
        now = self.clock() if now is None else now
        w = self._peers.get(peer)
        if w is None or not self.reachable:
            return RemoteStatus("unknown", None)
        if self.read_at is not None and now - self.read_at > self.stall_after_s:
            return RemoteStatus("unknown", None)  # no read completed lately (a store too slow): silence unseen
        age = now - w.changed_at
        if w.replaced:
            return RemoteStatus("exited", age)
        if w.state == FAILED:
            return RemoteStatus("failed", age)
        if w.state == CLOSED:
            return RemoteStatus("closed", age)
        if age > self.lost_after_s:
            return RemoteStatus("exited", age)
        if w.state == SERVING and age > self.stall_after_s:
            return RemoteStatus("stalled", age)
        return RemoteStatus("alive", age)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dwdp-remote-liveness", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.poll()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
