"""The transport backends by name: the one list of them (tests/test_layout.py keeps it the only one).

A backend is a Transport subclass whose class attributes say what the registry needs (see
dwdp.runtime.transport.base): `name`, `device_types` (the models it serves), `auto_for` (the device
types backend="auto" picks it for), `default_slice_bytes`, and `from_config` to build it from a
DWDPConfig. DWDPConfig's validation, `dwdp tune --backend`, `resolve_backend` and `make_transport`
read this registry. A new backend is its module plus one `register_transport` line at the bottom
of this file (or a call from the code that brings it, e.g. a test).
"""
from __future__ import annotations

from types import MappingProxyType

import torch

from dwdp.runtime.transport.base import Transport

_TRANSPORTS: dict[str, type[Transport]] = {}
TRANSPORTS = MappingProxyType(_TRANSPORTS)  # backend name -> its Transport class, in registration order
_DEVICE_WORDS = {"cpu": "the CPU", "cuda": "a CUDA device"}  # for refusals: where a backend needs the model


def register_transport(name: str, cls: type[Transport]) -> type[Transport]:
    """List `cls` as backend `name` (its `name` attribute); returns `cls`. ValueError, naming what is
    wrong, for a class that is not a Transport, a name taken by another class, or a device type that
    backend="auto" would already pick another backend for."""
    if not (isinstance(cls, type) and issubclass(cls, Transport)):
        raise ValueError(f"backend {name!r}: {cls!r} is not a Transport subclass")
    if name == "auto":
        raise ValueError("backend name 'auto' is taken: it picks a backend by the model's device type")
    if getattr(cls, "name", None) != name:
        raise ValueError(f"backend {name!r}: the class's name is {getattr(cls, 'name', None)!r}; they must agree "
                         "(handles and logs carry the class's)")
    if _TRANSPORTS.get(name, cls) is not cls:
        raise ValueError(f"backend {name!r} is already {_TRANSPORTS[name].__qualname__}")
    slice_bytes = getattr(cls, "default_slice_bytes", None)
    if isinstance(slice_bytes, bool) or not isinstance(slice_bytes, int) or slice_bytes < 1:
        raise ValueError(f"backend {name!r}: default_slice_bytes={slice_bytes!r} must be a positive int")
    if not cls.device_types or not set(cls.auto_for) <= set(cls.device_types):
        raise ValueError(f"backend {name!r}: auto_for={cls.auto_for} must be among device_types={cls.device_types} "
                         "(at least one)")
    for device_type in cls.auto_for:
        other = _auto(device_type)
        if other not in (None, name):
            raise ValueError(f"backend {name!r}: backend='auto' already picks {other!r} for {device_type} models")
    _TRANSPORTS[name] = cls
    return cls


def backend_names() -> tuple[str, ...]:
    """The registered backends, in registration order ("auto" is not one)."""
    return tuple(_TRANSPORTS)


def transport_class(backend: str) -> type[Transport]:
    """The class of a registered backend; ValueError naming the registered ones."""
    cls = _TRANSPORTS.get(backend)
    if cls is None:
        raise ValueError(f"backend={backend!r} has no transport; expected one of {backend_names()}")
    return cls


def _auto(device_type: str) -> str | None:
    return next((name for name, cls in _TRANSPORTS.items() if device_type in cls.auto_for), None)


def auto_backend(device_type: str) -> str:
    """The backend backend="auto" picks for a model on `device_type` ("cpu", "cuda")."""
    name = _auto(device_type)
    if name is None:
        raise ValueError(f"no backend serves models on {device_type} (backends: "
                         f"{ {n: c.device_types for n, c in _TRANSPORTS.items()} })")
    return name


def resolve_backend(backend: str, device) -> str:
    """`auto` picks the backend registered for the model's device type (cuda for CUDA-resident models,
    host for CPU ones); a backend that cannot serve the model's device is refused with the device named."""
    device = torch.device(device)
    if backend == "auto":
        return auto_backend(device.type)
    cls = transport_class(backend)
    if device.type not in cls.device_types:
        instead = _auto(device.type)
        where = " or ".join(_DEVICE_WORDS.get(t, f"a {t} device") for t in cls.device_types)
        raise ValueError(f"backend={backend!r} needs the model on {where}, found it on {device}; "
                         f"move it with model.to({cls.device_types[0]!r})"
                         + (f" or use backend={instead!r}" if instead else ""))
    return backend


def make_transport(backend: str, rank: int, config, *, device=None, mapping: str | None = None,
                   process_group=None) -> Transport:
    """The transport of `backend` for `rank`, set up from a DWDPConfig (its class's `from_config`)."""
    return transport_class(backend).from_config(rank, config, device=device, mapping=mapping,
                                                process_group=process_group)


def _register_builtin() -> None:
    from dwdp.runtime.transport.cuda import CudaTransport
    from dwdp.runtime.transport.host import HostTransport

    register_transport("host", HostTransport)
    register_transport("cuda", CudaTransport)


_register_builtin()

__all__ = ["TRANSPORTS", "auto_backend", "backend_names", "make_transport", "register_transport",
           "resolve_backend", "transport_class"]
