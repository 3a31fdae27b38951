"""django-celery-beat's ``DatabaseScheduler``, dispatching only while it leads the beat role.

Run ``celery beat`` on every replica with::

    celery -A proj beat -S django_nats_leader
    # or CELERY_BEAT_SCHEDULER = "django_nats_leader.schedulers:LeaderDatabaseScheduler"

Periodic tasks are edited in the database (admin, fixtures, code) exactly as
with django-celery-beat; every replica reads them. Only the leader of the
beat role dispatches, with the fencing token checked and each tick committed
in KV first (see :mod:`celery_nats_leader.beat`). The rows' ``last_run_at``
and ``total_run_count`` are written by the leader only, for display; KV holds
the state that decides what runs.

A row's own rules still apply on the leader: ``enabled``, ``start_time``,
``expires`` (the row is disabled once expired) and ``one_off``.

Settings come from ``NATS_LEADER`` under the ``CELERY_NATS_LEADER_*``
overrides when this package's Django app is installed, else from the Celery
app's ``nats_leader_*`` keys.
"""

from __future__ import annotations

from typing import Any

from django_celery_beat.schedulers import DatabaseScheduler

from celery_nats_leader.beat import LeaderSchedulerMixin
from celery_nats_leader.beat.state import EntryState
from celery_nats_leader.settings import LeaderSettings

__all__ = ["LeaderDatabaseScheduler"]


class LeaderDatabaseScheduler(LeaderSchedulerMixin, DatabaseScheduler):  # type: ignore[misc]
    """django-celery-beat's database scheduler under leader election.

    Celery alias: ``django_nats_leader`` (``celery beat -S django_nats_leader``).
    """

    @classmethod
    def leader_settings(cls, app: Any) -> LeaderSettings:
        """``NATS_LEADER`` under the Celery overrides (the Django app's view), if available.

        Args:
            app: The Celery app.

        Returns:
            The settings.

        """
        try:
            from django_nats_leader.conf import leader_settings
        except ImportError:  # the Django app is optional for the scheduler
            return LeaderSettings.from_celery(app.conf)
        return leader_settings(app.conf)

    def dispatch_gate(self, entry: Any, state: EntryState) -> float | None:
        """Apply the row's rules (enabled, start_time, expires, one_off) to a due tick.

        django-celery-beat keeps these rules in ``ModelEntry.is_due``; it is
        asked with ``last_run_at`` at the last committed slot, for which the
        schedule part agrees that the tick is due, so only the row's rules
        can say no (and disable an expired or spent one-off row, as usual).

        Args:
            entry: The ``ModelEntry``.
            state: Its KV state.

        Returns:
            ``None`` to dispatch, else seconds before asking again.

        """
        model = getattr(entry, "model", None)
        if model is None:
            return None
        entry.last_run_at = state.slot.astimezone(self.app.timezone)
        entry.total_run_count = model.total_run_count = state.runs
        due, next_check = entry.is_due()
        if due:
            return None
        return float(next_check)

    def record_run(self, entry: Any, state: EntryState) -> None:
        """Mirror the dispatch into the row (saved at the next sync, by the leader only)."""
        super().record_run(entry, state)
        model = getattr(entry, "model", None)
        if model is None:
            return
        model.last_run_at = entry.last_run_at
        model.total_run_count = state.runs
        # As django-celery-beat's own reserve(): a run is not a schedule change.
        model.no_changes = True
        self._dirty.add(entry.name)
