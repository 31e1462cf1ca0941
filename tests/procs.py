"""Running a command that starts processes of its own (`dwdp demo` spawns ranks, `dwdp bench serve` starts
servers, torchrun starts workers), so that nothing it started outlives the test.

`run` is subprocess.run with the output captured as text, but the command runs in a session of its own and,
whichever way the wait is left (its timeout, pytest-timeout firing inside it, a KeyboardInterrupt), its
whole process group is interrupted (SIGINT: a Python launcher's own clean-up runs, and stops servers it
started in sessions of their own), then killed. After a normal exit, whatever is left of the group is
killed too and named in the result's `left_behind`.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

from dwdp.runtime.processes import group_members, kill_group

INTERRUPT_GRACE_S = 10.0  # for the command's own clean-up after SIGINT, before SIGKILL


def end_group(proc: subprocess.Popen, grace_s: float = INTERRUPT_GRACE_S) -> list[int]:
    """SIGINT the group of `proc` (started with start_new_session=True), SIGKILL what is left after
    `grace_s`, and reap `proc`; returns the pids that were still running at the SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while group_members(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = kill_group(proc.pid)
    proc.kill()
    proc.wait()
    return left


def run(cmd, *, timeout: float, env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd), leaving no
    process behind (see the module's docstring). Raises subprocess.TimeoutExpired like it."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            end_group(proc)
            raise
        done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        done.left_behind = kill_group(proc.pid)
    return done
