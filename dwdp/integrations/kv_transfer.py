"""Where dwdp's KV travels to a decode engine, seen from the decode side: the transfer half of the
connector (dwdp.integrations.vllm_connector writes what this reads into the engine's pages).

Legend: Hkv = key / value heads (the cached ones), T = tokens (of the artifact's prompt), Dk = head dim
of the keys, Dv = head dim of the values, Rkv = MLA's kv_lora_rank, Dr = MLA's qk_rope_head_dim.

Nothing here imports a decode engine, so the checks run (and are tested) anywhere. Whatever a request
carries is hostile until checked: its `kv_transfer_params` come from any client of the engine's port.
One request's life, on the engine's two sides:
  scheduler side  `check(params, prompt_ids, expected)`: exactly one descriptor (dwdp.serve.kv_handoff),
                  strictly typed: a bare artifact name of dwdp's pattern, never a path; a token count
                  within the prompt; a digest of the prompt's first tokens; with a KV key, an HMAC only
                  dwdp serve can make. Then the artifact is opened inside the configured KV directory
                  (`openat` on the directory's descriptor, no symlink followed, no blocking open), checked
                  to be a regular file of the directory's owner that nobody else may write, and its
                  header (size-capped, schema-checked) against the request and the engine: format,
                  model, layers, heads, dims, dtype, digest, every tensor's bytes within the file. No
                  tensor is read. Any mismatch raises `Refused(reason)`: the engine recomputes.
  worker side     `open(ref)` -> `LayerReader`: the same file again (its device and inode must be the
                  ones checked), `layer(l)` reads that layer's keys [1, Hkv, T, Dk] and values
                  [1, Hkv, T, Dv] (MLA: latent [1, T, Rkv] and rope [1, T, Dr]) with pread, never mmap:
                  a file cut short reads short (an error, recomputed), it cannot SIGBUS the engine.
  `release(ref)`  once the engine holds the KV: the file is unlinked by name in the directory, only
                  if that name still holds the file that was loaded.

`FileTransfer` reads files in a directory both servers see (/dev/shm on one node, a shared file
system across nodes). Another transport (NIXL: RDMA reads from the prefill node's registered memory)
is another class with these methods; the page writing does not change (docs/decode-with-vllm.md).
"""
from __future__ import annotations

import errno
import hmac
import json
import os
import re
import stat
import struct
from dataclasses import dataclass

from dwdp.serve.kv import KV_FORMAT, KV_MLA_FORMAT, prompt_digest
from dwdp.serve.kv_handoff import ARTIFACT_NAME, HEX64, authenticator

# safetensors dtype names -> (torch's name, bytes per element): the ones an artifact is written in
_DTYPES = {"F32": ("float32", 4), "BF16": ("bfloat16", 2), "F16": ("float16", 2)}
_TENSOR_NAME = re.compile(r"layers\.(\d{1,5})\.(keys|values|latent|rope)")
_MAX_DIM = 1 << 31
HEADER_BASE_BYTES = 8192         # metadata and JSON framing of one artifact, with room to spare
HEADER_BYTES_PER_TENSOR = 256    # one tensor's entry is about 90 bytes in what dwdp writes


class Refused(Exception):
    """An artifact the engine must not load; str() is the one-line reason it recomputes instead."""


@dataclass(frozen=True)
class EngineKV:
    """What the decode engine caches, to check an artifact against.

    model: the model id an artifact must name (None: not checked); num_layers: decoder layers;
    num_kv_heads: cached heads of the whole model (before tensor parallelism); key_dim / value_dim:
    head dims; dtype: the dtype its cache writes take ("float32", "bfloat16", "float16").
    latent_dim / rope_dim: an MLA engine's kv_lora_rank and qk_rope_head_dim (it caches the latent and
    the roped shared key, rope dims in interleaved pairs, and takes `dwdp-kv-mla-v1` artifacts only);
    None for an engine that caches per-head keys and values (`dwdp-kv-v1`).
    """

    model: str | None
    num_layers: int
    num_kv_heads: int
    key_dim: int
    value_dim: int
    dtype: str
    latent_dim: int | None = None
    rope_dim: int | None = None

    @property
    def is_mla(self) -> bool:
        return self.latent_dim is not None

    @property
    def header_cap(self) -> int:
        """The largest header an artifact for this engine may have (bytes): what dwdp writes, with room."""
        return HEADER_BASE_BYTES + HEADER_BYTES_PER_TENSOR * 2 * self.num_layers


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor of a checked artifact lies: absolute file offset, bytes, dtype name, shape."""

    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ArtifactRef:
    """One checked artifact: its name in the KV directory, its prompt tokens and their digest, the file
    that was checked (device, inode, size) and where each tensor lies in it ({"layers.l.kind": span})."""

    name: str
    num_tokens: int
    prompt_sha256: str
    device: int = 0
    inode: int = 0
    size: int = 0
    tensors: tuple[tuple[str, TensorSpan], ...] = ()
    is_mla: bool = False


def show(value, limit: int = 60) -> str:
    """A client's value in a log line: its repr, cut to `limit` characters (a line stays one line)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def requested_artifacts(params) -> list | None:
    """The `kv_artifacts` of a request's kv_transfer_params, or None when the request names none (not
    ours: no log). Whatever the list holds is checked by `parse_descriptor`."""
    if not isinstance(params, dict) or "kv_artifacts" not in params:
        return None
    found = params["kv_artifacts"]
    if isinstance(found, list) and not found:
        return None
    if not isinstance(found, list):
        raise Refused(f"kv_artifacts is {type(found).__name__}, not a list of one descriptor")
    return found


