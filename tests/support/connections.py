"""Which process holds which NATS connection: the server's ``connz`` joined with ``/proc``.

The server lists every client connection with its remote port; the kernel
knows which process owns the socket bound to that port. Joining the two counts
connections per process without trusting anything the client says about
itself (Linux only).
"""

from __future__ import annotations

import os
from pathlib import Path

from celery_nats_leader.testing import NatsServer


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant of it."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = [root], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        tree.extend(children)
        frontier = children
    return tree


def _local_ports(pid: int) -> set[int]:
    """Local ports of the TCP sockets ``pid`` has open."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("tcp", "tcp6"):
        try:
            rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def connections_by_process(server: NatsServer, pids: list[int]) -> dict[int, list[str]]:
    """The names of the server's client connections held by each of ``pids``."""
    owner = {port: pid for pid in pids for port in _local_ports(pid)}
    held: dict[int, list[str]] = {pid: [] for pid in pids}
    for conn in server.monitor("connz?limit=4096")["connections"]:
        pid = owner.get(int(conn["port"]))
        if pid is not None:
            held[pid].append(str(conn.get("name", "")))
    return held


def thread_count(pid: int) -> int:
    """The number of threads of ``pid``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    raise ValueError(f"no thread count for {pid}")
