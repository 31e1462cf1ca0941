"""ServeError: every failure a client sees, with its HTTP status and an OpenAI-style error body."""
from __future__ import annotations

import logging
import uuid

log = logging.getLogger("dwdp.serve")


class ServeError(Exception):
    """status: HTTP status; error_type: stable machine-readable kind (also the `type` label of the
    errors metric); param: the request field at fault, if any; retry_after: seconds for the
    Retry-After header of 429 / 503 answers."""

    def __init__(self, status: int, error_type: str, message: str, *, param: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.status}}


def internal_error(exc: BaseException, where: str) -> ServeError:
    """A 500 for an unexpected exception: the client gets an error id, the log gets the exception with its
    traceback under that id (a client never sees internal exception text)."""
    error_id = uuid.uuid4().hex[:12]
    log.error("internal error %s in %s", error_id, where, exc_info=(type(exc), exc, exc.__traceback__))
    return ServeError(500, "internal_error", f"internal error {error_id}: the server's log has the details")
