"""Run a real JetStream cluster of ``nats-server`` processes for tests and benchmarks.

:class:`NatsCluster` runs N clustered JetStream servers (routes on free ports)
and waits until every member is healthy and agrees on a JetStream metadata
leader before returning. Its members are
:class:`~celery_nats_leader.testing.nats_server.NatsServer` objects.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

from celery_nats_leader.testing.nats_server import (
    POLL_INTERVAL,
    PORT_ATTEMPTS,
    NatsServer,
    NatsServerError,
    PortInUseError,
    find_nats_server_binary,
)
from celery_nats_leader.testing.ports import free_port

__all__ = ["NatsCluster", "with_store_dir"]

logger = logging.getLogger(__name__)

_STORE_DIR = re.compile(r"^(?P<indent>[ \t]*)store_dir\s*[:=].*$", re.M)


def with_store_dir(config: str, store_dir: str | os.PathLike[str]) -> str:
    """A nats-server configuration's text with its JetStream ``store_dir`` replaced.

    How the tests start the files of ``deploy/nats/`` as they are, apart
    from where the data goes (nats-server refuses ``-sd`` on the command
    line beside a ``store_dir`` in the file).

    Raises:
        ValueError: The configuration has no (or more than one) ``store_dir``.

    """
    found, count = _STORE_DIR.subn(
        lambda m: f"{m['indent']}store_dir: {json.dumps(os.fspath(store_dir))}", config
    )
    if count != 1:
        raise ValueError(f"expected one JetStream store_dir in the configuration, found {count}")
    return found


class NatsCluster:
    """N clustered JetStream ``nats-server`` processes on free ports.

    Members are named ``<cluster_name>-0`` .. ``<cluster_name>-{N-1}`` (2.9
    needs unique server names for JetStream clustering), each has its own
    store directory, and each routes to all the others. :meth:`start` returns
    once every member is ready and agrees on a JetStream metadata leader, so
    R3 streams and KV buckets can be created right away.

    Example:
        >>> with NatsCluster(3) as cluster:  # doctest: +SKIP
        ...     nc = await nats.connect(servers=cluster.urls)

    Args:
        size: Number of servers.
        cluster_name: ``--cluster_name``; random by default.
        advertise: If False, pass ``--no_advertise=true`` so servers do not
            gossip the other members' client URLs to clients. Needed when a
            client must only ever reach the cluster through a fault proxy
            (otherwise nats-py adds the discovered direct URLs to its pool).
        extra_args: Further arguments for every member.
        config_file: A nats-server configuration every member is started
            from, such as the repository's ``deploy/nats/cluster.conf``
            (it must enable JetStream with a ``store_dir``). Each member
            gets a copy whose ``store_dir`` is its own store; the harness's
            flags (ports, name, cluster name, routes) override the file's
            values; its other settings (JetStream limits, lame duck, ...)
            apply.
        binary: The executable; :func:`find_nats_server_binary` by default.
        startup_timeout: Seconds :meth:`start` (and :meth:`restart`) may take.
        stop_timeout: Seconds a member may take to exit after SIGTERM.

    """

    def __init__(
        self,
        size: int = 3,
        *,
        cluster_name: str | None = None,
        advertise: bool = True,
        extra_args: Sequence[str] = (),
        config_file: str | os.PathLike[str] | None = None,
        binary: str | None = None,
        startup_timeout: float = 20.0,
        stop_timeout: float = 10.0,
    ) -> None:
        if size < 1:
            raise ValueError("a cluster needs at least one server")
        binary = binary or find_nats_server_binary()  # fail before creating files
        self._name = cluster_name or f"test-{os.urandom(3).hex()}"
        self._startup_timeout = startup_timeout
        self._tmp_dir = Path(tempfile.mkdtemp(prefix="nats-cluster-"))
        self._finalizer = weakref.finalize(self, shutil.rmtree, self._tmp_dir, True)
        args = list(extra_args)
        config_text = None if config_file is None else Path(config_file).read_text()
        if not advertise:
            # A Go bool flag: "--no_advertise true" would end flag parsing.
            args.append("--no_advertise=true")
        ports, monitor_ports, cluster_ports = self._pick_ports(size)
        configs = [self._tmp_dir / f"member-{i}.conf" for i in range(size)]
        self._servers = [
            NatsServer(
                # With a configuration file, its jetstream block enables
                # JetStream (nats-server refuses -sd beside a store_dir).
                jetstream=config_text is None,
                port=ports[i],
                monitor_port=monitor_ports[i],
                server_name=f"{self._name}-{i}",
                cluster_name=self._name,
                cluster_port=cluster_ports[i],
                routes=self._routes_for(i, cluster_ports),
                extra_args=args if config_text is None else ["-c", str(configs[i]), *args],
                binary=binary,
                parent_dir=self._tmp_dir,
                startup_timeout=startup_timeout,
                stop_timeout=stop_timeout,
            )
            for i in range(size)
        ]
        if config_text is not None:
            for path, server in zip(configs, self._servers, strict=True):
                path.write_text(with_store_dir(config_text, server.store_dir))
        self._ports_pinned = False
        self._closed = False

    @property
    def servers(self) -> list[NatsServer]:
        """The members, index ``i`` being server ``<cluster_name>-i``."""
        return list(self._servers)

    @property
    def urls(self) -> list[str]:
        """Client URLs of all members (pass them all to the client)."""
        return [server.url for server in self._servers]

    @property
    def cluster_name(self) -> str:
        """The ``--cluster_name`` shared by the members."""
        return self._name

    def __len__(self) -> int:
        return len(self._servers)

    def start(self) -> None:
        """Start all members and wait for a JetStream metadata leader.

        If a port picked by the harness is taken before the server binds it,
        all members are moved to fresh ports and started again (up to 5 times).

        Raises:
            NatsServerError: If the cluster is not ready within ``startup_timeout``.

        """
        if self._closed:
            raise NatsServerError("cluster is closed")
        for attempt in range(1, PORT_ATTEMPTS + 1):
            deadline = time.monotonic() + self._startup_timeout
            for server in self._servers:
                if not server.is_running:
                    server._launch()
            try:
                for server in self._servers:
                    server._wait_ready(deadline)
                self._wait_meta_leader(deadline)
            except PortInUseError:
                if self._ports_pinned or attempt == PORT_ATTEMPTS:
                    raise
                # The routes of every member name every other member's port,
                # so all of them move to new ports.
                self._kill_all()
                logger.info("a cluster port was taken; retrying with new ports")
                self._move_to_new_ports()
                continue
            except BaseException:
                if not self._ports_pinned:
                    self._kill_all()  # a first start failed: leave nothing running
                raise
            self._ports_pinned = True
            for server in self._servers:
                server._port_pinned = True
            return

    def wait_for_meta_leader(self, timeout: float | None = None) -> str:
        """Wait until all running members name the same, running, meta leader.

        Useful after :meth:`kill` of the leader, to wait for the failover.

        Args:
            timeout: Seconds to wait; ``startup_timeout`` if None.

        Returns:
            The leader's server name.

        Raises:
            NatsServerError: On timeout.

        """
        return self._wait_meta_leader(
            time.monotonic() + (self._startup_timeout if timeout is None else timeout)
        )

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` (a crash)."""
        self._servers[index].kill()

    def stop_server(self, index: int) -> None:
        """Gracefully stop member ``index``."""
        self._servers[index].stop()

    def restart(self, index: int, *, graceful: bool = True) -> None:
        """Restart member ``index`` (same ports and store) and wait until it rejoined.

        Works on a killed or stopped member too (it is simply started).

        Args:
            index: Which member.
            graceful: SIGTERM if True, SIGKILL if False (when it is running).

        Raises:
            NatsServerError: If the member does not come back or no meta leader
                is agreed on within ``startup_timeout``.

        """
        server = self._servers[index]
        if graceful:
            server.stop()
        else:
            server.kill()
        server.start()
        self.wait_for_meta_leader()

    def stop(self) -> None:
        """Gracefully stop all members (in parallel); ports and stores are kept."""
        for server in self._servers:
            server._signal_stop()
        for server in self._servers:
            server.stop()

    def close(self) -> None:
        """Stop all members and delete all their files. Idempotent."""
        if self._closed:
            return
        try:
            self.stop()
        finally:
            self._closed = True
            for server in self._servers:
                server.close()
            self._finalizer()

    def __enter__(self) -> NatsCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals ----------------------------------------------------------

    @staticmethod
    def _pick_ports(size: int) -> tuple[list[int], list[int], list[int]]:
        """Client, monitoring and route ports for ``size`` members."""
        return (
            [free_port() for _ in range(size)],
            [free_port() for _ in range(size)],
            [free_port() for _ in range(size)],
        )

    @staticmethod
    def _routes_for(index: int, cluster_ports: Sequence[int]) -> list[str]:
        return [f"nats://127.0.0.1:{p}" for i, p in enumerate(cluster_ports) if i != index]

    def _move_to_new_ports(self) -> None:
        ports, monitor_ports, cluster_ports = self._pick_ports(len(self._servers))
        for i, server in enumerate(self._servers):
            server._reconfigure(
                port=ports[i],
                monitor_port=monitor_ports[i],
                cluster_port=cluster_ports[i],
                routes=self._routes_for(i, cluster_ports),
            )

    def _kill_all(self) -> None:
        for server in self._servers:
            server._kill_quietly()

    def _wait_meta_leader(self, deadline: float) -> str:
        """Wait until the live members agree on a live meta leader and are healthy.

        Paused members are left out: they cannot answer (nor vote).
        """
        while True:
            for server in self._servers:
                # A member can die after "Server is ready" (e.g. route port taken).
                server._raise_if_exited("a meta leader was elected")
            live = [s for s in self._servers if s.is_running and not s.is_paused]
            names = {s.server_name for s in live}
            views: dict[str, str | None] = {}
            problems: list[str] = []
            for server in live:
                name = server.server_name or server.url
                try:
                    views[name] = server.meta_leader()
                except NatsServerError as exc:
                    views[name] = None
                    problems.append(str(exc))
                    continue
                problem = server.healthz()
                if problem is not None:
                    problems.append(f"{name}: {problem}")
            leaders = set(views.values())
            if live and not problems and len(leaders) == 1:
                (leader,) = leaders
                if leader is not None and leader in names:
                    return leader
            if time.monotonic() >= deadline:
                tails = "\n".join(f"--- {s.server_name}:\n{s.log_tail(10)}" for s in live)
                raise NatsServerError(
                    f"no healthy JetStream meta leader agreed on: leaders seen {views}, "
                    f"problems {problems}; log tails:\n{tails}"
                )
            time.sleep(POLL_INTERVAL)
