"""A lost rank's new incarnation on the cuda transport, on a CPU through the recording fakes: its
board handle (JSON), the survivors' open_peer, and no copy ever reading the dead incarnation's
mapping again. IPC through tests/fake_cuda.py; cuMem POSIX fds through tests/fake_cuda_vmm.py's
HostBackedDriver and the real pidfd_getfd. Not yet run on a GPU.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from dwdp.runtime.composite import build_composite_plan
from dwdp.runtime.plan import build_copy_plan
from dwdp.runtime.transport.cuda import CudaTransport
from dwdp.runtime.transport.cuda_peers import raw_bytes
from fake_cuda import FakeCudaApi, FakeDevice, FakeGroup
from fake_cuda_vmm import HostBackedDriver
from test_cuda_composite_transport import CASES, VmmGroup

VICTIM = 1


def _board(handle: dict) -> dict:
    """What a rejoining process reads back from the board's JSON file."""
    return json.loads(json.dumps(handle))


def _new_incarnation(group: FakeGroup, seed: int) -> CudaTransport:
    """Rank VICTIM started again: a new transport whose segment holds other bytes than the old one's."""
    api = FakeCudaApi(group.device, VICTIM)
    t = CudaTransport(VICTIM, "cpu", copy="batch", copy_batches=3, api=api)
    gen = torch.Generator().manual_seed(seed)
    t.alloc_segment(group.layout.total_nbytes).copy_(
        torch.randint(0, 256, (group.layout.total_nbytes,), dtype=torch.uint8, generator=gen))
    t.register()
    return t


def _slot_after(transport, plan, slot: torch.Tensor, device) -> torch.Tensor:
    """`slot` (one buffer for the whole test: prepared plans are cached per slot buffer) after `plan`."""
    slot.fill_(7)
    ticket = transport.submit(plan, slot)
    device.run()
    assert ticket.done()
    return slot.clone()


def _reference(plan, peers: list[torch.Tensor], nbytes: int) -> torch.Tensor:
    from dwdp.runtime.transport.reference import execute_plan_reference

    return execute_plan_reference(plan, peers, torch.full((nbytes,), 7, dtype=torch.uint8))


def test_survivors_read_the_new_incarnation_and_never_the_dead_ones_mapping():
    group = FakeGroup(num_experts=8, size=3, num_local=4).open()  # redundancy: every expert on 2 ranks
    t0 = group.transports[0]
    nbytes = group.slot_nbytes(0)
    plan = build_copy_plan(group.placement, 0, 0, 0, group.layout, 1000)
    assert VICTIM in plan.peers, "the plan must read the victim for this test to prove anything"
    old = [t._segment.clone() for t in group.transports]
    slot = torch.empty(nbytes, dtype=torch.uint8)
    assert torch.equal(_slot_after(t0, plan, slot, group.device), _reference(plan, old, nbytes))

    old_base = t0.mapper.peer_bases[VICTIM]
    t0.forget_peer(VICTIM)
    group.device.run()
    t0._unmap_landed()
    assert (0, old_base) in group.device.closed, "rank 0 kept the dead incarnation's IPC mapping open"
    group.transports[VICTIM]._segment.fill_(255)  # its memory, reused by someone else: must never be read
    from dwdp.runtime.transport.base import PeerCopyError

    refused = t0.submit(plan, slot)  # a plan not yet re-planned around it: prepared, then refused
    with pytest.raises(PeerCopyError, match=f"peer {VICTIM} was lost"):
        refused.synchronize(1.0)

    new = _new_incarnation(group, seed=5)
    with pytest.raises(RuntimeError, match="forget_peer"):
        group.transports[2].open_peer(VICTIM, _board(new.board_handle()))  # rank 2 never forgot it
    t0.open_peer(VICTIM, _board(new.board_handle()))
    # The same plan object as before the loss: its prepared copies named the old mapping.
    got = _slot_after(t0, plan, slot, group.device)
    want = _reference(plan, [old[0], new._segment.clone(), old[2]], nbytes)
    assert torch.equal(got, want), "a survivor read the dead incarnation's memory after the rejoin"
    new.close()
    group.close()
    assert all(n == 0 for n in group.device.opened.values()), group.device.opened


