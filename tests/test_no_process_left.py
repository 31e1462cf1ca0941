"""Launchers leave no process behind, whichever way their wait is left: ServerProcess.start (a `dwdp serve`
and its workers), launch_local (ranks and what a rank started itself), and the tests' own `procs.run`.

The interruption is planted the way pytest-timeout fires: a signal handler raising in the main thread while
it waits, sent by a watcher thread once every process of interest exists. Each process is then checked
by pid.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dwdp.runtime.group import free_port, launch_local
from dwdp.runtime.processes import descendants, group_members, is_running, kill_pids
from dwdp.serve.launch import ServerProcess, ServerStartError
from deadlines import LOADED_SLACK_S
from procs import INTERRUPT_GRACE_S, run

RANKS = 2
WAIT_S = 90.0  # for the watched processes to appear on a loaded 2-core machine


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class _Planted(Exception):
    """Raised in the main thread while it waits, as pytest-timeout raises its failure."""


class _Interrupt:
    """On `plant()` (from a watcher thread), raise `error` in the main thread at its next bytecode."""

    def __init__(self, error: BaseException):
        self.error = error
        self._old = signal.signal(signal.SIGUSR1, self._raise)

    def _raise(self, *_):
        raise self.error

    def plant(self) -> None:
        os.kill(os.getpid(), signal.SIGUSR1)

    def restore(self) -> None:
        signal.signal(signal.SIGUSR1, self._old)


def _watch(find, enough, seen: dict, then) -> threading.Thread:
    """A thread adding each pid of `find()` to `seen` (pid -> its latest command line) until
    `enough(seen)`, then calling `then()` once."""

    def loop():
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            for pid in find():
                # Read again each time: a spawned child shows its parent's command line until it execs.
                seen[pid] = _cmdline(pid) or seen.get(pid, "")
            if enough(seen):
                then()
                return
            time.sleep(0.05)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def _assert_all_gone(pids, what: str) -> None:
    deadline = time.monotonic() + 10  # SIGKILL is delivered at once, but reaping an orphan is not
    while any(is_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = {p: _cmdline(p)[:120] for p in pids if is_running(p)}
    kill_pids(alive)  # a failing check leaves nothing behind either
    assert not alive, f"{what}: still running after the launcher was left: {alive}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("way_out", ["pytest-timeout", "KeyboardInterrupt", "start-up bound"])
def test_an_interrupted_server_start_leaves_no_process(tmp_path, way_out):
    """The wait for /health is left once the server's workers exist: by a planted pytest-timeout
    failure, a KeyboardInterrupt, or the start-up bound running out (the health check never passed)."""
    (tmp_path / "shm").mkdir()
    server = ServerProcess(["--ranks", str(RANKS), "--preset", "tiny", "--kv-dir", str(tmp_path)], free_port(),
                           env={"DWDP_SHM_DIR": str(tmp_path / "shm")}, startup_timeout_s=WAIT_S,
                           log_path=str(tmp_path / "log"))
    (tmp_path / "log").touch()
    error = {"pytest-timeout": pytest.fail.Exception("Timeout >180.0s"), "KeyboardInterrupt": KeyboardInterrupt(),
             "start-up bound": None}[way_out]
    interrupt = _Interrupt(error) if error is not None else None

    def bound_runs_out():
        server.startup_timeout_s = 0.0  # read at every turn of the wait: the next one is past it

    seen: dict[int, str] = {}
    workers = lambda seen: sum("multiprocessing.spawn" in line for line in seen.values())
    log = tmp_path / "log"
    started = lambda seen: workers(seen) >= RANKS and "workers started" in log.read_text()
    # Its group, and its descendants too: a server not in a group of its own is still found.
    find = lambda: set(group_members(server.proc.pid)) | {server.proc.pid, *descendants(server.proc.pid)} if server.proc else ()
    watcher = _watch(find, started, seen, interrupt.plant if interrupt else bound_runs_out)
    expected = {"pytest-timeout": pytest.fail.Exception, "KeyboardInterrupt": KeyboardInterrupt,
                "start-up bound": ServerStartError}[way_out]
    try:
        with pytest.raises(expected) as caught:
            server.start()
    except BaseException:
        server.kill()  # it started after all: this test leaves nothing behind either
        raise
    finally:
        if interrupt is not None:
            interrupt.restore()
    watcher.join(5)
    assert workers(seen) >= RANKS, f"the planted exit came before the workers started: {seen}, {server.output()}"
    assert server.proc.pid in seen and server.proc.returncode is not None, (seen, server.proc.returncode)
    _assert_all_gone(seen, "the server's group")
    assert group_members(server.proc.pid) == []
    if way_out == "start-up bound":
        message = str(caught.value)
        assert "start-up bound of 0 s (waited" in message and "lines of its output" in message, message
        assert message.rstrip().endswith(f"dwdp serve: {RANKS} dwdp workers started; waiting for them to build the "
                                         "model and join (at most 300 s)"), message


def _rank_with_a_child(rank: int, pid_dir: str) -> None:
    """A rank that starts a process of its own (as the rejoin tests start a replacement), then waits."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(pid_dir, f"rank{rank}").write_text(f"{os.getpid()} {child.pid}")
    time.sleep(600)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("error", [pytest.fail.Exception("Timeout >180.0s"), KeyboardInterrupt()],
                         ids=["pytest-timeout", "KeyboardInterrupt"])
def test_an_interrupted_local_launch_leaves_no_rank_and_no_child_of_a_rank(tmp_path, error):
    pids: dict[int, str] = {}

    def find():
        found = set()
        for file in tmp_path.glob("rank*"):
            text = file.read_text().split()
            if len(text) == 2:
                found.update(int(p) for p in text)
        return found

    interrupt = _Interrupt(error)
    watcher = _watch(find, lambda seen: len(seen) == 2 * RANKS, pids, interrupt.plant)
    try:
        with pytest.raises(type(error)):
            launch_local(_rank_with_a_child, RANKS, (str(tmp_path),), timeout_s=WAIT_S)
    finally:
        interrupt.restore()
    watcher.join(5)
    assert len(pids) == 2 * RANKS, f"the planted exit came before every rank started its child: {pids}"
    _assert_all_gone(pids, "the ranks and their children")


@pytest.mark.timeout(60)
def test_a_command_run_by_the_tests_leaves_nothing_when_its_wait_is_interrupted(tmp_path):
    """procs.run: the command and a process it started in its turn, both gone after the timeout."""
    script = ("import subprocess, sys, time, pathlib; "
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
              f"pathlib.Path({str(tmp_path / 'pids')!r}).write_text(f'{{c.pid}}'); time.sleep(600)")
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run([sys.executable, "-c", script], timeout=15)
    # The timeout, then SIGINT's grace before SIGKILL, then a busy machine's scheduling.
    bound = 15 + INTERRUPT_GRACE_S + LOADED_SLACK_S
    assert time.monotonic() - started < bound, f"the group was not ended within {bound} s of the command's start"
    child = int((tmp_path / "pids").read_text())
    _assert_all_gone([child], "the command's child")
