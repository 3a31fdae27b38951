"""The scheduler contract, against Celery's own ``PersistentScheduler`` as the oracle.

Each test runs the leader scheduler (on a real nats-server) and Celery's
``PersistentScheduler`` side by side, on the same entries, the same manual
clock and the same in-memory broker (kombu's ``memory://``: real
serialization), and asserts that a user sees the same thing from both: the
messages sent (which entry, at which time) and the delays ``tick()`` returns.
The clock advances event by event, by the smaller of the two delays, exactly
as ``celery beat`` sleeps between ticks.

Where the leader scheduler deliberately differs (catch-up of missed ticks,
retrying a tick whose send failed transiently) the test sets the behaviour
that matches Celery (``beat_max_catch_up=0``) or says what differs; the
differences are listed in docs/beat.md.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone, tzinfo
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from celery import Celery, _state
from celery.beat import PersistentScheduler
from celery.schedules import crontab, schedstate, schedule, solar

from celery_nats_leader.beat import LeaderScheduler
from celery_nats_leader.testing import NatsServer
from celery_nats_leader.worker.celery_compat import (
    crontab_catches_up_across_days,
    crontab_deadline_counts_the_due_slot,
    crontab_uses_its_timezone,
)

pytestmark = [pytest.mark.integration]

UTC = timezone.utc
#: Whether the installed Celery's crontab computes as Celery 5.7's.
CELERY_57_CRONTAB = crontab_uses_its_timezone() and crontab_catches_up_across_days()
#: A Monday.
T0 = datetime(2024, 3, 4, 0, 0, 0, tzinfo=UTC)


class Clock:
    """The manual clock of every schedule in a test."""

    def __init__(self) -> None:
        self.now = T0
        #: As ``app.now()``: the time in the app's timezone (Celery before 5.7
        #: matches a crontab's fields in the frame of the time it is given).
        self.zone: tzinfo = UTC
        self._lock = threading.Lock()

    def __call__(self) -> datetime:
        with self._lock:
            return self.now.astimezone(self.zone)

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += timedelta(seconds=seconds)


CLOCK = Clock()


def now() -> datetime:
    """The ``nowfun`` of the test schedules (a module function: shelve pickles it)."""
    return CLOCK()


def weekend(moment: datetime) -> bool:
    return moment.astimezone(UTC).weekday() >= 5


def until_monday(moment: datetime) -> float:
    utc = moment.astimezone(UTC)
    monday = (utc + timedelta(days=7 - utc.weekday())).replace(hour=0, minute=0, second=0)
    return (monday - utc).total_seconds()


class WeekdaysEvery(schedule):  # type: ignore[misc]
    """An interval that does not run on weekends (``is_due`` decides)."""

    def is_due(self, last_run_at: datetime) -> Any:
        if weekend(self.now()):
            return schedstate(False, until_monday(self.now()))
        return super().is_due(last_run_at)


class ManualCron(crontab):  # type: ignore[misc]
    """Celery's crontab, keeping its ``nowfun`` through any number of shelve round trips.

    (Before Celery 5.7 an unpickled crontab forgets its keyword arguments, so
    the second round trip drops ``nowfun`` and the schedule reads the real
    clock.)
    """

    def __setstate__(self, state: Any) -> None:
        super().__setstate__(state)
        self._orig_kwargs = dict(state)


class WeekdaysCron(ManualCron):
    """A crontab that does not run on weekends (``is_due`` decides)."""

    def is_due(self, last_run_at: datetime) -> Any:
        if weekend(self.now()):
            return schedstate(False, until_monday(self.now()))
        return super().is_due(last_run_at)


class ManualSolar(solar):  # type: ignore[misc]
    """Celery's solar schedule, keeping its ``nowfun`` through the shelve.

    (``solar.__reduce__`` drops it: after the shelve round trip Celery's own
    scheduler would read the real clock.)
    """

    def __reduce__(self) -> Any:
        return (self.__class__, (self.event, self.lat, self.lon), {"nowfun": self.nowfun})


class WeekdaysSolar(ManualSolar):
    """Sunrise in Paris, not on weekends (``is_due`` decides)."""

    def is_due(self, last_run_at: datetime) -> Any:
        if weekend(self.now()):
            return schedstate(False, until_monday(self.now()))
        return super().is_due(last_run_at)


class NeverDue(schedule):  # type: ignore[misc]
    """Always "not yet, ask again in 5 s", although its interval has long passed."""

    def is_due(self, last_run_at: datetime) -> Any:
        return schedstate(False, 5.0)


@dataclass
class Sent:
    entry: str
    at: datetime


@dataclass
class Run:
    """What one scheduler did during a run."""

    sent: list[Sent] = field(default_factory=list)
    delays: list[float] = field(default_factory=list)

    def times(self, entry: str) -> list[datetime]:
        return [s.at for s in self.sent if s.entry == entry]


class Recording:
    """Records every message the scheduler really sent (kombu's memory transport)."""

    run: Run

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kw: Any) -> Any:
        result = super().apply_async(entry, producer=producer, advance=advance, **kw)  # type: ignore[misc]
        self.run.sent.append(Sent(entry.name, CLOCK()))
        return result