def test_a_rejoining_rank_opens_a_group_that_lacks_a_peer():
    group = FakeGroup(num_experts=6, size=3, num_local=4)
    for r in (0, 2):
        group.transports[r].open(group.handles)
    new = _new_incarnation(group, seed=9)
    board = [_board(group.transports[0].board_handle()), _board(new.board_handle()), None]  # rank 2 lost
    new.open(board)
    with pytest.raises(ValueError, match="peer 2 has no mapped segment"):
        new.peer_segment(2)
    assert torch.equal(new.peer_segment(0), group.transports[0]._segment)
    plan = build_copy_plan(group.placement, VICTIM, 0, 0, group.layout, 1000)
    from dwdp.runtime.transport.base import PeerCopyError

    slot = torch.zeros(group.slot_nbytes(VICTIM), dtype=torch.uint8)
    if 2 in plan.peers:  # the fresh plan reads the lost peer: refused, naming it
        ticket = new.submit(plan, slot)
        with pytest.raises(PeerCopyError, match="peer 2 was lost"):
            ticket.synchronize(1.0)
    new.close()
    group.close()


def test_bad_rejoins_are_refused_naming_the_value():
    group = FakeGroup(num_experts=6, size=3).open()
    t0 = group.transports[0]
    t0.forget_peer(VICTIM)
    handle = _board(_new_incarnation(group, seed=1).board_handle())
    with pytest.raises(ValueError, match=r"offers a segment of 5 bytes; expected \d+"):
        t0.open_peer(VICTIM, {**handle, "nbytes": 5})
    with pytest.raises(ValueError, match="mapping 'vmm-fabric', expected 'cuda' with 'ipc'"):
        t0.open_peer(VICTIM, {**handle, "mapping": "vmm-fabric"})
    with pytest.raises(ValueError, match="cannot open peer 0"):
        t0.open_peer(0, handle)
    process = CudaTransport(0, "cpu", mapping="process", api=FakeCudaApi(FakeDevice(), 0))
    process.alloc_segment(64)
    process.register()
    assert not process.can_rejoin
    with pytest.raises(ValueError, match="mapping 'process' cannot be rejoined"):
        process.board_handle()
    process.close()
    group.close()


def test_handle_bytes_survive_the_boards_json():
    raw = bytes(range(64))
    assert raw_bytes(raw.hex()) == raw and raw_bytes(raw) == raw


def _fds() -> set[int]:
    return {int(x) for x in os.listdir("/proc/self/fd")}


