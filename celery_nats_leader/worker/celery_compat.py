"""What differs between the Celery versions the package supports (5.3 to 5.7), in one place.

Every difference is detected by the feature, never by the version string: a
probe asks the installed Celery once and the answer is cached. The callers
(the beat scheduler, the worker's leader-queue consumer) ask this module and
keep one code path each.

* :func:`crontab_uses_its_timezone` / :func:`crontab_catches_up_across_days`:
  before Celery 5.7, ``crontab.remaining_delta()`` computes in the frame of
  the ``last_run_at`` it is given (a ``crontab(hour=4)`` of an app in
  ``Europe/Paris`` fed a UTC time answers 04:00 UTC), and it does not return
  a slot of the hour of ``last_run_at`` unless ``now`` is on the same day (so
  missed minutes of an old day are jumped over). :func:`slot_schedule`
  gives such a crontab Celery 5.7's arithmetic, so the slots the scheduler
  dispatches are the same on every supported Celery.
* :func:`solar_measures_in_utc`: before Celery 5.7, ``solar.remaining_estimate()``
  subtracts the next event and ``now`` as wall-clock times when both are in
  the app's timezone (Python's arithmetic between datetimes of one zone), so
  across a DST change it is an hour off: a sunset of an app in
  ``Europe/Paris`` asked in October from a March ``last_run_at`` comes out
  at 16:39 UTC instead of 17:39 UTC. :func:`slot_schedule` gives such a
  solar a ``now`` in UTC (:class:`SolarSlots`), so its slots are the events
  ephem computes, as on Celery 5.7.
* :func:`crontab_deadline_counts_the_due_slot` / :func:`deadline_left_to_the_slots`:
  before Celery 5.7, with ``beat_cron_starting_deadline`` set, a crontab
  slot missed past the deadline makes ``crontab.is_due()`` refuse the next
  slot too, when it comes (03:00 is refused at 03:00 after 02:00 was
  missed). The beat scheduler applies the deadline to the slots itself, so
  on such a Celery it asks ``is_due()`` without it.
* :func:`hub_wakes_on_call_soon`: before kombu 5.7 the worker's event loop
  (the hub) does not wake when another thread calls ``hub.call_soon()``:
  the callback waits for the poller's next timeout, seconds later. Acks of
  the threads pool and the leader-queue change after a promotion (asked
  from the elector's thread) come that late; kombu 5.7's hub has a waker
  socket, the same is added here to older hubs.
* :func:`beat_nodename`: ``celery.beat.beat_nodename`` exists from 5.7 on.
* :func:`replaced_task_nesting`: ``Task.replace()`` marks the replacement
  with ``replaced_task_nesting``; Celery 5.3 does not put it in the task
  message's headers (its ``send_task`` passes the unknown option on as a
  message property), so the worker's request has it under ``properties``.
* :func:`immediate_acks`: before Celery 5.7 a worker without an event loop
  (the solo and threads pools, transports without async support) defers
  every ack to the top of its next loop iteration, after a
  ``drain_events(timeout=2.0)``: with a prefetch of one, tasks start about
  two seconds apart, and acks still pending at a warm shutdown are dropped
  (the messages are delivered again). Celery 5.7's ``call_soon_ack`` sends
  them at once; the same is done here for older consumers.
* :func:`hub_polls_at_once_when_ready`: not a version difference but a
  delay of kombu's hub (5.3 to 5.7): a callback queued by another one waits
  for the poll that follows, up to 10 s; a solo task's ack is such a
  callback, and with one message prefetched the next task waits for it.
  Made to poll at once while callbacks are ready, for the solo workers the
  package runs in.
* :func:`pool_shutdown_tells_every_process`: not a version difference but a
  race in billiard's threaded pool (4.3.2 and before) that can keep a
  prefork worker without an event loop from ever finishing its warm
  shutdown; worked around for the workers the package runs in.

This module imports Celery: only the Celery integration (``beat``,
``worker``) imports it, never the core.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

from celery import Celery
from celery.schedules import crontab, solar

__all__ = [
    "CrontabSlots",
    "SolarSlots",
    "beat_nodename",
    "crontab_catches_up_across_days",
    "crontab_deadline_counts_the_due_slot",
    "crontab_uses_its_timezone",
    "deadline_left_to_the_slots",
    "hub_polls_at_once_when_ready",
    "hub_wakes_on_call_soon",
    "immediate_acks",
    "pool_shutdown_tells_every_process",
    "replaced_task_nesting",
    "slot_schedule",
    "slots_overrule_is_due",
    "solar_measures_in_utc",
]

UTC = timezone.utc

logger = logging.getLogger(__name__)


def _probe_delta(cron: Any, last_run_at: datetime, now: datetime, tz: Any) -> tuple[datetime, Any]:
    """``cron.remaining_delta(last_run_at)`` with ``now`` frozen and ``tz`` as its timezone."""
    # Instance attributes shadow the schedule's cached ``tz``/``utc_enabled``
    # properties, so the probe needs no Celery app.
    cron.tz = tz
    cron.utc_enabled = True
    cron.nowfun = lambda: now
    start, delta, _ = cron.remaining_delta(last_run_at)
    return start, delta


@functools.cache
def crontab_uses_its_timezone() -> bool:
    """Whether ``crontab`` matches its fields in its own timezone whatever ``last_run_at``'s.

    True from Celery 5.7 on. Before, the fields are matched in the frame of
    the ``last_run_at`` passed in.

    Returns:
        The installed Celery's behaviour.

    """
    at = datetime(2024, 5, 1, 1, 0, tzinfo=UTC)
    start, _ = _probe_delta(crontab(minute=0, hour=4), at, at, ZoneInfo("Europe/Paris"))
    # 01:00 UTC is 03:00 in Paris in May.
    return start.utcoffset() == timedelta(hours=2)


@functools.cache
def crontab_catches_up_across_days() -> bool:
    """Whether ``crontab`` gives the next slot in ``last_run_at``'s hour when ``now`` is days later.

    True from Celery 5.7 on. Before, ``remaining_delta()`` only looks for a
    later minute of ``last_run_at``'s hour if ``now`` is on the same date,
    so an every-minute crontab last run at 01:00 on a past day answers
    02:00, not 01:01.

    Returns:
        The installed Celery's behaviour.

    """
    at = datetime(2024, 5, 1, 1, 0, tzinfo=UTC)
    start, delta = _probe_delta(crontab(), at, at + timedelta(days=2), UTC)
    return bool(start + delta == at + timedelta(minutes=1))


#: Paris (for the probes): a zone with a DST change, and a sky ephem knows.
_PARIS = (48.85, 2.35)


@functools.cache
def solar_measures_in_utc() -> bool:
    """Whether ``solar.remaining_estimate()`` measures in absolute time across a DST change.

    True from Celery 5.7 on. Before, the next event is converted to the
    schedule's timezone and subtracted from a ``now`` in that timezone as
    wall-clock times: an hour off when one is in summer time and the other
    not.

    Returns:
        The installed Celery's behaviour.

    """
    paris = ZoneInfo("Europe/Paris")
    winter = datetime(2024, 1, 10, 12, 0, tzinfo=UTC)
    summer = datetime(2024, 7, 1, 12, 0, tzinfo=UTC)
    answers = []
    for frame in (paris, UTC):
        sunset = solar("sunset", *_PARIS)
        # An instance attribute shadows the cached ``tz`` property: no app needed.
        sunset.tz = paris
        sunset.nowfun = lambda frame=frame: summer.astimezone(frame)
        answers.append(sunset.remaining_estimate(winter))
    # The same instants asked with ``now`` in Paris and in UTC: the same answer
    # unless the subtraction is on the wall clock.
    return bool(answers[0] == answers[1])


@functools.cache
def crontab_deadline_counts_the_due_slot() -> bool:
    """Whether ``crontab.is_due()`` runs a slot that is due now after an earlier one was missed.

    With ``beat_cron_starting_deadline`` set: true from Celery 5.7 on (any
    slot within the deadline counts); before, the slot missed is measured,
    so the one due now is refused as well.

    Returns:
        The installed Celery's behaviour.

    """
    app = Celery("nats-leader-probe", set_as_current=False)
    app.conf.beat_cron_starting_deadline = 120
    app.conf.timezone = "UTC"
    three = datetime(2024, 3, 4, 3, 0, tzinfo=UTC)
    hourly = crontab(minute=0, app=app, nowfun=lambda: three)
    # Last run 01:00, 02:00 missed (an hour old), 03:00 due right now.
    return bool(hourly.is_due(three - timedelta(hours=2))[0])


@contextlib.contextmanager
def deadline_left_to_the_slots(schedule: Any) -> Iterator[None]:
    """Ask Celery's own ``crontab.is_due()`` without ``beat_cron_starting_deadline`` inside.

    Only on a Celery whose crontab refuses the slot due now after a missed
    one (see :func:`crontab_deadline_counts_the_due_slot`), and only for a
    schedule whose ``is_due()`` is Celery's crontab's: the caller applies
    the deadline to the slots (the beat scheduler does, as Celery 5.7).

    Args:
        schedule: An entry's schedule.

    """
    if (
        not isinstance(schedule, crontab)
        or type(schedule).is_due is not crontab.is_due
        or crontab_deadline_counts_the_due_slot()
    ):
        yield
        return
    conf = schedule.app.conf
    deadline = conf.beat_cron_starting_deadline
    if deadline is None:
        yield
        return
    conf.beat_cron_starting_deadline = None
    try:
        yield
    finally:
        conf.beat_cron_starting_deadline = deadline


class CrontabSlots:
    """A crontab's slots computed as Celery 5.7 computes them, on any Celery 5.3+.

    It offers what :func:`celery_nats_leader.beat.ticks.next_slot` uses of a
    schedule (``nowfun``, ``now()``, ``remaining_estimate()``): the crontab's
    ``remaining_delta()`` is asked in the crontab's timezone (:meth:`frame`), with ``now``
    frozen at ``last_run_at`` (before 5.7 ``now`` only decides whether the
    rest of ``last_run_at``'s hour counts), and the slot is
    ``last_run_at + delta`` in the crontab's timezone, converted to UTC.

    Args:
        cron: The crontab (or a subclass, e.g. django-celery-beat's
            ``TzAwareCrontab``).

    """

    def __init__(self, cron: Any) -> None:
        self.cron = cron
        self.nowfun: Callable[[], datetime] | None = None

    def now(self) -> datetime:
        """The current time as the crontab sees it (or as ``nowfun`` says)."""
        moment: datetime = (self.nowfun or self.cron.now)()
        return moment

    def frame(self) -> Any:
        """The timezone the crontab's fields are matched in.

        The zone of the crontab's own clock: ``app.now()`` is in the app's
        timezone, django-celery-beat's ``TzAwareCrontab`` reads its row's
        zone. (Celery 5.7 takes ``crontab.tz``; before, a crontab unpickled
        from beat's shelve is bound to the current app, not beat's, so its
        ``tz`` cannot be trusted.)
        """
        zone = self.cron.now().tzinfo
        return zone if zone is not None else self.cron.tz

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        """Time from ``now()`` to the first slot after ``last_run_at``.

        Args:
            last_run_at: The previous slot.

        Returns:
            The remaining time (negative when the slot is past).

        """
        cron = self.cron
        last: datetime = cron.maybe_make_aware(last_run_at).astimezone(self.frame())
        now = self.now()
        saved = cron.nowfun
        cron.nowfun = lambda: last
        try:
            _, delta, _ = cron.remaining_delta(last)
        finally:
            cron.nowfun = saved
        end: datetime = last + delta
        # In UTC: arithmetic between datetimes of one zone is wall-clock time.
        current: datetime = cron.maybe_make_aware(now)
        return end.astimezone(UTC) - current.astimezone(UTC)


class SolarSlots:
    """A solar schedule's slots measured in absolute time, on any Celery 5.3+.

    It offers what :func:`celery_nats_leader.beat.ticks.next_slot` uses of a
    schedule (``nowfun``, ``now()``, ``remaining_estimate()``): the solar's
    own ``remaining_estimate()``, asked with ``now`` in UTC, so that the
    next event (which Celery converts to the app's timezone) and ``now`` are
    in different zones and Python subtracts them as instants. The event is
    ephem's either way; only the subtraction changes.

    Args:
        sun: The solar schedule.

    """

    def __init__(self, sun: Any) -> None:
        self.sun = sun
        self.nowfun: Callable[[], datetime] | None = None

    def now(self) -> datetime:
        """The current time as the solar sees it (or as ``nowfun`` says)."""
        moment: datetime = (self.nowfun or self.sun.now)()
        return moment

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        """Time from ``now()`` to the first event after ``last_run_at``.

        Args:
            last_run_at: The previous slot.

        Returns:
            The remaining time (negative when the event is past).

        """
        sun = self.sun
        now_utc: datetime = sun.maybe_make_aware(self.now()).astimezone(UTC)
        saved = sun.nowfun
        sun.nowfun = lambda: now_utc
        try:
            remaining: timedelta = sun.remaining_estimate(last_run_at)
        finally:
            sun.nowfun = saved
        return remaining


def slot_schedule(schedule: Any) -> Any:
    """The object whose ``remaining_estimate()`` gives ``schedule``'s slots.

    ``schedule`` itself, except a crontab on a Celery whose crontab computes
    in the caller's frame or skips the rest of an old hour (before 5.7):
    then a :class:`CrontabSlots` around it; and a solar on a Celery whose
    solar subtracts wall-clock times (before 5.7): then a :class:`SolarSlots`.

    Args:
        schedule: An entry's schedule.

    Returns:
        ``schedule``, its :class:`CrontabSlots` or its :class:`SolarSlots`.

    """
    if isinstance(schedule, crontab) and not (
        crontab_uses_its_timezone() and crontab_catches_up_across_days()
    ):
        return CrontabSlots(schedule)
    if isinstance(schedule, solar) and not solar_measures_in_utc():
        return SolarSlots(schedule)
    return schedule


def slots_overrule_is_due(schedule: Any) -> bool:
    """Whether ``schedule``'s slots decide when its ``is_due()`` says due and they do not.

    True for a crontab or a solar: their ``is_due()`` before Celery 5.7
    computes in wall-clock time, an hour off across a DST change, and would
    send an extra tick. False for an interval, whose ``is_due()`` is the
    authority: django-celery-beat honours a row's ``start_time`` through it
    (the tick is due at the start time, where the interval has no slot).

    Args:
        schedule: An entry's schedule.

    Returns:
        Whether the slots decide.

    """
    return isinstance(schedule, (crontab, solar))


def beat_nodename() -> str:
    """The node name beat reports (``celery.beat.beat_nodename()`` where it exists).

    Returns:
        Celery 5.7's ``beat_nodename()``, or ``celerybeat@<host>`` as before.

    """
    import celery.beat

    nodename = getattr(celery.beat, "beat_nodename", None)
    if callable(nodename):
        return str(nodename())
    return f"celerybeat@{socket.gethostname()}"


def replaced_task_nesting(request: Any) -> int:
    """How many ``Task.replace()`` calls led to the task of ``request`` (0: none).

    Read from the request's headers where Celery puts it (5.4 on), else from
    the message's properties, where Celery 5.3 leaves it.

    Args:
        request: A task's ``request`` (a Celery ``Context``).

    Returns:
        The nesting, ``0`` for a task that replaces nothing.

    """
    nesting = getattr(request, "replaced_task_nesting", 0)
    if not nesting:
        properties = getattr(request, "properties", None)
        if isinstance(properties, dict):
            nesting = properties.get("replaced_task_nesting", 0)
    return int(nesting or 0)


def immediate_acks(consumer: Any) -> bool:
    """Make ``consumer`` send acks and rejects at once, as Celery 5.7's ``call_soon_ack``.

    Call from a consumer bootstep's ``start()``: the task handler, created
    later by the consumer's loop, takes its ack callback from
    ``call_soon`` at creation; only for that moment ``call_soon`` is the
    immediate one, so remote-control commands and the leader-queue changes
    keep running on the consumer's thread.

    Args:
        consumer: A Celery worker consumer.

    Returns:
        Whether the consumer was changed (``False`` where Celery has
        ``call_soon_ack``, or when already changed).

    """
    if hasattr(consumer, "call_soon_ack") or "create_task_handler" in vars(consumer):
        return False
    create = type(consumer).create_task_handler

    def call_soon_ack(p: Any, *args: Any, **kwargs: Any) -> Any:
        # As Celery 5.7: the event loop (hub) runs it soon, else it runs now.
        if consumer.hub:
            return consumer.hub.call_soon(p, *args, **kwargs)
        try:
            p(*args, **kwargs)
        except Exception:
            logger.exception("nats-leader: ack callback failed")
        return p

    def create_task_handler(*args: Any, **kwargs: Any) -> Any:
        consumer.call_soon = call_soon_ack
        try:
            return create(consumer, *args, **kwargs)
        finally:
            del consumer.call_soon

    consumer.create_task_handler = create_task_handler
    return True


def _tell_others_from_a_copy(handler: Any) -> None:
    # billiard's tell_others() reads ``self.pool`` once and sends one sentinel
    # per process while iterating it: hand it a copy of the list for that.
    live = handler.pool
    handler.pool = list(live)  # one step under the GIL: no removal gets in between
    try:
        type(handler).tell_others(handler)
    finally:
        handler.pool = live


def pool_shutdown_tells_every_process(pool: Any) -> bool:
    """Make a warm shutdown of ``pool`` tell each of its processes to exit.

    Without an event loop (a transport without async support: filesystem,
    SQLAlchemy, ...) Celery's prefork pool is billiard's threaded ``Pool``.
    Its warm shutdown ends in ``TaskHandler.tell_others()``, which puts one
    ``None`` on the processes' shared inqueue for each process while
    iterating ``Pool._pool``, the live list. An idle process takes the first
    ``None`` and exits (the result handler SIGTERMs it on its ``DEATH``
    message), and the result handler thread
    (``ResultHandler.finish_at_shutdown()``, through
    ``Pool._join_exited_workers()``) reaps it and deletes it from that list,
    within milliseconds if the process dies before the handler's
    ``waitpid()``. When that happens before the loop's next step (on a
    loaded host the task handler thread can wait that long for the CPU after
    its write), the list has shifted under the loop, which skips a process:
    one ``None`` too few.
    The process still running a task then waits for work after it forever,
    and ``Pool.join()`` waits for that process: the worker never exits. Here
    the task handler counts the processes from a copy of the list taken
    before the first ``None``: a process that exits meanwhile leaves an
    unread ``None`` behind, which is harmless.

    Call from a worker bootstep's ``start()`` that runs after the pool's
    (the ``None`` are sent when the pool closes, at shutdown).

    Args:
        pool: The worker's pool (``worker.pool``).

    Returns:
        Whether the pool was changed (``False`` for an event-loop prefork
        pool, whose shutdown does not use the task handler thread, for the
        other pools, and when already changed).

    """
    threaded = getattr(pool, "_pool", None)  # Celery's prefork TaskPool wraps billiard's Pool
    handler = getattr(threaded, "_task_handler", None)
    if (
        handler is None
        or not getattr(threaded, "threads", False)
        or not isinstance(getattr(handler, "pool", None), list)
        or "tell_others" in vars(handler)
    ):
        return False
    handler.tell_others = functools.partial(_tell_others_from_a_copy, handler)
    return True


class _HubWaker:
    """A socket pair whose read end is in the hub's poller: a byte written wakes it."""

    def __init__(self) -> None:
        self.reader, self.writer = socket.socketpair()
        self.reader.setblocking(False)
        self.writer.setblocking(False)
        self.loop_thread = threading.get_ident()
        #: The hub's own ``call_soon``, once it is wrapped by :meth:`call_soon`.
        self.original: Callable[..., Any] | None = None
        #: Whether :func:`hub_polls_at_once_when_ready` added its tick callback.
        self.ticks = False

    def drain(self) -> None:
        with contextlib.suppress(OSError):
            self.reader.recv(4096)

    def wake(self) -> None:
        # Full buffer: a wake-up is pending already.
        with contextlib.suppress(OSError):
            self.writer.send(b"\0")

    def call_soon(self, callback: Any, *args: Any) -> Any:
        assert self.original is not None
        handle = self.original(callback, *args)
        if threading.get_ident() != self.loop_thread:
            self.wake()
        return handle


def _registered_waker(hub: Any) -> _HubWaker:
    """The package's waker of ``hub``, its read end (again) in the hub's poller.

    Call on the hub's thread after each (re)start: a hub reset unregisters
    every reader.
    """
    waker: _HubWaker | None = getattr(hub, "_nats_leader_waker", None)
    if waker is None:
        waker = _HubWaker()
        hub._nats_leader_waker = waker
    waker.loop_thread = threading.get_ident()
    hub.remove_reader(waker.reader.fileno())
    hub.add_reader(waker.reader.fileno(), waker.drain)
    return waker


def hub_wakes_on_call_soon(hub: Any) -> bool:
    """Make ``hub.call_soon()`` from another thread wake the hub's poller, as kombu 5.7's.

    Call on the hub's thread (a consumer bootstep's ``start()``), after each
    (re)start: a hub reset unregisters every reader, so the waker is
    registered again.

    Args:
        hub: The worker's kombu hub, or ``None`` (no event loop).

    Returns:
        Whether a waker is in place (``False`` where kombu has its own, or
        without a hub).

    """
    if hub is None or hasattr(hub, "_create_waker"):
        return False
    waker = _registered_waker(hub)
    if waker.original is None:
        waker.original = hub.call_soon
        hub.call_soon = waker.call_soon
    return True


def hub_polls_at_once_when_ready(hub: Any) -> bool:
    """Make the hub's poll return at once while callbacks wait in its ready set.

    kombu's hub (5.3 to 5.7) runs the callbacks ``call_soon()`` queued, then
    polls; callbacks queued *by* those callbacks wait in the ready set until
    that poll ends, at the next timer (up to 10 s) or I/O. A solo task run
    from kombu's deferred read is such a callback, and its ack such a queued
    one: with one message prefetched, RabbitMQ sends the next task only
    after that ack. A tick callback (kombu runs them right before it polls)
    writes a byte to a socket in the poller when the ready set is not empty,
    as asyncio polls without blocking while callbacks are ready; the loop
    still polls its sockets and fires its timers on every turn.

    Call on the hub's thread (a consumer bootstep's ``start()``), after each
    (re)start, as :func:`hub_wakes_on_call_soon`.

    Args:
        hub: The worker's kombu hub, or ``None`` (no event loop).

    Returns:
        Whether the hub polls at once when callbacks are ready (``False``
        without a hub, or for a hub without a ready set and tick callbacks).

    """
    if not isinstance(getattr(hub, "_ready", None), set) or not isinstance(
        getattr(hub, "on_tick", None), set
    ):
        return False
    waker = _registered_waker(hub)
    if not waker.ticks:

        def wake_if_ready() -> None:
            if hub._ready:  # replaced by a new set at every turn: read it now
                waker.wake()

        hub.on_tick.add(wake_if_ready)
        waker.ticks = True
    return True
