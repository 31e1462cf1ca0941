"""DWDPModel on the cuda backend's code in composite mode, on a CPU: two spawned ranks whose transports
are CudaTransport over the recording fakes (tests/fake_cuda.py's EagerFakeCudaApi for the runtime API,
tests/fake_cuda_vmm.py's HostBackedDriver for cuMem), the model's tensors on the CPU. What runs is
dwdp's own setup (VMM probe, the group's mapping choice, cuMemCreate segment, views, export, pidfd_getfd
import), the prefetch's copies into the views, and the model's experts implementation on the views; the
logits must match the unwrapped model. The same path ran on one H200 (tests/test_gpu.py, gpu_check i).
"""
import logging

import pytest
import torch

from dwdp.models.tiny import build_tiny_model
from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.group import init_group, launch_local
from dwdp.runtime.cuda_mapping import settle_cuda_mapping as _cuda_mapping
from dwdp.runtime.experts_paths import resolve_experts_path
from dwdp.runtime.model import DWDPModel
from dwdp.runtime.transport.host_composite import composite_unsupported_reason
from logits_check import check_logits

pytestmark = pytest.mark.skipif(composite_unsupported_reason() is not None,
                                reason=str(composite_unsupported_reason()))
PAGE = 4096


def _fake_cuda_backend(drivers: list) -> None:
    """Route DWDPModel's cuda backend to the fakes (in this process only)."""
    import dwdp.runtime.model as model_module
    from dwdp.runtime.transport import cuda_vmm_peers
    from dwdp.runtime.transport.cuda import CudaTransport
    from dwdp.runtime.transport.cuda_vmm import Vmm, choose_mapping
    from fake_cuda import EagerFakeCudaApi, FakeDevice
    from fake_cuda_vmm import HostBackedDriver

    def make_transport(backend, rank, config, *, device=None, mapping="ipc", process_group=None):
        assert backend == "cuda", backend
        drivers.append(HostBackedDriver(PAGE))
        return CudaTransport(rank, "cpu", copy=config.cuda_copy, copy_batches=config.copy_batches, mapping=mapping,
                             api=EagerFakeCudaApi(FakeDevice(), rank), driver=drivers[-1])

    model_module.resolve_backend = lambda backend, device: "cuda"
    model_module.make_transport = make_transport
    cuda_vmm_peers.local_vmm_mapping = lambda rank, device: choose_mapping(Vmm(0, HostBackedDriver(PAGE)), rank,
                                                                           imex=False)


def _record_close_order(events: list) -> None:
    """Log, in this process, when the board entry goes and when the transport closes its exports, with
    whether the exported fds were still open at the withdraw."""
    from dwdp.runtime.board import Board
    from dwdp.runtime.transport.cuda import CudaTransport

    withdraw, seal = Board.withdraw, CudaTransport.seal

    def recording_withdraw(board, rank):
        events.append(("withdraw", [fd for t in _live_transports for fd in t.mapper.exported_fds]))
        return withdraw(board, rank)

    def recording_seal(transport):
        _live_transports.append(transport)
        if transport._closed:
            events.append(("close exports", list(transport.mapper.exported_fds)))
        return seal(transport)

    Board.withdraw, CudaTransport.seal = recording_withdraw, recording_seal


_live_transports: list = []


def _eperm(pid, fds):
    import errno
    import os

    raise OSError(errno.EPERM, os.strerror(errno.EPERM))


