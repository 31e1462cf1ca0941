"""Transports: one interface (base.Transport), a backend per kind of memory, one registry of them."""
from __future__ import annotations

from dwdp.runtime.transport.base import PeerCopyError, PeerUnreadable, PrefetchError, PrefetchTimeout, Ticket, Transport
from dwdp.runtime.transport.host import HostTransport, connect_in_process
from dwdp.runtime.transport.registry import (TRANSPORTS, auto_backend, backend_names, make_transport,
                                             register_transport, resolve_backend, transport_class)

__all__ = ["HostTransport", "PeerCopyError", "PeerUnreadable", "PrefetchError", "PrefetchTimeout", "TRANSPORTS",
           "Ticket", "Transport", "auto_backend", "backend_names", "connect_in_process", "make_transport",
           "register_transport", "resolve_backend", "transport_class"]