def _int(value, what: str, low: int, high: int) -> int:
    if type(value) is not int or not low <= value <= high:  # bool, float, 1e999 and "7" are not token counts
        raise Refused(f"{what}={show(value)}: expected an int in [{low}, {high}]")
    return value


def parse_descriptor(descriptors: list, prompt_ids: list[int], model: str | None, key: bytes | None) -> ArtifactRef:
    """The one descriptor of a request, checked against its prompt (and, with `key`, authenticated)
    before any file is touched: an ArtifactRef of name, token count and digest, or Refused."""
    if len(descriptors) != 1:
        raise Refused(f"kv_artifacts holds {len(descriptors)} descriptors; a request loads exactly one")
    desc = descriptors[0]
    if not isinstance(desc, dict):
        raise Refused(f"the kv_artifacts entry is {type(desc).__name__}, not a descriptor object")
    name = desc.get("name")
    if not isinstance(name, str) or not ARTIFACT_NAME.fullmatch(name):
        raise Refused(f"artifact name {show(name)} is not dwdp's (pf-<32 hex>.safetensors; a name, never a path)")
    num_tokens = _int(desc.get("num_tokens"), "num_tokens", 1, max(1, len(prompt_ids)))
    digest = desc.get("prompt_sha256")
    if not isinstance(digest, str) or not HEX64.fullmatch(digest):
        raise Refused(f"{name}: prompt_sha256={show(digest)} is not 64 lowercase hex digits")
    if key is not None:
        given = desc.get("auth")
        if not isinstance(given, str) or not HEX64.fullmatch(given):
            raise Refused(f"{name}: no valid authenticator (auth={show(given)}); this engine loads only "
                          "descriptors dwdp serve signed with the KV key")
        if not hmac.compare_digest(given, authenticator(key, name, digest, model or "", num_tokens)):
            raise Refused(f"{name}: the authenticator does not match (not issued by dwdp serve with this KV key, "
                          "for this model, prompt and token count)")
    if len(prompt_ids) < num_tokens or prompt_digest(prompt_ids[:num_tokens]) != digest:
        raise Refused(f"the prompt's token ids ({len(prompt_ids)}) do not start with the prompt of {name} "
                      f"({num_tokens} tokens)")
    return ArtifactRef(name, num_tokens, digest)


