"""How many KV artifacts (and bytes) may wait for a decode engine, and the free space the KV directory
keeps: a request whose prompts would pass either is refused before any worker runs, with Retry-After,
instead of filling the disk (after which every request would fail until the next expiry sweep).

Counted: artifacts written and not yet loaded or removed (the ledger's pending ones) plus the prompts
admitted and still being prefilled (reserved here until their artifact is written or their request
fails). Bytes are estimated per prompt token from the largest artifact written so far (before the
first: 0, and only the file system's free space is checked). Refusals:
  429 kv_budget_exceeded   more pending artifacts than `max_pending`, or bytes than `max_pending_bytes`
  503 kv_disk_full         the KV directory's file system would keep less than `min_free_bytes`
"""
from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

from dwdp.serve.errors import ServeError
from dwdp.serve.kv_ledger import KVLedger

RETRY_AFTER_S = 1


@dataclass(frozen=True)
class KVBudget:
    """max_pending: artifacts pending at once; max_pending_bytes: their bytes (None: not limited);
    min_free_bytes: free bytes the KV directory's file system keeps."""

    max_pending: int = 1024
    max_pending_bytes: int | None = None
    min_free_bytes: int = 0

    def __post_init__(self):
        if isinstance(self.max_pending, bool) or not isinstance(self.max_pending, int) or self.max_pending < 1:
            raise ValueError(f"max_pending={self.max_pending!r} must be an int >= 1")
        for name in ("max_pending_bytes", "min_free_bytes"):
            value = getattr(self, name)
            if value is None and name == "max_pending_bytes":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be a number of bytes >= 0")


def default_budget(kv_dir: str, max_pending: int = 1024, max_pending_bytes: int | None = None,
                   min_free_bytes: int | None = None) -> KVBudget:
    """A budget for `kv_dir`: unless given, half its file system's size pending at most, and 5% of it
    (at most 1 GiB) kept free."""
    fs = os.statvfs(kv_dir)
    size = fs.f_blocks * fs.f_frsize
    return KVBudget(max_pending, size // 2 if max_pending_bytes is None else max_pending_bytes,
                    min(size // 20, 1 << 30) if min_free_bytes is None else min_free_bytes)


class KVAdmission:
    """Admits or refuses requests against a KVBudget, the ledger's pending artifacts and the free space
    of `kv_dir` (None: a pool without a KV directory of its own, free space not checked). Thread-safe."""

    def __init__(self, budget: KVBudget, ledger: KVLedger, kv_dir: str | None, statvfs=os.statvfs):
        self.budget, self.ledger, self.kv_dir, self._statvfs = budget, ledger, kv_dir, statvfs
        self._lock = threading.Lock()
        self._reserved_prompts = 0
        self._reserved_bytes = 0

    def _free_bytes(self) -> int:
        fs = self._statvfs(self.kv_dir)
        return fs.f_bavail * fs.f_frsize - self._reserved_bytes

    @contextlib.contextmanager
    def admit(self, num_prompts: int, num_tokens: int):
        """Reserve room for `num_prompts` artifacts of `num_tokens` prompt tokens in all while the block
        runs (their prefill); ServeError 429 / 503 with Retry-After when they do not fit."""
        estimate = int(self.ledger.bytes_per_token() * num_tokens)
        with self._lock:
            pending = self.ledger.pending() + self._reserved_prompts
            if pending + num_prompts > self.budget.max_pending:
                raise ServeError(429, "kv_budget_exceeded", f"{pending} KV artifacts are waiting for a decode engine; "
                                 f"this server keeps at most {self.budget.max_pending} (--kv-max-pending): retry later",
                                 retry_after=RETRY_AFTER_S)
            pending_bytes = self.ledger.pending_bytes() + self._reserved_bytes
            limit = self.budget.max_pending_bytes
            if limit is not None and pending_bytes + estimate > limit:
                raise ServeError(429, "kv_budget_exceeded", f"{pending_bytes} bytes of KV artifacts are waiting and "
                                 f"these prompts need about {estimate} more; this server keeps at most {limit} "
                                 "(--kv-max-pending-bytes): retry later", retry_after=RETRY_AFTER_S)
            free = None if self.kv_dir is None else self._free_bytes()
            if free is not None and free - estimate < self.budget.min_free_bytes:
                raise ServeError(503, "kv_disk_full", f"the KV directory's file system has {max(free, 0)} bytes free; "
                                 f"these prompts need about {estimate} and {self.budget.min_free_bytes} stay free "
                                 "(--kv-min-free-bytes): retry later", retry_after=RETRY_AFTER_S)
            self._reserved_prompts += num_prompts
            self._reserved_bytes += estimate
        try:
            yield
        finally:
            with self._lock:
                self._reserved_prompts -= num_prompts
                self._reserved_bytes -= estimate
