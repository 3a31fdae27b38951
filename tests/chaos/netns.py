"""Test hosts in Linux network namespaces, and real partitions between them.

A :class:`NetnsHost` is a network namespace connected to the root namespace
by a veth pair with a private ``/30`` (``10.213.x.y``): the root side gets the
first address (:attr:`~NetnsHost.root_address`, where a test's nats-server
listens), the namespace the second (:attr:`~NetnsHost.address`). The
namespace has no other route, so its processes can reach the root side's
address and nothing else; traffic stays between the root namespace and our
own namespaces.

:meth:`~NetnsHost.partition` takes the namespace's end of the veth down: the
kernel then drops every packet between the two sides, and open TCP
connections are *not* reset (a silent partition, as a cut cable or a dead
switch: a client notices only by its own timeouts). :meth:`~NetnsHost.heal`
brings it back up; connections that survived resume. (``tc netem`` would do
the same, but this kernel has no ``sch_netem``; nor is iptables installed.)

Processes run inside with :meth:`~NetnsHost.command` (``ip netns exec NAME
...``, which execs the command in place: the pid the parent gets is the
child's, so signals reach it). Both processes share the host's monotonic
clock (namespaces do not change it), so event times compare.

Names carry the creating process's pid (``cnl<pid>n<k>`` for the namespace,
``cnl<pid>r<k>`` / ``cnl<pid>h<k>`` for the veth ends): each new host first
removes the leftovers of processes that are gone (a killed test run), and
never touches those of a live one (another test running at the same time).

Requires root and ``ip`` (iproute2). :func:`netns_unavailable` says why
not, when not.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import TracebackType

__all__ = ["PREFIX", "NetnsHost", "cleanup_leftovers", "netns_unavailable"]

logger = logging.getLogger(__name__)

#: First letters of every namespace and link this module creates.
PREFIX = "cnl"

#: The private range the /30s are carved from (unused on this machine: a new
#: host checks that no address or route of the root namespace overlaps its /30).
NETWORK = ipaddress.IPv4Network("10.213.0.0/16")

_NAME = re.compile(rf"^{PREFIX}(\d+)([nrh])(\d+)$")
_LOCK_PATH = Path("/tmp") / f"{PREFIX}-netns.lock"


def _ip(*args: str, namespace: str | None = None) -> str:
    argv = ["ip"] if namespace is None else ["ip", "netns", "exec", namespace, "ip"]
    done = subprocess.run([*argv, *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join([*argv, *args])} failed: {done.stderr.strip()}")
    return done.stdout


def _pid_alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or ``None`` if they can.

    Tries to add and delete a namespace with a veth pair; returns the error.
    """
    if shutil.which("ip") is None:
        return "no 'ip' command (iproute2)"
    if os.geteuid() != 0:
        return "not root"
    probe = f"{PREFIX}{os.getpid()}n999"
    try:
        _ip("netns", "add", probe)
        try:
            _ip(
                "link", "add", f"{PREFIX}{os.getpid()}r999", "type", "veth",
                "peer", "name", f"{PREFIX}{os.getpid()}h999", "netns", probe,
            )  # fmt: skip
        finally:
            _ip("netns", "delete", probe)
    except (RuntimeError, OSError) as exc:
        return str(exc)
    return None


def cleanup_leftovers() -> list[str]:
    """Delete the namespaces and links of processes that have exited.

    Returns:
        The names deleted.

    """
    removed: list[str] = []
    namespaces = [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]
    links = re.findall(r"^\d+: ([^:@\s]+)", _ip("-o", "link", "show"), flags=re.MULTILINE)
    for name in [*namespaces, *links]:
        match = _NAME.match(name)
        if match is None or _pid_alive(int(match.group(1))):
            continue
        # Deleting the namespace deletes its veth end, and so the pair.
        what = ("netns", "delete", name) if name in namespaces else ("link", "delete", name)
        with contextlib.suppress(RuntimeError):  # gone with its namespace meanwhile
            _ip(*what)
            removed.append(name)
    if removed:
        logger.warning("removed network namespaces/links of exited test runs: %s", removed)
    return removed


