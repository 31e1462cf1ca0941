"""Process-group bootstrap: torchrun (env://), or a local group spawned by `dwdp demo` and tests.

DWDP only talks to peers once, at setup (exchanging segment handles); after that no rank waits on
another. The world may hold several DWDP groups of `group_size` consecutive ranks each.
"""
from __future__ import annotations

import datetime
import os
import socket
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dwdp import envs
from dwdp.runtime.processes import descendants, kill_pids


@dataclass
class DWDPGroup:
    """This process's place in its DWDP group.

    rank/size: position and size inside the DWDP group; global_rank/world_size: in the whole world.
    process_group: the torch.distributed group of the DWDP group (None when size is 1 and no
    process group exists, and for a rank rejoining a running group).
    group_id: names the group's board (dwdp.runtime.board), where a restarted rank and its peers
    find each other; None: no board, a lost rank never comes back.
    rejoining: this process replaces a lost rank of a running group: it joins through the board,
    with no collective (see dwdp.runtime.rejoin).
    """

    rank: int
    size: int
    global_rank: int = 0
    world_size: int = 1
    process_group: object | None = None
    group_id: str | None = None
    rejoining: bool = False

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank={self.rank} must be in [0, size={self.size})")

    def all_gather_object(self, obj) -> list:
        if self.size == 1:
            return [obj]
        if self.rejoining:
            raise RuntimeError(f"rank {self.rank} is rejoining its group: it has no collective to exchange over")
        if self.process_group is None:
            raise RuntimeError(f"DWDP group of size {self.size} has no process group to exchange handles over")
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.process_group)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            if self.process_group is None:
                raise RuntimeError(f"DWDP group of size {self.size} has no process group for a barrier")
            dist.barrier(group=self.process_group)


def default_backend() -> str:
    """gloo for the one-time handle exchange, plus nccl for CUDA tensors (the DEP baseline's
    all-to-all) when every local rank has a GPU of its own: NCCL refuses two ranks on one device."""
    if not torch.cuda.is_available():
        return "gloo"
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if local_ranks > torch.cuda.device_count():
        return "gloo"
    return "cpu:gloo,cuda:nccl"


def group_id(global_rank: int, size: int) -> str:
    """The board name of the DWDP group holding `global_rank`: DWDP_GROUP_ID (default: the world's
    MASTER_ADDR and MASTER_PORT), then the group's index in the world. A replacement started with
    the same environment computes the same name."""
    world = envs.group_id() or f"{os.environ.get('MASTER_ADDR', 'local')}-{os.environ.get('MASTER_PORT', '0')}"
    return f"{world.replace('/', '_')}-g{global_rank // size}"


def rejoin_group(group_size: int | None = None) -> DWDPGroup:
    """This process's place in a running world it replaces a lost rank of (same RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT, or DWDP_GROUP_ID, as the rank it replaces): no process group is
    joined, the peers are found on the group's board."""
    try:
        global_rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError as exc:
        raise ValueError(f"a rejoining rank needs {exc.args[0]} in its environment (the rank it replaces)") from None
    size = group_size or world
    if world % size:
        raise ValueError(f"group_size={size} must divide the world size {world}")
    return DWDPGroup(global_rank % size, size, global_rank, world, None, group_id(global_rank, size), rejoining=True)


def init_group(group_size: int | None = None, backend: str | None = None, timeout_s: float = 120.0) -> DWDPGroup:
    """Join the world described by the env:// variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
    and return this rank's DWDP group of `group_size` consecutive ranks (default: the whole world).

    Without those variables and with no initialised process group, returns a one-rank group.
    With DWDP_REJOIN=1 (a process started to replace a lost rank), joins through the board instead:
    see `rejoin_group`.
    """
    if envs.rejoin():
        return rejoin_group(group_size)
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            if group_size not in (None, 1):
                raise ValueError(
                    f"group_size={group_size} needs a distributed launch (torchrun or `dwdp demo --ranks N`); "
                    "WORLD_SIZE is not set"
                )
            return DWDPGroup(rank=0, size=1)
        dist.init_process_group(backend or default_backend(), timeout=datetime.timedelta(seconds=timeout_s))
    world, global_rank = dist.get_world_size(), dist.get_rank()
    size = group_size or world
    if world % size:
        raise ValueError(f"group_size={size} must divide the world size {world}")
    mine = None
    # Every rank creates every subgroup, in the same order, as torch.distributed requires.
    for start in range(0, world, size):
        ranks = list(range(start, start + size))
        pg = dist.new_group(ranks) if size < world else dist.group.WORLD
        if global_rank in ranks:
            mine = pg
    return DWDPGroup(global_rank % size, size, global_rank, world, mine, group_id(global_rank, size))