class OracleScheduler(Recording, PersistentScheduler):  # type: ignore[misc]
    """Celery's default scheduler."""

    is_oracle = True


class LeaderUnderTest(Recording, LeaderScheduler):  # type: ignore[misc]
    """The leader scheduler."""

    is_oracle = False


@dataclass
class Pair:
    oracle: OracleScheduler
    ours: LeaderUnderTest

    def run_for(self, seconds: float, *, max_passes: int = 100_000) -> None:
        """Tick both until ``seconds`` of the manual clock have passed."""
        end = CLOCK() + timedelta(seconds=seconds)
        passes = 0
        while CLOCK() < end:
            delays = [drain(self.oracle), drain(self.ours)]
            self.oracle.run.delays.append(delays[0])
            self.ours.run.delays.append(delays[1])
            CLOCK.advance(max(min(delays), 0.001))
            passes += 1
            assert passes < max_passes, "the schedulers never settled"


def drain(scheduler: Any) -> float:
    """Tick while there is work (Celery sends one message per ``tick()``).

    A ``0`` that sent nothing means "due in less than Celery's 10 ms drift"
    (both schedulers wake 10 ms early): on a real clock time passes before
    the next tick, here it must be moved, so it counts as 1 ms.
    """
    for _ in range(1000):
        before = len(scheduler.run.sent)
        delay = float(scheduler.tick())
        if delay > 0:
            return delay
        if len(scheduler.run.sent) == before:
            return 0.001
    raise AssertionError("tick() kept returning 0")


@pytest.fixture(scope="module")
def server() -> Iterator[NatsServer]:
    with NatsServer() as running:
        yield running


@pytest.fixture
def make_pair(server: NatsServer, tmp_path: Path) -> Iterator[Callable[..., Pair]]:
    made: list[Any] = []
    previous = _state.get_current_app()

    def make(
        entries: dict[str, dict[str, Any]],
        *,
        max_interval: float = 300,
        current: bool = False,
        **conf: Any,
    ) -> Pair:
        """Both schedulers on ``entries``; ``current``: their apps are the current app.

        (Celery's shelve hands back schedules bound to the *current* app, so
        app-level settings that schedules read, like the crontab starting
        deadline, only reach Celery's scheduler through the current app.)
        """
        CLOCK.now = T0
        CLOCK.zone = ZoneInfo(conf.get("timezone", "UTC"))
        schedulers = []
        for kind, cls in (("oracle", OracleScheduler), ("ours", LeaderUnderTest)):
            app = Celery(f"contract-{kind}", set_as_current=current)
            app.conf.update(
                broker_url="memory://",
                result_expires=None,  # no celery.backend_cleanup entry (on the real clock)
                beat_schedule=entries,
                nats_leader_servers=server.url,
                nats_leader_bucket=f"c{uuid.uuid4().hex[:10]}",
                nats_leader_create_bucket=True,
                nats_leader_required=True,
                nats_leader_ttl=5.0,
                nats_leader_instance_id=f"contract-{uuid.uuid4().hex[:6]}",
                **{"timezone": "UTC", **conf},
            )
            scheduler = type(cls.__name__, (cls,), {"run": Run()})(
                app=app, schedule_filename=str(tmp_path / f"{kind}.db"), max_interval=max_interval
            )
            made.append(scheduler)
            schedulers.append(scheduler)
        oracle, ours = schedulers
        assert ours.beat_role.wait_for_leadership(10)
        return Pair(oracle, ours)

    yield make
    for scheduler in made:
        scheduler.close()
    _state._set_current_app(previous)