class KVDirectory:
    """The KV directory, opened once (and again if its path comes to name another directory) and used
    only through its descriptor: names are looked up in it, never a path a client chose. It, and every
    file loaded from it, must belong to `owner_uid` (default: this process's user) and be writable by
    nobody else."""

    def __init__(self, path: str, owner_uid: int | None = None):
        self.path = path
        self.owner_uid = os.geteuid() if owner_uid is None else owner_uid
        self._fd: int | None = None
        self._identity: tuple[int, int] | None = None

    def _open_dir(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                what = "is a symlink" if os.path.islink(self.path) else "is not a directory"
            else:
                what = f"cannot be opened: {exc.strerror}"
            raise Refused(f"KV directory {self.path} {what}") from None
        try:
            self._check_owned(os.fstat(fd), f"KV directory {self.path}")
        except Refused:
            os.close(fd)
            raise
        return fd

    def _check_owned(self, st: os.stat_result, what: str) -> None:
        if st.st_uid != self.owner_uid:
            raise Refused(f"{what} belongs to uid {st.st_uid}, not {self.owner_uid}")
        if st.st_mode & 0o022:
            raise Refused(f"{what} has mode {stat.S_IMODE(st.st_mode):o}: writable by others")

    def fd(self) -> int:
        """The directory's descriptor, checked now (owner, mode), opened again if the path names a
        new directory (dwdp serve made it anew)."""
        try:
            now = os.stat(self.path, follow_symlinks=False)
            identity = (now.st_dev, now.st_ino)
        except OSError:
            identity = None
        if self._fd is not None and identity != self._identity:
            self.close()
        if self._fd is None:
            self._fd = self._open_dir()
            st = os.fstat(self._fd)
            self._identity = (st.st_dev, st.st_ino)
        self._check_owned(os.fstat(self._fd), f"KV directory {self.path}")
        return self._fd

    def open(self, name: str) -> tuple[int, os.stat_result]:
        """(read-only fd, its stat) of artifact `name`: a regular file with one link, owned as the
        directory must be, writable by nobody else. Refused otherwise (the fd closed)."""
        if not ARTIFACT_NAME.fullmatch(name):
            raise Refused(f"artifact name {show(name)} is not dwdp's")
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=self.fd())
        except FileNotFoundError:
            raise Refused(f"{name} is missing (expired, or removed after an earlier load)") from None
        except OSError as exc:
            what = "is a symlink" if exc.errno == errno.ELOOP else f"cannot be opened: {exc.strerror}"
            raise Refused(f"{name} {what}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Refused(f"{name} is not a regular file (mode {st.st_mode:o})")
            if st.st_nlink != 1:
                raise Refused(f"{name} has {st.st_nlink} links: an artifact has one name")
            self._check_owned(st, name)
        except BaseException:
            os.close(fd)
            raise
        return fd, st

    def remove(self, name: str, device: int, inode: int) -> bool:
        """Unlink `name` if it still is the file (device, inode); True when it was removed."""
        try:
            dfd = self.fd()
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except (OSError, Refused):
            return False
        if (st.st_dev, st.st_ino) != (device, inode):
            return False
        try:
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            return False
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = self._identity = None


def _pread_exact(fd: int, nbytes: int, offset: int, what: str) -> bytes:
    data = os.pread(fd, nbytes, offset)
    if len(data) != nbytes:
        raise Refused(f"{what}: {len(data)} of {nbytes} bytes at offset {offset} (cut short)")
    return data


def _metadata_int(meta: dict, key: str, name: str) -> int:
    value = meta.get(key)
    if not isinstance(value, str) or not value.isdigit() or len(value) > 9:
        raise Refused(f"{name}: metadata {key}={show(value)} is not a count")
    return int(value)


def _tensor_spans(header: dict, base: int, name: str) -> dict[str, TensorSpan]:
    """Every tensor entry of a parsed header, schema-checked: {"dtype", "shape", "data_offsets"} each,
    a known dtype, a shape of at most 4 dims, offsets whose span is the shape's bytes."""
    spans = {}
    for tensor, info in header.items():
        if not _TENSOR_NAME.fullmatch(tensor):
            raise Refused(f"{name}: tensor {show(tensor)} is not one an artifact holds")
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise Refused(f"{name}: tensor {tensor}'s entry is not {{dtype, shape, data_offsets}}")
        dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if dtype not in _DTYPES:
            raise Refused(f"{name}: tensor {tensor} has dtype {show(dtype)}, not one of {sorted(_DTYPES)}")
        if (not isinstance(shape, list) or not 1 <= len(shape) <= 4
                or any(type(d) is not int or not 0 <= d < _MAX_DIM for d in shape)):
            raise Refused(f"{name}: tensor {tensor} has shape {show(shape)}")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or any(type(o) is not int or not 0 <= o < 1 << 62 for o in offsets) or offsets[0] > offsets[1]):
            raise Refused(f"{name}: tensor {tensor} has data_offsets {show(offsets)}")
        count = 1
        for d in shape:
            count *= d
        torch_dtype, itemsize = _DTYPES[dtype]
        if offsets[1] - offsets[0] != count * itemsize:
            raise Refused(f"{name}: tensor {tensor} spans {offsets[1] - offsets[0]} bytes, its shape {shape} "
                          f"needs {count * itemsize}")
        spans[tensor] = TensorSpan(base + offsets[0], count * itemsize, torch_dtype, tuple(shape))
    return spans


