"""Free TCP ports for test servers.

Ports are picked below the kernel's ephemeral range when possible, and one
process never hands out the same port twice.
"""

from __future__ import annotations

import os
import random
import socket
import threading
from pathlib import Path

__all__ = ["free_port"]

# Ports handed out by this process are never handed out again: two servers of
# one cluster pick their ports before either binds, and the kernel may well
# offer the same "free" port twice in a row.
_port_lock = threading.Lock()
_handed_out_ports: set[int] = set()
# A private generator: tests (hypothesis, random.seed) reseed the global one,
# which would make parallel test processes pick identical port sequences.
_port_random = random.Random(int.from_bytes(os.urandom(8), "big"))


def _ephemeral_port_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux default


def _can_bind(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Mirror what nats-server (Go) and asyncio do, so that a port whose old
        # connections linger in TIME_WAIT still counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that is free right now.

    Ports are picked below the kernel's ephemeral range when possible: ports
    from that range are also used as the local end of outgoing connections, so
    one could be taken by some client between a server's stop and its restart
    on the same port. No port is returned twice by one process.

    Another process can still grab the port before it is bound, so callers
    that bind it later must be ready to retry with another port.

    Args:
        host: Address the port will be bound on.

    Returns:
        The port number.

    Raises:
        RuntimeError: If no free port could be found.

    """
    ephemeral_low, _ = _ephemeral_port_range()
    with _port_lock:
        low = 10000
        if ephemeral_low - low >= 1000:
            for port in _port_random.sample(range(low, ephemeral_low), k=64):
                if port not in _handed_out_ports and _can_bind(host, port):
                    _handed_out_ports.add(port)
                    return port
        for _ in range(64):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
            if port not in _handed_out_ports:
                _handed_out_ports.add(port)
                return port
    raise RuntimeError(f"could not find a free TCP port on {host}")
