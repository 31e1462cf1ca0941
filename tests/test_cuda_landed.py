"""The cuda backend's `landed_prefix`: what compute may read now, from host event queries alone
(never a stream wait or a host wait), on the recording fake device of tests/fake_cuda.py."""
import torch

from dwdp.runtime.plan import arrival_order, build_copy_plan, cut_batches
from fake_cuda import FakeGroup as Group


def test_landed_prefix_follows_the_batch_events_in_arrival_order():
    group = Group(8, 3, copy_batches=3, poll_runs=False).open()
    rank = 1
    plan = build_copy_plan(group.placement, rank, 0, 0, group.layout, 600)
    batches = cut_batches(plan, 3)
    assert len(batches) == 3, batches
    order = arrival_order(plan)
    slot = torch.empty(group.slot_nbytes(rank), dtype=torch.uint8)
    ticket = group.transports[rank].submit(plan, slot)
    events = group.transports[rank]._slot_events[0]
    copy_stream = group.transports[rank]._stream

    def prefix_with_host_queries_only():
        start = len(group.device.calls)
        count = ticket.landed_prefix(order)
        names = {name for r, name, _ in group.device.calls[start:] if r == rank}
        assert names <= {"event_query"}, f"landed_prefix made device calls {sorted(names)}"
        return count

    assert prefix_with_host_queries_only() == 0 and not ticket.done()
    while group.device.step(group.apis[rank].compute):  # the slot's consume event the copies wait on
        pass
    for landed, event in enumerate(events[:2]):
        while not group.device.events[event].completed:  # the copy stream up to this batch's event
            assert group.device.step(copy_stream), "the copy stream stopped before the batch event"
        done = sum(len(b.completes) for b in batches[: landed + 1])
        assert prefix_with_host_queries_only() == done, (landed, done, ticket.landed_prefix(order))
        assert set(order[:done]) == {e for b in batches[: landed + 1] for e in b.completes}
        # Compute asks only about experts with rows, which may skip whole batches.
        later = batches[landed].completes
        assert ticket.landed_prefix(later) == len(later), (landed, later, ticket.landed_prefix(later))
    group.device.run("copies_only")
    assert prefix_with_host_queries_only() == len(order) and ticket.done()
    assert torch.equal(slot, group.expected(plan, slot.numel(), slot.clone())), "landed bytes differ"
    group.close()
