"""Keeping the training ranks' rendezvous on loopback (checked on torch 2.13).

With ``MASTER_ADDR`` 127.0.0.1 (Lightning's default on one machine), torch's rendezvous store
(``TCPStore``, created by ``init_process_group``'s ``env://`` handler on rank 0) still listens on
every interface, and gloo binds its connections to the address the host name resolves to. Both
have a public way out: a ``TCPStore`` may serve on a socket its caller has bound
(``master_listen_fd``) and be handed to ``init_process_group(store=...)``, and gloo takes its
interface from ``GLOO_SOCKET_IFNAME``. Pinned by ``tests/compat/test_torch_distributed.py``.
NCCL's bootstrap sockets likewise take theirs from ``NCCL_SOCKET_IFNAME``
(:func:`nccl_environment`, for the training ranks and the weight broadcast's group).
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed

GLOO_INTERFACE = "GLOO_SOCKET_IFNAME"
NCCL_INTERFACE = "NCCL_SOCKET_IFNAME"


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP address or a host name) is a loopback address."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(address))
        except OSError:
            return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def loopback_interface() -> str | None:
    """The name of the network interface that carries 127.0.0.1 (``lo`` on Linux)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addresses):
            return name
    return None


def nccl_environment(host: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that keep NCCL's bootstrap sockets on loopback for a group whose store is
    at ``host``: ``NCCL_SOCKET_IFNAME`` set to the loopback interface when ``host`` is a
    loopback address (NCCL's own choice of interface leaves ``lo`` out). Empty when the user
    set the variable (``environ``: ``os.environ`` unless given), or when ``host`` is not
    loopback (members on other machines: NCCL picks an interface that reaches them). NCCL reads
    it once per process, when its first communicator forms: apply it before that, on every
    member (trainer and workers alike)."""
    environ = os.environ if environ is None else environ
    if NCCL_INTERFACE in environ or not is_loopback(host):
        return {}
    interface = loopback_interface()
    return {} if interface is None else {NCCL_INTERFACE: interface}


@contextmanager
def loopback_rendezvous() -> Iterator[None]:
    """Within this block, an ``init_process_group`` through ``env://`` whose ``MASTER_ADDR`` is
    a loopback address (read when it is called) listens on loopback only: rank 0 serves the
    store on a socket bound to that address, and gloo uses the loopback interface (unless
    ``GLOO_SOCKET_IFNAME`` is set). Any other call passes through unchanged."""
    original = torch.distributed.init_process_group

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        address = os.environ.get("MASTER_ADDR", "")
        if kwargs.get("store") is not None or kwargs.get("init_method") or not is_loopback(address):
            return original(*args, **kwargs)
        rank, world_size = kwargs["rank"], kwargs["world_size"]
        timeout = kwargs.get("timeout") or timedelta(minutes=30)
        interface = loopback_interface()
        if interface is not None:
            os.environ.setdefault(GLOO_INTERFACE, interface)
        os.environ.update(nccl_environment(address))  # NCCL ranks (DDP, FSDP) bootstrap there
        kwargs["store"] = _store(address, int(os.environ["MASTER_PORT"]), rank, world_size, timeout)
        return original(*args, **kwargs)

    torch.distributed.init_process_group = init_process_group
    try:
        yield
    finally:
        torch.distributed.init_process_group = original


def _store(
    address: str, port: int, rank: int, world_size: int, timeout: timedelta
) -> torch.distributed.TCPStore:
    """The rendezvous store: served by rank 0 on a socket bound to ``address`` only."""
    if rank != 0:
        return torch.distributed.TCPStore(address, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((address, port))
    listener.listen(world_size * 4)
    # The store's server takes over the socket (and closes it when the store goes).
    return torch.distributed.TCPStore(
        address, port, world_size, True, timeout, master_listen_fd=listener.detach()
    )
