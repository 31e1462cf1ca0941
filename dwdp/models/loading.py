"""Build one DWDP rank from a safetensors checkpoint, reading only what the rank keeps.

Legend: E = experts per MoE layer, L = local experts per rank, I = expert intermediate size,
H = hidden size.

The model skeleton is built on the meta device (no weight memory). The dense weights (attention,
norms, embeddings, router, shared experts) are read into it tensor by tensor; the experts are read
by DWDPModel through an expert source that returns only this rank's L experts of each layer, for
each of the experts' named tensors (weights, biases, ...): sliced out of a stacked `[E, ...]` (or
flattened `[E * rows, ...]`, DBRX) tensor with `get_slice`, or gathered from per-expert tensors.
This module does not import dwdp.runtime.model: DWDPModel.from_pretrained drives a CheckpointLoad.
safetensors memory-maps the shards, so a non-local expert is never read. A page that is read stays
resident while its shard is open or a tensor still uses the mapping, so one shard is open at a
time, dense tensors are copied out of it, and expert pages go once DWDPModel has copied them into
the rank's segment: the load's peak is about dense + local experts + one shard.

Quantized checkpoints (`quantization_config` in config.json: fp8 with block scales, MXFP4; see
dwdp.models.quantization) keep their experts quantized: the skeleton's experts modules are laid out for
values + scales, which are read per rank like any other expert tensor (a `weight_scale_inv` follows
its weight's name mapping). Dense fp8 linears are dequantized to the model's dtype once at load.

Checkpoint names are mapped to the model's with transformers' own conversion mapping (renames such
as Mixtral's `block_sparse_moe` -> `mlp`, and the per-expert -> stacked merges), so both layouts
load: per-expert `...experts.{e}.gate_proj/up_proj/down_proj.weight` (gate_up = cat(gate, up) on
dim 0, Mixtral: w1/w3/w2) and the stacked `...experts.gate_up_proj [E, 2I, H]` /
`...experts.down_proj [E, H, I]` that transformers 5 holds in memory.
"""
from __future__ import annotations

import json
import math
import mmap
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dwdp.models.adapters import ExpertsLayer, find_experts
from dwdp.models.expert_tensors import ExpertTensor
from dwdp.kernels.block_scales import FP8_DTYPE, dequantize
from dwdp.models.quantization import ExpertsQuantization, relayout_experts

INDEX_FILE = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"  # fp8 block scales: `<weight>_scale_inv`, `<module>.weight_scale_inv`
SINGLE_FILE = "model.safetensors"
_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


PEAK_METHOD = "RSS from /proc/self/status: VmHWM peak, VmRSS now"


def rss_bytes() -> tuple[int, int]:
    """(resident bytes now, resident high-water mark) of this process: VmRSS and VmHWM."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                name, value = line.split(":")
                fields[name] = int(value.split()[0]) * 1024  # the kernel reports kB
    return fields["VmRSS"], fields["VmHWM"]


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: write 5 to clear_refs); False if not allowed,
    in which case the peak is the process's since it started."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; the message names the file and the tensor."""