def test_vmm_posix_fd_export_outlives_seal_for_the_board_and_a_new_import_is_read():
    """cuMem: the replacement's fd export stays open after its seal (a survivor takes it later with
    pidfd_getfd); the survivor imports it into a new range, the old import released, and its copies
    land bit-exact from the new incarnation."""
    group = VmmGroup("page", E=6, G=3, L=4)
    t = group.transports
    # Every rank publishes on the board before sealing: their exports stay open until close.
    boards = [_board(x.board_handle()) for x in t]
    group.open()
    for r, x in enumerate(t):
        exported = x.mapper.exported_fds
        assert exported and set(exported) <= _fds(), f"rank {r} closed the exports the board names"

    survivor, dead_range = t[0], t[0].mapper.peer_ranges[VICTIM]
    survivor.forget_peer(VICTIM)
    group.device.run()
    survivor._unmap_landed()
    driver = group.drivers[0]
    assert dead_range.ptr not in driver.mapped, "the dead incarnation's import is still mapped"

    # The new incarnation: same rank, same layout, the same experts' bytes (it loaded the same weights).
    g, _ = CASES["page"]
    new = CudaTransport(VICTIM, "cpu", copy="batch", copy_batches=3, mapping="vmm-posix-fd",
                        api=FakeCudaApi(group.device, VICTIM), driver=HostBackedDriver(g))
    layout = group.layouts[VICTIM]
    segment = new.alloc_segment(layout.segment_nbytes, tuple(a.nbytes for a in layout.segment_allocations))
    segment.copy_(group.segments[VICTIM])
    new.composite_views(layout)
    new.register()
    handle = _board(new.board_handle())
    new.open([boards[0], handle, boards[2]])
    new.seal()
    assert set(new.mapper.exported_fds) <= _fds(), "the replacement closed the exports its board entry names"

    survivor.open_peer(VICTIM, handle)
    assert survivor.mapper.peer_ranges[VICTIM].ptr != dead_range.ptr
    for layer in range(group.num_layers):
        plan = build_composite_plan(group.layouts, 0, layer, group.slice_bytes)
        assert VICTIM in plan.peers
        group.prefetch(0, layer)
        for k in range(len(group.nbytes)):
            assert torch.equal(group.view_bytes(0, layer, k), group.stacked[layer][k]), (layer, k)
    fds = set(new.mapper.exported_fds)
    new.close()
    assert not fds & _fds(), "close left the board's exports open"
    group.close()
    assert not driver.errors and not driver.memory, (driver.errors, driver.memory)


class _Record:
    def seal(self):
        pass

    def start(self):
        pass

    def board_handle(self):
        return {"record": "fake"}


class _Board:
    """Records, at publish time, whether the device still had the fill queued and what the segment held."""

    def __init__(self, device, segment):
        self.device, self.segment, self.published = device, segment, []

    def publish(self, rank, entry, record, checksum):
        self.published.append((rank, self.device.pending(), int(self.segment.min()), int(self.segment.max())))

    def withdraw(self, rank):
        pass


def test_a_rejoining_rank_publishes_its_board_entry_only_once_its_fill_has_landed(monkeypatch):
    """A rejoin registers (and maps its peers) before it fills its segment; on a device the fill is
    asynchronous (a copy out of a live peer's segment, queued on a stream). Survivors map the segment as
    soon as the entry is on the board, so the entry goes up only once the fill has landed."""
    import types

    import dwdp.runtime.model as model_module
    from dwdp.runtime.group import DWDPGroup
    from dwdp.runtime.model import DWDPModel

    group = FakeGroup(num_experts=8, size=3, num_local=4).open()
    transport, api = group.transports[VICTIM], group.apis[VICTIM]
    segment = transport._segment
    segment.fill_(0)

    def fill(index, layer, seg, local_ids, source):  # the copy is queued, as torch queues it on a GPU
        api.launch(lambda: seg.fill_(9))

    model = DWDPModel.__new__(DWDPModel)
    torch.nn.Module.__init__(model)
    layer = types.SimpleNamespace(name="layers.0.experts", module=torch.nn.Linear(1, 1), spec=None)
    board = _Board(group.device, segment)
    model.group = DWDPGroup(VICTIM, 3, VICTIM, 3, None, "fake-group", rejoining=True)
    model.transport, model.experts_layers, model.experts_modules = transport, [layer], [layer.module]
    model.placement, model.model = group.placement, layer.module
    model.path = types.SimpleNamespace(alloc_segment=lambda: segment, fill=fill)
    model._rejoin = lambda board, checksum, source: (_Record(), None, {}, source)
    monkeypatch.setattr(model_module, "dense_checksum", lambda *a: 0)
    monkeypatch.setattr(model_module, "_module_source", lambda layers: None)
    monkeypatch.setattr(model_module, "close_records", lambda *a: None)
    model._share_experts(board, None)
    assert board.published == [(VICTIM, False, 9, 9)], f"published with the fill in flight: {board.published}"
    group.close()
