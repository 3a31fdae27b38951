"""Per-replica health for orchestrators: ``/healthz``, ``/readyz`` (and ``/metrics``).

One small HTTP server on a daemon thread, served on the metrics port of a
worker (``nats_leader_metrics_port``) or of any program hosting an
:class:`~celery_nats_leader.election.elector.Elector` (a beat process, a web app)::

    server = ProbeServer.for_elector(elector, registry=observer.registry)
    port = server.serve(9808)

* ``GET /healthz`` (liveness): the process answers and its election loop runs
  and responds (a callback scheduled on it ran within ``loop_timeout``).
  ``200`` when alive, ``503`` otherwise: a replica whose loop is stuck cannot
  renew, step down or release, so restarting it is right.
* ``GET /readyz`` (readiness): connected to NATS now and every role started
  (it campaigned at least once and no permanent error stopped it). ``503``
  while connecting, disconnected, or after a permanent error (missing bucket,
  permission denied). Leading is *not* required: followers are ready.
* ``GET /metrics``: Prometheus text, when a registry is given.

Bodies are JSON: ``{"status": "ok"|"fail", "checks": {...}}``. Neither probe
does a NATS round trip, so probing often costs nothing.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from celery_nats_leader.election import ElectionState

if TYPE_CHECKING:
    from celery_nats_leader.election.elector import Elector

logger = logging.getLogger(__name__)

#: Seconds the election loop has to run a probe's callback before the
#: replica counts as not alive. A loop this late is missing its renewals.
DEFAULT_LOOP_TIMEOUT_SECONDS = 2.0


@dataclass(frozen=True)
class ProbeResult:
    """The answer of one probe.

    Attributes:
        ok: Whether the probe passes (HTTP 200; otherwise 503).
        checks: What was checked, for people and scripts (the JSON body's ``checks``).

    """

    ok: bool
    checks: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The JSON body."""
        return {"status": "ok" if self.ok else "fail", "checks": self.checks}


def liveness(
    elector: Elector, *, loop_timeout: float = DEFAULT_LOOP_TIMEOUT_SECONDS
) -> ProbeResult:
    """Whether the elector's loop thread runs and answers within ``loop_timeout`` seconds."""
    checks: dict[str, Any] = {"process": True}
    if not elector.loop.is_running:
        checks["election_loop"] = False
        return ProbeResult(False, checks)
    ran = threading.Event()
    sent = time.monotonic()
    try:
        elector.loop.loop.call_soon_threadsafe(ran.set)
    except RuntimeError:  # stopped in between
        checks["election_loop"] = False
        return ProbeResult(False, checks)
    alive = ran.wait(loop_timeout)
    checks["election_loop"] = alive
    checks["loop_delay_seconds"] = round(time.monotonic() - sent, 4) if alive else None
    return ProbeResult(alive, checks)


def readiness(elector: Elector) -> ProbeResult:
    """Whether the elector is connected to NATS now and every role has started."""
    connected = elector.nats_connected
    roles: dict[str, Any] = {}
    ready = connected
    for handle in elector.roles:
        state = handle.state
        error = handle.error
        started = state not in (ElectionState.INIT, ElectionState.STOPPED) and error is None
        ready = ready and started
        roles[handle.role] = {
            "started": started,
            "state": state.value,
            "is_leader": handle.is_leader,
            "error": None if error is None else str(error),
        }
    return ProbeResult(ready, {"nats_connected": connected, "roles": roles})


class ProbeServer:
    """Serves ``/healthz``, ``/readyz`` and optionally ``/metrics`` on a daemon thread.

    Args:
        live: Computes the liveness answer.
        ready: Computes the readiness answer.
        registry: A ``prometheus_client`` registry to serve on ``/metrics``.

    """

    def __init__(
        self,
        *,
        live: Callable[[], ProbeResult],
        ready: Callable[[], ProbeResult],
        registry: Any = None,
    ) -> None:
        self._live = live
        self._ready = ready
        self._registry = registry
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def for_elector(
        cls,
        elector: Elector,
        *,
        registry: Any = None,
        loop_timeout: float = DEFAULT_LOOP_TIMEOUT_SECONDS,
    ) -> ProbeServer:
        """The probes of one elector (its loop, its connection, its roles)."""
        return cls(
            live=lambda: liveness(elector, loop_timeout=loop_timeout),
            ready=lambda: readiness(elector),
            registry=registry,
        )

    def serve(self, port: int, address: str = "0.0.0.0") -> int:
        """Start serving; returns the bound port (``0`` picks a free one).

        Raises:
            OSError: The port cannot be bound.

        """
        probes = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                probes._handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("probe %s: " + format, self.client_address[0], *args)

        server = ThreadingHTTPServer((address, port), Handler)
        server.daemon_threads = True
        thread = threading.Thread(
            target=server.serve_forever, name="nats-leader-probes", daemon=True
        )
        thread.start()
        self._server, self._thread = server, thread
        # A forked child (a prefork pool process, the beat of ``worker -B``)
        # gets a copy of the listening socket but not the thread serving it:
        # it closes its copy, so the port is only ever held by the process
        # that answers on it, and a close() in the child does not wait for
        # a thread that does not exist there.
        this = weakref.ref(self)

        def forget_in_child() -> None:
            probes = this()
            if probes is not None and probes._server is server:
                server.socket.close()
                probes._server = probes._thread = None

        os.register_at_fork(after_in_child=forget_in_child)
        bound = int(server.server_address[1])
        logger.info(
            "serving /healthz, /readyz%s on http://%s:%d",
            ", /metrics" if self._registry is not None else "",
            address,
            bound,
        )
        return bound

    def _handle(self, request: BaseHTTPRequestHandler) -> None:
        path = request.path.split("?", 1)[0]
        if path == "/metrics" and self._registry is not None:
            from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

            self._send(request, 200, generate_latest(self._registry), CONTENT_TYPE_LATEST)
            return
        probe = {"/healthz": self._live, "/readyz": self._ready}.get(path)
        if probe is None:
            self._send(request, 404, b'{"status": "not found"}\n', "application/json")
            return
        try:
            result = probe()
        except Exception as exc:  # a probe that raises is a failed probe, not a dead server
            logger.warning("probe %s failed: %s", path, exc)
            result = ProbeResult(False, {"error": str(exc)})
        body = json.dumps(result.to_dict(), sort_keys=True).encode() + b"\n"
        self._send(request, 200 if result.ok else 503, body, "application/json")

    @staticmethod
    def _send(request: BaseHTTPRequestHandler, code: int, body: bytes, content_type: str) -> None:
        request.send_response(code)
        request.send_header("Content-Type", content_type)
        request.send_header("Content-Length", str(len(body)))
        request.send_header("Cache-Control", "no-store")
        request.end_headers()
        request.wfile.write(body)

    def close(self) -> None:
        """Stop serving (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None


__all__ = ["DEFAULT_LOOP_TIMEOUT_SECONDS", "ProbeResult", "ProbeServer", "liveness", "readiness"]
