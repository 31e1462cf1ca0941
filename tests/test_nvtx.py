"""NVTX ranges: named exactly as dwdp.observe.phases, layer and slot in the attributes, built once; the torch
fallback without the nvtx package; nothing at all on the CPU."""
import sys
import types

import pytest
import torch

from dwdp.observe import phases
from dwdp.observe.nvtx_ranges import NvtxRanges
from dwdp.observe.tracing import attach_nvtx_hooks


class FakeDomain:
    def __init__(self):
        self.built, self.stack, self.log = [], [], []

    def get_event_attributes(self, message=None, color=None, category=None, payload=None):
        self.built.append((message, payload, category))
        return ("attrs", message, payload, category)

    def push_range(self, attributes):
        self.stack.append(attributes)
        self.log.append(("push", attributes))

    def pop_range(self):
        self.log.append(("pop", self.stack.pop()))


def _fake_nvtx():
    domain = FakeDomain()
    module = types.SimpleNamespace(get_domain=lambda name: domain if name == "dwdp" else pytest.fail(name))
    return module, domain


def test_ranges_carry_phase_layer_slot_and_attributes_are_built_once():
    module, domain = _fake_nvtx()
    ranges = NvtxRanges(module)
    for _ in range(3):
        ranges.push(phases.PREFETCH_WAIT, 4, 1)
        ranges.pop()
    ranges.push(phases.MOE_COMPUTE, 2)
    ranges.pop()
    assert ranges.source == "nvtx"
    assert domain.built == [(phases.PREFETCH_WAIT, 4, 1), (phases.MOE_COMPUTE, 2, None)], domain.built
    assert [a[1] for kind, a in domain.log if kind == "push"] == [phases.PREFETCH_WAIT] * 3 + [phases.MOE_COMPUTE]
    assert domain.stack == []


def test_without_the_nvtx_package_torch_nvtx_gets_the_bare_phase_names(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvtx", None)  # import nvtx -> ImportError
    pushed = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda msg: pushed.append(msg))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: pushed.append("pop"))
    ranges = NvtxRanges()
    ranges.push(phases.PREFETCH_ISSUE, 3, 0)
    ranges.pop()
    assert ranges.source == "torch.cuda.nvtx" and pushed == [phases.PREFETCH_ISSUE, "pop"]


def test_model_hooks_push_forward_attention_router_balanced():
    from dwdp.models.adapters import find_experts
    from dwdp.models.tiny import build_tiny_model

    model = build_tiny_model("qwen3_moe", num_layers=2)
    layers = find_experts(model)
    module, domain = _fake_nvtx()
    handles = attach_nvtx_hooks(model, NvtxRanges(module), [layer.name for layer in layers])
    with torch.no_grad():
        model(input_ids=torch.randint(3, 100, (1, 5), generator=torch.Generator().manual_seed(0)))
    for h in handles:
        h.remove()
    pushed = [(a[1], a[2]) for kind, a in domain.log if kind == "push"]
    assert pushed[0] == (phases.FORWARD, -1)
    assert (phases.ATTENTION, 0) in pushed and (phases.ATTENTION, 1) in pushed, pushed
    assert (phases.ROUTER, 0) in pushed and (phases.ROUTER, 1) in pushed, pushed
    assert domain.stack == [] and len(domain.log) == 2 * len(pushed)
    assert {name for name, _ in pushed} <= set(phases.ALL)


def test_cpu_models_make_no_ranges():
    from dwdp import DWDPConfig, DWDPModel
    from dwdp.runtime.group import DWDPGroup
    from dwdp.models.tiny import build_tiny_model

    with DWDPModel(build_tiny_model("mixtral"), DWDPConfig(), DWDPGroup(0, 1)) as wrapped:
        assert wrapped.prefetcher.nvtx is None


def test_prefetch_issue_and_wait_ranges_name_layer_and_slot():
    from dwdp.runtime.prefetch import Prefetcher
    from fake_cuda import FakeGroup

    group = FakeGroup(8, 3).open()
    from dwdp.runtime.plan import PlanCache

    nbytes = group.slot_nbytes(0)
    prefetcher = Prefetcher(group.transports[0], PlanCache(group.placement, 0, group.layout, 1000),
                            [group.transports[0].alloc_slot(nbytes) for _ in range(2)], group.layout.num_layers, 5.0)
    module, domain = _fake_nvtx()
    prefetcher.nvtx = NvtxRanges(module)
    prefetcher.start_forward()
    slot = prefetcher.begin(0)
    prefetcher.wait(0, slot)
    prefetcher.release(slot)
    pushed = [(a[1], a[2], a[3]) for kind, a in domain.log if kind == "push"]
    assert pushed == [(phases.PREFETCH_ISSUE, 0, 0), (phases.PREFETCH_ISSUE, 1, 1), (phases.PREFETCH_WAIT, 0, 0)]
    group.close()