def assert_same_times(ours: list[datetime], oracle: list[datetime], slack: float = 1.5) -> None:
    """The same sends; each within ``slack`` seconds of Celery's.

    Celery sends up to one tick late (it sleeps its delay minus 10 ms, then
    looks again) and counts an interval from that late send; the leader
    scheduler sends the tick of the slot itself.
    """
    assert len(ours) == len(oracle), (ours, oracle)
    late = [
        (a, b) for a, b in zip(ours, oracle, strict=True) if abs((a - b).total_seconds()) > slack
    ]
    assert not late, late


def entry(schedule_: Any, **extra: Any) -> dict[str, Any]:
    return {"task": "contract.noop", "schedule": schedule_, **extra}


# ----------------------------------------------------------------- is_due


@pytest.mark.parametrize(
    "kind",
    [
        pytest.param(lambda: WeekdaysEvery(timedelta(hours=6), nowfun=now), id="interval"),
        pytest.param(lambda: WeekdaysCron(minute=0, hour="*/4", nowfun=now), id="crontab"),
        pytest.param(lambda: WeekdaysSolar("sunrise", 48.85, 2.35, nowfun=now), id="solar"),
    ],
)
def test_is_due_of_a_schedule_subclass_decides(
    make_pair: Callable[..., Pair], kind: Callable[[], Any]
) -> None:
    pair = make_pair({"weekdays": entry(kind())})
    pair.run_for(7 * 86400 + 3600)
    oracle, ours = pair.oracle.run.times("weekdays"), pair.ours.run.times("weekdays")
    assert oracle, "the oracle never sent: the scenario is wrong"
    assert not any(weekend(at) for at in oracle)
    assert_same_times(ours, oracle)


def test_is_due_refusing_holds_the_entry_with_its_delay(make_pair: Callable[..., Pair]) -> None:
    # Issue 10 #1: an interval long past, but is_due() says "not yet, 5 s".
    pair = make_pair({"never": entry(NeverDue(timedelta(seconds=1), nowfun=now))})
    pair.run_for(6)
    assert pair.oracle.run.sent == [] and pair.ours.run.sent == []
    # Both ask again 5 s later (Celery subtracts 10 ms of drift).
    assert pair.ours.run.delays[0] == pytest.approx(5.0, abs=0.02)
    assert pair.oracle.run.delays[0] == pytest.approx(5.0, abs=0.02)


