"""FrontConfig: the router's own settings, which the workers never see: the decode server it hands
each completion to, how long and how many KV artifacts wait to be loaded, the KV hand-off's key, and
the API key clients must send."""
from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlparse


@dataclass(frozen=True)
class FrontConfig:
    """Settings of `dwdp serve`'s router beyond ServeConfig.

    decode_url: base URL of an OpenAI-compatible decode server (vLLM with dwdp's KV connector) that
        continues every completion from its prefill KV (`--decode-url`); None: a prefill server that
        answers one token.
    decode_api_key: Bearer key sent to the decode server (DWDP_DECODE_API_KEY); never logged.
    decode_timeout_s: longest wait for the decode server between two of its tokens (and to connect).
    kv_ttl_s: an artifact not loaded this long after it was written is removed (counted expired);
        None keeps artifacts until the server stops.
    api_key: the key clients send as `Authorization: Bearer <key>` on /v1/* and /admin/*
        (`--api-key` or DWDP_API_KEY); None: no key asked for. Never logged.
    kv_key: the KV hand-off's secret (DWDP_KV_KEY or DWDP_KV_KEY_FILE, dwdp.serve.kv_handoff): every
        descriptor handed out carries its authenticator; None: descriptors name artifacts only. Never logged.
    kv_max_pending: KV artifacts that may wait for a decode engine at once (more: 429).
    kv_max_pending_bytes: their bytes (None: half the KV directory's file system).
    kv_min_free_bytes: free bytes the KV directory's file system keeps (None: 5% of it, at most 1 GiB;
        less: 503).
    max_prompts_per_request: prompts one completion request may carry (more: 400).
    served_model_name: another name clients may ask for (`--served-model-name`); the decode engine's served
        name is taken too.
    """

    decode_url: str | None = None
    decode_api_key: str | None = field(default=None, repr=False)
    decode_timeout_s: float = 600.0
    kv_ttl_s: float | None = 600.0
    api_key: str | None = field(default=None, repr=False)
    kv_key: bytes | None = field(default=None, repr=False)
    kv_max_pending: int = 1024
    kv_max_pending_bytes: int | None = None
    kv_min_free_bytes: int | None = None
    max_prompts_per_request: int = 64
    served_model_name: str | None = None

    def __post_init__(self):
        if self.decode_url is not None:
            parsed = urlparse(self.decode_url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ValueError(f"decode_url={self.decode_url!r} must be an http(s) URL such as http://127.0.0.1:8100")
        for name in ("decode_timeout_s", "kv_ttl_s"):
            value = getattr(self, name)
            if value is None and name == "kv_ttl_s":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ValueError(f"{name}={value!r} must be a finite number of seconds > 0")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key is empty: give a key, or leave it out for no key")
        for name, low in (("kv_max_pending", 1), ("max_prompts_per_request", 1), ("kv_max_pending_bytes", 0),
                          ("kv_min_free_bytes", 0)):
            value = getattr(self, name)
            if value is None and name in ("kv_max_pending_bytes", "kv_min_free_bytes"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} must be an int >= {low}")
