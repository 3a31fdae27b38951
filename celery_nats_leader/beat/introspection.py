"""What the leader scheduler reads from Celery's schedules.

Which schedules are Celery's own (their ``is_due()`` is plain "is a slot
due", so missed ticks can be caught up), the period of an interval
schedule, and the cron starting deadline; what Celery's hooks return is
checked here too. The parts that plan ticks (:mod:`.ticks`) import no
Celery: this module is where the scheduler looks inside Celery's types.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from celery.schedules import crontab
from celery.schedules import schedule as celery_schedule

from celery_nats_leader.beat.ticks import to_utc

__all__ = [
    "STANDARD_IS_DUE_MODULES",
    "cron_cutoff",
    "has_standard_is_due",
    "interval_of",
    "is_numeric",
]

#: Modules whose schedules' ``is_due()`` is plain "is a slot due" (see :func:`has_standard_is_due`).
STANDARD_IS_DUE_MODULES = frozenset({"celery.schedules", "django_celery_beat.tzcrontab"})


def has_standard_is_due(schedule: Any) -> bool:
    """Whether ``schedule``'s ``is_due()`` is Celery's own (interval, crontab, solar).

    A schedule that overrides ``is_due()`` (business days, holidays) refuses
    ticks on purpose: those must not be dispatched later as "missed".
    """
    module = getattr(type(schedule).is_due, "__module__", "")
    return module in STANDARD_IS_DUE_MODULES


def is_numeric(value: object) -> bool:
    """Whether ``value`` is a number of seconds (Celery's schedules may return ``None``)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def interval_of(schedule: Any) -> timedelta | None:
    """The period of a schedule whose slots are ``anchor + k * period``, else ``None``.

    That is Celery's plain ``schedule`` (and django-celery-beat's interval
    rows), not relative and with Celery's own ``remaining_estimate``; a
    subclass that computes its remaining time otherwise is planned by jumping.
    """
    if not isinstance(schedule, celery_schedule) or schedule.relative:
        return None
    if type(schedule).remaining_estimate is not celery_schedule.remaining_estimate:
        return None
    period = schedule.run_every
    return period if isinstance(period, timedelta) else None


def cron_cutoff(schedule: Any, now: datetime, deadline: float | None) -> datetime | None:
    """The oldest slot of a crontab still run under ``beat_cron_starting_deadline``.

    As Celery: a cron slot older than the deadline is not run. ``None`` when
    there is no deadline or the schedule is not a crontab.
    """
    if deadline is None or not isinstance(schedule, crontab):
        return None
    return to_utc(now) - timedelta(seconds=float(deadline))
