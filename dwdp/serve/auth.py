"""API keys: `Authorization: Bearer <key>` on every path but /health and /metrics (the convention of
vLLM's --api-key and SGLang's), 401 in the API's error shape otherwise. The scheme is matched without
regard to case (RFC 9110: `bearer`, `BEARER`); the open paths exactly (/healthz or /health/x ask for
the key like any other path)."""
from __future__ import annotations

import hmac
import ipaddress

from starlette.responses import JSONResponse

from dwdp.serve.errors import ServeError

OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers reach these without a key


def bearer_token(header: bytes) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header value, or None for another scheme."""
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip()


class BearerAuth:
    """ASGI middleware: 401 for a request to a closed path without `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        token = bearer_token(given)
        if token is not None and hmac.compare_digest(token, self._expected):
            return await self.app(scope, receive, send)
        why = "no Authorization header" if not given else "a wrong API key"
        error = ServeError(401, "authentication_error", f"{scope['method']} {scope['path']}: {why}; send "
                           "`Authorization: Bearer <key>` with this server's API key")
        response = JSONResponse(error.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


def is_loopback(host: str) -> bool:
    """Whether binding `host` keeps the server on this machine (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
