"""Prometheus metrics of the elections (extra ``metrics``: ``prometheus-client``).

:class:`PrometheusObserver` implements the core's
:class:`~celery_nats_leader.election.observer.ElectionObserver` hooks and keeps its
metrics in a registry of its own (so that several electors in one process, or
in one test run, do not collide). The worker bootstep serves it on
``nats_leader_metrics_port``; any other program can pass it to an
:class:`~celery_nats_leader.election.elector.Elector` and serve or merge its registry.

Metrics (labels ``bucket``, ``role`` and ``instance_id``; the prefix
``nats_leader`` is the ``namespace`` argument, ``nats_leader_metrics_namespace``
in the settings). The label is ``instance_id``, not ``instance``: Prometheus
sets ``instance`` to the scraped target's ``host:port`` and, with default
settings, renames a scraped ``instance`` label to ``exported_instance``.

* ``nats_leader_is_leader`` (gauge): 1 while this instance leads the role.
* ``nats_leader_has_leader`` (gauge): 1 while, as this replica sees it,
  somebody (itself or another) leads the role.
* ``nats_leader_leaderless_seconds`` (gauge): how long this replica has seen
  no leader of the role (0 while it sees one), on its own monotonic clock.
* ``nats_leader_ttl_seconds`` (gauge): the role's TTL (for alert rules).
* ``nats_leader_connected`` (gauge, label ``instance_id``): 1 while the NATS
  connection is up.
* ``nats_leader_once_guard_ready`` (gauge, labels ``bucket`` (the
  ``once_bucket``) and ``instance_id``): on workers whose tasks use the
  once-guard, 1 once its buckets proved usable, 0 while they are not
  (:mod:`~celery_nats_leader.worker.once_check`); absent elsewhere.
* ``nats_leader_failures_total`` (counter, plus ``kind``): every failure, by
  kind: ``renewal``, ``validation``, and each involuntary end of a term
  (``lease_expired``, ``disconnected``, ``revision_changed``, ``key_deleted``,
  ``token_mismatch``, ``health_check_failed``, ``fenced``, ``error``). An
  election stopped by a permanent error counts one ``error``, whether it led
  or not.
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
import time
from typing import TYPE_CHECKING, Any

from celery_nats_leader.core.constants import DEFAULT_METRICS_NAMESPACE
from celery_nats_leader.core.errors import ConfigError

try:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from prometheus_client.exposition import start_http_server
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ConfigError(
        "nats_leader_metrics_port needs prometheus-client: "
        "pip install 'celery-nats-leader[metrics]'"
    ) from exc

if TYPE_CHECKING:
    from celery_nats_leader.core.errors import ElectionError
    from celery_nats_leader.election import DemoteReason
    from celery_nats_leader.election.elector import Elector, RoleHandle
    from celery_nats_leader.term.record import LeaderRecord

logger = logging.getLogger(__name__)

#: Ends of a term that are failures (``nats_leader_failures_total{kind}``);
#: stop, resign and takeover are not.
FAILURE_REASONS = frozenset(
    {
        "lease_expired",
        "disconnected",
        "revision_changed",
        "key_deleted",
        "token_mismatch",
        "health_check_failed",
        "fenced",
        "error",
    }
)

#: Renewal duration buckets, seconds: a healthy loopback renewal is ~0.3 ms,
#: a cross-region one tens of milliseconds, anything near a second is trouble.
HEARTBEAT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class PrometheusObserver:
    """An :class:`~celery_nats_leader.election.observer.ElectionObserver` feeding Prometheus.

    Args:
        registry: Where to register the metrics; a new private registry by default.
        namespace: Metric name prefix (``<namespace>_is_leader``, ...).
        bucket: The ``bucket`` label of roles not registered with
            :meth:`watch_elector` (or :meth:`track`).

    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        namespace: str = DEFAULT_METRICS_NAMESPACE,
        *,
        bucket: str = "leaders",
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        #: The metric name prefix (beat's tick counters use the same).
        self.namespace = namespace
        self.default_bucket = bucket
        self._buckets: dict[str, str] = {}
        labels = ("bucket", "role", "instance_id")
        self.is_leader = Gauge(
            "is_leader",
            "1 while this instance leads the role, else 0.",
            labels,
            namespace=namespace,
            registry=self.registry,
        )
        self.election_error = Gauge(
            "election_error",
            "1 while the role's election is not running because of an error "
            "(missing bucket, permission denied, NATS unreachable), else 0.",
            labels,
            namespace=namespace,
            registry=self.registry,
        )
        self.once_guard_ready = Gauge(
            "once_guard_ready",
            "1 when this worker's once-guard buckets are usable, 0 while they are not "
            "(missing and not creatable, a permission missing, other settings): ticks "
            "and once-guarded tasks then never run on it.",
            ("bucket", "instance_id"),
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
        self.has_leader = Gauge(
            "has_leader",
            "1 while somebody leads the role, as this replica sees it.",
            labels,
            namespace=namespace,
            registry=self.registry,
        )
        self.leaderless_seconds = Gauge(
            "leaderless_seconds",
            "Seconds this replica has seen no leader of the role (0 while it sees one).",
            labels,
            namespace=namespace,
            registry=self.registry,
        )
        self.ttl_seconds = Gauge(
            "ttl_seconds",
            "The role's election TTL.",
            labels,
            namespace=namespace,
            registry=self.registry,
        )
        self.connected = Gauge(
            "connected",
            "1 while this replica's NATS connection is up.",
            ("instance_id",),
            namespace=namespace,
            registry=self.registry,
        )
        self.failures = Counter(
            "failures",
            "Failures by kind: renewal, validation, and involuntary ends of a term.",
            (*labels, "kind"),
            namespace=namespace,
            registry=self.registry,
        )
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def _labels(self, role: str, instance_id: str) -> tuple[str, str, str]:
        return (self._buckets.get(role, self.default_bucket), role, instance_id)

    def track(self, role: str, bucket: str) -> None:
        """Label ``role``'s metrics with ``bucket``."""
        self._buckets[role] = bucket

    def watch_elector(self, elector: Elector, instance: str) -> None:
        """Export what only the elector knows: connection, leaders seen, ends of terms.

        Call once, after every role was added (before or after start). The
        gauges are computed when scraped; the failure counts come from each
        role's demote and error callbacks.

        Args:
            elector: The elector whose roles to watch.
            instance: The ``instance_id`` label of the connection gauge.

        """
        self.connected.labels(instance).set_function(lambda: 1.0 if elector.nats_connected else 0.0)
        for handle in elector.roles:
            self._watch_role(handle)

    def _watch_role(self, handle: RoleHandle) -> None:
        role, config = handle.role, handle.config
        self.track(role, config.bucket)
        labels = self._labels(role, config.instance_id)
        self.ttl_seconds.labels(*labels).set(config.ttl)
        # Leaderless since (monotonic), or None while a leader is seen.
        since: list[float | None] = [time.monotonic()]

        def sees_leader() -> bool:
            return handle.is_leader or handle.leader_id is not None

        def on_change(record: LeaderRecord | None) -> None:
            if record is not None:
                since[0] = None
            elif since[0] is None and not handle.is_leader:
                since[0] = time.monotonic()

        def leaderless() -> float:
            if sees_leader():
                since[0] = None
                return 0.0
            started = since[0]
            if started is None:
                started = since[0] = time.monotonic()
            return round(time.monotonic() - started, 3)

        def on_demote(reason: DemoteReason) -> None:
            # An election stopped by an error demotes its leader with reason
            # "error" and then reports the error: on_error counts it, once,
            # and also for a follower.
            if reason.value in FAILURE_REASONS and reason.value != "error":
                self.failures.labels(*labels, reason.value).inc()

        def on_error(error: ElectionError) -> None:
            self.failures.labels(*labels, "error").inc()

        self.has_leader.labels(*labels).set_function(lambda: 1.0 if sees_leader() else 0.0)
        self.leaderless_seconds.labels(*labels).set_function(leaderless)
        handle.on_leader_change(on_change)
        handle.on_demote(on_demote)
        handle.on_error(on_error)

    # ------------------------------------------------------ observer hooks

    def state_changed(self, role: str, instance_id: str, old: str, new: str) -> None:
        """Count the transition and update the is-leader gauge."""
        self.transitions.labels(*self._labels(role, instance_id), old, new).inc()
        self.is_leader.labels(*self._labels(role, instance_id)).set(1 if new == "leader" else 0)

    def campaign(self, role: str, instance_id: str, won: bool) -> None:
        """Count a campaign."""
        self.campaigns.labels(*self._labels(role, instance_id), "won" if won else "lost").inc()

    def heartbeat(self, role: str, instance_id: str, seconds: float, ok: bool) -> None:
        """Record a renewal's duration, and count it if it failed."""
        labels = self._labels(role, instance_id)
        self.heartbeat_seconds.labels(*labels).observe(seconds)
        if not ok:
            self.heartbeat_failures.labels(*labels).inc()
            self.failures.labels(*labels, "renewal").inc()

    def validation(self, role: str, instance_id: str, ok: bool) -> None:
        """Count a token validation."""
        labels = self._labels(role, instance_id)
        self.validations.labels(*labels).inc()
        if not ok:
            self.validation_failures.labels(*labels).inc()
            self.failures.labels(*labels, "validation").inc()

    def set_election_error(self, role: str, instance_id: str, failing: bool) -> None:
        """Set the election-error gauge: 1 while the role's election cannot run."""
        self.election_error.labels(*self._labels(role, instance_id)).set(1 if failing else 0)

    def set_once_guard_ready(self, bucket: str, instance_id: str, ready: bool) -> None:
        """Set the once-guard gauge of a worker (``bucket`` is its ``once_bucket``)."""
        self.once_guard_ready.labels(bucket, instance_id).set(1 if ready else 0)

    def set_leader(self, role: str, instance_id: str, leading: bool) -> None:
        """Set the is-leader gauge (the lease can end without a state change)."""
        self.is_leader.labels(*self._labels(role, instance_id)).set(1 if leading else 0)

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
