"""DWDPConnector: vLLM continues a prompt from the KV cache `dwdp serve` prefilled (the consumer side of
vLLM's v1 KV connector interface). vLLM loads it by module path; nothing is installed into vLLM:

    DWDP_KV_KEY=... python -m vllm.entrypoints.openai.api_server --model DIR ... --kv-transfer-config
        '{"kv_connector": "DWDPConnector", "kv_connector_module_path": "dwdp.integrations.vllm_connector",
          "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"kv_dir": "/dev/shm/dwdp-kv"}}'

A completion request that carries dwdp's `kv_transfer_params` ({"kv_artifacts": [descriptor]}, what
`dwdp serve` answers) loads that artifact's tokens into the blocks vLLM allocated for its prompt
(per-head keys and values, `dwdp-kv-v1`; on an MLA model, the latent and roped key, `dwdp-kv-mla-v1`);
vLLM then computes only the prompt tokens past the artifact (at least the last one: it needs their
logits). The descriptor names the artifact by name inside the configured KV directory, carries dwdp
serve's authenticator when both sides have the KV key, and the artifact must be of this prompt (its
token ids' digest), this model, layer count, head shape and dtype; anything else makes vLLM recompute
the prompt, with one log line naming why (dwdp.integrations.kv_transfer).

Whatever a client sends, the connector never raises into vLLM: every method vLLM calls turns an
exception into "recompute this request" (blocks it promised are reported as load errors) and one
bounded log line, so the engine keeps serving.

Scheduler side: get_num_new_matched_tokens checks the descriptor and the artifact's header,
update_state_after_alloc and build_connector_meta hand the worker (the checked file, token range,
block ids), request_finished removes the artifact once loaded (and reports the tokens loaded in the
completion's kv_transfer_params). Worker side: start_load_kv opens each artifact (the same file the
scheduler checked), wait_for_layer_load(layer) writes that layer's pages just before its attention
runs (dwdp.integrations.vllm_pages), a load that fails is reported as invalid blocks, which vLLM
recomputes.

kv_connector_extra_config: {"kv_dir": DIR} the KV directory dwdp serve writes to (`--kv-dir`; without
it nothing is loaded); {"model": NAME} the model id artifacts must name (default: the last part of
vLLM's --model path, as `dwdp serve --model` names it); {"keep_artifacts": true} leaves loaded
artifacts in place (default: removed once loaded). DWDP_KV_KEY / DWDP_KV_KEY_FILE in vLLM's
environment: the KV key (docs/decode-with-vllm.md#security).

Imports only vLLM, torch and dwdp's artifact format and hand-off (no transformers of dwdp's own
release, no dwdp runtime): it runs in vLLM's environment.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.logger import init_logger

from dwdp.integrations import reserved_cpu_advice
from dwdp.integrations.guard import answer as _answer
from dwdp.integrations.guard import guarded_by, one_line
from dwdp.integrations.kv_transfer import ArtifactRef, EngineKV, FileTransfer, Refused
from dwdp.integrations.vllm_pages import head_share, rows, slot_mapping, write_kv, write_latent
from dwdp.serve.kv_handoff import kv_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under vLLM's logger tree, so its lines come out formatted like vLLM's own.
logger = init_logger("vllm.dwdp_connector")


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()
never_raises = guarded_by(logger)


@dataclass
class LoadSpec:
    """One request's load for the worker: the checked artifact, positions [start, stop) and its blocks."""

    request_id: str
    ref: ArtifactRef
    start: int
    stop: int
    block_ids: list[int]

    def blocks_loaded(self, block_size: int) -> list[int]:
        return self.block_ids[self.start // block_size:(self.stop - 1) // block_size + 1]


@dataclass
class DWDPConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    invalid_blocks: set[int] = field(default_factory=set)  # promised to vLLM but not loadable: report them


@dataclass
class _Load:
    """A load in progress on a worker: its artifact open, its slots [n], the layers not written yet."""

    spec: LoadSpec
    reader: Any
    slots: torch.Tensor
    left: set[str]
    failed: bool = False


def engine_kv(vllm_config: "VllmConfig", model: str | None) -> EngineKV:
    """What this engine caches per layer, to check artifacts against (MLA: the latent and rope dims)."""
    config = vllm_config.model_config
    head = config.get_head_size()
    dtype = str(config.dtype).removeprefix("torch.")
    latent = rope = None
    if config.use_mla:
        text = config.hf_text_config
        latent, rope = int(text.kv_lora_rank), int(text.qk_rope_head_dim)
    return EngineKV(model=model, num_layers=config.get_total_num_hidden_layers(),
                    num_kv_heads=config.get_total_num_kv_heads(), key_dim=head, value_dim=head, dtype=dtype,
                    latent_dim=latent, rope_dim=rope)


def layer_index(layer_name: str) -> int:
    """Decoder layer of an attention layer's name: "model.layers.7.self_attn.attn" -> 7."""
    numbers = [int(part) for part in layer_name.split(".") if part.isdigit()]
    if len(numbers) != 1:
        raise ValueError(f"cannot tell the decoder layer of attention layer {layer_name!r}")
    return numbers[0]


def unsupported_inputs(request: "Request") -> str | None:
    """What makes a request's KV depend on more than its token ids (dwdp's artifacts hold token ids'
    KV only), or None."""
    found = [what for what, present in (("a LoRA adapter", getattr(request, "lora_request", None)),
                                        ("multimodal inputs", getattr(request, "mm_features", None)),
                                        ("a cache_salt", getattr(request, "cache_salt", None))) if present]
    return " and ".join(found) or None


class DWDPConnector(KVConnectorBase_V1):
    """vLLM's v1 KV connector over dwdp KV artifacts (consumer: loads, never saves)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self._block_size = vllm_config.cache_config.block_size
        kv_dir = extra.get("kv_dir")
        if kv_dir is not None and not isinstance(kv_dir, str):
            raise ValueError(f"kv_connector_extra_config.kv_dir={kv_dir!r} must be a directory path")
        self._transfer = FileTransfer(kv_dir, kv_key())
        self._keep = bool(extra.get("keep_artifacts", False))
        if role == KVConnectorRole.SCHEDULER:
            advice = reserved_cpu_advice(os.environ, _on_cpu(), vllm_config.parallel_config.local_world_size)
            if advice is not None:
                logger.info("dwdp connector: %s", advice)
            model = extra.get("model") or os.path.basename(str(vllm_config.model_config.model).rstrip("/"))
            self._expected = engine_kv(vllm_config, model)
            if self._kv_transfer_config.kv_load_failure_policy != "recompute":
                logger.warning("dwdp connector: kv_load_failure_policy is %r: a KV file that fails to read while "
                               "loading fails its request; set it to 'recompute' to recompute instead",
                               self._kv_transfer_config.kv_load_failure_policy)
            if kv_dir is None:
                logger.warning("dwdp connector: no kv_dir in kv_connector_extra_config: every prompt is recomputed")
            elif self._transfer.key is None:
                logger.warning("dwdp connector: no DWDP_KV_KEY: any client of this server may name an artifact of "
                               "%s by its name (only dwdp's, only of its own prompt); set the same key for dwdp "
                               "serve and this server so only descriptors dwdp serve signed load", kv_dir)
            self._checked: dict[str, tuple[ArtifactRef | None, int]] = {}  # request -> (artifact, start asked)
            self._to_load: dict[str, tuple[ArtifactRef, int, int]] = {}   # request -> (artifact, start, stop)
            self._loading: dict[str, tuple[ArtifactRef, set[int], int]] = {}  # -> (artifact, blocks, tokens)
            self._failed: set[str] = set()
            self._invalid: set[int] = set()  # blocks promised but not loadable: reported by the next step
        else:
            self._active: list[_Load] = []
            self._bad_blocks: set[int] = set()
            self._heads: tuple[int, int] | None = None

    # -- scheduler side ---------------------------------------------------------------------------
    def _check_request(self, request: "Request") -> ArtifactRef | None:
        prompt = list(request.prompt_token_ids or [])
        try:
            return self._transfer.check(request.kv_transfer_params, prompt, self._expected,
                                        unsupported_inputs(request))
        except Refused as reason:
            logger.warning("dwdp connector: request %s recomputes its %d-token prompt: %s",
                           one_line(request.request_id, 80), len(prompt), one_line(reason))
            return None

    def _no_match(self, request: "Request", num_computed_tokens: int = 0) -> tuple[int, bool]:
        self._checked[request.request_id] = (None, 0)
        return 0, False

    _no_match.default = (0, False)

    @never_raises(_no_match)
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if request.request_id not in self._checked:
            self._checked[request.request_id] = (self._check_request(request), 0)
        ref, _ = self._checked[request.request_id]
        if ref is None:
            return 0, False
        # vLLM computes at least the last prompt token (it needs its logits).
        stop = min(ref.num_tokens, len(request.prompt_token_ids or ()) - 1)
        self._checked[request.request_id] = (ref, num_computed_tokens)
        return max(0, stop - num_computed_tokens), False

    def _unloadable(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        """The blocks vLLM allocated for this request's external tokens are reported as load errors."""
        self._to_load.pop(request.request_id, None)
        self._checked[request.request_id] = (None, 0)
        if num_external_tokens > 0:
            self._invalid.update(blocks.get_block_ids()[0])

    @never_raises(_unloadable)
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int):
        if num_external_tokens <= 0:
            return
        ref, start = self._checked[request.request_id]
        self._to_load[request.request_id] = (ref, start, start + num_external_tokens)
        logger.info("dwdp connector: request %s loads prompt tokens [%d, %d) of %d from %s",
                    one_line(request.request_id, 80), start, start + num_external_tokens, request.num_prompt_tokens,
                    ref.name)

    def _nothing_loads(self, scheduler_output: "SchedulerOutput") -> DWDPConnectorMetadata:
        """Every load this step promised is reported as a load error: vLLM recomputes those blocks."""
        meta = DWDPConnectorMetadata(invalid_blocks=set(self._invalid))
        self._invalid.clear()
        scheduled = {r.req_id: r.block_ids[0] for r in scheduler_output.scheduled_new_reqs}
        for req_id in list(self._to_load):
            if req_id in scheduled:
                meta.invalid_blocks.update(scheduled[req_id])
                self._to_load.pop(req_id)
                self._failed.add(req_id)
        return meta

    _nothing_loads.default = DWDPConnectorMetadata()

    @never_raises(_nothing_loads)
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = DWDPConnectorMetadata(invalid_blocks=set(self._invalid))
        scheduled = [(r.req_id, r.block_ids[0]) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            # A request resumed after preemption was given all its blocks again (and loads again).
            if req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                scheduled.append((req_id, cached.new_block_ids[i][0]))
        for req_id, block_ids in scheduled:
            if req_id not in self._to_load:
                continue
            ref, start, stop = self._to_load.pop(req_id)
            spec = LoadSpec(req_id, ref, start, stop, list(block_ids))
            meta.loads.append(spec)
            self._loading[req_id] = (ref, set(spec.blocks_loaded(self._block_size)), stop - start)
            self._failed.discard(req_id)
        self._invalid.clear()
        return meta

    @never_raises(_answer(None))
    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        bad = connector_output.invalid_block_ids
        if bad:
            for req_id, (_, blocks, _) in self._loading.items():
                if blocks & bad:
                    self._failed.add(req_id)

    def _forget(self, request: "Request", block_ids: list[int]) -> tuple[bool, None]:
        for table in (self._checked, self._to_load, self._loading):
            table.pop(request.request_id, None)
        self._failed.discard(request.request_id)
        return False, None

    _forget.default = (False, None)

    @never_raises(_forget)
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._checked.pop(request.request_id, None)
        self._to_load.pop(request.request_id, None)
        loading = self._loading.pop(request.request_id, None)
        failed = request.request_id in self._failed
        self._failed.discard(request.request_id)
        if loading is None:
            return False, None
        ref, _, tokens = loading
        if failed:
            return False, {"dwdp": {"loaded_tokens": 0, "artifact": ref.name, "failed": True}}
        if not self._keep:
            self._transfer.release(ref)
        return False, {"dwdp": {"loaded_tokens": tokens, "artifact": ref.name}}

    # -- worker side ------------------------------------------------------------------------------
    def _head_share(self, total: int) -> tuple[int, int]:
        if self._heads is None:
            from vllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                         get_tensor_model_parallel_world_size)

            self._heads = head_share(total, get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size())
        return self._heads

    def _fail(self, spec: LoadSpec, why: str) -> None:
        logger.warning("dwdp connector: request %s: loading %s failed (%s); vLLM recomputes its blocks",
                       one_line(spec.request_id, 80), spec.ref.name, one_line(why))
        self._bad_blocks.update(spec.blocks_loaded(self._block_size))

    def _fail_step(self, *args, **kwargs) -> None:
        """Every load of this step fails (its blocks reported), every open artifact is closed."""
        metadata = self._connector_metadata if self.has_connector_metadata() else None
        if isinstance(metadata, DWDPConnectorMetadata):
            self._bad_blocks.update(metadata.invalid_blocks)
            for spec in metadata.loads:
                self._bad_blocks.update(spec.blocks_loaded(self._block_size))
        for load in self._active:
            load.failed = True
            self._bad_blocks.update(load.spec.blocks_loaded(self._block_size))
            load.reader.close()
        self._active = []

    @never_raises(_fail_step)
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, DWDPConnectorMetadata):
            raise TypeError(f"connector metadata of type {type(metadata).__name__}, not DWDPConnectorMetadata")
        self._bad_blocks.update(metadata.invalid_blocks)
        if not metadata.loads:
            return
        layers = {name for name, layer in forward_context.no_compile_layers.items()
                  if getattr(layer, "kv_cache", None) is not None and hasattr(layer, "impl")}
        for spec in metadata.loads:
            try:
                reader = self._transfer.open(spec.ref)
            except Exception as exc:  # vanished, replaced or unreadable since the scheduler's check
                self._fail(spec, f"{type(exc).__name__}: {exc}")
                continue
            slots = slot_mapping(spec.block_ids, self._block_size, spec.start, spec.stop)  # [n]
            self._active.append(_Load(spec, reader, slots, set(layers)))

    def _fail_layer(self, layer_name: str) -> None:
        for load in self._active:
            if not load.failed:
                load.failed = True
                self._bad_blocks.update(load.spec.blocks_loaded(self._block_size))

    @never_raises(_fail_layer)
    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._active:
            return
        layer = self._get_forward_layer(layer_name)
        index = layer_index(layer_name)
        for load in self._active:
            if load.failed or layer_name not in load.left:
                continue
            load.left.discard(layer_name)
            spec = load.spec
            try:
                first, second = load.reader.layer(index)
                if load.reader.is_mla:  # latent [1, T, R], rope [1, T, P]: one latent, every head reads it
                    write_latent(layer, layer.kv_cache, first[0, spec.start:spec.stop],      # [n, R]
                                 second[0, spec.start:spec.stop], load.slots)                # [n, P]
                else:                   # keys [1, H, T, Dk], values [1, H, T, Dv]
                    heads = self._head_share(first.shape[1])
                    write_kv(layer, layer.kv_cache, rows(first, heads, spec.start, spec.stop),   # [n, h, Dk]
                             rows(second, heads, spec.start, spec.stop), load.slots)            # [n, h, Dv]
            except Exception as exc:
                load.failed = True
                self._fail(spec, f"layer {index}: {type(exc).__name__}: {exc}")

    @staticmethod
    def _get_forward_layer(layer_name: str):
        from vllm.forward_context import get_forward_context

        return get_forward_context().no_compile_layers[layer_name]

    @never_raises(_answer(None))
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: "AttentionMetadata",
                      **kwargs: Any) -> None:
        return  # a consumer: it loads, never saves

    @never_raises(_fail_step)
    def wait_for_save(self):
        active, self._active = self._active, []
        try:
            for load in active:
                if load.left and not load.failed:  # a layer whose attention never asked for its KV
                    self._fail(load.spec, f"layers {sorted(layer_index(n) for n in load.left)} were never written")
        finally:
            for load in active:
                load.reader.close()

    @never_raises(_answer(set()))
    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._bad_blocks = self._bad_blocks, set()
        return bad
