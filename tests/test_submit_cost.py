"""What bench/submit_cost.py times goes through dwdp.benchmarks.submit_cost: a no-device CudaTransport's
submit (every device call a no-op, the plan's batches issued as batch calls) and the cuda_api calls of
one batch, which run here whether or not a driver is present."""
import pytest

from dwdp.benchmarks import submit_cost
from dwdp.benchmarks.submit_cost import NoDeviceApi, bindings_calls, no_device_submit


@pytest.mark.timeout(60)
@pytest.mark.parametrize("copies", [8, 128])
def test_a_no_device_submit_issues_its_plan_as_batch_calls_every_time(monkeypatch, copies):
    batches = []
    monkeypatch.setattr(NoDeviceApi, "memcpy_prepared_batch", lambda self, batch, stream: batches.append(batch.count))
    submit, slices = no_device_submit(copies, copy_batches=4)
    assert slices == copies
    for _ in range(3):
        batches.clear()
        submit()
        assert len(batches) == 4, batches  # one batch call per batch (a peer's adjacent slices: one copy)


@pytest.mark.timeout(60)
def test_every_function_of_cuda_api_is_a_no_op_of_the_no_device_api():
    api = NoDeviceApi()
    assert api.has_memcpy_batch() is True and api.device_synchronize() is None
    assert api.stream_create() != api.event_create()  # distinct handles


@pytest.mark.timeout(60)
def test_the_bindings_calls_run_without_a_device():
    calls, close = bindings_calls(8, 4096, device=False)
    assert sorted(calls) == ["bindings_call", "prepare", "prepare_and_call"]
    for fn in calls.values():
        fn()  # a missing driver is accepted: the bindings converted the arguments first
    close()
    assert isinstance(submit_cost.device_usable(), bool)
