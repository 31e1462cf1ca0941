"""The router's ledger of KV artifacts: where each went (loaded by the decode side, expired, dropped),
for /metrics, the removal of those nobody loaded within the time-to-live, and the artifacts (and bytes)
still pending, for the KV budget (dwdp.serve.kv_budget).

An artifact is written by a worker; the decode side's connector removes it once its KV is in the
engine's cache (dwdp.integrations.kv_transfer.FileTransfer.release), which the ledger sees as the
file gone: loaded. One still there `ttl_s` after it was written is removed: expired. One the router
removes itself because no decode will read it (a one-token answer behind --decode-url, or a decode
that recomputed instead of loading): dropped. At stop (`close(remove_pending=True)`) the server
removes what is still pending: nobody would expire it after the server is gone.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

EVENTS = ("written", "loaded", "expired", "dropped")


@dataclass
class _Pending:
    when: float      # written (clock)
    nbytes: int
    num_tokens: int


class KVLedger:
    """Counts and expiry of this server's KV artifacts. Thread-safe; `start()` runs the sweep every
    `interval_s` in a thread of its own until `close()`."""

    def __init__(self, ttl_s: float | None, interval_s: float | None = None, clock=time.monotonic):
        self.ttl_s = ttl_s
        self.interval_s = interval_s if interval_s is not None else min(1.0, (ttl_s or 4.0) / 4)
        self._clock = clock
        self._written: dict[str, _Pending] = {}  # path -> what is pending there
        self._counts = dict.fromkeys(EVENTS, 0)
        self._bytes_per_token = 0.0              # the largest seen: an estimate for prompts not written yet
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def written(self, path: str, nbytes: int = 0, num_tokens: int = 0) -> None:
        if not path.endswith(".safetensors"):
            return  # only ever remove what a worker wrote as an artifact
        with self._lock:
            self._written[path] = _Pending(self._clock(), int(nbytes), int(num_tokens))
            self._counts["written"] += 1
            if num_tokens > 0:
                self._bytes_per_token = max(self._bytes_per_token, nbytes / num_tokens)

    def drop(self, path: str) -> None:
        """Remove an artifact no decode will read (counted loaded when the decode side removed it first)."""
        with self._lock:
            if self._written.pop(path, None) is None:
                return
            try:
                os.remove(path)
                self._counts["dropped"] += 1
            except FileNotFoundError:
                self._counts["loaded"] += 1

    def sweep(self) -> None:
        """Count artifacts the decode side removed as loaded; remove those past the time-to-live."""
        now = self._clock()
        with self._lock:
            for path, pending in list(self._written.items()):
                if not os.path.exists(path):
                    self._counts["loaded"] += 1
                    del self._written[path]
                elif self.ttl_s is not None and now - pending.when > self.ttl_s:
                    try:
                        os.remove(path)
                        self._counts["expired"] += 1
                    except FileNotFoundError:
                        self._counts["loaded"] += 1
                    del self._written[path]

    def remove_pending(self) -> int:
        """Remove every artifact still pending (counted expired); returns how many were removed."""
        removed = 0
        with self._lock:
            for path in list(self._written):
                try:
                    os.remove(path)
                    self._counts["expired"] += 1
                    removed += 1
                except FileNotFoundError:
                    self._counts["loaded"] += 1
                del self._written[path]
        return removed

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def pending(self) -> int:
        """Artifacts written and neither loaded nor removed yet."""
        with self._lock:
            return len(self._written)

    def pending_bytes(self) -> int:
        with self._lock:
            return sum(p.nbytes for p in self._written.values())

    def bytes_per_token(self) -> float:
        """The most bytes per prompt token an artifact took so far (0 before the first)."""
        with self._lock:
            return self._bytes_per_token

    def start(self) -> "KVLedger":
        self._thread = threading.Thread(target=self._run, name="dwdp-kv-ledger", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sweep()

    def close(self, remove_pending: bool = False) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if remove_pending:
            self.remove_pending()