def _rank(rank: int) -> dict:
    from dwdp.runtime.transport import cuda_vmm

    torch.set_num_threads(1)
    drivers: list = []
    _fake_cuda_backend(drivers)
    events: list = []
    _record_close_order(events)
    group = init_group(2)
    gen = torch.Generator().manual_seed(90 + rank)
    ids = [torch.randint(3, 128, (2, 6 + i), generator=gen) for i in range(2)]
    out = {}
    # gpt_oss: pidfd_getfd refused with EPERM (a container's seccomp profile): the fds come over the socket.
    cases = [("mixtral", "composite", {}), ("qwen3_moe", "auto", dict(num_local_experts=5)),
             ("gpt_oss", "composite", {})]
    getfds = cuda_vmm.pidfd_getfds
    for index, (family, kernel, extra) in enumerate(cases):
        cuda_vmm.pidfd_getfds = _eperm if family == "gpt_oss" else getfds
        del events[:]
        model = build_tiny_model(family, seed=40 + index, num_hidden_layers=3)
        reference = build_tiny_model(family, seed=40 + index, num_hidden_layers=3)
        with torch.no_grad():
            want = [reference(input_ids=x).logits for x in ids]
        with DWDPModel(model, DWDPConfig(slice_bytes=1000, experts_kernel=kernel, **extra), group) as wrapped, \
                torch.no_grad():
            got = [wrapped(input_ids=x).logits for x in ids]
            driver = drivers[-1]
            r = dict(kernel=wrapped.experts_kernel, mapping=wrapped.transport.mapping,
                     plans=wrapped.stats.plans_issued, layers=len(wrapped.experts_layers),
                     access=len(driver.access), reserved=len(driver.reserved),
                     imports=driver.names().count("cuMemImportFromShareableHandle"), errors=list(driver.errors),
                     peer_allocations=len(wrapped.transport.mapper.peer_ranges[1 - rank].sizes),
                     fd_path=wrapped.transport.fd_paths[1 - rank])
        # After close, no parameter may lie in memory the driver mapped (now unmapped): a read would fault.
        mapped = [args[:2] for name, args in driver.calls if name == "cuMemMap"]
        r["dangling"] = [name for name, p in model.named_parameters() if p.device.type != "meta"
                         and any(ptr <= p.data_ptr() < ptr + size for ptr, size in mapped)]
        r["parked"] = sorted({name.rsplit(".", 1)[-1] for name, p in model.named_parameters()
                              if p.device.type == "meta"})
        r.update(diff=max((g - w).abs().max().item() for g, w in zip(got, want)),
                 scale=max(w.abs().max().item() for w in want),
                 left=(len(driver.mapped), len(driver.reserved), len(driver.memory)), errors_after=list(driver.errors),
                 close_events=[(what, bool(fds)) for what, fds in events])
        out[f"{family}:{kernel}"] = r
    return out


@pytest.fixture(scope="module")
def results():
    return launch_local(_rank, 2, timeout_s=240)


@pytest.mark.timeout(260)
def test_two_rank_cuda_model_in_composite_mode_matches_the_unwrapped_model(results):
    for rank, out in enumerate(results):
        assert set(out) == {"mixtral:composite", "qwen3_moe:auto", "gpt_oss:composite"}
        for name, r in out.items():
            assert r["kernel"] == "composite" and r["mapping"] == "vmm-posix-fd", (name, r)
            assert r["plans"] > 0, f"{name}: no prefetch ran"
            check_logits(name, r, rank)
            # The segment, one range of views (all layers), the peer's import; one set-access per
            # segment, layer and import; one import per allocation of the peer's segment.
            assert r["reserved"] == 3 and r["access"] == 1 + r["layers"] + 1, (name, r)
            assert r["imports"] == r["peer_allocations"] and not r["errors"] and not r["errors_after"], (name, r)
            assert r["left"] == (0, 0, 0), f"{name}: close left mappings/ranges/allocations {r['left']}"
            assert r["dangling"] == [] and r["parked"], (name, r["dangling"], r["parked"])
            want_path = "socket (pidfd_getfd: EPERM)" if name.startswith("gpt_oss") else "pidfd_getfd"
            assert r["fd_path"] == want_path, (name, r["fd_path"])
            # The board entry goes while the exports it names are still open, and before they close.
            assert r["close_events"] == [("withdraw", True), ("close exports", True)], (name, r["close_events"])


class _Answers:
    """A group whose all-gather returns fixed (host, mapping) answers; this rank's mapping is checked
    against its slot (its host is this machine's name, which the answers stand in for)."""

    rejoining = False

    def __init__(self, rank, answers):
        self.rank, self.answers = rank, answers

    def all_gather_object(self, mine):
        if isinstance(mine, tuple):  # the (host, mapping) round
            assert mine[1] == self.answers[self.rank][1], (mine, self.answers)
            return list(self.answers)
        return [mine] * len(self.answers)  # the fabric trial's rounds: every rank answers as this one


@pytest.mark.parametrize("local, answers, requested, want", [
    ("vmm-posix-fd", [("a", "vmm-posix-fd"), ("a", "vmm-posix-fd")], "auto", "vmm-posix-fd"),
    ("vmm-fabric", [("a", "vmm-fabric"), ("b", "vmm-fabric")], "auto", "vmm-fabric"),    # across trays
    ("vmm-fabric", [("a", "vmm-fabric"), ("a", "vmm-posix-fd")], "auto", "vmm-posix-fd"),
    ("vmm-posix-fd", [("a", "vmm-posix-fd"), ("a", "ipc")], "auto", "ipc"),              # one rank refused
    ("vmm-posix-fd", [("a", "vmm-posix-fd"), ("b", "vmm-posix-fd")], "auto", "symmetric_memory"),
])
def test_the_group_settles_on_a_mapping_every_rank_can_use(monkeypatch, local, answers, requested, want):
    from dwdp.runtime.transport import cuda_vmm_peers

    monkeypatch.setattr(cuda_vmm_peers, "local_vmm_mapping", lambda rank, device: local)
    monkeypatch.setattr(cuda_vmm_peers, "fabric_import_refusals", lambda rank, device, gather: [])
    assert _cuda_mapping(requested, "auto", _Answers(0, answers), torch.device("cuda", 0)) == want


