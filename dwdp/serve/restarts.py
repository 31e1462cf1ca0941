"""When the router starts a dead worker again (`dwdp serve --restart on-failure`).

A worker that died (its process exited, or it reported its own device lost and was stopped) is
started again as the same rank after a back-off that doubles with each restart of that rank in
the last minute; once `max_per_minute` restarts happened within a minute, the next death leaves it
down, with the reason, and the server keeps serving on the others. The new process rejoins its
DWDP group without a collective (dwdp.runtime.rejoin) and gets requests once it reports ready.
"""
from __future__ import annotations

import collections

WINDOW_S = 60.0


class RestartPolicy:
    """Back-off and bound of the restarts of each rank. backoff_s: delay before the first restart
    in a minute (then 2x, 4x, ...); max_per_minute: restarts of one rank allowed within WINDOW_S."""

    def __init__(self, backoff_s: float, max_per_minute: int):
        if not backoff_s > 0:
            raise ValueError(f"backoff_s={backoff_s!r} must be > 0")
        if max_per_minute < 1:
            raise ValueError(f"max_per_minute={max_per_minute!r} must be >= 1")
        self.backoff_s, self.max_per_minute = backoff_s, max_per_minute
        self._starts: dict[int, collections.deque] = collections.defaultdict(collections.deque)

    def _recent(self, rank: int, now: float) -> collections.deque:
        starts = self._starts[rank]
        while starts and now - starts[0] > WINDOW_S:
            starts.popleft()
        return starts

    def delay(self, rank: int, now: float) -> float | None:
        """Seconds to wait before starting `rank` again after a death at `now`; None: leave it down."""
        recent = self._recent(rank, now)
        if len(recent) >= self.max_per_minute:
            return None
        return self.backoff_s * 2 ** len(recent)

    def started(self, rank: int, now: float) -> None:
        """`rank` was started again at `now`."""
        self._starts[rank].append(now)

    def down_reason(self, rank: int, now: float, exit_code, failure: str | None) -> str:
        recent = len(self._recent(rank, now))
        last = (failure or "").strip().splitlines()[-1:] or ["no traceback (killed?)"]
        return (f"worker rank {rank} died again (exit code {exit_code}: {last[0]}) after {recent} restart(s) within "
                f"{WINDOW_S:.0f} s (at most {self.max_per_minute}); left down")