@dataclass(frozen=True)
class LoadReport:
    """What loading one rank read and how much memory it took.

    Memory is the process's resident set from /proc/self/status (see `peak_method`): `rss_before`
    once the meta skeleton is built (model code imported, no weights yet), `rss_peak` the
    high-water mark from there on (VmHWM, reset at that point when the kernel allows, see
    `peak_is_load_only`), `rss_after` once the rank is built.
    The byte split (dense / local experts / prefetch buffers) is what the rank allocated.
    Prefetch buffers are not touched until the first forward, so `rss_after` does not hold them.
    """

    path: str
    rank: int
    group_size: int
    seconds: float
    tensors_read: int
    bytes_read: int             # checkpoint bytes this rank read (dense + its local experts)
    checkpoint_bytes: int       # all shard files of the checkpoint
    largest_shard_bytes: int
    dense_bytes: int
    local_expert_bytes: int
    prefetch_buffer_bytes: int
    full_expert_bytes: int
    rss_before: int
    rss_peak: int
    rss_after: int
    peak_is_load_only: bool
    peak_method: str = PEAK_METHOD
    expert_bytes: int = 0       # one expert as held and moved: every named tensor (values, scales, biases)
    experts_format: str = ""    # "torch.bfloat16", "fp8 + 128x128 torch.float32 block scales", ...

    @property
    def load_peak_bytes(self) -> int:
        """Resident bytes the load added at its peak."""
        return self.rss_peak - self.rss_before

    @property
    def steady_bytes(self) -> int:
        """Resident bytes the built rank holds (before its first forward)."""
        return self.rss_after - self.rss_before

    def table(self) -> str:
        mib = 1 << 20
        rows = [
            ("dense", self.dense_bytes), ("local experts", self.local_expert_bytes),
            ("prefetch buffers", self.prefetch_buffer_bytes), ("all experts (unwrapped)", self.full_expert_bytes),
            ("read from checkpoint", self.bytes_read), ("checkpoint", self.checkpoint_bytes),
            ("largest shard", self.largest_shard_bytes), ("RSS added at load peak", self.load_peak_bytes),
            ("RSS added after load", self.steady_bytes),
        ]
        head = f"rank {self.rank}/{self.group_size}: loaded {self.path} in {self.seconds:.2f} s ({self.peak_method})"
        expert = f"  {'one expert':<26}{self.expert_bytes / 1024:10.1f} KiB ({self.experts_format})"
        return "\n".join([head, expert] + [f"  {name:<26}{n / mib:10.1f} MiB" for name, n in rows])


