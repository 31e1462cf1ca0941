"""What `dwdp serve` hands a decode engine for one prompt's KV, and what proves dwdp serve issued it.

A hand-off descriptor (one entry of `kv_transfer_params = {"kv_artifacts": [descriptor]}`) names an
artifact by its bare file name, never a path: the decode side's connector reads only from the KV
directory its operator configured (`kv_connector_extra_config.kv_dir`). Fields the connector reads:
  name           `pf-<32 hex>.safetensors` (ARTIFACT_NAME): a request id dwdp serve drew at random
  num_tokens     the prompt tokens the artifact holds (an int)
  prompt_sha256  their digest (dwdp.serve.kv.prompt_digest: 64 hex)
  auth           HMAC-SHA256 over (name, digest, model, num_tokens) with the operator's KV key (64 hex);
                 present when dwdp serve has a key (DWDP_KV_KEY or DWDP_KV_KEY_FILE)
Everything else in the descriptor (path, format, tensors, ...) is for people and is never acted on.

The key is a secret both servers read from the environment the operator gives them; a connector that
has one loads only descriptors it authenticates, so a client of vLLM's port can name no artifact dwdp
serve did not hand out for that prompt and model. Without a key, the name (122 random bits, returned
only to the client that asked for the prefill) is what a client must know.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import re
import stat

from dwdp import envs

ARTIFACT_NAME = re.compile(r"pf-[0-9a-f]{32}\.safetensors")
HEX64 = re.compile(r"[0-9a-f]{64}")
AUTH_TAG = b"dwdp-kv-auth-v1"
MIN_KEY_BYTES = 16


class KVKeyError(ValueError):
    """A KV key that cannot be used: too short, or a key file others can read."""


def kv_key() -> bytes | None:
    """The operator's KV key: DWDP_KV_KEY_FILE's contents (stripped; a file only its owner may read), else
    DWDP_KV_KEY; None when neither is set. KVKeyError for a key shorter than MIN_KEY_BYTES bytes."""
    path = envs.kv_key_file()
    if path is not None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise KVKeyError(f"DWDP_KV_KEY_FILE={path!r} cannot be opened: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
                raise KVKeyError(f"DWDP_KV_KEY_FILE={path!r} has mode {stat.S_IMODE(st.st_mode):o}: a key file must be "
                                 "a regular file only its owner can read (chmod 600)")
            key = os.read(fd, 4096).strip()
        finally:
            os.close(fd)
        source = f"DWDP_KV_KEY_FILE={path!r}"
    else:
        value = envs.kv_key()
        if value is None:
            return None
        key, source = value.strip().encode(), "DWDP_KV_KEY"
    if len(key) < MIN_KEY_BYTES:
        raise KVKeyError(f"{source} holds a key of {len(key)} bytes; give at least {MIN_KEY_BYTES} (e.g. "
                         "`python3 -c 'import secrets; print(secrets.token_hex(32))'`)")
    return key


def artifact_name(request_id: str) -> str:
    """The file name of a request's artifact in the KV directory."""
    return f"{request_id}.safetensors"


def authenticator(key: bytes, name: str, prompt_sha256: str, model: str, num_tokens: int) -> str:
    """HMAC-SHA256 (hex) of one descriptor's fields, each length-prefixed so no two field lists collide."""
    mac = hmac.new(key, AUTH_TAG, hashlib.sha256)
    for field in (name, prompt_sha256, model, str(int(num_tokens))):
        data = field.encode()
        mac.update(len(data).to_bytes(4, "little") + data)
    return mac.hexdigest()


def handoff_descriptor(request_id: str, kv: dict, model: str, key: bytes | None) -> dict:
    """The descriptor of one prefilled prompt's artifact for a decode engine: the worker's artifact
    descriptor `kv` (dwdp.serve.kv.write_kv_artifact's), its bare name, and the authenticator when the
    server has a key."""
    name = os.path.basename(kv["path"])
    out = {"request_id": request_id, **kv, "name": name}
    if key is not None and "prompt_sha256" in kv:
        out["auth"] = authenticator(key, name, kv["prompt_sha256"], model, kv["num_tokens"])
    return out
