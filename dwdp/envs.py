"""Every environment variable dwdp reads, in one place (all start with DWDP_)."""
from __future__ import annotations

import os

ENV_VARS = {
    "DWDP_SHM_DIR": "directory for host-backend shared segments (default /dev/shm)",
    "DWDP_WAIT_TIMEOUT_S": "overrides DWDPConfig.wait_timeout_s when set",
    "DWDP_TRACE_DIR": "write each rank's trace_rank{r}.json there (Chrome trace format)",
    "DWDP_LOG_LEVEL": "log level of the dwdp logger (default WARNING)",
}


def shm_dir() -> str:
    return os.environ.get("DWDP_SHM_DIR", "/dev/shm")


def wait_timeout_s(default: float) -> float:
    value = os.environ.get("DWDP_WAIT_TIMEOUT_S")
    if value is None:
        return default
    try:
        parsed = float(value)
    except ValueError:
        raise ValueError(f"DWDP_WAIT_TIMEOUT_S={value!r} must be a number of seconds") from None
    if not parsed > 0:
        raise ValueError(f"DWDP_WAIT_TIMEOUT_S={value!r} must be > 0")
    return parsed


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level() -> str:
    value = os.environ.get("DWDP_LOG_LEVEL", "WARNING").upper()
    if value not in LOG_LEVELS:
        raise ValueError(f"DWDP_LOG_LEVEL={value!r} must be one of {LOG_LEVELS}")
    return value


def trace_dir() -> str | None:
    return os.environ.get("DWDP_TRACE_DIR") or None
