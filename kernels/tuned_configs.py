"""Tuned tile configurations of the grouped GEMM, kept as data: one JSON file per device.

Legend: N = output features (the weight rows of one expert: 2 N_OUT for a gated first projection),
K = input features, Re = rows per expert (sorted rows / experts in the table: tokens x top_k / E on
the MoE path).

A file names the device it was measured on (exactly as `torch.cuda.get_device_name` spells it),
when, with which versions and code, and holds:
  defaults: one tile configuration per kind, used on that device when no entry matches;
  entries:  tiles measured best for one (kind, N, K, Re).
A kind is the dot the kernel runs plus whether the epilogue is gated (two weight tiles per K step):
"bf16" (bf16 or fp16 tensor-core dots), "fp8" (fp8 x fp8 dots), "fp8w" (fp8 weights dequantized
to bf16 dots in the K loop), "fp32"; each with a "_gated" twin.

Files are read from the directory named by DWDP_KERNEL_CONFIGS first (where `dwdp tune-kernel`
writes), then from the package's own `configs/` directory. A malformed file raises
KernelConfigError naming the file and the field.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent / "configs"
FORMAT = "dwdp-kernel-configs/1"
DOTS = ("bf16", "fp8", "fp8w", "fp32")
KINDS = tuple(d + g for d in DOTS for g in ("", "_gated"))
TILE_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages", "programs_per_sm")
OPTIONAL_FIELDS = ("group_m", "tma")
MEASURED_FIELDS = ("date", "torch", "triton", "code")


class KernelConfigError(ValueError):
    """A tuned-configuration file that cannot be used; the message starts with the file's path."""


@dataclass(frozen=True)
class TunedEntry:
    kind: str
    n: int
    k: int
    rows_per_expert: int
    config: dict  # GroupedGemmConfig fields
    extra: dict = field(default_factory=dict)  # what was measured with it (TFLOP/s, baseline, notes)


@dataclass(frozen=True)
class TunedFile:
    path: Path
    device: str
    measured: dict  # date, torch, triton, code (+ free text on how)
    defaults: dict  # kind -> GroupedGemmConfig fields
    entries: tuple[TunedEntry, ...]

    def entries_for(self, kind: str, n: int, k: int) -> list[TunedEntry]:
        return [e for e in self.entries if e.kind == kind and e.n == n and e.k == k]


def file_name(device: str) -> str:
    """File name of a device's configurations: 'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3.json'."""
    return re.sub(r"[^A-Za-z0-9]+", "_", device).strip("_") + ".json"


def _bad(path: Path, what: str) -> KernelConfigError:
    return KernelConfigError(f"{path}: {what}")


def _config_fields(path: Path, where: str, raw) -> dict:
    """Validate one configuration dict (the GroupedGemmConfig fields) and return it."""
    from dwdp.kernels.settings import GroupedGemmConfig

    if not isinstance(raw, dict):
        raise _bad(path, f"{where} must be an object of {TILE_FIELDS}, got {raw!r}")
    missing = [f for f in TILE_FIELDS if f not in raw]
    unknown = [f for f in raw if f not in TILE_FIELDS + OPTIONAL_FIELDS]
    if missing or unknown:
        raise _bad(path, f"{where}: missing fields {missing}, unknown fields {unknown}")
    for name, value in raw.items():
        ok = isinstance(value, bool) or value is None if name == "tma" else isinstance(value, int) and not isinstance(
            value, bool)
        if not ok:
            raise _bad(path, f"{where}.{name}={value!r} must be {'true, false or null' if name == 'tma' else 'an int'}")
    try:
        GroupedGemmConfig(**raw)
    except ValueError as exc:
        raise _bad(path, f"{where}: {exc}") from None
    return dict(raw)


