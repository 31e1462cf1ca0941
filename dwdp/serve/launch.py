"""Start `dwdp serve` as a subprocess and wait until it answers /health (tests, benchmarks)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx


class ServerProcess:
    """`python -m dwdp serve <args>` on 127.0.0.1:`port`; use as a context manager.

    start() returns once GET /health answers 200 (or raises with the server's output after
    `startup_timeout_s`); stop() sends SIGTERM (graceful drain) and returns the exit code.
    """

    def __init__(self, args: list[str], port: int, env: dict | None = None, startup_timeout_s: float = 120.0,
                 log_path: str | None = None):
        self.args = list(args)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout_s = startup_timeout_s
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", "dwdp", "serve", "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        self._log = open(self.log_path, "w+") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dwdp serve exited with code {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"dwdp serve was not healthy within {self.startup_timeout_s:.0f} s:\n{self.output()}")

    def output(self) -> str:
        if self._log in (None, subprocess.DEVNULL):
            return "(output not captured)"
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
