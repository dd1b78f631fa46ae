"""Which network interfaces the NIXL agents' UCX may use: the one of the server's address, by default.

UCX's TCP transport opens a listening socket on every interface it is allowed (``UCX_NET_DEVICES``, default: all),
so a server bound to 127.0.0.1 would still accept UCX connections from the network. The agents are created with
``UCX_NET_DEVICES`` set to what the operator names (``--ucx-net-devices``), else to the one already in the
environment, else to the interface that carries ``--address`` (``lo`` for loopback); ``0.0.0.0`` / ``::`` mean
every interface, as for the endpoints.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

SIOCGIFADDR = 0x8915
AUTO = "auto"


def _ipv4_of(interface: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", interface[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_of(address: str) -> str | None:
    """The interface carrying IPv4 ``address`` (None: every interface, for 0.0.0.0 / ::); ValueError if none does."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        ip = ipaddress.ip_address(socket.gethostbyname(address))
    if ip.is_unspecified:
        return None
    for _, name in socket.if_nameindex():
        found = _ipv4_of(name)
        if found is not None and ipaddress.ip_address(found) == ip:
            return name
    if ip.is_loopback:
        return "lo"
    raise ValueError(f"no network interface carries {address}; name one with --ucx-net-devices")


def net_devices(setting: str, address: str) -> str:
    """The ``UCX_NET_DEVICES`` value for a setting and the server address ("" = leave UCX's choice): an explicit
    setting wins; ``auto`` keeps a ``UCX_NET_DEVICES`` already in the environment (e.g. an RDMA device), else binds
    to the interface of ``address`` (every interface for 0.0.0.0)."""
    if setting and setting != AUTO:
        return setting
    if os.environ.get("UCX_NET_DEVICES"):
        return ""  # the operator chose; the agents inherit it
    return interface_of(address) or ""


def apply(devices: str) -> None:
    """Set ``UCX_NET_DEVICES`` for agents created after this call ("" leaves UCX's default: every interface); UCX
    reads the environment when an agent's worker is created."""
    if devices:
        os.environ["UCX_NET_DEVICES"] = devices
