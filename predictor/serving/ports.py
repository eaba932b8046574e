"""Whether the server's ports are free, asked before the checkpoint loads: a port in use (another
server, a second replica on a host network) is said at once, not after a minute of loading (the
bind then failed as the last step of the start, and the process aborted in uvicorn's shutdown)."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable


def taken(binds: Iterable[tuple[str, int, str]]) -> list[str]:
    """Of (host, port, what) to bind, those another process holds, said as 'what host:port'."""
    held = []
    for host, port, what in binds:
        if port == 0:  # the system picks one: always free
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn, gRPC
                probe.bind((host, port))
        except OSError as error:  # only a port in use: an address this host lacks (no IPv6)
            if error.errno == errno.EADDRINUSE:  # is the server's own bind's to report
                held.append(f"{what} {host}:{port}")
    return held