def read_header(fd: int, size: int, name: str, cap: int) -> tuple[dict, dict[str, TensorSpan], int]:
    """(string metadata, tensor spans, bytes the header promises) of the artifact open as `fd` (`size`
    bytes), read with pread: the header's length is checked against `cap` before it is read, its JSON
    must be an object of tensor entries and a flat string `__metadata__`."""
    if size < 8:
        raise Refused(f"{name}: {size} bytes, not a safetensors file")
    (length,) = struct.unpack("<Q", _pread_exact(fd, 8, 0, name))
    if length > cap:
        raise Refused(f"{name}: a header of {length} bytes, above the {cap} an artifact for this engine has")
    if 8 + length > size:
        raise Refused(f"{name} is truncated: its header needs {8 + length} bytes, the file has {size}")
    raw = _pread_exact(fd, length, 8, name)
    try:
        header = json.loads(raw)
    except RecursionError:
        raise Refused(f"{name}: the header nests too deep") from None
    except ValueError as exc:
        raise Refused(f"{name}: the header is not JSON ({show(str(exc), 80)})") from None
    if not isinstance(header, dict):
        raise Refused(f"{name}: the header is a {type(header).__name__}, not an object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise Refused(f"{name}: __metadata__ is not an object of strings")
    spans = _tensor_spans(header, 8 + length, name)
    end = max((s.offset + s.nbytes for s in spans.values()), default=8 + length)
    return meta, spans, end


def check_artifact(meta: dict, spans: dict[str, TensorSpan], promised: int, size: int, ref: ArtifactRef,
                   expected: EngineKV) -> None:
    """Refused naming the first thing in a parsed header that does not fit `expected` or `ref`."""
    name = ref.name
    if size < promised:
        raise Refused(f"{name} is truncated: {size} of {promised} bytes")
    fmt = meta.get("format")
    if expected.is_mla and fmt == KV_FORMAT:
        raise Refused(f"{name} holds per-head keys and values ({KV_FORMAT}); this engine runs MLA and caches "
                      f"the latent ({KV_MLA_FORMAT})")
    if not expected.is_mla and fmt == KV_MLA_FORMAT:
        raise Refused(f"{name} holds an MLA latent ({KV_MLA_FORMAT}); this engine caches per-head keys and "
                      f"values ({KV_FORMAT})")
    if fmt not in (KV_FORMAT, KV_MLA_FORMAT):
        raise Refused(f"{name}: format {show(fmt)}, this connector reads {KV_FORMAT!r} and {KV_MLA_FORMAT!r}")
    if meta.get("prompt_sha256") != ref.prompt_sha256:
        raise Refused(f"{name} holds the KV of another prompt (prompt_sha256 {show(meta.get('prompt_sha256'), 70)}, "
                      f"the request's is {ref.prompt_sha256!r})")
    if expected.model is not None and meta.get("model") != expected.model:
        raise Refused(f"{name} was made by model {show(meta.get('model'))}, this engine runs {expected.model!r}")
    layers = _metadata_int(meta, "num_layers", name)
    if layers != expected.num_layers:
        raise Refused(f"{name} has {layers} layers, this engine's model has {expected.num_layers}")
    if _metadata_int(meta, "num_tokens", name) != ref.num_tokens:
        raise Refused(f"{name} holds {meta.get('num_tokens')} tokens, the request says {ref.num_tokens}")
    if meta.get("positions", f"0..{ref.num_tokens - 1}") != f"0..{ref.num_tokens - 1}":
        raise Refused(f"{name}: positions {show(meta['positions'])}, expected 0..{ref.num_tokens - 1}")
    if expected.is_mla:
        if meta.get("rope_layout") != "interleaved":
            raise Refused(f"{name}: rope dims laid out as {show(meta.get('rope_layout'))}; this engine ropes "
                          "interleaved pairs")
        kinds = (("latent", [1, ref.num_tokens, expected.latent_dim], "[1, tokens, kv_lora_rank]"),
                 ("rope", [1, ref.num_tokens, expected.rope_dim], "[1, tokens, qk_rope_head_dim]"))
    else:
        legend = "[1, kv heads, tokens, head dim]"
        kinds = (("keys", [1, expected.num_kv_heads, ref.num_tokens, expected.key_dim], legend),
                 ("values", [1, expected.num_kv_heads, ref.num_tokens, expected.value_dim], legend))
    wanted = {f"layers.{layer}.{kind}" for layer in range(layers) for kind, _, _ in kinds}
    if set(spans) != wanted:
        extra, missing = sorted(set(spans) - wanted), sorted(wanted - set(spans))
        raise Refused(f"{name} has no {missing[0]}" if missing else f"{name} holds tensors it should not: "
                      f"{show(extra[:3])}")
    for layer in range(layers):
        for kind, want, legend in kinds:
            span = spans[f"layers.{layer}.{kind}"]
            if list(span.shape) != want:
                raise Refused(f"{name}: layers.{layer}.{kind} is {list(span.shape)}, this engine caches "
                              f"{want} ({legend})")
            if span.dtype != expected.dtype:
                raise Refused(f"{name}: dtype {span.dtype}, this engine's cache takes {expected.dtype}")


class LayerReader:
    """Reads one checked artifact layer by layer with pread (worker side); close() when done."""

    def __init__(self, fd: int, ref: ArtifactRef):
        self.name, self._fd, self.is_mla = ref.name, fd, ref.is_mla
        self._spans = dict(ref.tensors)
        self._kinds = ("latent", "rope") if ref.is_mla else ("keys", "values")

    def _read(self, tensor: str):
        import torch

        span = self._spans[tensor]
        out = torch.empty(span.nbytes, dtype=torch.uint8)
        view, done = memoryview(out.numpy()), 0
        while done < span.nbytes:
            got = os.preadv(self._fd, [view[done:]], span.offset + done)
            if got == 0:
                raise Refused(f"{self.name}: {tensor} cut short at {done} of {span.nbytes} bytes")
            done += got
        return out.view(getattr(torch, span.dtype)).reshape(span.shape)

    def layer(self, index: int):
        """Decoder layer `index` on the CPU: (keys [1, Hkv, T, Dk], values [1, Hkv, T, Dv]), or for an MLA
        artifact (latent [1, T, Rkv], rope [1, T, Dr])."""
        first, second = self._kinds
        return self._read(f"layers.{index}.{first}"), self._read(f"layers.{index}.{second}")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class FileTransfer:
    """KV artifacts as files in one directory both servers see, named by dwdp serve only.

    kv_dir: the directory (the operator's setting, never a request's); key: the KV key descriptors must
    be signed with (None: names alone, see docs/decode-with-vllm.md#security); owner_uid: whose files
    are loaded (default: this process's user)."""

    def __init__(self, kv_dir: str | None, key: bytes | None = None, owner_uid: int | None = None):
        self.directory = None if kv_dir is None else KVDirectory(kv_dir, owner_uid)
        self.key = key

    def check(self, params, prompt_ids, expected: EngineKV, unsupported: str | None = None) -> ArtifactRef | None:
        """The artifact this request may load (None: the request names no dwdp artifact); raises
        Refused with the reason when it names one that must not be loaded. unsupported: what makes
        this request's KV differ from its token ids' (a LoRA adapter, multimodal inputs, a cache salt)."""
        descriptors = requested_artifacts(params)
        if descriptors is None:
            return None
        if unsupported is not None:
            raise Refused(f"the request has {unsupported}: dwdp's KV covers token ids only")
        if self.directory is None:
            raise Refused("no KV directory is configured (kv_connector_extra_config.kv_dir)")
        ref = parse_descriptor(descriptors, list(prompt_ids), expected.model, self.key)
        fd, st = self.directory.open(ref.name)
        try:
            meta, spans, promised = read_header(fd, st.st_size, ref.name, expected.header_cap)
            check_artifact(meta, spans, promised, st.st_size, ref, expected)
        finally:
            os.close(fd)
        return ArtifactRef(ref.name, ref.num_tokens, ref.prompt_sha256, st.st_dev, st.st_ino, st.st_size,
                           tuple(sorted(spans.items())), meta.get("format") == KV_MLA_FORMAT)

    def open(self, ref: ArtifactRef) -> LayerReader:
        """A reader of the file the scheduler checked: the same device and inode and size, or Refused."""
        if self.directory is None:
            raise Refused("no KV directory is configured (kv_connector_extra_config.kv_dir)")
        fd, st = self.directory.open(ref.name)
        if (st.st_dev, st.st_ino, st.st_size) != (ref.device, ref.inode, ref.size):
            os.close(fd)
            raise Refused(f"{ref.name} is not the file that was checked (replaced or changed since)")
        return LayerReader(fd, ref)

    def release(self, ref: ArtifactRef) -> bool:
        """The engine holds this KV now: unlink the artifact if its name still holds the loaded file
        (True when removed; gone already, or replaced, is left alone)."""
        return self.directory is not None and self.directory.remove(ref.name, ref.device, ref.inode)
