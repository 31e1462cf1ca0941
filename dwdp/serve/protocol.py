"""Messages between the router and the workers, and the worker's channel back to the router.

Router -> worker (the worker's own request queue): PrefillJob, InjectFault (chaos testing, acted on
at once), or STOP to finish the queue and exit.
Worker -> router (a pipe of each worker process's own, `ResultsChannel`): WorkerReady / WorkerFailed
once at startup, then
BatchStarted when a forward begins, BatchDone when it ends, and one PrefillResult or
PrefillError per request; WorkerHealth every few hundred milliseconds (its silence means a stall).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

STOP = None  # sentinel on a request queue: finish what is queued, then exit


@dataclass(frozen=True)
class PrefillJob:
    request_id: str
    input_ids: tuple[int, ...]  # [T] prompt token ids, already validated by the router
    enqueued: float             # time.monotonic() when the router queued it (CLOCK_MONOTONIC on Linux)
    banned_first: tuple[int, ...] = ()  # token ids the first token may not be (min_tokens: end and stop tokens)


def greedy_first(logits, banned: tuple[int, ...] = ()) -> int:
    """The greedy first token of last-position logits [V], never one of `banned` (vLLM's min_tokens masks the
    end and stop tokens' logits to -inf)."""
    banned = [t for t in banned if 0 <= t < logits.shape[-1]]  # the router checked them; a worker stays safe
    if banned:
        logits = logits.clone()
        logits[banned] = float("-inf")
    return int(logits.argmax())


@dataclass(frozen=True)
class WorkerReady:
    rank: int
    pid: int
    model_info: dict            # vocab_size, max_position_embeddings, num_layers, model_type, memory
    worker: dict                # this worker's device, dtype, expert and buffer bytes, warmup and ready seconds


@dataclass(frozen=True)
class WorkerFailed:
    rank: int
    error: str                  # traceback of a failure outside a single forward


@dataclass(frozen=True)
class BatchStarted:
    rank: int
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class BatchDone:
    rank: int
    num_requests: int
    padded_tokens: int          # tokens the forward computed: packed, its real tokens; padded, batch size x longest
    prefill_s: float
    prefetch_wait_s: float      # exposed expert-prefetch wait of this forward (DEP: time inside its all-to-alls)
    real_tokens: int = 0        # prompt tokens of the forward (no padding)
    prefilled: tuple[tuple[str, int], ...] = ()  # (request id, its tokens in this forward): a chunk or a whole prompt
    outside_s: float | None = None  # the rank's previous forward's end -> this one's start, waits for work left out


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    rank: int
    first_token_id: int
    prompt_tokens: int
    queue_s: float              # router queued it -> its (first) forward started
    prefill_s: float            # its first forward's start -> its last forward's end
    kv_write_s: float           # extracting and writing its KV artifact
    batch_size: int             # requests in that forward
    batch_tokens: int           # tokens computed by its last forward (BatchDone.padded_tokens)
    prefetch_wait_s: float      # exposed expert-prefetch wait of that forward (DEP: time inside its all-to-alls)
    kv: dict                    # the KV artifact descriptor (dwdp.serve.kv.write_kv_artifact)
    chunks: tuple[int, ...] = ()  # its tokens per forward, in order (one entry: not chunked)


@dataclass(frozen=True)
class PrefillError:
    request_id: str
    rank: int
    error_type: str
    message: str
    retryable: bool = False     # the rank failed it for what it lost, not for the prompt: try another


@dataclass(frozen=True)
class WorkerHealth:
    rank: int
    status: dict                # dataclasses.asdict(dwdp.runtime.failover.FailoverStatus) + can_serve_all


@dataclass(frozen=True)
class InjectFault:
    rank: int                   # the rank whose memory becomes unreadable (DWDPModel.inject_fault)


class ResultsChannel:
    """A worker process's end of its own pipe to the router: `put` sends one message, the worker's
    threads taking turns. One writer per pipe, on purpose: a worker killed in the middle of a message
    can only cut its own pipe, which the router then reads as closed. (A queue shared by the workers
    has one lock for all writers; a writer killed while holding it silences every other worker.)"""

    def __init__(self, conn):
        self._conn = conn
        self._lock = threading.Lock()

    def __getstate__(self):
        return {"conn": self._conn}

    def __setstate__(self, state):
        self._conn, self._lock = state["conn"], threading.Lock()

    def put(self, message) -> None:
        with self._lock:
            self._conn.send(message)
