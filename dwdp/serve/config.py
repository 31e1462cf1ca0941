"""ServeConfig: the knobs of one context server (router + one prefill worker per DWDP rank)."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from dwdp.runtime.transport.registry import auto_backend, transport_class
from dwdp.runtime.config import DWDPConfig

PRESETS = ("tiny", "small")
MODES = ("dwdp", "dep")
BATCH_ORDERS = ("fifo", "shortest")
RESTARTS = ("never", "on-failure")
FORWARDS = ("auto", "padded")
# Serve settings that are also DWDPConfig fields: ServeConfig field -> DWDPConfig field. Left at None
# each takes its value from `dwdp` (the --config file), else SERVE_DEFAULTS; given, it wins over the
# file and `dwdp_overrides` records it. `device` sets the DWDPConfig backend the same way.
DWDP_FIELDS = {"ranks": "group_size", "slice_bytes": "slice_bytes", "expert_replicas": "expert_replicas",
               "peer_timeout_s": "peer_timeout_s", "remote_lost_after_s": "remote_lost_after_s", "device": "backend"}
SERVE_DEFAULTS = {"ranks": 2, "slice_bytes": None, "expert_replicas": 1, "peer_timeout_s": 2.0,
                  "remote_lost_after_s": 10.0, "device": "cpu"}


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name}={value!r} must be an int >= {low}")


def _check_seconds(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ValueError(f"{name}={value!r} must be a finite number of seconds > 0")


@dataclass(frozen=True)
class ServeConfig:
    """Settings of `dwdp serve`.

    ranks: worker processes on this node, all in one DWDP group (each an independent prefill worker);
        None: `dwdp.group_size`, else 2. Over several nodes, this node's share of the group.
    nnodes, node_rank, dist_init_addr: a group over `nnodes` nodes, `ranks` on each (SGLang's names):
        this server runs group ranks node_rank * ranks .. + ranks - 1 behind its own router, and all
        nodes' workers meet at dist_init_addr ("HOST:PORT"), where node 0's server hosts the world's
        store (the board and the beats of dwdp.runtime.store_board and store_liveness). The store
        has no authentication: HOST must be on a network only the group's nodes reach.
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
    slice_bytes: DWDP copy slice size of every worker (None: `dwdp.slice_bytes`, else the backend's
        default, DWDPConfig.slice_bytes_for).
    expert_replicas: ranks owning every expert (DWDPConfig.expert_replicas); 2 keeps every expert
        servable when any one worker is lost. None: `dwdp.expert_replicas`, else 1.
    peer_timeout_s: DWDPConfig.peer_timeout_s of every worker (bound on a copy before the peer's
        liveness is read; heartbeat age that counts as stalled). None: `dwdp.peer_timeout_s`, else 2.
    remote_lost_after_s: DWDPConfig.remote_lost_after_s (a worker on another node silent this long in
        the store is lost). None: `dwdp.remote_lost_after_s`, else 10.
    stall_timeout_s: a worker silent this long (no health report) gets no new requests until it
        speaks again; its queued requests wait for it.
    fault_injection: enable POST /admin/fault (make one rank's memory unreadable), for chaos tests.
    threads_per_worker: torch intra-op threads of each worker.
    startup_timeout_s: longest wait for every worker to build its model, warm it up and join the group.
    device: "cpu" (host backend) or "cuda": worker rank r on cuda:(r % GPUs), cuda backend (several
        workers may share a GPU). None: "cuda" when `dwdp.backend` is "cuda", else "cpu".
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
    dwdp: the DWDPConfig every worker starts from (`dwdp serve --config FILE`: what `dwdp tune`
        writes); None: DWDPConfig's defaults. The settings of DWDP_FIELDS that are given win over
        it (`dwdp_overrides`); `worker_dwdp` is what the workers run with. DWDP mode only.
    dwdp_overrides (set here, not passed): (ServeConfig field, DWDPConfig field, the file's value,
        the value served) of each setting given that differs from `dwdp`.
    """

    ranks: int | None = None
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
    expert_replicas: int | None = None
    peer_timeout_s: float | None = None
    remote_lost_after_s: float | None = None
    stall_timeout_s: float = 2.0
    fault_injection: bool = False
    threads_per_worker: int = 1
    startup_timeout_s: float = 300.0
    drain_timeout_s: float = 30.0
    device: str | None = None
    dtype: str | None = None
    mode: str = "dwdp"
    step_timeout_s: float = 30.0
    batch_order: str = "fifo"
    fairness_s: float = 0.5
    restart: str | None = None
    restart_backoff_s: float = 0.5
    max_restarts_per_minute: int = 3
    forwards: str = "auto"
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    dwdp: DWDPConfig | None = None
    dwdp_overrides: tuple = field(default=(), init=False, compare=False)

    def __post_init__(self):
        if self.dwdp is not None and not isinstance(self.dwdp, DWDPConfig):
            raise ValueError(f"dwdp={self.dwdp!r} must be a DWDPConfig (or None)")
        if self.mode == "dep" and self.dwdp is not None:
            raise ValueError("dwdp: a DWDPConfig (--config) sets up DWDP workers and mode='dep' runs none; serve it "
                             "in mode 'dwdp', or leave the DWDPConfig out")
        ranks_given = self.ranks is not None
        self._take_dwdp_settings()
        _check_int("ranks", self.ranks, 1)
        self._check_nodes(ranks_given)
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
        if self.expert_replicas > self.group_ranks:
            raise ValueError(f"expert_replicas={self.expert_replicas} must be <= the group's ranks "
                             f"({self.group_ranks})")
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
        if self.mode == "dwdp":
            self._merged_dwdp()  # DWDPConfig checks the merged settings here, not later in a worker

    def _check_nodes(self, ranks_given: bool) -> None:
        _check_int("nnodes", self.nnodes, 1)
        _check_int("node_rank", self.node_rank, 0)
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank} must be < nnodes={self.nnodes}")
        if self.nnodes == 1:
            if self.dist_init_addr is not None or self.node_rank:
                raise ValueError("dist_init_addr and node_rank are for a group over several nodes: give nnodes too")
            return
        if self.mode != "dwdp":
            raise ValueError(f"nnodes={self.nnodes}: a group over nodes is served in mode 'dwdp' (got "
                             f"mode={self.mode!r})")
        if not ranks_given:
            raise ValueError(f"nnodes={self.nnodes}: give ranks (this node's workers) as well; a --config file's "
                             "group_size is the whole group's")
        split_address(self.dist_init_addr)

    @property
    def group_ranks(self) -> int:
        """Ranks of the DWDP group over every node."""
        return self.ranks * self.nnodes

    @property
    def first_rank(self) -> int:
        """The group rank of this node's first worker."""
        return self.node_rank * self.ranks

    def _take_dwdp_settings(self) -> None:
        """Each DWDP_FIELDS setting left at None from `dwdp` (else SERVE_DEFAULTS); a given one that
        differs from `dwdp` goes into dwdp_overrides."""
        overrides = []
        for name, dwdp_name in DWDP_FIELDS.items():
            given = getattr(self, name)
            in_file = getattr(self.dwdp, dwdp_name) if self.dwdp is not None else None
            if name == "device":  # the file names a backend; "auto" leaves the device to the flag
                in_file = None if in_file in (None, "auto") else transport_class(in_file).device_types[0]
            if given is None:
                object.__setattr__(self, name, in_file if in_file is not None else SERVE_DEFAULTS[name])
            elif in_file is not None and given != in_file:
                overrides.append((name, dwdp_name, getattr(self.dwdp, dwdp_name), given))
        object.__setattr__(self, "dwdp_overrides", tuple(overrides))

    @property
    def worker_dwdp(self) -> DWDPConfig | None:
        """The DWDPConfig every worker builds its DWDPModel with: `dwdp` (or the defaults) with the
        settings of DWDP_FIELDS, the device's backend and that backend's slice size; None in DEP mode."""
        return self._merged_dwdp() if self.mode == "dwdp" else None

    def _merged_dwdp(self) -> DWDPConfig:
        backend = auto_backend(self.device)
        config = (self.dwdp or DWDPConfig()).replace(
            group_size=self.group_ranks, slice_bytes=self.slice_bytes, expert_replicas=self.expert_replicas,
            peer_timeout_s=self.peer_timeout_s, remote_lost_after_s=self.remote_lost_after_s, backend=backend)
        if self.nnodes > 1:  # each node's workers own experts spread over the ring: a node lost leaves the most
            config = config.replace(ranks_per_node=self.ranks)
        return config.replace(slice_bytes=config.slice_bytes_for(backend))

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


def split_address(address) -> tuple[str, int]:
    """(host, port) of a "HOST:PORT" (IPv6 hosts in brackets); ValueError naming the value otherwise."""
    if not isinstance(address, str) or ":" not in address:
        raise ValueError(f"dist_init_addr={address!r} must be HOST:PORT (the first node's address, where its server "
                         "hosts the group's store)")
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ValueError(f"dist_init_addr={address!r} must be HOST:PORT with a port in 1..65535")
    return host, int(port)


def load_dwdp_config(path: str) -> DWDPConfig:
    """The DWDPConfig saved at `path` (DWDPConfig.to_json, as `dwdp tune` writes it), or ValueError in
    one line naming the path and what is wrong: the file, its JSON, or the field and its value."""
    where = f"--config {path}"
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"{where}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object of DWDPConfig fields (what `dwdp tune` writes), got "
                         f"{type(data).__name__}")
    known = {f.name for f in dataclasses.fields(DWDPConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown DWDPConfig field {unknown[0]!r}; expected some of {sorted(known)}")
    try:
        return DWDPConfig(**data)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def override_notice(config: ServeConfig, source: str) -> str | None:
    """One line naming each serve flag that overrides the DWDPConfig of `source`, with both values;
    None when none does."""
    if not config.dwdp_overrides:
        return None
    flags = ", ".join(f"--{name.removesuffix('_s').replace('_', '-')} {value} over {dwdp_name}={in_file!r}"
                      for name, dwdp_name, in_file, value in config.dwdp_overrides)
    return f"flags override {source}: {flags}"


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
