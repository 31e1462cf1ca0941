"""What tests that start a `dwdp serve` share: its start-up bound, and per-test timeouts with room for it.

A module-scoped server starts inside the first of its module's tests to run, and pytest-timeout counts a
test's fixtures in its time: so each such test's timeout is its own time plus the server's bound. When the
bound runs out, ServerProcess says how long it waited and what the server printed last, and kills it.
"""
import pytest

# 60.8 s was seen for a 3-rank tiny server on 2 cores at a load average of 7 to 9 (issue 44).
SERVER_START_S = 150.0


def server_timeout(seconds: float):
    """pytest.mark.timeout for a test of `seconds` of its own that may be the one starting the server."""
    return pytest.mark.timeout(SERVER_START_S + seconds)
