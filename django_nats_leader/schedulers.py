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

from datetime import datetime
from typing import Any

from django_celery_beat.schedulers import DatabaseScheduler

from celery_nats_leader.beat import LeaderSchedulerMixin
from celery_nats_leader.beat.schedule_store import EntryState
from celery_nats_leader.config.settings import LeaderSettings

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

    def prepare_entry(self, entry: Any, state: EntryState) -> None:
        """Give the ``ModelEntry`` its KV state before its ``is_due()`` is asked.

        django-celery-beat keeps a row's rules (``enabled``, ``start_time``,
        ``expires``, ``one_off``) in ``ModelEntry.is_due``, which reads
        ``last_run_at`` and the row's ``total_run_count``; both come from the
        last committed tick.

        Args:
            entry: The ``ModelEntry``.
            state: Its KV state.

        """
        super().prepare_entry(entry, state)
        model = getattr(entry, "model", None)
        if model is not None:
            model.total_run_count = state.runs

    def same_entry(self, old: Any, new: Any) -> bool:
        """The same ``ModelEntry`` object: django-celery-beat builds new ones on any row change.

        (``ScheduleEntry.__eq__`` ignores ``enabled``, ``start_time``, ... .)
        """
        return old is new

    def earliest_slot(self, entry: Any) -> datetime | None:
        """The row's ``start_time``: its schedule has no ticks before it.

        django-celery-beat backdates a never-run row with a ``start_time`` by
        30 years so that it runs at its start time; without this bound the
        ticks of those 30 years would be caught up.
        """
        model = getattr(entry, "model", None)
        start: datetime | None = getattr(model, "start_time", None)
        return start

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
