"""What tests that start a `dwdp serve` share: its start-up bound, and per-test timeouts with room for it.

A module-scoped server starts inside the first of its module's tests to run, and pytest-timeout counts a
test's fixtures in its time: so each such test's timeout is its own time plus the server's bound. When the
bound runs out, ServerProcess says how long it waited and what the server printed last, and kills it.
"""
import contextlib
import os
import signal

import pytest

# 60.8 s was seen for a 3-rank tiny server on 2 cores at a load average of 7 to 9 (issue 44).
SERVER_START_S = 150.0


def server_timeout(seconds: float):
    """pytest.mark.timeout for a test of `seconds` of its own that may be the one starting the server."""
    return pytest.mark.timeout(SERVER_START_S + seconds)


@contextlib.contextmanager
def paused(pids):
    """Every live process of `pids` stopped (SIGSTOP) inside the block, continued (SIGCONT) on the way out.
    Tests pause a server's workers to hold a state (prompts queued, in flight) that fast forwards would
    otherwise end before it is seen; such servers run with a --stall-timeout longer than the pause."""
    stopped = []
    try:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            except (ProcessLookupError, TypeError):
                continue  # a worker killed earlier (its pid may be None)
        yield
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
