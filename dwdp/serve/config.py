"""ServeConfig: the knobs of one context server (router + one prefill worker per DWDP rank)."""
from __future__ import annotations

from dataclasses import dataclass

PRESETS = ("tiny", "small")
MODES = ("dwdp", "dep")
BATCH_ORDERS = ("fifo", "shortest")
RESTARTS = ("never", "on-failure")
FORWARDS = ("auto", "padded")


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an int >= {low}")


def _check_seconds(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name}={value!r} must be a finite number of seconds > 0")


@dataclass(frozen=True)
class ServeConfig:
    """Settings of `dwdp serve`.

    ranks: worker processes, all in one DWDP group (each an independent prefill worker).
    model: checkpoint directory loaded per rank with DWDPModel.from_pretrained; None = `preset`.
    preset: built-in random-weight model ("tiny": the demo's DeepSeek-V3-style model; "small": a
        Qwen3-MoE shape with 384 MiB of bf16 experts, for GPUs), seeded by `seed`.
    tokenizer: directory of a tokenizer for text prompts (default: `model` when it has one).
    max_num_tokens: tokens per forward: real tokens of a packed forward (prompts back to back, a
        longer prompt prefilled in chunks of at most this many); padded tokens (batch size x longest
        prompt) for a family that cannot pack, where it also bounds the prompt (no chunks).
    max_prompt_tokens: longest prompt accepted (400 beyond); None = the model's
        max_position_embeddings, capped by max_queue_tokens. Above the model's positions the server
        refuses to start (`prompt_limit`).
    max_queue_tokens: prompt tokens one worker may hold (queued + running) before the router
        answers 429; bounds the memory of every queue.
    max_body_bytes: largest request body; bigger ones get 413 before they are parsed.
    kv_dir: where each request's KV cache is written as `<request id>.safetensors` (None: a
        temporary directory removed at shutdown).
    slice_bytes: DWDP copy slice size of every worker (None: the backend's default, DWDPConfig.slice_bytes_for).
    expert_replicas: ranks owning every expert (DWDPConfig.expert_replicas); 2 keeps every expert
        servable when any one worker is lost.
    peer_timeout_s: DWDPConfig.peer_timeout_s of every worker (bound on a copy before the peer's
        liveness is read; heartbeat age that counts as stalled).
    stall_timeout_s: a worker silent this long (no health report) gets no new requests until it
        speaks again; its queued requests wait for it.
    fault_injection: enable POST /admin/fault (make one rank's memory unreadable), for chaos tests.
    threads_per_worker: torch intra-op threads of each worker.
    startup_timeout_s: longest wait for every worker to build its model, warm it up and join the group.
    device: "cpu" (host backend) or "cuda": worker rank r on cuda:(r % GPUs), cuda backend (several
        workers may share a GPU).
    dtype: the model's dtype, "fp32" / "bf16" / "fp16" (None: bf16 on CUDA, fp32 on CPU).
    drain_timeout_s: longest graceful shutdown waits for requests in flight.
    mode: "dwdp" (every rank an independent DWDP worker) or "dep" (the expert-parallel baseline:
        ranks step together, each step one forward per rank or an idle step, dwdp.serve.dep_worker).
    step_timeout_s: DEP only: longest a rank waits for its peers at one collective of a step before
        it fails the step, naming the peers it waited for.
    batch_order: which queued prompts a forward takes (dwdp.serve.scheduling): "fifo" (arrival order;
        the default: on a quiet machine it matched "shortest" in max load and had the lower TTFT in both
        modes in `dwdp bench serve`) or "shortest" (shortest first, never past a prompt older than
        `fairness_s`).
    fairness_s: "shortest" only: a prompt queued this long goes first, whatever its length.
    restart: "on-failure" starts a dead worker again, as the same rank, which rejoins its DWDP group
        (dwdp.serve.restarts); "never" leaves it dead. None: "on-failure" in dwdp mode on the CPU's host
        backend, "never" elsewhere: on the cuda device a rank rejoins through CUDA IPC or cuMem exports,
        which have not yet run on a GPU, so it is only on when asked for.
    restart_backoff_s: delay before a worker's first restart in a minute; doubles with each further one.
    max_restarts_per_minute: restarts of one rank within a minute; one more death leaves it down.
    forwards: "auto" (packed when the family's attention packs, dwdp.serve.packed.packing_support,
        and the worker's startup self-check of a packed forward passes, dwdp.serve.packcheck; else
        padded) or "padded" (left-padded batches whatever the family, no chunks: the baseline
        `dwdp bench serve` compares packing against).
    """

    ranks: int = 2
    host: str = "127.0.0.1"
    port: int = 8000
    model: str | None = None
    preset: str = "tiny"
    seed: int = 0
    tokenizer: str | None = None
    max_num_tokens: int = 1024
    max_prompt_tokens: int | None = None
    max_queue_tokens: int = 8192
    max_body_bytes: int = 1 << 20
    kv_dir: str | None = None
    slice_bytes: int | None = None
    expert_replicas: int = 1
    peer_timeout_s: float = 2.0
    stall_timeout_s: float = 2.0
    fault_injection: bool = False
    threads_per_worker: int = 1
    startup_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0
    device: str = "cpu"
    dtype: str | None = None
    mode: str = "dwdp"
    step_timeout_s: float = 30.0
    batch_order: str = "fifo"
    fairness_s: float = 0.5
    restart: str | None = None
    restart_backoff_s: float = 0.5
    max_restarts_per_minute: int = 3
    forwards: str = "auto"

    def __post_init__(self):
        _check_int("ranks", self.ranks, 1)
        _check_int("port", self.port, 0)
        if self.port > 65535:
            raise ValueError(f"port={self.port} must be <= 65535")
        if self.model is None and self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r} is not one of {PRESETS}")
        _check_int("seed", self.seed, 0)
        _check_int("max_num_tokens", self.max_num_tokens, 1)
        _check_int("max_queue_tokens", self.max_queue_tokens, 1)
        if self.max_queue_tokens < self.max_num_tokens:
            raise ValueError(f"max_queue_tokens={self.max_queue_tokens} must be >= max_num_tokens="
                             f"{self.max_num_tokens}: a worker must be able to queue the longest prompt")
        if self.max_prompt_tokens is not None:
            _check_int("max_prompt_tokens", self.max_prompt_tokens, 1)
            if self.max_prompt_tokens > self.max_queue_tokens:
                raise ValueError(f"max_prompt_tokens={self.max_prompt_tokens} must be <= max_queue_tokens="
                                 f"{self.max_queue_tokens}: a worker must be able to queue the longest prompt")
        _check_int("max_body_bytes", self.max_body_bytes, 64)
        if self.slice_bytes is not None:
            _check_int("slice_bytes", self.slice_bytes, 1)
        _check_int("expert_replicas", self.expert_replicas, 1)
        if self.expert_replicas > self.ranks:
            raise ValueError(f"expert_replicas={self.expert_replicas} must be <= ranks={self.ranks}")
        _check_seconds("peer_timeout_s", self.peer_timeout_s)
        _check_seconds("stall_timeout_s", self.stall_timeout_s)
        _check_int("threads_per_worker", self.threads_per_worker, 1)
        _check_seconds("startup_timeout_s", self.startup_timeout_s)
        _check_seconds("drain_timeout_s", self.drain_timeout_s)
        from dwdp.runtime.devices import check_device, model_dtype

        check_device(self.device)
        model_dtype(self.device, self.dtype)  # validates dtype
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r} is not one of {MODES}")
        if self.mode == "dep" and self.expert_replicas != 1:
            raise ValueError(f"expert_replicas={self.expert_replicas}: DEP keeps one disjoint share of the experts "
                             "per rank (a lost rank stops the group); replicas are a DWDP option")
        if self.mode == "dep" and self.fault_injection:
            raise ValueError("fault_injection makes a DWDP rank's expert memory unreadable to its peers; DEP mode "
                             "has no such memory (kill a worker instead)")
        _check_seconds("step_timeout_s", self.step_timeout_s)
        if self.batch_order not in BATCH_ORDERS:
            raise ValueError(f"batch_order={self.batch_order!r} is not one of {BATCH_ORDERS}")
        _check_seconds("fairness_s", self.fairness_s)
        if self.restart is not None and self.restart not in RESTARTS:
            raise ValueError(f"restart={self.restart!r} is not one of {RESTARTS}")
        if self.restart == "on-failure" and self.mode != "dwdp":
            raise ValueError(f"restart='on-failure' needs a rank that can rejoin its group: dwdp mode (got "
                             f"mode={self.mode!r}); use restart='never'")
        _check_seconds("restart_backoff_s", self.restart_backoff_s)
        _check_int("max_restarts_per_minute", self.max_restarts_per_minute, 1)
        if self.forwards not in FORWARDS:
            raise ValueError(f"forwards={self.forwards!r} is not one of {FORWARDS}")

    @property
    def restarts_workers(self) -> bool:
        if self.restart is not None:
            return self.restart == "on-failure"
        return self.mode == "dwdp" and self.device == "cpu"

    def packs(self, model_config) -> tuple[bool, str]:
        """(whether workers may run packed forwards for this model, why not when they may not), from the
        config alone; a worker then self-checks a packed forward (dwdp.serve.packcheck.worker_forwards)."""
        if self.forwards == "padded":
            return False, "padded forwards asked for (forwards='padded')"
        from dwdp.serve.packed import packing_support

        return packing_support(model_config)

    @property
    def health_interval_s(self) -> float:
        """How often a worker reports: four times per stall bound, so one late report is no stall."""
        return self.stall_timeout_s / 4

    @property
    def model_name(self) -> str:
        """The id clients pass as `model` to /v1/completions."""
        if self.model is not None:
            return self.model.rstrip("/").rsplit("/", 1)[-1]
        return f"dwdp-{self.preset}"


