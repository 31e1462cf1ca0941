"""Every environment variable dwdp reads, in one place (all start with DWDP_)."""
from __future__ import annotations

import os

ENV_VARS = {
    "DWDP_SHM_DIR": "directory for host-backend shared segments (default /dev/shm)",
    "DWDP_WAIT_TIMEOUT_S": "overrides DWDPConfig.wait_timeout_s when set",
    "DWDP_TRACE_DIR": "write each rank's trace_rank{r}.json there (Chrome trace format)",
    "DWDP_LOG_LEVEL": "log level of the dwdp logger (default WARNING)",
    "DWDP_KERNEL_CONFIGS": "directory of tuned kernel configuration files, read before the shipped ones "
                           "(`dwdp tune-kernel` writes there when set)",
    "DWDP_GROUP_ID": "names the DWDP groups' boards in DWDP_SHM_DIR, where a restarted rank finds its peers "
                     "(default: MASTER_ADDR-MASTER_PORT of the world)",
    "DWDP_REJOIN": "1 in a process started to replace a lost rank: `init_group` joins the running group through "
                   "its board, with no collective (default 0)",
    "DWDP_FORKSERVER_PRELOAD": "comma-separated module names: when set, `launch_local` (`dwdp demo`, the benches, the "
                               "tests) forks its ranks from one server process that imported torch, dwdp and these "
                               "modules once, instead of spawning ranks that each import them (unset: spawn; "
                               "`dwdp serve` always spawns its workers)",
    "DWDP_KERNEL_TMA": "1 reads the Triton experts kernel's tiles through TMA descriptors where the device and "
                       "the layout allow it; 0 never; unset: pointer loads unless the tiles ask for tma=True "
                       "(TMA is not yet measured at least as fast on a GPU)",
    "DWDP_API_KEY": "`dwdp serve`'s API key when --api-key is not given: clients send `Authorization: Bearer <key>` "
                    "on /v1/* (and /admin/*); /health and /metrics stay open",
    "DWDP_DECODE_API_KEY": "the key `dwdp serve --decode-url URL` sends to the decode server (a vLLM started with "
                           "--api-key)",
    "DWDP_KV_KEY": "the KV hand-off's secret (at least 16 bytes), set alike for `dwdp serve` and the vLLM that loads "
                   "its KV: dwdp signs each artifact's descriptor with it and the connector loads only what it "
                   "authenticates",
    "DWDP_KV_KEY_FILE": "a file holding that secret (mode 600), read instead of DWDP_KV_KEY when set",
    "DWDP_NODE": "the name of this rank's node (default: the host name): peers on the same node watch each other "
                 "through shared memory and pidfds, peers on other nodes through beats in the world's store; set "
                 "it to emulate several nodes on one machine",
    "DWDP_FABRIC_DIR": "directory for the host backend's segments, reachable from every node of a group (default: "
                       "DWDP_SHM_DIR); on one machine emulating nodes, the stand-in for the NVLink fabric while "
                       "each node's DWDP_SHM_DIR holds its node-local files",
}

NODE_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def shm_dir() -> str:
    return os.environ.get("DWDP_SHM_DIR", "/dev/shm")


def fabric_dir() -> str:
    return os.environ.get("DWDP_FABRIC_DIR") or shm_dir()


def node_name() -> str:
    """DWDP_NODE, or the host name: letters, digits and ._- only, at most 64 characters."""
    value = os.environ.get("DWDP_NODE")
    if value is None:
        import socket

        return socket.gethostname()
    if not 0 < len(value) <= 64 or not set(value) <= NODE_NAME_CHARS:
        raise ValueError(f"DWDP_NODE={value!r} must be 1 to 64 letters, digits, '.', '_' or '-'")
    return value


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


def kernel_configs_dir() -> str | None:
    return os.environ.get("DWDP_KERNEL_CONFIGS") or None


def kernel_tma() -> bool | None:
    """True / False when DWDP_KERNEL_TMA is 1 / 0; None when unset (the tiles decide, pointers by default)."""
    value = os.environ.get("DWDP_KERNEL_TMA")
    if value is None:
        return None
    if value not in ("0", "1"):
        raise ValueError(f"DWDP_KERNEL_TMA={value!r} must be 0 or 1")
    return value == "1"


def group_id() -> str | None:
    return os.environ.get("DWDP_GROUP_ID") or None


def rejoin() -> bool:
    value = os.environ.get("DWDP_REJOIN", "0")
    if value not in ("0", "1"):
        raise ValueError(f"DWDP_REJOIN={value!r} must be 0 or 1")
    return value == "1"


def api_key() -> str | None:
    return os.environ.get("DWDP_API_KEY") or None


def decode_api_key() -> str | None:
    return os.environ.get("DWDP_DECODE_API_KEY") or None


def kv_key() -> str | None:
    return os.environ.get("DWDP_KV_KEY") or None


def kv_key_file() -> str | None:
    return os.environ.get("DWDP_KV_KEY_FILE") or None


def forkserver_preload() -> list[str] | None:
    """The modules of DWDP_FORKSERVER_PRELOAD (possibly none), or None when it is unset: spawn ranks."""
    value = os.environ.get("DWDP_FORKSERVER_PRELOAD")
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]