def connect_store(timeout_s: float = 30.0):
    """A new client connection to the world's store (MASTER_ADDR, MASTER_PORT: torchrun's agent store, or the
    router's LoopbackStore), which outlives any rank. Raises naming the address when none is set or reachable."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        raise RuntimeError("a DWDP group spanning nodes needs the world's store: MASTER_ADDR and MASTER_PORT are "
                           "not set (launch with torchrun, or `dwdp serve`)")
    try:
        return dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except Exception as exc:
        raise RuntimeError(f"the world's store at {host}:{port} cannot be reached: {type(exc).__name__}: {exc}") from None


def free_port() -> int:
    """A port free now on 127.0.0.1 (another process may take it before it is bound again: for servers a
    test starts, not for a world's store, which LoopbackStore binds before it is named)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LOOPBACK_INTERFACE = "lo"


def store_env(host: str, port: int) -> dict[str, str]:
    """What a rank's environment needs to join the world's store at host:port (with RANK and WORLD_SIZE of its
    own): env:// with torch's agent-store switch (the ranks are its clients), and on loopback gloo's and
    NCCL's own sockets there too, unless this environment names another interface."""
    out = {"MASTER_ADDR": host, "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    if host in ("127.0.0.1", "localhost", "::1"):
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if name not in os.environ and os.path.isdir(f"/sys/class/net/{LOOPBACK_INTERFACE}"):
                out[name] = LOOPBACK_INTERFACE
    return out


class LoopbackStore:
    """The world's store, hosted by the process that starts the ranks: its listening socket is bound before
    its port is known (no port picked, then raced for). By default on 127.0.0.1, so nothing beyond this host
    reaches it, unlike a rank 0's store, which listens on every interface; `dwdp serve --nnodes` binds it to
    the address the other nodes reach (`host`, `port`). The ranks join it as clients: `env()` for their
    environment, then init_process_group as usual. close() when the ranks are done with it."""

    def __init__(self, timeout_s: float = 300.0, host: str = "127.0.0.1", port: int = 0):
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(1024)
            self.host, self.port = host, sock.getsockname()[1]
            self.store = dist.TCPStore(host, self.port, None, True, datetime.timedelta(seconds=timeout_s),
                                       wait_for_workers=False, master_listen_fd=sock.fileno())
        except BaseException:
            sock.close()
            raise
        sock.detach()  # the store's server owns the listening descriptor now

    def env(self) -> dict[str, str]:
        return store_env(self.host, self.port)

    def close(self) -> None:
        self.store = None  # the server stops with its last reference


def _child(fn, rank: int, world: int, store_env: dict, args: tuple, results, env: dict) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), **store_env})
    torch.set_num_threads(1)
    try:
        value = fn(rank, *args)
        results.put((rank, True, value))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_context():
    """The multiprocessing context launch_local's ranks start in: spawn, or with DWDP_FORKSERVER_PRELOAD
    set, a forkserver that imported torch, dwdp and those modules once. Ranks forked from it start in a
    fraction of a spawned rank's time: importing torch and transformers is most of a tiny rank's start."""
    import multiprocessing as mp

    preload = envs.forkserver_preload()
    if preload is None:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "dwdp", *preload])  # read when the server starts: at its first use
    return ctx


class LaunchError(RuntimeError):
    """A rank of a local group failed or did not finish in time."""


def launch_local(fn, nprocs: int, args: tuple = (), timeout_s: float = 120.0, env: dict | None = None,
                 may_die: tuple[int, ...] = ()) -> list:
    """Run `fn(rank, *args)` in `nprocs` new processes (see rank_context) forming one env:// world whose store
    this process hosts on loopback (LoopbackStore).

    Returns the per-rank return values (picklable). Raises LaunchError naming the rank on the first
    failure, a crash without a result, or when `timeout_s` passes; every child is stopped.
    may_die: ranks killed on purpose (chaos tests): their exit without a result gives None.
    """
    import queue
    import time

    if nprocs < 1:
        raise ValueError(f"nprocs={nprocs} must be >= 1")
    ctx = rank_context()
    results = ctx.Queue()
    store = LoopbackStore(timeout_s)
    procs = [
        ctx.Process(target=_child, args=(fn, r, nprocs, store.env(), args, results, dict(env or {})), daemon=False)
        for r in range(nprocs)
    ]
    values: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.start()
        while len(values) < nprocs:
            try:
                rank, ok, value = results.get(timeout=0.5)
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in values and p.exitcode is not None:
                        # Exited; its result may still be in the pipe.
                        try:
                            rank, ok, value = results.get(timeout=2.0)
                            break
                        except queue.Empty:
                            if r in may_die:
                                values[r] = None
                                continue
                            raise LaunchError(f"rank {r} exited with code {p.exitcode} without a result") from None
                else:
                    if time.monotonic() > deadline:
                        missing = sorted(set(range(nprocs)) - set(values))
                        raise LaunchError(f"ranks {missing} did not finish within {timeout_s:.0f} s")
                    continue
            if not ok:
                raise LaunchError(f"rank {rank} failed:\n{value}")
            values[rank] = value
        for p in procs:
            p.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        _stop_ranks(procs)
        store.close()
    return [values[r] for r in range(nprocs)]


def _stop_ranks(procs) -> None:
    """Stop every started rank still running, and first whatever it started itself (a rank waiting on
    a child it spawned would otherwise leave that child behind as an orphan)."""
    started = [p for p in procs if p.pid is not None]
    kill_pids(pid for p in started if p.is_alive() for pid in descendants(p.pid))
    for p in started:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