def prompt_limit(config: ServeConfig, model_info: dict) -> tuple[int, str]:
    """(longest prompt the server takes, the bound that sets it) once the workers told `model_info`
    (max_position_embeddings, forwards "packed" or "padded", padded_reason). Packed workers chunk a
    long prompt, so only the model's positions and the operator's bounds apply; padded ones take a
    prompt in one forward. Raises ValueError naming the value and the limit when max_prompt_tokens
    is above the model's positions."""
    positions = int(model_info["max_position_embeddings"])
    if config.max_prompt_tokens is not None and config.max_prompt_tokens > positions:
        raise ValueError(f"max_prompt_tokens={config.max_prompt_tokens} is above the model's "
                         f"max_position_embeddings={positions}")
    bounds = {"the model's max_position_embeddings": positions}  # first: it names a tie
    if config.max_prompt_tokens is not None:
        bounds["--max-prompt-tokens"] = config.max_prompt_tokens
    if model_info.get("forwards", "padded") == "packed":
        bounds["--max-queue-tokens"] = config.max_queue_tokens
    else:
        why = model_info.get("padded_reason") or "padded forwards"
        bounds[f"--max-num-tokens; this model's prompts are not chunked: {why}"] = config.max_num_tokens
    name = min(bounds, key=bounds.get)
    return bounds[name], name
