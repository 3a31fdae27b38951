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

This module imports neither Celery nor Django: schedules are used through
``now()``, ``nowfun`` and ``remaining_estimate()`` only.
"""

from __future__ import annotations

import math
import uuid
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

#: Most slots scanned to find the latest overdue one when coalescing; beyond
#: this the scheduler coalesces in several steps (each one committed).
MAX_SCAN = 100_000

#: Cached "next slot" links kept per planner before the cache is reset.
_CACHE_LIMIT = 20_000


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
    """Plans the next tick of each entry from its last committed slot.

    After a gap (a failover, every replica down) several ticks of an entry may
    be overdue. Up to ``max_catch_up`` missed ticks are dispatched one by one,
    oldest first, each its own committed tick; with more overdue, all but the
    latest are skipped and the latest is dispatched (Celery's behaviour after
    downtime). The count is of slots, so it is the same on every replica up to
    the skew of their clocks.

    Args:
        max_catch_up: Missed ticks dispatched one by one (``0`` = coalesce).
        max_scan: Most slots scanned when coalescing.

    """

    def __init__(self, max_catch_up: int, max_scan: int = MAX_SCAN) -> None:
        self.max_catch_up = max_catch_up
        self.max_scan = max_scan
        # (entry, id(schedule), after) -> (schedule, next slot). The schedule
        # is kept so that its id cannot be reused by another object.
        self._links: dict[tuple[str, int, datetime], tuple[Any, datetime | None]] = {}

    def forget(self) -> None:
        """Drop every cached slot (for example when a new term begins)."""
        self._links.clear()

    def next_slot(
        self, name: str, schedule: Any, after: datetime, now: datetime
    ) -> datetime | None:
        """:func:`next_slot`, cached per entry and schedule object."""
        key = (name, id(schedule), after)
        cached = self._links.get(key)
        if cached is not None and cached[0] is schedule:
            return cached[1]
        slot = next_slot(schedule, after, now)
        if len(self._links) >= _CACHE_LIMIT:
            self._links.clear()
        self._links[key] = (schedule, slot)
        return slot

    def plan(self, name: str, schedule: Any, last: datetime, now: datetime) -> TickPlan:
        """The next tick of entry ``name`` whose last committed slot is ``last``.

        Args:
            name: The entry's name (cache key).
            schedule: Its schedule.
            last: Its last committed slot (or its anchor).
            now: The current time as the schedule sees it.

        Returns:
            The plan.

        """
        first = self.next_slot(name, schedule, last, now)
        if first is None:
            return TickPlan(None, False, math.inf)
        now_utc = to_utc(now)
        if first > now_utc:
            return TickPlan(first, False, (first - now_utc).total_seconds())
        # Overdue. Count the missed slots after this one, up to the limit.
        current = first
        missed = 0
        while missed <= self.max_catch_up:
            following = self.next_slot(name, schedule, current, now)
            if following is None or following > now_utc:
                return TickPlan(first, True, 0.0)
            current = following
            missed += 1
        # Too many: coalesce to the latest overdue slot (bounded scan).
        latest, skipped = current, missed
        for _ in range(self.max_scan):
            following = self.next_slot(name, schedule, latest, now)
            if following is None or following > now_utc:
                break
            latest = following
            skipped += 1
        return TickPlan(latest, True, 0.0, skipped=skipped)


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
