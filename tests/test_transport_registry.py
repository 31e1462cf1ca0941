"""A backend is one class and one registry entry: a toy transport defined and registered here, and nowhere
else, runs a two-rank DWDPModel whose logits equal the unwrapped model's; the config, `dwdp tune --backend`,
resolve_backend and the default slice size all learn of it from the registry alone."""
import pytest
import torch

from dwdp.cli import build_parser
from dwdp.runtime.config import DWDPConfig
from dwdp.runtime.group import init_group, launch_local
from dwdp.runtime.transport import HostTransport, registry
from dwdp.runtime.transport.registry import register_transport, resolve_backend
from dwdp.models.tiny import build_tiny_model
from logits_check import check_logits

TOY_SLICE_BYTES = 3000  # no other backend's default: a plan cut at it was cut by the toy's class


class ToyTransport(HostTransport):
    """The host backend under another name, counting what it is asked to copy."""

    name = "toy"
    auto_for = ()  # "auto" keeps picking host for CPU models
    default_slice_bytes = TOY_SLICE_BYTES

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.submits, self.largest_slice = 0, 0

    def submit(self, plan, slot_buffer):
        self.submits += 1
        self.largest_slice = max([self.largest_slice, *(s.nbytes for s in plan.slices)])
        return super().submit(plan, slot_buffer)


@pytest.fixture
def toy_registered():
    register_transport("toy", ToyTransport)
    yield
    registry._TRANSPORTS.pop("toy", None)


def test_the_registry_lists_the_builtin_backends_and_auto_picks_by_device():
    assert registry.backend_names() == ("host", "cuda")
    assert resolve_backend("auto", "cpu") == "host" and resolve_backend("auto", "cuda:0") == "cuda"
    assert registry.transport_class("host") is HostTransport


def test_a_registered_backend_is_known_to_the_config_the_cli_and_resolve_backend(toy_registered):
    config = DWDPConfig(backend="toy")
    assert config.slice_bytes_for("toy") == TOY_SLICE_BYTES
    assert build_parser().parse_args(["tune", "--backend", "toy"]).backend == "toy"
    assert resolve_backend("toy", "cpu") == "toy" and resolve_backend("auto", "cpu") == "host"
    with pytest.raises(ValueError, match=r"backend='toy' needs the model on the CPU, found it on cuda:0"):
        resolve_backend("toy", "cuda:0")


def test_an_unregistered_backend_is_refused_by_name_everywhere():
    with pytest.raises(ValueError, match=r"backend='toy' is not one of \('auto', 'host', 'cuda'\)"):
        DWDPConfig(backend="toy")
    with pytest.raises(ValueError, match=r"backend='toy' has no transport; expected one of \('host', 'cuda'\)"):
        resolve_backend("toy", "cpu")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tune", "--backend", "toy"])


def test_register_refuses_a_second_auto_backend_a_wrong_name_and_a_taken_name():
    class Greedy(ToyTransport):
        name, auto_for = "greedy", ("cpu",)

    class Misnamed(ToyTransport):
        name = "other"

    with pytest.raises(ValueError, match=r"backend='auto' already picks 'host' for cpu models"):
        register_transport("greedy", Greedy)
    with pytest.raises(ValueError, match=r"backend 'misnamed': the class's name is 'other'"):
        register_transport("misnamed", Misnamed)
    with pytest.raises(ValueError, match=r"backend 'host' is already HostTransport"):
        register_transport("host", type("Host2", (HostTransport,), {}))
    with pytest.raises(ValueError, match="is not a Transport subclass"):
        register_transport("toy", object)
    assert "greedy" not in registry.TRANSPORTS and "misnamed" not in registry.TRANSPORTS


def _toy_rank(rank: int) -> dict:
    from dwdp.runtime.model import DWDPModel

    torch.set_num_threads(1)
    register_transport("toy", ToyTransport)  # this process's registry: nothing else names the toy
    group = init_group(2)
    out = {}
    for kernel in ("reference", "composite"):
        model = build_tiny_model("mixtral", seed=11)
        ids = torch.randint(3, 128, (2, 7 + rank), generator=torch.Generator().manual_seed(60 + rank))
        with torch.no_grad():
            want = model(input_ids=ids).logits
        with DWDPModel(model, DWDPConfig(backend="toy", experts_kernel=kernel), group) as wrapped, torch.no_grad():
            got = [wrapped(input_ids=ids).logits for _ in range(2)]
            transport = wrapped.transport
            out[kernel] = dict(backend=wrapped.backend, cls=type(transport).__name__, kernel=wrapped.experts_kernel,
                               submits=transport.submits, largest_slice=transport.largest_slice,
                               diff=max((g - want).abs().max().item() for g in got), scale=want.abs().max().item())
    return out


@pytest.mark.timeout(300)
def test_a_toy_backend_registered_in_the_test_runs_a_two_rank_model_equal_to_the_unwrapped_one():
    for rank, out in enumerate(launch_local(_toy_rank, 2, timeout_s=280)):
        for kernel, r in out.items():
            assert (r["backend"], r["cls"], r["kernel"]) == ("toy", "ToyTransport", kernel), (rank, r)
            assert r["submits"] > 0, f"rank {rank} {kernel}: the toy transport copied nothing"
            # The plans were cut at the toy's default slice size, read off its class by the registry.
            assert r["largest_slice"] == TOY_SLICE_BYTES, (rank, kernel, r["largest_slice"])
            check_logits(f"toy:{kernel}", r, rank)