@contextlib.contextmanager
def _lock() -> Iterator[None]:
    # Choosing a free /30 and claiming it must not interleave with another
    # process doing the same.
    with _LOCK_PATH.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _used_networks() -> list[ipaddress.IPv4Network]:
    used: list[ipaddress.IPv4Network] = []
    for cidr in re.findall(r"inet (\d+\.\d+\.\d+\.\d+/\d+)", _ip("-4", "-o", "addr", "show")):
        used.append(ipaddress.IPv4Interface(cidr).network)
    for line in _ip("-4", "route", "show", "table", "all").splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("local", "broadcast", "unreachable", "blackhole", "prohibit"):
            first = line.split()[1]
        if first == "default" or not re.match(r"^\d+\.\d+\.\d+\.\d+(/\d+)?$", first):
            continue
        used.append(ipaddress.IPv4Network(first, strict=False))
    return used


class NetnsHost:
    """A network namespace joined to the root namespace by a veth pair.

    Use as a context manager (or call :meth:`create` and :meth:`close`):
    leaving it deletes the namespace, its veth pair, and so its addresses.
    Processes still running inside keep running but lose the network; stop
    them first.

    Example:
        >>> with NetnsHost() as host:  # doctest: +SKIP
        ...     server = NatsServer(host=host.root_address)
        ...     proc = subprocess.Popen(host.command(["python", "-m", "..."]))
        ...     host.partition()
        ...     host.heal()

    Attributes:
        name: The namespace's name.
        root_link: The veth end in the root namespace.
        link: The veth end inside the namespace.
        root_address: The root side's address (listen here).
        address: The namespace's address.

    """

    def __init__(self) -> None:
        self.name = ""
        self.root_link = ""
        self.link = ""
        self.root_address = ""
        self.address = ""
        self._partitioned = False

    def create(self) -> NetnsHost:
        """Remove leftovers of exited runs, then make the namespace and its link.

        Returns:
            This host.

        Raises:
            RuntimeError: If an ``ip`` command fails (the message has its error).

        """
        cleanup_leftovers()
        with _lock():
            used = _used_networks()
            taken = set(_ip("netns", "list").split())
            pid = os.getpid()
            index = next(i for i in range(1000) if f"{PREFIX}{pid}n{i}" not in taken)
            subnet = next(
                s for s in NETWORK.subnets(new_prefix=30) if not any(s.overlaps(u) for u in used)
            )
            self.name = f"{PREFIX}{pid}n{index}"
            self.root_link = f"{PREFIX}{pid}r{index}"
            self.link = f"{PREFIX}{pid}h{index}"
            root, inside = list(subnet.hosts())
            self.root_address, self.address = str(root), str(inside)
            _ip("netns", "add", self.name)
            try:
                _ip(
                    "link", "add", self.root_link, "type", "veth",
                    "peer", "name", self.link, "netns", self.name,
                )  # fmt: skip
                _ip("addr", "add", f"{root}/30", "dev", self.root_link)
                _ip("link", "set", self.root_link, "up")
                _ip("addr", "add", f"{inside}/30", "dev", self.link, namespace=self.name)
                _ip("link", "set", self.link, "up", namespace=self.name)
                _ip("link", "set", "lo", "up", namespace=self.name)
            except BaseException:
                self.close()
                raise
        logger.info("network namespace %s: %s <-> %s", self.name, self.root_address, self.address)
        return self

    def command(self, argv: Sequence[str]) -> list[str]:
        """The command line that runs ``argv`` inside the namespace.

        ``ip netns exec`` execs ``argv`` in its own process, so the pid of a
        process started with this line is the pid of ``argv``.
        """
        return ["ip", "netns", "exec", self.name, *argv]

    @property
    def partitioned(self) -> bool:
        """Whether :meth:`partition` was called and :meth:`heal` not since."""
        return self._partitioned

    def partition(self) -> None:
        """Cut the namespace off: every packet between it and the root is dropped.

        Idempotent. Open connections are not reset; both ends just stop
        hearing from each other.
        """
        _ip("link", "set", self.link, "down", namespace=self.name)
        self._partitioned = True

    def heal(self) -> None:
        """Reconnect the namespace (undo :meth:`partition`). Idempotent."""
        _ip("link", "set", self.link, "up", namespace=self.name)
        self._partitioned = False

    def close(self) -> None:
        """Delete the namespace (and with it the veth pair). Idempotent."""
        if not self.name:
            return
        with contextlib.suppress(RuntimeError):
            _ip("netns", "delete", self.name)
        # The pair normally goes with the namespace; make sure of the root end.
        with contextlib.suppress(RuntimeError):
            _ip("link", "delete", self.root_link)
        self._partitioned = False

    def __enter__(self) -> NetnsHost:
        return self.create()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
