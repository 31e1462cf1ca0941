"""Start a server (`dwdp serve`, or another HTTP server such as vLLM's) as a subprocess and wait until it
answers /health; on every way out, nothing it started is left running (tests, benchmarks)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from dwdp.runtime.processes import group_members, kill_group

LOG_TAIL_LINES = 20  # of the server's output, in the error of a start that failed
STRAGGLER_GRACE_S = 5.0  # after a graceful exit, for the rest of the server's group to end on its own


class ServerStartError(RuntimeError):
    """A server exited, or did not answer /health in time; the message says how long the start
    waited and what the server printed last."""


class HttpServerProcess:
    """A server command `cmd` that listens on 127.0.0.1:`port` and answers GET /health; use as a
    context manager. `name` names it in errors (`dwdp serve`, `vllm`).

    start() returns once GET /health answers 200, or raises ServerStartError (how long it waited,
    the last lines of the server's output) when the server exits or `startup_timeout_s` passes.
    stop() sends SIGTERM (graceful drain) and returns the exit code; kill() ends the server at once.
    The server runs in a session of its own, so what it starts shares its process group: whichever
    way start() is left without returning (that error, a KeyboardInterrupt, pytest-timeout firing
    inside its wait), and on every stop() or kill(), that whole group is killed, so nothing it started
    can outlive it. `left_behind`: pids still running in the group after the server itself had exited.
    """

    def __init__(self, cmd: list[str], port: int, env: dict | None = None, startup_timeout_s: float = 120.0,
                 log_path: str | None = None, name: str = "server", cwd: str | None = None):
        self.cmd = list(cmd)
        self.port = port
        self.name = name
        self.cwd = cwd
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout_s = startup_timeout_s
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.left_behind: list[int] = []
        self._log = None

    def start(self) -> "HttpServerProcess":
        self._log = open(self.log_path, "w+") if self.log_path else subprocess.DEVNULL
        started = time.monotonic()
        self.proc = subprocess.Popen(self.cmd, env=self.env, cwd=self.cwd, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self._wait_healthy(started)
        except BaseException:
            self.kill()
            raise
        return self

    def _wait_healthy(self, started: float) -> None:
        while time.monotonic() - started < self.startup_timeout_s:
            if self.proc.poll() is not None:
                raise ServerStartError(f"{self.name} exited with code {self.proc.returncode} after "
                                       f"{time.monotonic() - started:.1f} s; {self._tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.2)
        raise ServerStartError(f"{self.name} was not healthy within its start-up bound of "
                               f"{self.startup_timeout_s:.0f} s (waited {time.monotonic() - started:.1f} s); {self._tail()}")

    def _tail(self) -> str:
        lines = self.output().rstrip().splitlines()
        if not lines:
            return "it printed nothing"
        return f"the last {min(len(lines), LOG_TAIL_LINES)} lines of its output:\n" + "\n".join(lines[-LOG_TAIL_LINES:])

    def output(self) -> str:
        if self._log in (None, subprocess.DEVNULL):
            return "(output not captured)"
        self._log.flush()
        self._log.seek(0)
        return self._log.read()

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc is None:
            return 0
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()  # the drain took too long
        except BaseException:
            self.kill()
            raise
        self._sweep(grace_s=STRAGGLER_GRACE_S)
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the server and everything in its process group; waits for the server."""
        if self.proc is None:
            return
        kill_group(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.kill()  # not yet its own group leader: killed between fork and setsid
        self.proc.wait(timeout=10)
        self._sweep(grace_s=0.0)

    def _sweep(self, grace_s: float) -> None:
        """Once the server has exited: give what is left of its group `grace_s` to exit on its own
        (multiprocessing's resource tracker ends just after it), then kill it and name it in left_behind."""
        deadline = time.monotonic() + grace_s
        while group_members(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.left_behind = sorted(set(self.left_behind) | set(kill_group(self.proc.pid)))

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        try:
            self.stop()
        finally:
            if self._log not in (None, subprocess.DEVNULL):
                self._log.close()


class ServerProcess(HttpServerProcess):
    """`python -m dwdp serve <args>` on 127.0.0.1:`port` (this interpreter), as HttpServerProcess."""

    def __init__(self, args: list[str], port: int, env: dict | None = None, startup_timeout_s: float = 120.0,
                 log_path: str | None = None):
        self.args = list(args)
        cmd = [sys.executable, "-m", "dwdp", "serve", "--host", "127.0.0.1", "--port", str(port), *self.args]
        super().__init__(cmd, port, env, startup_timeout_s, log_path, name="dwdp serve")