def test_vmm_across_hosts_without_fabric_is_refused(monkeypatch):
    from dwdp.runtime.transport import cuda_vmm_peers

    monkeypatch.setattr(cuda_vmm_peers, "local_vmm_mapping", lambda rank, device: "vmm-posix-fd")
    with pytest.raises(ValueError, match="cuda_mapping='vmm' across 2 hosts needs fabric handles"):
        _cuda_mapping("vmm", "auto", _Answers(0, [("a", "vmm-posix-fd"), ("b", "vmm-posix-fd")]), torch.device("cuda"))


def _resolve(kernel: str, mapping: str, rank: int = 0):
    """The experts path resolve_experts_path picks for a cuda transport (on the fakes) with `mapping`."""
    from dwdp.runtime.group import DWDPGroup
    from dwdp.runtime.placement import build_placement
    from dwdp.runtime.transport.cuda import CudaTransport
    from dwdp.runtime.experts_paths import TablesPath
    from dwdp.models.adapters import find_experts
    from fake_cuda import FakeCudaApi, FakeDevice
    from fake_cuda_vmm import HostBackedDriver

    model = build_tiny_model("mixtral", seed=1, num_hidden_layers=1)
    layers = find_experts(model)
    transport = CudaTransport(rank, "cpu", mapping=mapping, api=FakeCudaApi(FakeDevice(), rank),
                              driver=HostBackedDriver(PAGE))
    try:
        path = resolve_experts_path(DWDPConfig(experts_kernel=kernel), layers, build_placement(8, 2), rank,
                                    transport, torch.device("cpu"))
        return path.name if not isinstance(path, TablesPath) else f"tables:{path.kernel}"
    finally:
        transport.close()


def test_ipc_fallback_is_one_log_line_under_auto_and_an_error_for_composite(caplog):
    with caplog.at_level(logging.INFO, logger="dwdp"):
        assert _resolve("auto", "ipc", rank=1) == "tables:reference"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rank 1:")]
    assert len(lines) == 1 and "multi-buffer" in lines[0] and "'ipc'" in lines[0], lines
    with pytest.raises(ValueError, match="experts_kernel='composite' cannot run here: the cuda backend maps peers "
                                         "with 'ipc'"):
        _resolve("composite", "ipc")
    assert _resolve("auto", "vmm-posix-fd") == "composite"
    assert _resolve("reference", "vmm-posix-fd") == "tables:reference"


def test_fabric_handles_that_do_not_cross_fall_back_to_posix_fds_with_the_reason(monkeypatch, caplog):
    from dwdp.runtime.transport import cuda_vmm_peers

    monkeypatch.setattr(cuda_vmm_peers, "local_vmm_mapping", lambda rank, device: "vmm-fabric")
    monkeypatch.setattr(cuda_vmm_peers, "fabric_import_refusals",
                        lambda rank, device, gather: ["rank 1: import from rank 0: CUDA_ERROR_NOT_PERMITTED"])
    with caplog.at_level(logging.INFO, logger="dwdp"):
        got = _cuda_mapping("auto", "auto", _Answers(0, [("a", "vmm-fabric"), ("a", "vmm-fabric")]), torch.device("cuda"))
    assert got == "vmm-posix-fd"
    assert any("fabric handles do not cross" in r.getMessage() and "NOT_PERMITTED" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("refuse_import", [False, True])
def test_the_fabric_trial_imports_every_peers_handle(refuse_import):
    from dwdp.runtime.transport.cuda_vmm_peers import fabric_import_refusals
    from dwdp.runtime.transport.cuda_vmm import Vmm
    from fake_cuda_vmm import FakeDriver

    peer = Vmm(0, FakeDriver())
    peer_handle = peer.create(peer.granularity("fabric"), "fabric")
    peer_raw = peer.export(peer_handle, "fabric")
    driver = FakeDriver()
    driver.refuse_fabric_import = refuse_import
    rounds = []

    def gather(mine):  # rank 0 of two; rank 1 exported peer_raw and refused nothing
        rounds.append(mine)
        return [mine, peer_raw] if len(rounds) == 1 else [mine, []]

    refusals = fabric_import_refusals(0, "cuda:0", gather, driver=driver)
    assert len(rounds) == 2 and isinstance(rounds[0], bytes) and len(rounds[0]) == 64
    assert bool(refusals) == refuse_import
    if refuse_import:
        assert refusals == [f"rank 0: import from rank 1: {refusals[0].split(': ', 2)[2]}"]
        assert "NOT_PERMITTED" in refusals[0]
    assert not driver.memory and driver.retained == 0, "the trial left an allocation or a context reference"
