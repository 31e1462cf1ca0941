"""The healing cases of bench/chaos.py: a server started with `--restart on-failure`, rank(s)
lost under load, restarted by the router, rejoining their DWDP group.

- kill-restart: the victim is killed (SIGKILL); the router starts it again, it rejoins.
- two-loss: at the same moment the victim is killed and a second rank's memory is made unreadable
  (POST /admin/fault): the second rank then reports its own device lost and the router restarts it
  too. Run with every expert on 3 of 4 ranks, so the two survivors still hold every expert.
- loss-while-rejoining: the victim is killed; the moment its new process starts, a second rank is
  killed too. Same 4 ranks, 3 owners per expert.

Besides chaos.py's counts, per case: /health sampled every 0.1 s gives the smallest number of
routable owners of any expert before the fault, at its lowest during the run, and at the end
("redundancy before / during / after"); `rejoined s`: from the fault until every worker is routable
again with the redundancy of before; `full capacity s`: from the fault until every hit rank,
restarted, has answered a request (it takes its share again). When the load ends before the group
has healed, the run waits for it (at most --heal-timeout) and then sends a short probe load at the
same rate, whose answers count like the others.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx

HEAL_CASES = ("kill-restart", "two-loss", "loss-while-rejoining")
SAMPLE_S = 0.1


async def sample_health(url: str, start: float, stop: asyncio.Event, samples: list) -> list[dict]:
    """Append (t, min redundancy, per-worker pid/routable/restarts) to `samples` every SAMPLE_S
    until `stop`; returns them."""
    async with httpx.AsyncClient(timeout=10) as http:
        while not stop.is_set():
            try:
                h = (await http.get(f"{url}/health")).json()
            except httpx.HTTPError:
                h = None
            if h is not None:
                samples.append({"t": time.perf_counter() - start, "min_redundancy": h["min_redundancy"],
                                "routable": [w["routable"] for w in h["workers"]],
                                "pids": [w["pid"] for w in h["workers"]],
                                "restarts": [w["restarts"] for w in h["workers"]]})
            await asyncio.sleep(SAMPLE_S)
    return samples


async def _wait_restart_started(url: str, rank: int, timeout_s: float) -> None:
    deadline = time.perf_counter() + timeout_s
    async with httpx.AsyncClient(timeout=10) as http:
        while time.perf_counter() < deadline:
            if (await http.get(f"{url}/health")).json()["workers"][rank]["restarts"] >= 1:
                return
            await asyncio.sleep(0.02)
    raise TimeoutError(f"rank {rank} was not restarted within {timeout_s} s")


async def inject_heal(case: str, url: str, pids: list[int], victim: int, second: int, at_s: float,
                      start: float, busy) -> dict:
    """Hit `victim` (and `second`) `at_s` after `start`; returns when the fault began and who was hit."""
    await asyncio.sleep(max(0.0, start + at_s - time.perf_counter()))
    is_busy = await busy(url, victim, patience_s=3.0)
    began = time.perf_counter() - start
    hit = [victim]
    if case == "kill-restart":
        os.kill(pids[victim], signal.SIGKILL)
    elif case == "two-loss":
        os.kill(pids[victim], signal.SIGKILL)
        async with httpx.AsyncClient(timeout=30) as http:
            (await http.post(f"{url}/admin/fault", json={"rank": second})).raise_for_status()
        hit.append(second)
    else:
        os.kill(pids[victim], signal.SIGKILL)
        await _wait_restart_started(url, victim, timeout_s=30.0)
        os.kill(pids[second], signal.SIGKILL)
        hit.append(second)
    return {"fault_s": began, "end_s": None, "victim_busy": is_busy, "hit": hit}


def healed_at(samples: list[dict], fault: dict) -> float | None:
    """Seconds after `start` at which every worker was routable again with the redundancy of before
    and every hit rank had been restarted (None: not yet)."""
    t0 = fault["fault_s"]
    before = [s for s in samples if s["t"] < t0]
    if not before:
        return None
    initial = before[-1]["min_redundancy"]
    return next((s["t"] for s in samples if s["t"] >= t0 and all(s["routable"]) and s["min_redundancy"] == initial
                 and all(s["restarts"][r] >= 1 for r in fault["hit"])), None)


async def wait_healed(samples: list[dict], fault: dict, timeout_s: float) -> float | None:
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        at = healed_at(samples, fault)
        if at is not None:
            return at
        await asyncio.sleep(SAMPLE_S)
    return None


def heal_summary(samples: list[dict], fault: dict, results: list[dict]) -> dict:
    """Redundancy before / during / after, and the times until the group had healed."""
    t0 = fault["fault_s"]
    before = [s for s in samples if s["t"] < t0]
    after_fault = [s for s in samples if s["t"] >= t0]
    initial = before[-1]["min_redundancy"] if before else None
    during = min((s["min_redundancy"] for s in after_fault if s["min_redundancy"] is not None), default=None)
    at = healed_at(samples, fault)
    rejoined = None if at is None else at - t0
    firsts = []
    for r in fault["hit"]:
        # Answers from rank r after the router started it again come from its new process.
        restarted = next((s["t"] for s in after_fault if s["restarts"][r] >= 1), None)
        answered = [x["done"] for x in results if x["status"] == 200 and x["rank"] == r
                    and restarted is not None and x["done"] >= restarted]
        firsts.append(min(answered) - t0 if answered else None)
    capacity = None if None in firsts or not firsts else max(firsts)
    return {"redundancy_before": initial, "redundancy_during": during,
            "redundancy_after": samples[-1]["min_redundancy"] if samples else None,
            "rejoined_s": rejoined, "full_capacity_s": capacity, "restarts": samples[-1]["restarts"] if samples else None}