def _positive_int(path: Path, where: str, value, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise _bad(path, f"{where}={value!r} must be an int >= {minimum}")
    return value


def parse(path: Path, data) -> TunedFile:
    """Validate the decoded JSON of a configuration file."""
    if not isinstance(data, dict):
        raise _bad(path, f"top level must be an object, got {type(data).__name__}")
    if data.get("format") != FORMAT:
        raise _bad(path, f"format={data.get('format')!r}, expected {FORMAT!r}")
    device = data.get("device")
    if not isinstance(device, str) or not device:
        raise _bad(path, f"device={device!r} must name the GPU as torch.cuda.get_device_name() does")
    measured = data.get("measured")
    if not isinstance(measured, dict) or any(not isinstance(measured.get(f), str) or not measured.get(f)
                                             for f in MEASURED_FIELDS):
        raise _bad(path, f"measured must be an object with the strings {MEASURED_FIELDS} (when, with what, "
                         f"at which code), got {measured!r}")
    defaults_raw = data.get("defaults", {})
    if not isinstance(defaults_raw, dict):
        raise _bad(path, f"defaults must be an object kind -> configuration, got {defaults_raw!r}")
    defaults = {}
    for kind, raw in defaults_raw.items():
        if kind not in KINDS:
            raise _bad(path, f"defaults.{kind}: unknown kind, expected one of {KINDS}")
        config = raw.get("config") if isinstance(raw, dict) and "config" in raw else raw
        defaults[kind] = _config_fields(path, f"defaults.{kind}", config)
    entries_raw = data.get("entries", [])
    if not isinstance(entries_raw, list):
        raise _bad(path, f"entries must be a list, got {type(entries_raw).__name__}")
    entries, seen = [], set()
    for i, raw in enumerate(entries_raw):
        where = f"entries[{i}]"
        if not isinstance(raw, dict):
            raise _bad(path, f"{where} must be an object, got {raw!r}")
        kind = raw.get("kind")
        if kind not in KINDS:
            raise _bad(path, f"{where}.kind={kind!r}, expected one of {KINDS}")
        n = _positive_int(path, f"{where}.n", raw.get("n"))
        k = _positive_int(path, f"{where}.k", raw.get("k"))
        rows = _positive_int(path, f"{where}.rows_per_expert", raw.get("rows_per_expert"))
        if (kind, n, k, rows) in seen:
            raise _bad(path, f"{where} repeats kind={kind} n={n} k={k} rows_per_expert={rows}")
        seen.add((kind, n, k, rows))
        config = _config_fields(path, f"{where}.config", raw.get("config"))
        extra = {key: value for key, value in raw.items() if key not in ("kind", "n", "k", "rows_per_expert", "config")}
        entries.append(TunedEntry(kind, n, k, rows, config, extra))
    return TunedFile(path, device, dict(measured), defaults, tuple(entries))


def load(path: Path) -> TunedFile:
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise _bad(path, f"cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise _bad(path, f"is not valid JSON: {exc}") from None
    return parse(path, data)


def search_dirs() -> list[Path]:
    from dwdp.envs import kernel_configs_dir

    extra = kernel_configs_dir()
    return ([Path(extra)] if extra else []) + [PACKAGE_DIR]


_CACHE: dict[tuple, dict[str, TunedFile]] = {}


def _stamp(directory: Path) -> tuple:
    if not directory.is_dir():
        return (str(directory), None)
    return (str(directory),) + tuple(sorted((p.name, p.stat().st_mtime_ns) for p in directory.glob("*.json")))


def files_by_device() -> dict[str, TunedFile]:
    """Every configuration file of the search directories, by the device it names; the first directory wins
    when two name the same device. Re-read when a file changes."""
    dirs = search_dirs()
    key = tuple(_stamp(d) for d in dirs)
    if key not in _CACHE:
        found: dict[str, TunedFile] = {}
        for directory in dirs:
            for path in sorted(directory.glob("*.json")) if directory.is_dir() else ():
                tuned = load(path)
                found.setdefault(tuned.device, tuned)
        _CACHE.clear()
        _CACHE[key] = found
    return _CACHE[key]


def nearest(entries: list[TunedEntry], rows_per_expert: int) -> list[TunedEntry]:
    """Entries ordered by how far their rows per expert are from `rows_per_expert` on a log scale (the
    smaller one first on a tie): tiles tuned at 256 rows suit 200 better than tiles tuned at 64."""
    target = math.log2(max(rows_per_expert, 1))
    return sorted(entries, key=lambda e: (abs(math.log2(e.rows_per_expert) - target), e.rows_per_expert))
