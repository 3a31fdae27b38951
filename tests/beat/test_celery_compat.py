"""The Celery compatibility layer: each branch gives Celery 5.7's slots on the installed Celery.

Both branches run on every Celery: :class:`CrontabSlots` (what 5.3-5.6 get)
is asked directly, and the probes' answers are checked against what the
installed ``crontab`` itself does, so a probe that lies fails here.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
import warnings
from datetime import datetime, timedelta, timezone
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.schedules import crontab, solar

from celery_nats_leader.beat.ticks import next_slot
from celery_nats_leader.worker import celery_compat
from celery_nats_leader.worker.celery_compat import CrontabSlots, SolarSlots, slot_schedule

UTC = timezone.utc


def paris_app() -> Celery:
    app = Celery("compat", set_as_current=False)
    app.conf.timezone = "Europe/Paris"
    return app


def test_crontab_slots_in_the_app_timezone_whatever_the_branch() -> None:
    now = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
    for daily in (
        CrontabSlots(crontab(minute=0, hour=4, app=paris_app())),
        slot_schedule(crontab(minute=0, hour=4, app=paris_app())),
    ):
        # 04:00 in Paris (UTC+2 in May) is 02:00 UTC, on every Celery.
        slot = next_slot(daily, datetime(2024, 5, 1, 1, 0, tzinfo=UTC), now)
        assert slot == datetime(2024, 5, 1, 2, 0, tzinfo=UTC)
        assert next_slot(daily, slot, now) == datetime(2024, 5, 2, 2, 0, tzinfo=UTC)


def test_missed_minutes_of_an_old_day_are_slots_whatever_the_branch() -> None:
    app = Celery("compat", set_as_current=False)
    last = datetime(2024, 3, 4, 0, 1, tzinfo=UTC)
    three_days_later = last + timedelta(days=3)
    for minutely in (CrontabSlots(crontab(app=app)), slot_schedule(crontab(app=app))):
        assert next_slot(minutely, last, three_days_later) == last + timedelta(minutes=1)


@pytest.mark.parametrize(
    ("after", "expected"),
    [
        # 02:30 does not exist on 31 March 2024 in Paris: 03:30 CEST (01:30 UTC).
        pytest.param(
            datetime(2024, 3, 30, 12, tzinfo=UTC),
            datetime(2024, 3, 31, 1, 30, tzinfo=UTC),
            id="spring-forward",
        ),
        # 02:30 exists twice on 27 October 2024: the first, 02:30 CEST (00:30 UTC).
        pytest.param(
            datetime(2024, 10, 26, 12, tzinfo=UTC),
            datetime(2024, 10, 27, 0, 30, tzinfo=UTC),
            id="fall-back",
        ),
    ],
)
def test_a_night_slot_across_a_dst_change_whatever_the_branch(
    after: datetime, expected: datetime
) -> None:
    for night in (
        CrontabSlots(crontab(minute=30, hour=2, app=paris_app())),
        slot_schedule(crontab(minute=30, hour=2, app=paris_app())),
    ):
        assert next_slot(night, after, after) == expected


def test_the_probes_tell_what_the_installed_crontab_does() -> None:
    # A raw crontab fed a UTC time: right only where the probe says so.
    daily = crontab(minute=0, hour=4, app=paris_app())
    at = datetime(2024, 5, 1, 1, 0, tzinfo=UTC)
    raw = next_slot(daily, at, at)
    assert (
        raw == datetime(2024, 5, 1, 2, 0, tzinfo=UTC)
    ) is celery_compat.crontab_uses_its_timezone()
    minutely = crontab(app=Celery("compat", set_as_current=False))
    raw = next_slot(minutely, at, at + timedelta(days=2))
    assert (raw == at + timedelta(minutes=1)) is celery_compat.crontab_catches_up_across_days()
    # The adapter only where needed: on Celery 5.7 the crontab is used as it is.
    native = (
        celery_compat.crontab_uses_its_timezone() and celery_compat.crontab_catches_up_across_days()
    )
    assert isinstance(slot_schedule(daily), CrontabSlots) is not native


#: The sunsets in Paris that ephem computes (Celery 5.7's ``solar("sunset")``),
#: to the second: ephem's answer moves by some milliseconds with the start time.
SUNSET_4_MARCH = datetime(2024, 3, 4, 17, 39, 22, tzinfo=UTC)
SUNSET_25_OCTOBER = datetime(2024, 10, 25, 16, 41, 29, tzinfo=UTC)


def paris_sunset() -> Any:
    return solar("sunset", 48.85, 2.35, app=paris_app())


@pytest.mark.parametrize(
    ("after", "expected"),
    [
        # Asked in October (summer time) from March (winter time): wall-clock
        # arithmetic in Paris is an hour off here.
        pytest.param(datetime(2024, 3, 4, tzinfo=UTC), SUNSET_4_MARCH, id="across-the-change"),
        pytest.param(datetime(2024, 10, 25, 12, tzinfo=UTC), SUNSET_25_OCTOBER, id="same-side"),
    ],
)
def test_solar_slots_are_ephems_events_whatever_the_branch(
    after: datetime, expected: datetime
) -> None:
    now = datetime(2024, 10, 26, 12, tzinfo=UTC).astimezone(ZoneInfo("Europe/Paris"))
    for sunset in (SolarSlots(paris_sunset()), slot_schedule(paris_sunset())):
        slot = next_slot(sunset, after, now)
        assert slot is not None
        assert abs((slot - expected).total_seconds()) < 1, slot


def test_the_solar_probe_tells_what_the_installed_solar_does() -> None:
    # A raw solar of a Paris app, asked in October (its clock in Paris) for
    # the sunset after a March time: right only where the probe says so.
    now = datetime(2024, 10, 26, 12, tzinfo=UTC).astimezone(ZoneInfo("Europe/Paris"))
    raw = next_slot(paris_sunset(), datetime(2024, 3, 4, tzinfo=UTC), now)
    assert raw is not None
    right = abs((raw - SUNSET_4_MARCH).total_seconds()) < 1
    assert right is celery_compat.solar_measures_in_utc()
    # Off by the change of offset, not by anything else.
    assert right or abs((raw - SUNSET_4_MARCH + timedelta(hours=1)).total_seconds()) < 1
    # The adapter only where needed.
    assert isinstance(slot_schedule(paris_sunset()), SolarSlots) is not right


def test_beat_nodename_is_celerys_where_it_has_one() -> None:
    import celery.beat

    name = celery_compat.beat_nodename()
    if hasattr(celery.beat, "beat_nodename"):
        assert name == celery.beat.beat_nodename()
    else:
        assert name.startswith("celerybeat@")


class OldConsumer:
    """What immediate_acks() uses of a Celery 5.3-5.6 worker consumer (no event loop)."""

    hub = None

    def __init__(self) -> None:
        self.pending: list[Any] = []

    def call_soon(self, p: Any, *args: Any) -> Any:
        self.pending.append((p, args))  # run at the top of the next loop iteration
        return p

    def create_task_handler(self) -> Any:
        call_soon = self.call_soon  # taken once, as Celery's task handler does
        return call_soon


class NewConsumer(OldConsumer):
    def call_soon_ack(self, p: Any, *args: Any) -> Any:
        return p(*args)


def test_acks_are_sent_at_once_other_callbacks_stay_on_the_loop() -> None:
    consumer = OldConsumer()
    assert celery_compat.immediate_acks(consumer)
    assert not celery_compat.immediate_acks(consumer)  # a restarted consumer: once
    handler = consumer.create_task_handler()
    acked: list[str] = []
    handler(lambda: acked.append("ack"))
    assert acked == ["ack"]
    assert consumer.pending == []
    # Everything else still waits for the consumer's loop (its thread).
    consumer.call_soon(lambda: acked.append("reconcile"))
    assert acked == ["ack"]
    assert len(consumer.pending) == 1


def test_a_celery_with_call_soon_ack_is_left_alone() -> None:
    consumer = NewConsumer()
    assert not celery_compat.immediate_acks(consumer)
    assert "create_task_handler" not in vars(consumer)


def test_call_soon_from_another_thread_wakes_the_event_loop() -> None:
    from kombu.asynchronous import Hub

    hub = Hub()
    hub.call_later(30.0, lambda: None)  # the poller may sleep for seconds
    # A quiet connection to poll (as the broker's): the loop blocks in poll().
    quiet, other_end = socket.socketpair()
    hub.add_reader(quiet.fileno(), lambda: None)
    ready, stop, ran = threading.Event(), threading.Event(), threading.Event()

    def loop() -> None:
        celery_compat.hub_wakes_on_call_soon(hub)  # on the loop's thread
        steps = hub.create_loop()
        ready.set()
        while not stop.is_set():
            next(steps)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    assert ready.wait(5)
    time.sleep(0.2)  # let the loop block in its poll
    asked = time.monotonic()
    hub.call_soon(ran.set)
    assert ran.wait(5)
    latency = time.monotonic() - asked
    stop.set()
    hub.call_soon(lambda: None)
    thread.join(5)
    hub.close()
    quiet.close()
    other_end.close()
    waker = getattr(hub, "_nats_leader_waker", None)
    if waker is not None:
        waker.reader.close()
        waker.writer.close()
    # Without a wake-up the callback waits for the poll's timeout (1-10 s).
    assert latency < 0.5, latency


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "kombu-alone"])
def test_a_callback_queued_by_a_ready_callback_runs_without_waiting_for_a_timer(
    fixed: bool,
) -> None:
    """As a solo task's ack, queued by kombu's deferred read (a ready callback)."""
    from kombu.asynchronous import Hub

    hub = Hub()
    hub.call_later(1.0, lambda: None)  # the poll that follows may last this long
    quiet, other_end = socket.socketpair()  # the broker's connection: nothing to read
    hub.add_reader(quiet.fileno(), lambda: None)
    if fixed:
        assert celery_compat.hub_polls_at_once_when_ready(hub)
        assert celery_compat.hub_polls_at_once_when_ready(hub)  # a restart: once
        assert len(hub.on_tick) == 1
    ran: list[float] = []
    hub.call_soon(lambda: hub.call_soon(lambda: ran.append(time.monotonic())))
    steps = hub.create_loop()
    started = time.monotonic()
    while not ran:
        next(steps)
    hub.close()
    quiet.close()
    other_end.close()
    waker = getattr(hub, "_nats_leader_waker", None)
    if waker is not None:
        waker.reader.close()
        waker.writer.close()
    latency = ran[0] - started
    if fixed:
        assert latency < 0.5, latency
    else:  # what the fix is for: the queued callback waited for the timer
        assert latency >= 0.9, latency


def _run_until_released(started: int, release: int) -> str:
    """The pool test's task: says it runs, then waits for the test's byte."""
    os.write(started, b"s")
    os.read(release, 1)
    return "done"


@pytest.mark.parametrize("workaround", [True, False], ids=["workaround", "billiard-alone"])
def test_a_warm_shutdown_tells_the_process_running_a_task_to_exit(workaround: bool) -> None:
    """Celery's prefork pool without an event loop (billiard's threaded pool) closes
    while one process runs a task and the other idles. The idle one exits on the
    first sentinel and is reaped before the task handler sends the next: what a
    loaded host does now and then, made certain here."""
    from celery.concurrency.prefork import TaskPool

    app = Celery("compat-pool", set_as_current=False)
    started_r, started_w = os.pipe()
    release_r, release_w = os.pipe()
    pool = TaskPool(limit=2, app=app, threads=True, initargs=(app, "compat@test"))
    with warnings.catch_warnings():
        # Python 3.12+ warns about fork() in a threaded process (pytest's):
        # the children only run the pool's loop.
        warnings.simplefilter("ignore", DeprecationWarning)
        pool.start()
    threaded = pool._pool
    handler = threaded._task_handler
    try:
        if workaround:
            assert celery_compat.pool_shutdown_tells_every_process(pool)
            assert not celery_compat.pool_shutdown_tells_every_process(pool)  # once

        reaped = threading.Event()
        result_handler = threaded._result_handler
        join_exited = result_handler.join_exited_workers

        def join_exited_workers(shutdown: bool = False) -> Any:
            try:
                return join_exited(shutdown=shutdown)
            finally:
                if len(threaded._pool) < 2:
                    reaped.set()

        result_handler.join_exited_workers = join_exited_workers
        put = handler.put
        sentinels: list[None] = []

        def put_then_wait(obj: Any) -> None:
            put(obj)
            if obj is None:
                sentinels.append(obj)
                if len(sentinels) == 1:
                    reaped.wait(30)  # the process that took it is gone from the pool

        handler.put = put_then_wait
        done = threading.Event()
        results: list[str] = []

        def on_result(value: str) -> None:
            results.append(value)
            done.set()

        pool.apply_async(_run_until_released, args=(started_w, release_r), callback=on_result)
        assert select.select([started_r], [], [], 30)[0], "the task did not start"
        os.read(started_r, 1)

        pool.close()  # the warm shutdown's first step
        assert reaped.wait(30), "the idle process was not reaped"
        handler.join(30)  # every sentinel sent
        os.write(release_w, b"r")
        assert done.wait(30)
        assert results == ["done"]
        if workaround:
            joined = threading.Event()
            threading.Thread(target=lambda: (threaded.join(), joined.set()), daemon=True).start()
            assert joined.wait(30), "a pool process did not exit"
            assert len(sentinels) == 2
        else:
            # billiard alone: one sentinel for two processes. Nothing is left
            # to read, and nothing more will be written: the process that ran
            # the task waits for work forever, and so would Pool.join(). (If
            # this fails, billiard counts its sentinels right by itself.)
            assert len(sentinels) == 1
            assert [p for p in threaded._pool if p.is_alive()]
            assert not threaded._inqueue._reader.poll(0)
    finally:
        for process in list(threaded._pool):
            if process.is_alive():
                process.terminate()
        threaded.terminate()
        for fd in (started_r, started_w, release_r, release_w):
            os.close(fd)


def test_replaced_task_nesting_from_the_headers_or_celery_53s_properties() -> None:
    from celery.app.task import Context

    # Celery 5.4+: a header, so an attribute of the request.
    assert celery_compat.replaced_task_nesting(Context({"replaced_task_nesting": 2})) == 2
    # Celery 5.3: a message property (its send_task passes the option on).
    by_property = Context({"properties": {"replaced_task_nesting": 1}})
    assert celery_compat.replaced_task_nesting(by_property) == 1
    assert celery_compat.replaced_task_nesting(Context({"properties": {}})) == 0
    assert celery_compat.replaced_task_nesting(Context({})) == 0
