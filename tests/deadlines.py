"""Bounds for tests that check a timeout fires: never before it was set, and not long after.

"Long" is what a loaded machine adds before a woken thread runs again (CI shares its 2 cores with other
work: a load average of 4-6 was seen), never a speed dwdp promises: speeds are bench/ figures. A timeout
that never fires is caught by the test's own pytest-timeout.
"""
from __future__ import annotations

LOADED_SLACK_S = 10.0  # scheduling on a busy 2-core machine, not detection


def assert_fired_after(elapsed_s: float, timeout_s: float, what: str) -> None:
    """`what` gave up after `elapsed_s`: at its `timeout_s` or later, within LOADED_SLACK_S of it."""
    assert timeout_s <= elapsed_s < timeout_s + LOADED_SLACK_S, (
        f"{what} gave up after {elapsed_s:.3f} s; its timeout is {timeout_s} s (slack {LOADED_SLACK_S} s)")


class VirtualClock:
    """Stands in for the `time` module of code that polls against a deadline: perf_counter() and
    monotonic() read a virtual now that only sleep() advances, so a test checks the deadline arithmetic
    exactly, whatever the machine's load. `sleeps` records each pause asked for."""

    def __init__(self, start: float = 1000.0):
        self.now = start
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    monotonic = time = perf_counter

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds
