"""Tick identity for the leader beat scheduler: every run has a scheduled time.

A *tick* of a periodic entry is identified by its **slot**: the time the
schedule says it is due, derived from the schedule alone, never from the
clock of whoever dispatches it. The n-th slot of an entry is computed from
the (n-1)-th: ``slot(n) = next_slot(schedule, slot(n-1))``, starting from an
anchor stored with the entry's state in KV. So:

* an interval schedule's slots are ``anchor + k * run_every``;
* a crontab's slots are its cron slots (``12:00``, ``12:01``, ...);
* any Celery schedule that implements ``remaining_estimate`` works the same
  way (solar, django-celery-beat's clocked and timezone-aware crontab).

A scheduler compares a slot with *its own* clock only to decide *when* to
dispatch it; two schedulers whose clocks disagree compute the same slots, so
skew can shift when a tick fires but cannot make the same tick fire twice
(the KV commit is keyed by slot) or skip one (the next slot is always the one
after the last committed slot, however late).

*Whether* an entry is due is its ``is_due()``'s answer (the Celery mixin asks
it); :class:`TickPlanner` then names the due tick and applies catch-up, in a
bounded number of ``remaining_estimate()`` calls whatever the gap.

Catch-up is for failovers, not for outages: missed ticks are dispatched one by
one only while the oldest of them is inside the *catch-up window* (by default
``2 x ttl + 5 s``, see :meth:`~celery_nats_leader.config.settings.LeaderSettings.catch_up_window`),
which every tick missed during a failover is; a longer gap (every replica
down, a migration) coalesces into one run, as with Celery's own scheduler.

This module imports neither Celery nor Django: schedules are used through
``now()``, ``nowfun`` and ``remaining_estimate()`` only.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

__all__ = [
    "TICK_ID_NAMESPACE",
    "TickPlan",
    "TickPlanner",
    "next_slot",
    "parse_slot",
    "slot_text",
    "tick_task_id",
    "to_utc",
]

UTC = timezone.utc

#: The resolution of the search for the latest overdue slot of a schedule
#: whose slots are not evenly spaced (crontab, solar): slots are stored with
#: microseconds.
_RESOLUTION = timedelta(microseconds=1)


def to_utc(moment: datetime) -> datetime:
    """Return ``moment`` as an aware UTC datetime (naive values are taken as UTC).

    Args:
        moment: A datetime.

    Returns:
        The same instant in UTC.

    """
    if moment.tzinfo is None or moment.tzinfo.utcoffset(moment) is None:
        return moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC)


def next_slot(schedule: Any, after: datetime, now: datetime) -> datetime | None:
    """The first slot of ``schedule`` strictly after ``after``.

    Uses the schedule's own ``remaining_estimate(after)``, evaluated against a
    frozen ``now`` (the schedule's ``nowfun`` is swapped for the call), so the
    result is ``now + (end - now) = end`` exactly: it does not depend on when
    or where it is computed.

    Args:
        schedule: A Celery schedule (``schedule``, ``crontab``, ``solar``, ...).
        after: The previous slot (aware).
        now: The current time as the schedule sees it (``schedule.now()``).

    Returns:
        The next slot in UTC, or ``None`` when the schedule has no slot after
        ``after`` (a one-off ``clocked`` schedule that already ran).

    Raises:
        Exception: Whatever the schedule raises (a custom schedule without
            ``remaining_estimate`` raises ``NotImplementedError``).

    """
    local_now = now if now.tzinfo is not None else now.replace(tzinfo=UTC)
    local_after = to_utc(after).astimezone(local_now.tzinfo)
    saved = schedule.nowfun
    schedule.nowfun = lambda: local_now
    try:
        remaining: timedelta = schedule.remaining_estimate(local_after)
    finally:
        schedule.nowfun = saved
    slot = to_utc(local_now) + remaining
    if slot <= to_utc(after):
        return None
    return slot


@dataclass(frozen=True)
class TickPlan:
    """What an entry should do now.

    Attributes:
        slot: The tick to dispatch next, or ``None`` when the schedule has no
            further tick.
        due: Whether ``slot`` is due now.
        wait: Seconds until ``slot`` is due (``0`` when due, ``inf`` when none).
        skipped: Overdue ticks jumped over to reach ``slot`` (coalescing).

    """

    slot: datetime | None
    due: bool
    wait: float
    skipped: int = 0


class TickPlanner:
    """Plans the next tick of each entry from its last committed slot, in O(1) slots.

    After a gap (a failover, every replica down) several ticks of an entry may
    be overdue. When the oldest of them is at most ``window`` old and there
    are at most ``max_catch_up + 1`` of them, they are dispatched one by one,
    oldest first, each its own committed tick (the ticks a failover missed).
    Otherwise all but the latest are skipped and the latest is dispatched:
    one run, Celery's behaviour after downtime. Both tests are of slots
    against this scheduler's clock, so they agree on every replica up to the
    skew of their clocks.

    Whatever the gap, a plan costs a bounded number of ``remaining_estimate()``
    calls: an interval schedule's latest overdue slot is computed
    arithmetically (``last + k * run_every``), any other schedule's by
    jumping (at most ``max_catch_up + 2`` steps, then a binary search on the
    time axis), never by walking slot after slot.

    Args:
        max_catch_up: Missed ticks dispatched one by one (``0`` = coalesce).
        window: Overdue ticks are caught up only while the oldest is at most
            this old; ``None`` = whatever their age (the count alone limits).
        interval_of: The period of a schedule whose slots are
            ``anchor + k * period`` (Celery's plain ``schedule``), else
            ``None``. The Celery side knows which schedules those are; this
            module imports no Celery.

    """

    def __init__(
        self,
        max_catch_up: int,
        interval_of: Callable[[Any], timedelta | None] = lambda schedule: None,
        window: timedelta | None = None,
    ) -> None:
        self.max_catch_up = max_catch_up
        self.interval_of = interval_of
        self.window = window

    def plan(
        self,
        name: str,
        schedule: Any,
        last: datetime,
        now: datetime,
        *,
        not_before: datetime | None = None,
        max_catch_up: int | None = None,
    ) -> TickPlan:
        """The next tick of entry ``name`` whose last committed slot is ``last``.

        Args:
            name: The entry's name (for log lines).
            schedule: Its schedule.
            last: Its last committed slot (or its anchor).
            now: The current time as the schedule sees it.
            not_before: Slots before this time do not exist (a start time, a
                starting deadline): they are neither dispatched nor counted.
            max_catch_up: Overrides the planner's limit for this entry.

        Returns:
            The plan.

        Raises:
            Exception: Whatever the schedule raises (a custom schedule without
                ``remaining_estimate`` raises ``NotImplementedError``).

        """
        limit = self.max_catch_up if max_catch_up is None else max_catch_up
        now_utc = to_utc(now)
        after = to_utc(last)
        period = self.interval_of(schedule)
        if period is not None and period <= timedelta(0):
            period = None
        if not_before is not None:
            after = self._skip_before(schedule, after, to_utc(not_before), period)
        first = self._next(schedule, after, now, period)
        if first is None:
            return TickPlan(None, False, math.inf)
        if first > now_utc:
            return TickPlan(first, False, (first - now_utc).total_seconds())
        if self.window is not None and now_utc - first > self.window:
            # Older than any failover leaves a tick: an outage (every
            # replica down, a migration). One run, as Celery after downtime.
            limit = 0
        if period is not None:
            overdue = (now_utc - first) // period + 1
            if overdue - 1 <= limit:
                return TickPlan(first, True, 0.0)
            return TickPlan(first + (overdue - 1) * period, True, 0.0, skipped=overdue - 1)
        # Jump forward up to the limit: few enough overdue slots are caught up.
        current, missed = first, 0
        while missed <= limit:
            following = next_slot(schedule, current, now)
            if following is None or following > now_utc:
                return TickPlan(first, True, 0.0)
            current = following
            missed += 1
        # Too many: the latest overdue slot, by a binary search on the time
        # axis. ``skipped`` is then a lower bound (the slots jumped over).
        latest = self._latest(schedule, current, now)
        return TickPlan(latest, True, 0.0, skipped=missed)

    @staticmethod
    def _next(
        schedule: Any, after: datetime, now: datetime, period: timedelta | None
    ) -> datetime | None:
        if period is not None:
            return after + period
        return next_slot(schedule, after, now)

    @staticmethod
    def _skip_before(
        schedule: Any, after: datetime, not_before: datetime, period: timedelta | None
    ) -> datetime:
        """Move ``after`` so that the next slot is the first one at or after ``not_before``."""
        if period is not None:
            if after + period >= not_before:
                return after
            # The chain keeps its phase: the first slot >= not_before.
            steps = -(-(not_before - after) // period)  # ceil
            return after + (steps - 1) * period
        return max(after, not_before - _RESOLUTION)

    @staticmethod
    def _latest(schedule: Any, slot: datetime, now: datetime) -> datetime:
        """The latest slot at or before ``now``, given one (``slot``) at or before it."""
        now_utc = to_utc(now)
        # Invariant: next_slot(low) <= now < next_slot(high) (or None).
        low, high = slot, now_utc
        found = next_slot(schedule, low, now)
        if found is None or found > now_utc:
            return slot
        while high - low > _RESOLUTION:
            middle = low + (high - low) / 2
            candidate = next_slot(schedule, middle, now)
            if candidate is not None and candidate <= now_utc:
                low, found = middle, candidate
            else:
                high = middle
        return found


def slot_text(slot: datetime) -> str:
    """The slot as stored and sent: ISO 8601 in UTC with microseconds.

    Args:
        slot: An aware datetime.

    Returns:
        For example ``"2024-05-01T12:00:00.000000+00:00"``.

    """
    return to_utc(slot).isoformat(timespec="microseconds")


def parse_slot(text: str) -> datetime:
    """Parse :func:`slot_text`'s output.

    Raises:
        ValueError: If ``text`` is not an ISO 8601 datetime.

    """
    return to_utc(datetime.fromisoformat(text))


#: Namespace of the task ids derived from ticks (uuid5).
TICK_ID_NAMESPACE = uuid.UUID("5d1f9b1e-2c4a-4e0b-9a57-6b3c1f0d8e42")


def tick_task_id(bucket: str, role: str, entry: str, tick: str) -> str:
    """The task id of a tick: the same for every scheduler that could send it.

    Args:
        bucket: The state bucket.
        role: The beat role.
        entry: The entry's name.
        tick: The tick's slot as sent in the ``nats_leader_tick`` header.

    Returns:
        A UUID string (uuid5), usable as an idempotency key downstream.

    """
    return str(uuid.uuid5(TICK_ID_NAMESPACE, f"{bucket}/{role}/{entry}/{tick}"))
