"""A listening socket on every address of the pod, IPv6 and IPv4 alike.

In an IPv6-only cluster a pod's only address is an IPv6 one: the kubelet's probes, the
Services and Prometheus reach a server there, never on 0.0.0.0. Binding "::" through asyncio
(aiohttp's TCPSite) does not help on its own: asyncio turns IPV6_V6ONLY on for every IPv6
socket it binds, so "::" takes no IPv4 connection and breaks dual-stack and IPv4 clients.
`every_address_socket` binds one IPv6 socket with IPV6_V6ONLY off instead, which takes both,
and an IPv4 one on a node whose kernel has IPv6 turned off.
"""

import errno
import socket

# The host that asks for every address, IPv6 and IPv4.
EVERY_ADDRESS = "::"


def every_address_socket(port: int) -> socket.socket:
    """A TCP socket bound to `port` on every address: one IPv6 socket that takes IPv4
    connections too, or an IPv4 one on 0.0.0.0 where the kernel has no IPv6.

    An IPv6-only cluster gives a pod an IPv6 address alone, which a server on 0.0.0.0 never
    answers; asyncio binds "::" for IPv6 only (IPV6_V6ONLY on), so the socket is made here.
    Any other failure to bind, a port already taken above all, is raised: listening on
    IPv4 alone then would hide it.
    """
    try:
        return _bound(socket.AF_INET6, EVERY_ADDRESS, port)
    except OSError as error:
        if error.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
            raise
    return _bound(socket.AF_INET, "0.0.0.0", port)


def host_port(host: str, port: int) -> str:
    """`host:port` as a URL or a log line writes it: an IPv6 address in brackets
    (`[fd00::7]:8000`), which without them reads as an address ending in the port."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def listening_site(runner, host: str, port: int):
    """An aiohttp site of `runner` listening where `host` says: "::" (EVERY_ADDRESS) on
    every address, IPv6 and IPv4, on one dual-stack socket (aiohttp would bind it for IPv6
    alone); any other host as given."""
    from aiohttp import web  # the servers that take it have aiohttp; the lookup server not

    if host == EVERY_ADDRESS:
        return web.SockSite(runner, every_address_socket(port))
    return web.TCPSite(runner, host, port)


def _bound(family: socket.AddressFamily, host: str, port: int) -> socket.socket:
    """A TCP socket of `family` bound to (host, port) as asyncio binds its own (address
    reuse on), dual-stack when IPv6; closed if binding fails, and the error names the
    address, as asyncio's do."""
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        message = f"error while attempting to bind on address {(host, port)!r}: {error.strerror}"
        raise OSError(error.errno, message) from None
    return sock
