"""Beats in the world's store for peers on other nodes (dwdp.runtime.store_liveness), against a real
TCPStore on loopback; the reader's clock is passed in, so silence is decided without waiting."""
from __future__ import annotations

import pytest

from dwdp.runtime.group import LoopbackStore
from dwdp.runtime.liveness import PeerLiveness
from dwdp.runtime.store_liveness import (CLOSED, FAILED, SERVING, RemotePeers, StoreBeat, beat_key, parse_beat)


@pytest.fixture
def store():
    loop = LoopbackStore(timeout_s=10)
    yield loop.store
    loop.close()


def _watching(store, beat: StoreBeat, stall=1.0, lost=3.0) -> RemotePeers:
    peers = RemotePeers(store, stall, lost, period_s=0.1, clock=lambda: 0.0)
    peers.watch(5, 4242, beat.handle())
    return peers


def _read(peers: RemotePeers, now: float, peer: int = 5):
    """The peer's status right after a read of the beats at `now` (the reader's thread reads every period)."""
    peers.poll(now=now)
    return peers.status(peer, now=now)


def test_a_beating_peer_is_alive_a_silent_one_stalled_then_lost(store):
    beat = StoreBeat(store, "g0", 5)
    beat.set_state(SERVING)
    peers = _watching(store, beat)
    peers.poll(now=0.0)
    assert _read(peers, 0.9).state == "alive"
    assert _read(peers, 1.5).state == "stalled"
    beat.beat()
    peers.poll(now=2.0)  # the count moved: silence starts again at 2.0
    assert peers.status(5, now=2.5).state == "alive" and peers.status(5, now=2.5).beat_age_s == 0.5
    peers.poll(now=4.0)  # no beat since 2.0
    assert _read(peers, 4.9).state == "stalled"
    assert _read(peers, 5.1).state == "exited", "silent past the lost bound must be lost"


def test_a_peer_still_starting_is_not_stalled_before_the_lost_bound(store):
    beat = StoreBeat(store, "g0", 5)
    peers = _watching(store, beat)
    peers.poll(now=0.0)
    assert _read(peers, 2.0).state == "alive"
    assert _read(peers, 3.5).state == "exited"


def test_silence_the_reader_has_not_read_is_not_the_peers(store):
    """A store that answers too slowly (a read still blocked): past the stall bound since the last read
    completed, the reader does not know, and a peer is never lost on silence it has not seen."""
    beat = StoreBeat(store, "g0", 5)
    beat.set_state(SERVING)
    peers = _watching(store, beat)
    peers.poll(now=0.0)
    assert peers.status(5, now=0.9).state == "alive"
    assert peers.status(5, now=1.1).state == "unknown" and peers.status(5, now=100.0).state == "unknown"
    assert _read(peers, 100.0).state == "exited"  # read now: silent since 0.0 it is


@pytest.mark.parametrize("state, seen", [(CLOSED, "closed"), (FAILED, "failed")])
def test_closed_and_failed_are_read_from_the_beat(store, state, seen):
    beat = StoreBeat(store, "g0", 5)
    peers = _watching(store, beat)
    beat.set_state(state)
    peers.poll(now=0.0)
    assert _read(peers, 100.0).state == seen


def test_a_new_incarnation_under_the_key_means_the_watched_one_is_gone(store):
    old = StoreBeat(store, "g0", 5)
    peers = _watching(store, old)
    StoreBeat(store, "g0", 5).set_state(SERVING)  # a replacement of rank 5
    peers.poll(now=0.1)
    assert peers.status(5, now=0.1).state == "exited"


class _DeadStore:
    def multi_get(self, keys):
        raise RuntimeError("Connection reset by peer")

    def set(self, key, value):
        raise RuntimeError("Connection reset by peer")