# -- the checkpoint on disk ---------------------------------------------------------------------
class Shards:
    """The safetensors shards of one checkpoint directory, opened lazily, memory-mapped.

    `weight_map` maps every checkpoint tensor name to its shard file name; `index` is the file that
    lists them (the index json, or the single shard). Reads count `tensors_read` / `bytes_read`.
    """

    def __init__(self, root: Path):
        self.root = root
        index = root / INDEX_FILE
        if index.is_file():
            self.index = index
            self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (root / SINGLE_FILE).is_file():
            from safetensors import safe_open

            self.index = root / SINGLE_FILE
            with safe_open(str(self.index), framework="pt") as f:
                self.weight_map = {k: SINGLE_FILE for k in f.keys()}
        else:
            raise CheckpointError(f"{root}: neither {INDEX_FILE} nor {SINGLE_FILE} is there")
        self._open, self._open_name = None, None
        self.tensors_read = 0
        self.bytes_read = 0

    def file_of(self, key: str) -> Path:
        return self.root / self.weight_map[key]

    def _handle(self, key: str):
        """The open shard holding `key`. One shard is open at a time: a mapping stays resident (every
        page read through it) while its handle or any tensor read from it lives, so switching shards
        releases the previous one and bounds the load's slack to about one shard."""
        name = self.weight_map[key]
        if self._open_name != name:
            from safetensors import safe_open

            self.close()
            path = self.root / name
            if not path.is_file():
                raise CheckpointError(f"shard {path} is missing; {self.index.name} lists tensor {key!r} in it")
            self._open, self._open_name = safe_open(str(path), framework="pt", device="cpu"), name
        return self._open

    def _slice(self, key: str, shape: tuple[int, ...] | None):
        sl = self._handle(key).get_slice(key)
        got = tuple(sl.get_shape())
        if shape is not None and got != shape:
            raise CheckpointError(
                f"{self.file_of(key)}: tensor {key!r} has shape {list(got)}, the model config expects {list(shape)}"
            )
        return sl

    def _count(self, t: torch.Tensor) -> None:
        self.tensors_read += 1
        self.bytes_read += t.numel() * t.element_size()

    def view(self, key: str, shape: tuple[int, ...] | None, dtype: torch.dtype | None) -> torch.Tensor:
        """The whole tensor `key` (checked against `shape` unless None, and castable to `dtype` unless
        None) as stored, still backed by the shard's mapping: callers copy it and drop it."""
        t = self._slice(key, shape)[:]
        self._count(t)
        if dtype is not None:
            _check_cast(t.dtype, dtype, self.file_of(key), key)
        return t

    def shape_of(self, key: str) -> tuple[int, ...]:
        """The stored shape of `key` (from the shard's header; nothing is read)."""
        return tuple(self._handle(key).get_slice(key).get_shape())

    def read(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The whole tensor `key` cast to `dtype`, in memory of its own (a tensor kept after the load
        must not pin its shard's mapping)."""
        t = self.view(key, shape, dtype)
        return t.clone() if t.dtype == dtype else t.to(dtype)

    def read_rows(self, key: str, rows: list[int], shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Rows `rows` of the stacked tensor `key` of full shape `shape` -> [len(rows), *shape[1:]].

        Each run of consecutive rows is one `get_slice` read; no other row is touched. The result may
        share the shard's mapping: callers copy it and drop it.
        """
        sl = self._slice(key, shape)
        _check_cast(_SAFETENSORS_DTYPES.get(sl.get_dtype()), dtype, self.file_of(key), key, sl.get_dtype())
        runs = _runs(rows)
        if len(runs) == 1 and _SAFETENSORS_DTYPES[sl.get_dtype()] == dtype:
            t = sl[runs[0][0] : runs[0][1]]  # [L, ...], backed by the shard's mapping
            self._count(t)
            return t
        out = scratch((len(rows), *shape[1:]), dtype)  # [L, ...]
        at = 0
        for start, stop in runs:
            t = sl[start:stop]
            self._count(t)
            out[at : at + stop - start] = t  # casts
            at += stop - start
        return out

    def total_bytes(self) -> tuple[int, int]:
        """(bytes of all shard files present, bytes of the largest one)."""
        sizes = [(self.root / n).stat().st_size for n in set(self.weight_map.values()) if (self.root / n).is_file()]
        return sum(sizes), max(sizes, default=0)

    def close(self) -> None:
        """Close the open shard; a tensor still using its mapping keeps that alive until it goes."""
        if self._open is not None:
            self._open.__exit__(None, None, None)
        self._open, self._open_name = None, None


def write_shards(tensors: dict[str, torch.Tensor], directory: Path, num_shards: int) -> None:
    """Write `tensors` as `num_shards` safetensors files of about equal size plus the index json
    (the layout `Shards` reads; tests and the tiny checkpoint makers use it)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    shards, current, size = [], {}, 0
    for key, t in tensors.items():
        if current and size >= total * (len(shards) + 1) / num_shards:
            shards.append(current)
            current = {}
        current[key] = t.contiguous()
        size += t.numel() * t.element_size()
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """[5, 6, 7, 0] -> [(5, 8), (0, 1)]: half-open runs of consecutive indices, in order."""
    runs: list[tuple[int, int]] = []
    for r in rows:
        if runs and runs[-1][1] == r:
            runs[-1] = (runs[-1][0], r + 1)
        else:
            runs.append((r, r + 1))
    return runs


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}


def _check_cast(stored: torch.dtype | None, dtype: torch.dtype, file: Path, key: str, name: str = "") -> None:
    """Only float -> float is a cast that keeps the weights' meaning; ints or bools would not, nor would
    a cast into or out of a 1-byte float (fp8 values mean nothing without their block scales)."""
    if stored == dtype:
        return
    if stored is None or not (stored.is_floating_point and dtype.is_floating_point):
        raise CheckpointError(
            f"{file}: tensor {key!r} is {stored or name} and cannot be cast to the model's {dtype}"
        )
    if stored.itemsize == 1 or dtype.itemsize == 1:
        raise CheckpointError(
            f"{file}: tensor {key!r} is {stored} where the model expects {dtype}: quantized values are never cast "
            "(a quantized checkpoint needs its quantization_config in config.json, and fp8 weights their "
            "weight_scale_inv)"
        )


def scratch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor in an anonymous mapping of its own, returned to the OS when the tensor
    goes. A freed multi-MiB block from malloc often stays in its heap, i.e. in the rank's RSS, and
    the load assembles one such [L, ...] block per layer."""
    count = math.prod(shape)
    buffer = mmap.mmap(-1, max(count * dtype.itemsize, 1))
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)


# -- checkpoint names -> model names ------------------------------------------------------------
@dataclass
class ExpertEntry:
    """Where one experts tensor of one layer (e.g. its `gate_up_proj`, `down_proj_bias`, DBRX's `w1`)
    lives in the checkpoint.

    tensor: what one expert's slice is (shape, rows when flattened); shape: the model's full stored
    shape; stacked: the checkpoint key of that whole tensor, or parts[e]: keys of expert e's pieces,
    concatenated on its dim 0 (gate, up) in this order.
    """

    tensor: ExpertTensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    stacked: str | None = None
    parts: dict[int, list[str | None]] = field(default_factory=dict)


@dataclass
class KeyPlan:
    """dense: model state_dict name -> checkpoint key; experts: (experts module, tensor name) -> ExpertEntry;
    dense_scales: model name of a dense fp8 weight -> checkpoint key of its block scales."""

    dense: dict[str, str]
    experts: dict[tuple[str, str], ExpertEntry]
    dense_scales: dict[str, str] = field(default_factory=dict)


def plan_keys(model: torch.nn.Module, shards: Shards, layers: list[ExpertsLayer]) -> KeyPlan:
    """Map every checkpoint key to a dense model tensor or a piece of an experts tensor.

    Raises CheckpointError for a key the model has no place for, an expert index outside the model,
    or an experts tensor the checkpoint lacks (or holds in both layouts at once).
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, rename_source_key

    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    meta_state = model.state_dict()
    plan = KeyPlan({}, {})
    by_target = {}
    for layer in layers:
        for tensor in layer.spec.tensors:
            stored = tensor.stored(layer.module)
            plan.experts[(layer.name, tensor.name)] = ExpertEntry(tensor, tuple(stored.shape), stored.dtype)
            by_target[f"{layer.name}.{tensor.param}"] = (layer.name, tensor.name)
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    unexpected = []
    for key in shards.weight_map:
        # A weight's scales follow the weight's own name mapping (per-expert pieces included).
        suffix = SCALE_SUFFIX if key.endswith(SCALE_SUFFIX) else ""
        source = key.removesuffix(suffix)
        target, pattern = rename_source_key(source, renamings, converters, model.base_model_prefix, meta_state)
        if suffix and pattern is None and target in meta_state and target not in by_target:
            plan.dense_scales[target] = key
            continue
        target += suffix
        if target in by_target:
            entry = plan.experts[by_target[target]]
            if pattern is None:
                entry.stacked = key
            else:
                _add_part(entry, key, pattern, converters, shards)
        elif pattern is None and target in meta_state:
            plan.dense[target] = key
        elif not any(p.search(key) for p in ignored):
            unexpected.append(key)
    if unexpected:
        scales = [k for k in unexpected if k.endswith((SCALE_SUFFIX, "_blocks", "_scales"))]
        hint = (f"; {scales[0]!r} looks like quantized weights: is config.json missing the checkpoint's "
                "quantization_config?" if scales and not any(layer.spec.math.quantized for layer in layers) else "")
        raise CheckpointError(
            f"{shards.index}: {len(unexpected)} tensors have no place in {type(model).__name__}, "
            f"e.g. {unexpected[:3]} (in {shards.file_of(unexpected[0]).name}){hint}"
        )
    for (name, _), entry in plan.experts.items():
        _check_complete(f"{name}.{entry.tensor.param}", entry, shards)
    return plan


def _add_part(entry: ExpertEntry, key: str, pattern: str, converters, shards: Shards) -> None:
    converter = next(c for c in converters if pattern in c.source_patterns)
    _check_merge(converter, entry, key, shards)
    found = _EXPERT_INDEX.search(key)
    if found is None:
        raise CheckpointError(f"{shards.file_of(key)}: tensor {key!r} names no expert index (.experts.<e>.)")
    e, num_experts = int(found.group(1)), entry.shape[0]
    if e >= num_experts:
        raise CheckpointError(
            f"{shards.file_of(key)}: tensor {key!r} is expert {e}, outside the model's {num_experts} experts"
        )
    parts = entry.parts.setdefault(e, [None] * len(converter.source_patterns))
    parts[converter.source_patterns.index(pattern)] = key


def _check_merge(converter, entry: ExpertEntry, key: str, shards: Shards) -> None:
    """Per-expert pieces must be stacked on dim 0 of a [E, ...] tensor and (when there are several)
    concatenated on each expert's dim 0, as gate and up of [E, 2I, H]; anything else (interleaving,
    transposes, flattened experts) would be read wrongly, so refuse it."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(converter.operations)
    merge_ok = bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0 and not entry.tensor.rows
    rest_ok = (
        (len(ops) == 1 and len(converter.source_patterns) == 1)
        or (len(ops) == 2 and isinstance(ops[1], Concatenate) and ops[1].dim == 1)
    )
    if not (merge_ok and rest_ok):
        raise CheckpointError(
            f"{shards.file_of(key)}: tensor {key!r} is merged into {entry.tensor.param} by {ops}, "
            "which this loader does not read per expert"
        )


def _check_complete(target: str, entry: ExpertEntry, shards: Shards) -> None:
    if entry.stacked is not None and entry.parts:
        some = next(iter(entry.parts.values()))
        raise CheckpointError(
            f"{shards.index}: {target} is stored both stacked ({entry.stacked!r}) and per expert ({some})"
        )
    if entry.stacked is not None:
        return
    num_experts = entry.shape[0] if not entry.tensor.rows else entry.shape[0] // entry.tensor.rows
    for e in range(num_experts):
        parts = entry.parts.get(e)
        if parts is None or None in parts:
            raise CheckpointError(f"{shards.index}: tensor {target} of expert {e} is missing (pieces found: {parts})")


# -- building the rank --------------------------------------------------------------------------
def _skeleton(path: Path, dtype: torch.dtype | None):
    """The model built on the meta device: every tensor has its shape and dtype, none has memory."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(path)
    if dtype is None:
        dtype = getattr(config, "dtype", None) or torch.float32
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r} must be a floating torch.dtype")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    return model.eval()


def _experts_quantization(model, path: Path) -> ExpertsQuantization | None:
    """The checkpoint's expert format from its quantization_config (None: dense), with the meta
    skeleton's experts modules laid out for it. CheckpointError for a format dwdp does not read."""
    config = getattr(model.config, "quantization_config", None)
    if config is None:
        return None
    try:
        quant = ExpertsQuantization.from_config(config, str(path / "config.json"))
        for layer in find_experts(model):
            relayout_experts(layer, quant)
    except (ValueError, RuntimeError) as exc:
        raise CheckpointError(str(exc) if str(path) in str(exc) else f"{path / 'config.json'}: {exc}") from None
    return quant


def _set_tensor(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    if leaf in parent._parameters:
        old = parent._parameters[leaf]
        parent._parameters[leaf] = torch.nn.Parameter(value, requires_grad=old.requires_grad)
    else:
        parent._buffers[leaf] = value


def load_dense(model, plan: KeyPlan, shards: Shards, device: torch.device,
               quant: ExpertsQuantization | None = None) -> None:
    """Read every dense tensor into the meta `model`, tie shared weights and recompute the buffers
    that checkpoints do not hold (rotary inv_freq); dense fp8 weights are dequantized with their block
    scales (`quant`'s blocks). Raises CheckpointError for a missing tensor."""
    # Non-persistent buffers are derived from the config: let the model's own init compute them.
    owners = {name.rpartition(".")[0] for name, _ in model.named_non_persistent_buffers()}
    for owner in sorted(owners):
        module = model.get_submodule(owner)
        module.to_empty(device=device, recurse=False)
        model._init_weights(module)
    # In shard order, so each shard is opened once.
    for target, key in sorted(plan.dense.items(), key=lambda item: shards.weight_map[item[1]]):
        current = model.get_parameter_or_buffer(target)
        if target in plan.dense_scales:
            value = _dequantized(shards, key, plan.dense_scales[target], tuple(current.shape), current.dtype, quant)
        else:
            value = shards.read(key, tuple(current.shape), current.dtype)
        _set_tensor(model, target, value if value.device == device else value.to(device))
    expert_names = {f"{name}.{entry.tensor.param}" for (name, _), entry in plan.experts.items()}
    missing = set(model.state_dict()) - set(plan.dense) - expert_names
    model.tie_weights(missing_keys=missing, recompute_mapping=False)
    if missing:
        raise CheckpointError(f"{shards.index}: tensors {sorted(missing)[:5]} of the model are missing")


def _dequantized(shards: Shards, key: str, scale_key: str, shape: tuple[int, ...], dtype: torch.dtype,
                 quant: ExpertsQuantization | None) -> torch.Tensor:
    """The dense fp8 weight `key` [N, K] times its block scales `scale_key`, in `dtype`."""
    file = shards.file_of(scale_key)
    if quant is None or quant.format != "fp8":
        raise CheckpointError(f"{file}: tensor {scale_key!r} scales {key!r}, but config.json has no fp8 "
                              "quantization_config to say how")
    values = shards.view(key, shape, None)
    if values.dtype != FP8_DTYPE or len(shape) != 2:
        raise CheckpointError(f"{shards.file_of(key)}: tensor {key!r} is {values.dtype} {list(shape)} next to its "
                              f"scales {scale_key!r}; expected float8_e4m3fn [N, K]")
    bq = quant.block_quant(*shape, fused_gate=False)
    scales = shards.view(scale_key, None, None)
    if scales.numel() == 1 and quant.block is None:
        scales = scales.reshape(1, 1)  # one scale for the whole matrix
    if tuple(scales.shape) != bq.scale_shape(*shape):
        raise CheckpointError(f"{file}: tensor {scale_key!r} has shape {list(scales.shape)}, expected "
                              f"{list(bq.scale_shape(*shape))}: one scale per {bq.block[0]} x {bq.block[1]} block "
                              f"of {key!r} {list(shape)}")
    return dequantize(values, scales, bq, dtype)


def check_scale_shapes(plan: KeyPlan, shards: Shards, layers: list[ExpertsLayer]) -> None:
    """Every experts scale tensor of the checkpoint holds one scale per block of its weight; raises
    CheckpointError naming the file, the tensor and the block otherwise (before anything is read)."""
    for layer in layers:
        for q in layer.spec.math.quantized:
            entry = plan.experts[(layer.name, q.scale)]
            weight = layer.spec.tensor(q.weight)
            keys = [(entry.stacked, entry.shape)] if entry.stacked is not None else [
                (k, (entry.shape[1] // len(parts), *entry.shape[2:]))
                for parts in entry.parts.values() for k in parts]
            for key, expected in keys:
                got = shards.shape_of(key)
                if got != tuple(expected):
                    split = " (gate and up blocked apart)" if q.quant.halves == 2 else ""
                    raise CheckpointError(
                        f"{shards.file_of(key)}: tensor {key!r} has shape {list(got)}, expected {list(expected)}: "
                        f"one scale per {q.quant.block[0]} x {q.quant.block[1]} block of {layer.name}.{q.weight} "
                        f"{list(weight.shape)} per expert{split}")


def expert_reader(plan: KeyPlan, shards: Shards):
    """The expert source DWDPModel calls: (experts module, tensor name, expert ids [n]) -> [n, *shape]."""

    def read(name: str, tensor_name: str, ids: torch.Tensor) -> torch.Tensor:
        entry = plan.experts[(name, tensor_name)]
        tensor = entry.tensor
        ids = [int(e) for e in ids]
        try:
            if entry.stacked is not None:
                if not tensor.rows:
                    return shards.read_rows(entry.stacked, ids, entry.shape, entry.dtype)  # [n, *shape]
                rows = [e * tensor.rows + r for e in ids for r in range(tensor.rows)]  # flattened experts
                return shards.read_rows(entry.stacked, rows, entry.shape, entry.dtype).view(len(ids), *tensor.shape)
            shape = tensor.shape
            out = scratch((len(ids), *shape), entry.dtype)  # [n, *shape]
            for i, e in enumerate(ids):
                keys = entry.parts[e]
                step = shape[0] // len(keys)
                for p, key in enumerate(keys):
                    out[i, p * step : (p + 1) * step] = shards.view(key, (step, *shape[1:]), entry.dtype)  # casts
            return out
        finally:
            # The pages just read are copied into the rank's segment next: let them go with the copy.
            shards.close()

    return read


class CheckpointLoad:
    """One rank's read of a checkpoint directory: the meta skeleton and its key plan, then the dense
    weights (`load_dense`), then the experts through `expert_source` as DWDPModel asks for them, then
    `report`. Only the dense tensors and the rank's local experts are ever read.

    path: a directory with config.json and safetensors shards (+ model.safetensors.index.json).
    dtype: the model's dtype (None: the checkpoint config's dtype); tensors are cast on read.
    """

    def __init__(self, path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
        self.path = Path(path)
        self.device = torch.device(device)
        self.start = time.perf_counter()
        self.shards = Shards(self.path)
        self.model = _skeleton(self.path, dtype)
        self.quant = _experts_quantization(self.model, self.path)
        layers = find_experts(self.model)
        self.plan = plan_keys(self.model, self.shards, layers)
        if self.quant is not None:
            check_scale_shapes(self.plan, self.shards, layers)
        self.expert_source = expert_reader(self.plan, self.shards)
        # Measured from here: the model code is imported and the skeleton holds no weights, so what the
        # RSS gains is the rank's data.
        self.peak_is_load_only = reset_peak_rss()
        self.rss_before = rss_bytes()[0]

    def load_dense(self) -> None:
        load_dense(self.model, self.plan, self.shards, self.device, self.quant)

    def close(self) -> None:
        self.shards.close()

    def report(self, memory, rank: int, group_size: int) -> LoadReport:
        """The LoadReport of the finished rank (`memory`: its DWDPModel.memory); RuntimeError if any
        tensor of the model was never loaded."""
        on_meta = [n for n, t in [*self.model.named_parameters(), *self.model.named_buffers()] if t.is_meta]
        if on_meta:
            raise RuntimeError(f"{self.path}: tensors {on_meta[:5]} were never loaded")
        rss_after, rss_peak = rss_bytes()
        checkpoint_bytes, largest_shard = self.shards.total_bytes()
        return LoadReport(
            path=str(self.path), rank=rank, group_size=group_size, seconds=time.perf_counter() - self.start,
            tensors_read=self.shards.tensors_read, bytes_read=self.shards.bytes_read,
            checkpoint_bytes=checkpoint_bytes, largest_shard_bytes=largest_shard, dense_bytes=memory.dense_bytes,
            local_expert_bytes=memory.local_expert_bytes, prefetch_buffer_bytes=memory.prefetch_buffer_bytes,
            full_expert_bytes=memory.full_expert_bytes, rss_before=self.rss_before, rss_peak=rss_peak,
            rss_after=rss_after, peak_is_load_only=self.peak_is_load_only,
            expert_bytes=self.expert_bytes, experts_format=self.experts_format,
        )

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert of the first MoE layer, every named tensor at its own dtype."""
        first = next(iter(self.plan.experts))[0]
        return sum(entry.tensor.nbytes for (name, _), entry in self.plan.experts.items() if name == first)

    @property
    def experts_format(self) -> str:
        if self.quant is None:
            return str(next(iter(self.plan.experts.values())).dtype)
        if self.quant.format == "mxfp4":
            return "mxfp4: e2m1 values + one e8m0 scale per 32"
        block = "x".join(map(str, self.quant.block)) if self.quant.block else "per-matrix"
        return f"fp8 e4m3 values + {block} {self.quant.scale_dtype} block scales"
