"""Per-entry tick counters of the leader scheduler, optionally exported to Prometheus.

Every outcome of a tick is counted per entry, so that the singleton beat can
be alerted on (a tick lost, sends failing, ticks skipped by catch-up):

* ``dispatched``: committed and sent;
* ``reverted``: committed, not sent, commit undone or left pending (dispatched
  later);
* ``resent``: a tick left pending by another scheduler (or by this one before
  a failed undo) sent again by the outbox, under the same task id;
* ``lost``: committed and not sent, for good (the message can never be built);
* ``skipped``: overdue ticks jumped over by catch-up (``beat_max_catch_up``);
* ``send_failed``: sends that raised (each attempt).

With ``nats_leader_metrics_port`` (a standalone beat) or
``nats_leader_beat_metrics_port`` (also ``celery worker -B``) the counters are
served with the election metrics as
``nats_leader_beat_ticks_total{role, instance_id, entry, outcome}``
(the prefix is ``nats_leader_metrics_namespace``).
This module imports neither Celery nor Django; ``prometheus-client`` only
when :meth:`TickMetrics.export_to` is called.
"""

from __future__ import annotations

import threading
from typing import Any

from celery_nats_leader.core.constants import DEFAULT_METRICS_NAMESPACE

__all__ = ["OUTCOMES", "TickMetrics"]

#: The outcomes counted, in display order.
OUTCOMES = ("dispatched", "reverted", "resent", "lost", "skipped", "send_failed")


class TickMetrics:
    """Tick counters of one scheduler, by entry and outcome.

    Args:
        role: The beat role (a label).
        instance: This scheduler's instance id (a label).

    """

    def __init__(self, role: str, instance: str) -> None:
        self.role = role
        self.instance = instance
        self._counts: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()
        self._counter: Any = None

    def add(self, entry: str, outcome: str, amount: int = 1) -> None:
        """Count ``amount`` ticks of ``entry`` with ``outcome`` (one of :data:`OUTCOMES`)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown tick outcome {outcome!r}")
        if amount <= 0:
            return
        with self._lock:
            counts = self._counts.setdefault(entry, dict.fromkeys(OUTCOMES, 0))
            counts[outcome] += amount
        if self._counter is not None:
            self._counter.labels(self.role, self.instance, entry, outcome).inc(amount)

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Every entry's counts so far: ``{entry: {outcome: count}}``."""
        with self._lock:
            return {entry: dict(counts) for entry, counts in self._counts.items()}

    def export_to(self, registry: Any, namespace: str = DEFAULT_METRICS_NAMESPACE) -> None:
        """Export the counters into a Prometheus registry (the election metrics' one).

        Args:
            registry: A ``prometheus_client.CollectorRegistry``.
            namespace: Metric name prefix.

        """
        from prometheus_client import Counter

        self._counter = Counter(
            "beat_ticks",
            "Ticks of the leader beat scheduler, by entry and outcome.",
            ("role", "instance_id", "entry", "outcome"),
            namespace=namespace,
            registry=registry,
        )
        for entry, counts in self.snapshot().items():
            for outcome, count in counts.items():
                if count:
                    self._counter.labels(self.role, self.instance, entry, outcome).inc(count)
