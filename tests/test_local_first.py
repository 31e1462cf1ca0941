"""Local experts are computed before the first wait on a layer's copies, on both experts paths.

Observed through the transport: rank 0's remote copies are held back until compute first waits on
them, and at that moment rank 0's local experts of that layer are overwritten with other values.
Logits equal to the unwrapped model's mean every local expert was computed before that first wait.
A control run overwrites them at submit, before any compute of the layer, and must see the change.
Rank 1 only serves rank 0's pulls from its own (untouched) segment.
"""
import pytest
import torch

from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.group import init_group, launch_local
from dwdp.runtime.model import DWDPModel
from dwdp.models.tiny import build_tiny_model
from logits_check import ATOL, RTOL, check_logits


class HeldTicket:
    """A ticket whose copies start only when compute first waits on it; `on_first_wait(plan)` runs first."""

    def __init__(self, plan, start_copy, on_first_wait):
        self.plan, self._start_copy, self._on_first_wait = plan, start_copy, on_first_wait
        self._ticket = None

    def _started(self):
        if self._ticket is None:
            self._on_first_wait(self.plan)
            self._ticket = self._start_copy()
        return self._ticket

    @property
    def error(self):
        return None if self._ticket is None else self._ticket.error

    @property
    def finished_ns(self):
        return None if self._ticket is None else self._ticket.finished_ns

    def wait(self, timeout):
        return self._started().wait(timeout)

    def wait_experts(self, experts, timeout):
        return self._started().wait_experts(experts, timeout)

    def done(self):
        return self._ticket is not None and self._ticket.done()

    def expert_ready(self, expert):
        return self._ticket is not None and self._ticket.expert_ready(expert)

    def __getattr__(self, name):
        # Any other ticket call (a host-blocking drain, say) also ends the hold, then goes through.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._started(), name)


class HoldingTransport:
    """Wraps the real transport: calls `on_submit(plan)`, then holds the plan's copies back; every
    other transport call goes straight to the real transport."""

    def __init__(self, inner, on_submit, on_first_wait):
        self.inner, self.on_submit, self.on_first_wait = inner, on_submit, on_first_wait

    def submit(self, plan, slot_buffer):
        self.on_submit(plan)
        return HeldTicket(plan, lambda: self.inner.submit(plan, slot_buffer), self.on_first_wait)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _overwriter(wrapped):
    """overwrite(plan): replace rank 0's local experts of plan.layer (once) with fresh random values."""
    done = []

    def overwrite(plan):
        if plan.layer in done:
            return
        done.append(plan.layer)
        gen = torch.Generator().manual_seed(1000 + plan.layer)
        module = wrapped.experts_modules[plan.layer]
        with torch.no_grad():
            for weights in (module.gate_up_proj, module.down_proj):  # [L, ...] views of this rank's segment
                weights.copy_(torch.randn(weights.shape, generator=gen, dtype=weights.dtype))

    return overwrite, done


CASES = {  # name: (experts_kernel, when rank 0's local experts are overwritten)
    "reference": ("reference", "first_wait"),
    "triton": ("triton", "first_wait"),
    "control": ("reference", "submit"),
}


def _rank(rank: int) -> dict:
    group = init_group()
    out = {}
    for name, (kernel, when) in CASES.items():
        model = build_tiny_model("mixtral", seed=6)
        ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(40))
        with torch.no_grad():
            reference = model(ids).logits
        with DWDPModel(model, DWDPConfig(experts_kernel=kernel), group) as wrapped, torch.no_grad():
            if rank == 0:
                overwrite, overwritten = _overwriter(wrapped)
                idle = lambda plan: None  # noqa: E731
                wrapped.prefetcher.transport = HoldingTransport(
                    wrapped.prefetcher.transport, overwrite if when == "submit" else idle,
                    overwrite if when == "first_wait" else idle)
                got = wrapped(ids).logits
                out[name] = dict(diff=(got - reference).abs().max().item(), scale=reference.abs().max().item(),
                                 kernel=wrapped.experts_kernel, overwritten=list(overwritten),
                                 num_layers=len(wrapped.experts_modules))
            group.barrier()  # rank 1's segment stays mapped until rank 0 has pulled what it needs
    return out


@pytest.mark.timeout(300)
def test_local_experts_run_before_the_first_wait_on_both_experts_paths():
    results = launch_local(_rank, 2, timeout_s=280, env={"TRITON_INTERPRET": "1"})[0]
    for name in ("reference", "triton"):
        r = results[name]
        assert r["kernel"] == name, r
        assert r["overwritten"] == list(range(r["num_layers"])), f"{name}: layers overwritten at first wait {r}"
        check_logits(f"{name} path with local experts overwritten at the first wait", r, 0)
    control = results["control"]
    assert control["diff"] > 100 * (ATOL + RTOL * control["scale"]), (
        f"overwriting local experts before compute changed the logits by only {control['diff']:.3e}: "
        "the check above could not see a late local compute")