def test_max_interval_bounds_the_delay(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair({"hourly": entry(schedule(timedelta(hours=1), nowfun=now))}, max_interval=7)
    pair.run_for(3 * 3600 + 1)
    assert max(pair.ours.run.delays) <= 7 and max(pair.oracle.run.delays) <= 7
    assert_same_times(pair.ours.run.times("hourly"), pair.oracle.run.times("hourly"))
    assert len(pair.ours.run.times("hourly")) == 3


# ---------------------------------------------------------- failing entry


def test_an_entry_that_cannot_be_sent_does_not_hold_the_others(
    make_pair: Callable[..., Pair],
) -> None:
    # Issue 10 #2: a set is not JSON-serializable; the healthy entry keeps its schedule.
    pair = make_pair(
        {
            "unsendable": entry(schedule(timedelta(seconds=1), nowfun=now), args=({1, 2},)),
            "healthy": entry(schedule(timedelta(seconds=1), nowfun=now)),
        }
    )
    pair.run_for(12)
    oracle, ours = pair.oracle.run.times("healthy"), pair.ours.run.times("healthy")
    assert len(oracle) >= 11
    assert_same_times(ours, oracle)
    assert pair.ours.run.times("unsendable") == pair.oracle.run.times("unsendable") == []
    # Counted, once per tick (not retried in a loop).
    counts = pair.ours.nats_leader_metrics.snapshot()["unsendable"]
    assert counts["send_failed"] == counts["lost"] == len(oracle)
    assert counts["dispatched"] == counts["reverted"] == 0


# ---------------------------------------------------------- solar and DST


@pytest.mark.parametrize(
    "start",
    [
        pytest.param(datetime(2024, 3, 30, 12, tzinfo=UTC), id="spring-forward"),
        pytest.param(datetime(2024, 10, 26, 12, tzinfo=UTC), id="fall-back"),
    ],
)
def test_crontab_and_solar_across_a_dst_change(
    make_pair: Callable[..., Pair], start: datetime
) -> None:
    pair = make_pair(
        {
            # 02:30 does not exist on the spring day and exists twice in autumn.
            "night": entry(ManualCron(minute=30, hour=2, nowfun=now)),
            "hourly": entry(ManualCron(minute=15, nowfun=now)),
            "sunset": entry(ManualSolar("sunset", 48.85, 2.35, nowfun=now)),
        },
        # As in `celery beat`: the app is the current app, so the crontabs
        # back from the shelve are in its timezone.
        current=True,
        timezone="Europe/Paris",
        nats_leader_beat_max_catch_up=0,
    )
    CLOCK.now = start
    pair.run_for(3 * 86400)
    for name in ("night", "hourly", "sunset"):
        oracle, ours = pair.oracle.run.times(name), pair.ours.run.times(name)
        assert oracle, name
        if name != "sunset":
            # Celery 5.7's slots, by brute force: Celery's own scheduler gives
            # them where its crontab computes as 5.7's; Celery 5.3-5.6's is
            # off around the change (wall-clock arithmetic), the leader
            # scheduler is not.
            fields = {"night": (30, 2), "hourly": (15, None)}[name]
            # (Not the last hour: where the run stops is the harness's business.)
            until = start + timedelta(days=3, hours=-1)
            expected = [start, *cron_slots_57(*fields, start, until)]
            ours = [t for t in ours if t <= until]
            oracle = [t for t in oracle if t <= until]
            if CELERY_57_CRONTAB:
                assert_same_times(oracle, expected)
            oracle = expected
        elif not CELERY_57_CRONTAB:
            # Celery 5.3-5.6's own scheduler sends some sunsets late here; the
            # leader scheduler sends each at the sunset ephem computes, as 5.7.
            until = start + timedelta(days=3, hours=-1)
            ours = [t for t in ours if t <= until]
            oracle = [start, *sunsets(48.85, 2.35, start, until)]
        assert_same_times(ours, oracle)


def sunsets(lat: float, lon: float, start: datetime, end: datetime) -> list[datetime]:
    """The sunsets in (start, end], as Celery's ``solar("sunset")`` computes them."""
    import ephem

    observer = ephem.Observer()
    observer.lat, observer.lon = str(lat), str(lon)
    observer.horizon, observer.pressure = "-0:34", 0
    observer.date = start.astimezone(UTC).replace(tzinfo=None)
    found = []
    while True:
        at = observer.next_setting(ephem.Sun(), use_center=False)
        moment = ephem.Date(at).datetime().replace(tzinfo=UTC)
        if moment > end:
            return found
        found.append(moment)
        observer.date = at + ephem.minute


def cron_slots_57(minute: int, hour: int | None, start: datetime, end: datetime) -> list[datetime]:
    """A Paris crontab's slots in (start, end] as Celery 5.7 gives them, by brute force.

    Every matching wall-clock time in Paris, taken at its first occurrence
    (``fold=0``): a repeated time runs once, a time that does not exist runs
    at the same wall time with the offset before the change (02:30 on the
    spring-forward day is 03:30 CEST).
    """
    paris = ZoneInfo("Europe/Paris")
    found = set()
    day = start.astimezone(paris).date() - timedelta(days=1)
    while day <= end.astimezone(paris).date():
        for h in range(24) if hour is None else [hour]:
            wall = datetime(day.year, day.month, day.day, h, minute, tzinfo=paris)
            slot = wall.astimezone(UTC)
            if start < slot <= end:
                found.add(slot)
        day += timedelta(days=1)
    return sorted(found)


# -------------------------------------------------------------- catch-up


def test_after_a_long_gap_at_most_max_catch_up_ticks_then_the_latest(
    make_pair: Callable[..., Pair],
) -> None:
    # Issue 10 #3: three days behind, a 1-s, a 60-s and a cron entry.
    names = ("second", "minute", "cron")
    pair = make_pair(
        {
            "second": entry(schedule(timedelta(seconds=1), nowfun=now)),
            "minute": entry(schedule(timedelta(minutes=1), nowfun=now)),
            "cron": entry(ManualCron(nowfun=now)),
        },
        nats_leader_beat_max_catch_up=3,
        # A window longer than the gap: the count alone limits (the default
        # window coalesces any gap longer than a failover, see below).
        nats_leader_beat_catch_up_window=4 * 86400,
    )
    pair.run_for(2)
    before = pair.ours.entry_states()
    sent_before = {name: len(pair.ours.run.times(name)) for name in names}
    CLOCK.advance(3 * 86400)
    gap_end = CLOCK()
    drain(pair.ours)
    after = {name: pair.ours.run.times(name)[sent_before[name] :] for name in names}
    # Every entry: exactly one tick, the latest, the skipped ones counted.
    assert {name: len(times) for name, times in after.items()} == dict.fromkeys(names, 1)
    states = pair.ours.entry_states()
    for name, period in (("second", 1), ("minute", 60), ("cron", 60)):
        assert gap_end - timedelta(seconds=period) < states[name].slot <= gap_end, name
    skipped = {n: c["skipped"] for n, c in pair.ours.nats_leader_metrics.snapshot().items()}
    for name, period in (("second", 1), ("minute", 60)):
        missed = (states[name].slot - before[name].slot) // timedelta(seconds=period)
        assert skipped[name] == missed - 1 > 3, name
    assert skipped["cron"] >= 4  # a lower bound: cron slots are jumped over, not counted
    # Celery sends each once too (it always coalesces).
    drain(pair.oracle)
    assert [len(pair.oracle.run.times(n)) - sent_before[n] for n in names] == [1, 1, 1]


def test_a_few_missed_ticks_are_caught_up_one_by_one(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(
        {"minute": entry(ManualCron(nowfun=now))},
        nats_leader_beat_max_catch_up=5,
        nats_leader_beat_catch_up_window=300,
    )
    pair.run_for(61)
    CLOCK.advance(4 * 60)
    drain(pair.ours)
    slots = [state.slot for state in [pair.ours.entry_states()["minute"]]]
    assert len(pair.ours.run.times("minute")) == 1 + 4
    assert slots == [T0 + timedelta(minutes=5)]


def test_by_default_a_gap_longer_than_a_failover_is_one_run_as_with_celery(
    make_pair: Callable[..., Pair],
) -> None:
    # The default window (2 x ttl + 5 s) is shorter than a 4-minute gap:
    # the four missed minutes coalesce into one run, the latest, as Celery's.
    pair = make_pair(
        {
            "minute": entry(ManualCron(nowfun=now)),
            "second": entry(schedule(timedelta(seconds=1), nowfun=now)),
        }
    )
    pair.run_for(61)
    before = pair.ours.entry_states()["second"].slot
    sent = {name: len(pair.ours.run.times(name)) for name in ("minute", "second")}
    oracle_sent = {name: len(pair.oracle.run.times(name)) for name in ("minute", "second")}
    CLOCK.advance(4 * 60)
    gap_end = CLOCK()
    drain(pair.ours)
    drain(pair.oracle)
    after = {name: len(pair.ours.run.times(name)) - sent[name] for name in sent}
    oracle_after = {name: len(pair.oracle.run.times(name)) - oracle_sent[name] for name in sent}
    assert after == oracle_after == {"minute": 1, "second": 1}
    states = pair.ours.entry_states()
    assert states["minute"].slot == gap_end.replace(second=0, microsecond=0)
    assert gap_end - timedelta(seconds=1) < states["second"].slot <= gap_end
    missed = (states["second"].slot - before) // timedelta(seconds=1)
    assert missed > 200 and states["second"].skipped == missed - 1


# ------------------------------------------------------ starting deadline


def test_beat_cron_starting_deadline(make_pair: Callable[..., Pair]) -> None:
    # Issue 10 #5: a cron slot older than the deadline is not run after a gap.
    pair = make_pair(
        {"hourly": entry(ManualCron(minute=0, nowfun=now))},
        current=True,
        beat_cron_starting_deadline=120,
        nats_leader_beat_max_catch_up=10,
    )
    pair.run_for(3601)
    assert len(pair.ours.run.times("hourly")) == len(pair.oracle.run.times("hourly")) == 1
    # Down from 01:00:01 to 02:05: the 02:00 slot is 5 min old, beyond 120 s.
    CLOCK.advance(3900)
    pair.run_for(3600)
    oracle, ours = pair.oracle.run.times("hourly"), pair.ours.run.times("hourly")
    if crontab_deadline_counts_the_due_slot():
        assert_same_times(ours, oracle)
    else:
        # Celery 5.3-5.6's own crontab also refuses 03:00 (it measures the
        # deadline from the missed 02:00); the leader scheduler runs it, as 5.7.
        assert [at.hour for at in oracle] == [1], oracle
    assert [at.hour for at in ours] == [1, 3], ours


# ------------------------------------------- Celery's own Scheduler tests
#
# The scheduler tests of Celery's t/unit/app/test_beat.py (``test_Scheduler``),
# each run on Celery's ``beat.Scheduler`` (the oracle, as in Celery's suite)
# and on the leader scheduler, with Celery's expected values: the delay
# tick() returns (Celery wakes 10 ms early: ``adjust()``) and the error that
# reaches the ``celery.beat`` logger. Deliberate differences: docs/beat.md.


class MockedSchedule(schedule):  # type: ignore[misc]
    """Celery's ``mocked_schedule``: ``is_due()`` answers a fixed pair."""

    def __init__(self, is_due: bool, next_run_at: Any) -> None:
        self._is_due = is_due
        self._next_run_at = next_run_at
        self.run_every = timedelta(seconds=1)
        self.nowfun = now
        self.default_now = self.nowfun

    def is_due(self, last_run_at: datetime) -> Any:
        return self._is_due, self._next_run_at


class RaisingSchedule(schedule):  # type: ignore[misc]
    """``is_due()`` raises (Celery's ``test_tick_survives_entry_failing_*``)."""

    def __init__(self) -> None:
        super().__init__(timedelta(seconds=1), nowfun=now)

    def is_due(self, last_run_at: datetime) -> Any:
        raise RuntimeError("dict modified while itervalues")


class SendRecorder:
    """Celery's ``mScheduler``: ``send_task`` records (or raises ``SchedulingError``)."""

    fail = False

    def send_task(self, name: Any = None, args: Any = None, kwargs: Any = None, **opts: Any) -> Any:
        if self.fail:
            from celery.beat import SchedulingError

            raise SchedulingError("Could not apply task")
        self.sent.append(name)  # type: ignore[attr-defined]
        return self.app.AsyncResult(uuid.uuid4().hex)  # type: ignore[attr-defined]


@pytest.fixture
def make_scheduler(server: NatsServer, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    from celery.beat import Scheduler

    made: list[Any] = []

    def make(kind: str, *, fail: bool = False) -> Any:
        CLOCK.now = T0
        app = Celery(f"celery-suite-{kind}", set_as_current=False)
        app.conf.update(
            broker_url="memory://",
            result_expires=None,
            beat_schedule={},
            timezone="UTC",
            nats_leader_servers=server.url,
            nats_leader_bucket=f"s{uuid.uuid4().hex[:10]}",
            nats_leader_create_bucket=True,
            nats_leader_required=True,
            nats_leader_ttl=5.0,
        )
        base = Scheduler if kind == "celery" else LeaderScheduler
        cls = type(f"m{base.__name__}", (SendRecorder, base), {"fail": fail})
        options: dict[str, Any] = {"app": app}
        if kind != "celery":
            options["schedule_filename"] = str(tmp_path / f"{uuid.uuid4().hex[:6]}.db")
        scheduler = cls(**options)
        scheduler.sent = []
        made.append(scheduler)
        if kind != "celery":
            assert scheduler.beat_role.wait_for_leadership(10)
        return scheduler

    yield make
    for scheduler in made:
        scheduler.close()


def both(make_scheduler: Callable[..., Any], **options: Any) -> tuple[Any, Any]:
    """Celery's scheduler and ours, on the same (manual) clock."""
    return make_scheduler("celery", **options), make_scheduler("leader", **options)


def beat_errors(caplog: pytest.LogCaptureFixture, scheduler: Any) -> list[logging.LogRecord]:
    """Errors on the ``celery.beat`` logger while ``scheduler`` ticked."""
    return [
        r
        for r in caplog.records
        if r.name == "celery.beat" and r.levelno >= logging.ERROR and r.ticked is scheduler
    ]


def tick_logged(scheduler: Any, caplog: pytest.LogCaptureFixture) -> float:
    """``scheduler.tick()``, its log records marked as its own."""
    first = len(caplog.records)
    delay = float(scheduler.tick())
    for record in caplog.records[first:]:
        record.ticked = scheduler
    return delay


#: Equal delays: Celery 5.7 computes them from timestamps (ts + d - ts).
SAME = 1e-6

#: Celery 5.7 logs an entry whose schedule raises and reschedules it (its
#: heap), older versions let the error out of tick(); the leader scheduler
#: does as 5.7 on every version (docs/beat.md, "Deliberate differences").
CELERY_57 = hasattr(PersistentScheduler, "_is_due_failed")


def test_due_tick(make_scheduler: Callable[..., Any]) -> None:
    for scheduler in both(make_scheduler):
        scheduler.add(name="test_due_tick", schedule=MockedSchedule(True, 1), args=(1, 2))
        assert scheduler.tick() == 0
        assert len(scheduler.sent) == 1


def test_due_tick_SchedulingError(  # Celery's name
    make_scheduler: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="celery.beat")
    for scheduler in both(make_scheduler, fail=True):
        scheduler.add(name="test_due_tick_SchedulingError", schedule=MockedSchedule(True, 1))
        assert tick_logged(scheduler, caplog) == 0
        errors = beat_errors(caplog, scheduler)
        assert errors and errors[0].getMessage().startswith("Message Error: "), caplog.records


@pytest.mark.parametrize(
    ("next_run", "expected"),
    [
        pytest.param(1, 1 - 0.010, id="test_pending_tick"),
        pytest.param(0.01, 0.010 - 0.010, id="test_pending_left_10_milliseconds_tick"),
        pytest.param(300 * 4, 300, id="test_honors_max_interval"),
        # Celery 5.7's heap wakes up early also for an unknown delay (older
        # versions return max_interval itself: 10 ms apart).
        pytest.param(None, 300 - 0.010, id="test_schedule_no_remain"),
    ],
)
def test_pending_entry_delay(
    make_scheduler: Callable[..., Any], next_run: Any, expected: float
) -> None:
    celery, ours = both(make_scheduler)
    for scheduler in (celery, ours):
        assert scheduler.max_interval == 300
        scheduler.add(name="pending", schedule=MockedSchedule(False, next_run))
    oracle = celery.tick()
    same = SAME if CELERY_57 or next_run is not None else 0.010 + SAME
    assert oracle == pytest.approx(expected, abs=same)
    assert ours.tick() == pytest.approx(oracle, abs=same)


def test_ticks(make_scheduler: Callable[..., Any]) -> None:
    nums = [600, 300, 650, 120, 250, 36]
    delays = []
    for scheduler in both(make_scheduler):
        scheduler.update_from_dict(
            {f"test_ticks{i}": {"schedule": MockedSchedule(False, j)} for i, j in enumerate(nums)}
        )
        delays.append(scheduler.tick())
    assert delays == [pytest.approx(min(nums) - 0.010, abs=SAME)] * 2


@pytest.mark.parametrize("alone", [True, False], ids=["in_populate_heap", "when_due"])
def test_tick_survives_entry_failing(
    make_scheduler: Callable[..., Any], caplog: pytest.LogCaptureFixture, alone: bool
) -> None:
    # An entry whose is_due() raises is logged on celery.beat and asked again
    # in max_interval; another entry keeps its schedule.
    caplog.set_level(logging.ERROR, logger="celery.beat")
    results = []
    for scheduler in both(make_scheduler) if CELERY_57 else both(make_scheduler)[1:]:
        scheduler.add(name="failing", schedule=RaisingSchedule())
        if not alone:
            scheduler.add(name="pending", schedule=MockedSchedule(False, 5))
        delays = [tick_logged(scheduler, caplog) for _ in range(2)]
        errors = beat_errors(caplog, scheduler)
        assert errors, caplog.records
        assert "Cannot calculate the next run of 'failing'" in errors[0].getMessage()
        assert scheduler.sent == []
        results.append(delays[-1])
    expected = 300 - 0.010 if alone else 5 - 0.010
    assert results == [pytest.approx(expected, abs=SAME)] * len(results)