def test_an_unreachable_store_makes_remote_peers_unknown_never_lost(store, caplog):
    beat = StoreBeat(store, "g0", 5)
    peers = _watching(store, beat)
    peers.poll(now=0.0)
    live = peers.store
    peers.store = _DeadStore()
    peers.poll(now=50.0)
    assert peers.status(5, now=100.0).state == "unknown"
    peers.store = live  # the store is back: the time it was away is not the peer's silence
    peers.poll(now=100.0)
    assert peers.status(5, now=100.5).state == "alive"
    writer = StoreBeat(_DeadStore(), "g0", 6)  # a beat that cannot be written does not raise
    writer.beat()
    assert writer.failed_writes == 2 and "store is unreachable" in caplog.text


@pytest.mark.parametrize("raw", [b"", b"x" * 200, b"abc 1", b"abc 9 1", b"abc 1 -1", b"a/b 1 1", b"\xff 1 1",
                                 b"abc one 1"])
def test_anything_but_a_beat_under_the_key_is_ignored(store, raw):
    beat = StoreBeat(store, "g0", 5)
    beat.set_state(SERVING)
    peers = _watching(store, beat)
    peers.poll(now=0.0)
    store.set(beat_key("g0", 5), raw)
    assert parse_beat(raw) is None
    peers.poll(now=0.5)
    assert peers.status(5, now=0.5).state == "alive" and peers.status(5, now=0.5).beat_age_s == 0.5


@pytest.mark.parametrize("stall, lost", [(0, 1), (2, 1), (-1, 5)])
def test_bounds_out_of_order_are_refused_naming_them(store, stall, lost):
    with pytest.raises(ValueError, match="stall_after_s=.* and lost_after_s="):
        RemotePeers(store, stall, lost, 0.1)


def test_peer_liveness_watches_a_peer_of_another_node_through_its_beat(store, monkeypatch):
    monkeypatch.setenv("DWDP_NODE", "node0")
    beat = StoreBeat(store, "g0", 1)
    beat.set_state(SERVING)
    remote = RemotePeers(store, 1.0, 3.0, 0.1, clock=lambda: 0.0)
    handles = [None, {"path": "/nonexistent", "pid": 99, "host": "node1", "beat": beat.handle()}]
    liveness = PeerLiveness(0, handles, 1.0, remote)
    remote.poll(now=0.0)
    assert liveness.peers == (1,) and liveness.pid(1) == 99
    status = liveness.status(1)
    assert status.state == "alive" and status.remote, status
    remote.clock = lambda: 10.0
    remote.poll()
    assert liveness.status(1).is_lost and "another node" in liveness.status(1).describe(1)
    liveness.forget(1)
    assert liveness.peers == () and remote.peers == ()
    # Without a store, a peer of another node is not watched at all (its status unknown), as before.
    assert PeerLiveness(0, handles, 1.0, None).peers == ()


def test_a_hanging_store_never_holds_up_the_beat_node_mates_read(tmp_path):
    """The store's beats are written from their own thread: while a write hangs, the shared-memory record
    keeps beating (its node-mates would otherwise see a healthy rank stalled)."""
    import threading
    import time

    from dwdp.runtime.liveness import _BEAT, LivenessRecord

    class HangingStore:
        def __init__(self):
            self.release, self.writes = threading.Event(), 0

        def set(self, key, value):
            self.writes += 1
            if self.writes > 2:  # the beat thread's first write hangs until released
                self.release.wait(60)

    store = HangingStore()
    record = LivenessRecord(tmp_path, 0.005, StoreBeat(store, "g0", 0))
    record.start()
    try:
        deadline = time.monotonic() + 30
        while store.writes < 3:
            assert time.monotonic() < deadline, "the store beat never wrote"
            time.sleep(0.005)
        seen = {int(record.words[_BEAT])}
        while len(seen) < 4:  # the record beats on while the store write hangs
            assert time.monotonic() < deadline, f"the record stopped beating while the store hung: {seen}"
            time.sleep(0.005)
            seen.add(int(record.words[_BEAT]))
        assert store.writes == 3  # still hanging in the third
    finally:
        store.release.set()
        record.close()
