"""Teardown that runs every step whatever fails before it: `Steps.run(what, fn, *args)` runs one step
and keeps its exception; `raise_first()` raises the first one once all steps ran. One failing unmap must
not leave the events, the stream, the exported fds and the fd-server thread of a transport alive until
the process exits."""
from __future__ import annotations

import logging

log = logging.getLogger("dwdp")


class Steps:
    def __init__(self, where: str):
        self.where = where
        self.errors: list[tuple[str, BaseException]] = []

    def run(self, what: str, fn, *args):
        """fn(*args), or None when it raised (kept, logged in one line)."""
        try:
            return fn(*args)
        except Exception as exc:
            self.errors.append((what, exc))
            log.error("%s: %s failed: %s: %s", self.where, what, type(exc).__name__, exc)
            return None

    def attempt(self, what: str, fn, *args) -> bool:
        """Run one step as `run` does; True when it succeeded."""
        failed = len(self.errors)
        self.run(what, fn, *args)
        return len(self.errors) == failed

    @property
    def ok(self) -> bool:
        return not self.errors

    def raise_first(self) -> None:
        if self.errors:
            raise self.errors[0][1]
