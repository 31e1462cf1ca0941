"""What keeps a connector's exception out of the engine that calls it: `guarded_by(logger)(fallback)`
wraps a method so that any exception becomes one bounded log line and `fallback(self, *args)`'s answer.

An exception raised into vLLM's scheduler or model runner ends the engine ("EngineCore encountered a
fatal error"); a connector's failure must cost only the request it concerned (recomputed). The guarded
method keeps the original as `__wrapped__` and its fallback as `fallback` (tests plant faults with them).
Imports no engine: tested in the main suite (tests/test_kv_guard.py).
"""
from __future__ import annotations

import functools

LINE_LIMIT = 400  # characters of one log line's reason: a client's values never flood the log


def one_line(text, limit: int = LINE_LIMIT) -> str:
    """`text` as one log line of at most `limit` characters."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def guarded_by(logger):
    """A decorator factory: `@guarded_by(logger)(fallback)` on a method. `fallback.default`, when set, is
    answered if the fallback itself raises."""

    def never_raises(fallback):
        def wrap(method):
            @functools.wraps(method)
            def guarded(self, *args, **kwargs):
                try:
                    return method(self, *args, **kwargs)
                except Exception as exc:
                    logger.error("dwdp connector: %s raised %s; the requests it concerned are recomputed",
                                 method.__name__, one_line(f"{type(exc).__name__}: {exc}"))
                    try:
                        return fallback(self, *args, **kwargs)
                    except Exception as again:
                        logger.error("dwdp connector: %s's fallback raised %s", method.__name__,
                                     one_line(f"{type(again).__name__}: {again}"))
                        return getattr(fallback, "default", None)

            guarded.fallback = fallback
            return guarded

        return wrap

    return never_raises


def answer(value):
    """A fallback that only answers `value` (a fresh copy each time for sets)."""

    def fallback(self, *args, **kwargs):
        return set(value) if isinstance(value, set) else value

    fallback.default = value
    return fallback
