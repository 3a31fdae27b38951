"""Prometheus metrics of the elections (extra ``metrics``: ``prometheus-client``).

:class:`PrometheusObserver` implements the core's
:class:`~celery_nats_leader.election.observer.ElectionObserver` hooks and keeps its
metrics in a registry of its own (so that several electors in one process, or
in one test run, do not collide). The worker bootstep serves it on
``nats_leader_metrics_port``; any other program can pass it to an
:class:`~celery_nats_leader.elector.Elector` and serve or merge its registry.

Metrics (labels ``role`` and ``instance``):

* ``nats_leader_is_leader`` (gauge): 1 while this instance leads the role.
* ``nats_leader_transitions_total`` (counter, plus ``from_state``/``to_state``):
  state changes (``follower -> candidate``, ``candidate -> leader``, ...).
* ``nats_leader_campaigns_total`` (counter, plus ``outcome`` = won/lost).
* ``nats_leader_heartbeat_seconds`` (histogram): duration of each renewal.
* ``nats_leader_heartbeat_failures_total`` (counter): renewals that failed.
* ``nats_leader_token_validations_total`` and
  ``nats_leader_token_validation_failures_total`` (counters).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery_nats_leader.errors import ConfigError

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.exposition import start_http_server
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ConfigError(
        "nats_leader_metrics_port needs prometheus-client: "
        "pip install 'celery-nats-leader[metrics]'"
    ) from exc

logger = logging.getLogger(__name__)

#: Renewal duration buckets, seconds: a healthy loopback renewal is ~0.3 ms,
#: a cross-region one tens of milliseconds, anything near a second is trouble.
HEARTBEAT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class PrometheusObserver:
    """An :class:`~celery_nats_leader.election.observer.ElectionObserver` feeding Prometheus.

    Args:
        registry: Where to register the metrics; a new private registry by default.
        namespace: Metric name prefix.

    """

    def __init__(
        self, registry: CollectorRegistry | None = None, namespace: str = "nats_leader"
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ("role", "instance")
        self.is_leader = Gauge(
            "is_leader",
            "1 while this instance leads the role, else 0.",
            labels,
            namespace=namespace,
            registry=self.registry,
        )
        self.transitions = Counter(
            "transitions",
            "Election state changes.",
            (*labels, "from_state", "to_state"),
            namespace=namespace,
            registry=self.registry,
        )
        self.campaigns = Counter(
            "campaigns",
            "Campaigns (atomic creates of the role's key), by outcome.",
            (*labels, "outcome"),
            namespace=namespace,
            registry=self.registry,
        )
        self.heartbeat_seconds = Histogram(
            "heartbeat_seconds",
            "Duration of the leader's renewals.",
            labels,
            namespace=namespace,
            registry=self.registry,
            buckets=HEARTBEAT_BUCKETS,
        )
        self.heartbeat_failures = Counter(
            "heartbeat_failures",
            "Renewals that failed or timed out.",
            labels,
            namespace=namespace,
            registry=self.registry,
        )
        self.validations = Counter(
            "token_validations",
            "Fencing token validations against KV.",
            labels,
            namespace=namespace,
            registry=self.registry,
        )
        self.validation_failures = Counter(
            "token_validation_failures",
            "Fencing token validations that found the term over.",
            labels,
            namespace=namespace,
            registry=self.registry,
        )
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------ observer hooks

    def state_changed(self, role: str, instance_id: str, old: str, new: str) -> None:
        """Count the transition and update the is-leader gauge."""
        self.transitions.labels(role, instance_id, old, new).inc()
        self.is_leader.labels(role, instance_id).set(1 if new == "leader" else 0)

    def campaign(self, role: str, instance_id: str, won: bool) -> None:
        """Count a campaign."""
        self.campaigns.labels(role, instance_id, "won" if won else "lost").inc()

    def heartbeat(self, role: str, instance_id: str, seconds: float, ok: bool) -> None:
        """Record a renewal's duration, and count it if it failed."""
        self.heartbeat_seconds.labels(role, instance_id).observe(seconds)
        if not ok:
            self.heartbeat_failures.labels(role, instance_id).inc()

    def validation(self, role: str, instance_id: str, ok: bool) -> None:
        """Count a token validation."""
        self.validations.labels(role, instance_id).inc()
        if not ok:
            self.validation_failures.labels(role, instance_id).inc()

    def set_leader(self, role: str, instance_id: str, leading: bool) -> None:
        """Set the is-leader gauge (the lease can end without a state change)."""
        self.is_leader.labels(role, instance_id).set(1 if leading else 0)

    # -------------------------------------------------------------- serving

    def serve(self, port: int, address: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` over HTTP on a daemon thread.

        Args:
            port: TCP port; 0 picks a free one.
            address: Address to listen on.

        Returns:
            The port actually bound.

        """
        server, thread = start_http_server(port, addr=address, registry=self.registry)
        self._server, self._thread = server, thread
        bound = int(server.server_port)
        logger.info("serving leader election metrics on http://%s:%d/metrics", address, bound)
        return bound

    def close(self) -> None:
        """Stop serving (idempotent)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
