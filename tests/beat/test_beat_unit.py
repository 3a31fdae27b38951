"""Fast tests of the leader scheduler's logic, against the in-memory KV stub.

Tick arithmetic, the state record, and the scheduler itself (two replicas on
one in-memory server): followers never write, each tick is committed once,
conflicts and a lost token dispatch nothing, a failed send hands the tick
back, a new leader continues where the old one stopped. Schedules run on a
manual clock (``nowfun``), so due times are exact. The same behaviour is
exercised with real processes in the other test modules.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab, schedule

from celery_nats_leader.beat import (
    DISPATCHER_HEADER,
    ENTRY_HEADER,
    EPOCH_HEADER,
    ONCE_HEADER,
    RUN_HEADER,
    TICK_HEADER,
    TOKEN_HEADER,
    LeaderScheduler,
    check_dispatch_token,
    tick_task_id,
)
from celery_nats_leader.beat.introspection import interval_of
from celery_nats_leader.beat.schedule_store import EntryState, decode_state, encode_state, state_key
from celery_nats_leader.beat.ticks import TickPlanner, next_slot, parse_slot, slot_text
from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.backend import KVEntry
from celery_nats_leader.core.errors import (
    BackendTimeoutError,
    BucketConfigError,
    BucketNotFoundError,
    ConfigError,
    NatsUnavailableError,
    PermissionDeniedError,
)
from celery_nats_leader.election.elector import Elector
from celery_nats_leader.nats.memory import (
    MemoryBackend,
    MemoryServer,
    _MemoryBucketState,
    _Stored,
)
from celery_nats_leader.term.record import encode_record
from celery_nats_leader.worker.celery_compat import slot_schedule

UTC = timezone.utc
T0 = datetime(2024, 5, 1, 11, 59, 30, 250000, tzinfo=UTC)


class ManualNow:
    """A schedule clock the test moves by hand (one per test, see ``clock``)."""

    def __init__(self, start: datetime = T0) -> None:
        self.now = start
        self._lock = threading.Lock()

    def __call__(self) -> datetime:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += timedelta(seconds=seconds)


_CLOCK = ManualNow()


def manual_now() -> datetime:
    """The ``nowfun`` of the test schedules (a module function: shelve pickles it)."""
    return _CLOCK()


# ------------------------------------------------------------ tick identity


def test_interval_slots_are_anchor_plus_k_periods_whatever_the_clock() -> None:
    every = schedule(timedelta(seconds=10))
    anchor = T0
    slots = []
    last = anchor
    for _ in range(5):
        # Each computed on a different, skewed clock: the identity does not move.
        slot_a = next_slot(every, last, T0 + timedelta(seconds=3))
        slot_b = next_slot(every, last, T0 - timedelta(hours=2, seconds=17))
        assert slot_a == slot_b
        assert slot_a is not None
        slots.append(slot_a)
        last = slot_a
    assert slots == [anchor + timedelta(seconds=10 * k) for k in range(1, 6)]


def test_crontab_slots_are_cron_slots_in_the_app_timezone() -> None:
    app = Celery("tz", set_as_current=False)
    app.conf.timezone = "Europe/Paris"
    # What the scheduler plans with: on Celery before 5.7 the crontab gets 5.7's arithmetic.
    daily = slot_schedule(crontab(minute=0, hour=4, app=app))
    now = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)
    slot = next_slot(daily, datetime(2024, 5, 1, 1, 0, tzinfo=UTC), now)
    # 04:00 in Paris (UTC+2 in May) is 02:00 UTC.
    assert slot == datetime(2024, 5, 1, 2, 0, tzinfo=UTC)
    assert next_slot(daily, slot, now) == datetime(2024, 5, 2, 2, 0, tzinfo=UTC)
    minutely = slot_schedule(crontab(app=app))
    assert next_slot(minutely, T0, now) == datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


class OneShot:
    """A schedule with a single slot, like django-celery-beat's ``clocked``."""

    def __init__(self, at: datetime) -> None:
        self.at = at
        self.nowfun: Any = None

    def now(self) -> datetime:
        return self.nowfun() if self.nowfun else datetime.now(UTC)

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        return self.at - self.now()


def test_a_schedule_without_further_slots_has_none() -> None:
    once = OneShot(T0 + timedelta(minutes=5))
    slot = next_slot(once, T0, T0)
    assert slot == T0 + timedelta(minutes=5)
    assert next_slot(once, slot, T0 + timedelta(hours=1)) is None
    plan = TickPlanner(10).plan("once", once, slot, T0 + timedelta(hours=1))
    assert plan.slot is None and not plan.due


def test_overdue_ticks_are_caught_up_one_by_one_up_to_the_limit() -> None:
    every = schedule(timedelta(seconds=1))
    planner = TickPlanner(max_catch_up=10, interval_of=interval_of)
    now = T0 + timedelta(seconds=5.5)
    plan = planner.plan("e", every, T0, now)
    assert plan.due and plan.slot == T0 + timedelta(seconds=1) and plan.skipped == 0
    # Beyond the limit: all but the latest overdue tick are skipped.
    later = T0 + timedelta(seconds=50.5)
    plan = planner.plan("e", every, T0, later)
    assert plan.due and plan.slot == T0 + timedelta(seconds=50) and plan.skipped == 49
    # Not due yet: how long to wait.
    plan = planner.plan("e", every, T0, T0 + timedelta(seconds=0.25))
    assert not plan.due and plan.wait == pytest.approx(0.75)


def test_catch_up_is_for_a_failover_window_and_an_outage_coalesces() -> None:
    every = schedule(timedelta(seconds=1))
    planner = TickPlanner(max_catch_up=100, interval_of=interval_of, window=timedelta(seconds=25))
    # A failover: the oldest missed tick is 20 s old, inside the window: the
    # 20 missed ticks are dispatched one by one, oldest first.
    now = T0 + timedelta(seconds=20.5)
    plan = planner.plan("e", every, T0, now)
    assert (plan.slot, plan.skipped) == (T0 + timedelta(seconds=1), 0)
    for k in range(2, 21):
        plan = planner.plan("e", every, plan.slot, now)
        assert (plan.slot, plan.skipped) == (T0 + timedelta(seconds=k), 0)
    assert not planner.plan("e", every, plan.slot, now).due
    # An outage of two hours (7,200 periods): one run, the latest tick.
    later = T0 + timedelta(hours=2, seconds=0.5)
    plan = planner.plan("e", every, T0, later)
    assert (plan.slot, plan.skipped) == (T0 + timedelta(hours=2), 7199)
    assert not planner.plan("e", every, plan.slot, later).due
    # A crontab two hours behind (120 minutes) likewise: one run, at the latest minute.
    every_minute = crontab()
    plan = planner.plan("cron", every_minute, T0, later)
    assert plan.slot == (T0 + timedelta(hours=2)).replace(second=0, microsecond=0)
    assert plan.skipped >= 1
    assert not planner.plan("cron", every_minute, plan.slot, later).due
    # ... and one minute behind, inside the window: its one tick, nothing skipped.
    just = T0.replace(second=0, microsecond=0) + timedelta(minutes=1, seconds=10)
    plan = planner.plan("cron", every_minute, T0, just)
    assert (plan.slot, plan.skipped) == (just.replace(second=0), 0)


def test_without_a_window_the_count_alone_limits_catch_up() -> None:
    every = schedule(timedelta(seconds=1))
    planner = TickPlanner(max_catch_up=100, interval_of=interval_of, window=None)
    plan = planner.plan("e", every, T0, T0 + timedelta(seconds=90.5))
    assert (plan.slot, plan.skipped) == (T0 + timedelta(seconds=1), 0)


class CountingCrontab(crontab):  # type: ignore[misc]
    """A crontab that counts its remaining_estimate() calls."""

    calls = 0

    def remaining_estimate(self, last_run_at: datetime, *args: Any, **kwargs: Any) -> timedelta:
        type(self).calls += 1
        return super().remaining_estimate(last_run_at, *args, **kwargs)


def test_a_crontab_a_year_behind_is_planned_by_jumping_not_scanning() -> None:
    every_minute = CountingCrontab()
    CountingCrontab.calls = 0
    now = T0 + timedelta(days=365, seconds=20)
    plan = TickPlanner(max_catch_up=3).plan("cron", every_minute, T0, now)
    latest = (T0 + timedelta(days=365)).replace(second=0, microsecond=0)
    assert plan.due and plan.slot == latest
    # 525,600 minutes behind: a handful of jumps and a binary search, not a walk.
    assert CountingCrontab.calls <= 5 + 64
    assert plan.skipped >= 4


def test_an_interval_a_year_behind_is_planned_arithmetically() -> None:
    every = schedule(timedelta(seconds=1))
    plan = TickPlanner(max_catch_up=3, interval_of=interval_of).plan(
        "second", every, T0, T0 + timedelta(days=365, seconds=0.5)
    )
    assert plan.slot == T0 + timedelta(days=365) and plan.skipped == 365 * 86400 - 1


def test_slots_before_not_before_do_not_exist() -> None:
    every = schedule(timedelta(seconds=10))
    planner = TickPlanner(max_catch_up=100, interval_of=interval_of)
    start = T0 + timedelta(days=30 * 365)
    # A row backdated 30 years whose start time has just come: one tick, the first
    # slot at or after the start, nothing caught up.
    plan = planner.plan("row", every, T0, start + timedelta(seconds=25), not_before=start)
    assert plan.due and plan.skipped == 0 and start <= plan.slot <= start + timedelta(seconds=10)


# ------------------------------------------------------------------ state


def test_state_round_trip_and_keys() -> None:
    state = EntryState(entry="send report", slot=T0, runs=3, epoch=7, by="h:1:a", commit="c")
    assert decode_state(encode_state(state), 42) == EntryState(
        entry="send report", slot=T0, runs=3, epoch=7, by="h:1:a", commit="c", revision=42
    )
    keys = {state_key("beat", name) for name in ("a b", "a_b", "a.b", "ä", "", "x" * 300)}
    assert len(keys) == 6
    for key in keys:
        assert key.startswith("beat.") and ".." not in key and not key.endswith(".")
    assert parse_slot(slot_text(T0)) == T0


def test_an_infinite_catch_up_window_is_none(make: Any) -> None:
    assert make("a").nats_leader_planner.window == timedelta(seconds=2 * 1.0 + 5)
    endless = make("b", nats_leader_beat_catch_up_window=float("inf"))
    assert endless.nats_leader_planner.window is None


def test_the_catch_up_window_defaults_to_twice_the_ttl_plus_five_seconds() -> None:
    assert LeaderSettings().catch_up_window() == 2 * 10.0 + 5
    assert LeaderSettings(ttl=30).catch_up_window() == 65.0
    assert LeaderSettings(role_options={"beat": {"ttl": 2.0}}).catch_up_window() == 9.0
    assert LeaderSettings(ttl=30, beat_catch_up_window=3600).catch_up_window() == 3600.0
    assert LeaderSettings(beat_catch_up_window=0).catch_up_window() == 0.0


def test_settings_reject_bad_beat_values() -> None:
    assert LeaderSettings(bucket="elections").beat_state_bucket == "elections_beat"
    for bad in (-1, "10", True, float("nan")):
        with pytest.raises(ConfigError, match="beat_catch_up_window"):
            LeaderSettings(beat_catch_up_window=bad)
    with pytest.raises(ConfigError, match="beat_max_catch_up"):
        LeaderSettings(beat_max_catch_up=-1)
    with pytest.raises(ConfigError, match="beat_follower_interval"):
        LeaderSettings(beat_follower_interval=0)
    with pytest.raises(ConfigError, match="bucket"):
        LeaderSettings(beat_state_bucket="no.dots")


# -------------------------------------------------------------- scheduler


class Sent:
    def __init__(self, name: str, options: dict[str, Any]) -> None:
        self.name = name
        self.options = options
        self.headers = options["headers"]
        self.tick = parse_slot(self.headers[TICK_HEADER])


class MemoryScheduler(LeaderScheduler):
    """The real scheduler, on the in-memory KV, recording instead of sending."""

    server: MemoryServer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.sent: list[Sent] = []
        self.syncs = 0
        self.fail_sends = 0
        super().__init__(*args, **kwargs)

    def make_elector(self) -> Elector:
        server = self.server
        return Elector(backend_factory=lambda: MemoryBackend(server))

    def apply_async(self, entry: Any, producer: Any = None, advance: bool = True, **kw: Any) -> Any:
        if self.fail_sends:
            self.fail_sends -= 1
            raise ConnectionError("broker down")
        self.sent.append(Sent(entry.name, entry.options))
        return None

    @property
    def producer(self) -> Any:
        return None

    def sync(self) -> None:
        self.syncs += 1
        super().sync()


@pytest.fixture
def server() -> MemoryServer:
    return MemoryServer()


@pytest.fixture
def clock() -> ManualNow:
    _CLOCK.now = T0
    return _CLOCK


@pytest.fixture
def make(server: MemoryServer, clock: ManualNow, tmp_path: Path) -> Iterator[Any]:
    made: list[MemoryScheduler] = []

    def factory(name: str, **conf: Any) -> MemoryScheduler:
        app = Celery(f"unit-{name}", set_as_current=False)
        app.conf.update(
            broker_url="memory://",
            result_expires=None,
            timezone="UTC",
            beat_schedule={
                "ten-seconds": {
                    "task": "unit.ten",
                    "schedule": schedule(timedelta(seconds=10), nowfun=manual_now),
                },
            },
            nats_leader_ttl=1.0,
            nats_leader_create_bucket=True,
            nats_leader_required=True,
            nats_leader_beat_follower_interval=0.05,
            nats_leader_instance_id=f"unit-{name}",
            **conf,
        )
        cls = type("Scheduler", (MemoryScheduler,), {"server": server})
        scheduler = cls(
            app=app, schedule_filename=str(tmp_path / f"schedule-{name}"), max_interval=5
        )
        made.append(scheduler)
        return scheduler

    yield factory
    for scheduler in made:
        scheduler.close()


def poke(server: MemoryServer, bucket: str, key: str, value: bytes) -> int:
    """Write into the in-memory KV behind every watch's back.

    Like a write by another process whose watch event has not arrived yet:
    only a read (the token validation, a compare-and-set) can notice it.
    """
    server.revision += 1
    server.buckets[bucket].keys[key] = _Stored(
        KVEntry(key, value, server.revision), server.clock.monotonic()
    )
    return server.revision


def drive(scheduler: MemoryScheduler, passes: int = 20) -> None:
    """Tick until nothing is due (a bounded number of passes)."""
    for _ in range(passes):
        if scheduler.tick() != 0.0:
            return
    raise AssertionError(f"still dispatching after {passes} passes")


def leader_and_follower(make: Any, **conf: Any) -> tuple[MemoryScheduler, MemoryScheduler]:
    a = make("a", **conf)
    assert a.beat_role is not None and a.beat_role.wait_for_leadership(5)
    b = make("b", **conf)
    assert not b.is_leader
    return a, b


@pytest.mark.parametrize(
    ("conf", "options", "once"),
    [
        ({}, {}, True),
        ({}, {ONCE_HEADER: False}, False),
        ({}, {"headers": {ONCE_HEADER: False}}, False),  # a database row's headers
        ({}, {"headers": {ONCE_HEADER: "false"}}, False),
        ({"nats_leader_beat_once": False}, {}, False),
        ({}, {"task_id": "fixed"}, False),  # the same id every tick: not a tick's identity
    ],
    ids=["default", "entry-option", "entry-header", "entry-header-text", "setting", "own-id"],
)
def test_ticks_are_marked_run_once_unless_opted_out(
    make: Any, clock: ManualNow, conf: dict[str, Any], options: dict[str, Any], once: bool
) -> None:
    a = make("a", **conf)
    a.schedule["ten-seconds"].options.update(options)
    assert a.tick() > 0
    clock.advance(10)
    assert a.tick() == 0.0
    [sent] = a.sent
    assert sent.headers[ONCE_HEADER] is once
    # Our option never reaches Celery's apply_async (it would become a message property).
    assert ONCE_HEADER not in sent.options


def test_a_follower_tick_reads_and_writes_nothing(make: Any, server: MemoryServer) -> None:
    a, b = leader_and_follower(make)
    assert a.tick() >= 0  # the leader anchors its entry

    def state() -> dict[str, int]:
        keys = server.buckets["leaders_beat"].keys
        return {key: stored.entry.revision for key, stored in keys.items()}

    before, syncs = state(), b.syncs  # (setup syncs the definitions, once)
    started = time.monotonic()
    for _ in range(5):
        assert b.tick() == 0.0
    elapsed = time.monotonic() - started
    # Bounded waits (beat_follower_interval each), then it looks again.
    assert elapsed < 5 * 0.05 + 1.0
    assert state() == before, "a follower wrote schedule state"
    assert b.sent == [] and b.syncs == syncs and not b.should_sync()
    assert b.entry_states() == {}


def test_a_pass_after_beats_stop_signal_ends_beat(make: Any, clock: ManualNow) -> None:
    # celery beat's SIGTERM handler closes the scheduler, then raises
    # SystemExit; Python drops that exception when the signal lands in a
    # weakref callback or a __del__, and beat goes on ticking.
    a = make("a")
    assert a.tick() > 0
    a.close()
    with pytest.raises(SystemExit):
        a.tick()
    assert a.sent == []


def test_a_pass_cut_short_by_beats_stop_signal_ends_beat(
    make: Any, clock: ManualNow, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The signal closes the scheduler while its first pass opens the state
    # bucket: the pending request is cancelled. Beat stops (as the signal
    # meant), instead of failing with the cancelled request's error.
    a = make("a")
    dispatcher = a.nats_leader_dispatcher
    assert dispatcher is not None

    def closed_while_opening(token: Any) -> None:
        a.close()
        raise concurrent.futures.CancelledError()

    monkeypatch.setattr(dispatcher, "begin_term", closed_while_opening)
    with pytest.raises(SystemExit):
        a.tick()
    # The same error on an open scheduler is no stop signal: it is raised.
    b = make("b")
    b_dispatcher = b.nats_leader_dispatcher
    assert b_dispatcher is not None

    def cancelled(token: Any) -> None:
        raise concurrent.futures.CancelledError()

    monkeypatch.setattr(b_dispatcher, "begin_term", cancelled)
    a_role = a.beat_role
    assert a_role is None or not a_role.is_leader
    assert b.beat_role is not None and b.beat_role.wait_for_leadership(5)
    with pytest.raises(concurrent.futures.CancelledError):
        b.tick()


def test_each_tick_dispatched_once_with_its_identity(make: Any, clock: ManualNow) -> None:
    a, _ = leader_and_follower(make)
    assert a.tick() > 0
    anchor = a.entry_states()["ten-seconds"].slot
    assert a.sent == []
    clock.advance(10)
    assert a.tick() == 0.0
    assert a.tick() > 0  # nothing else due
    [sent] = a.sent
    assert sent.tick == anchor + timedelta(seconds=10)
    token = a.beat_role.token if a.beat_role else None
    # The term's epoch and who sent it; never the token, a secret of the term.
    assert token is not None and sent.headers[EPOCH_HEADER] == token.epoch
    assert sent.headers[DISPATCHER_HEADER] == "unit-a" and TOKEN_HEADER not in sent.headers
    assert token.value not in repr(sent.options)
    assert sent.headers[ONCE_HEADER] is True
    assert sent.headers[ENTRY_HEADER] == "ten-seconds" and sent.headers[RUN_HEADER] == 1
    assert sent.options["task_id"] == tick_task_id(
        "leaders_beat", "beat", "ten-seconds", slot_text(sent.tick)
    )
    # The entry's own options are untouched (they may be persisted).
    assert "task_id" not in a.schedule["ten-seconds"].options
    state = a.entry_states()["ten-seconds"]
    assert (state.slot, state.runs, state.epoch) == (sent.tick, 1, token.epoch)
    assert a.schedule["ten-seconds"].total_run_count == 1


def test_a_state_written_meanwhile_makes_the_dispatch_back_off(
    make: Any, clock: ManualNow, server: MemoryServer
) -> None:
    a, _ = leader_and_follower(make)
    a.tick()
    state = a.entry_states()["ten-seconds"]
    # Another scheduler that believed it led committed the next tick first.
    other = state.advanced(state.slot + timedelta(seconds=10), epoch=state.epoch, by="someone")
    key = state_key("beat", "ten-seconds")
    assert server.buckets["leaders_beat"].keys[key].entry.revision == state.revision
    poke(server, "leaders_beat", key, encode_state(other))
    clock.advance(10)
    assert a.tick() == 0.0
    assert a.sent == [], "the tick committed by someone else was dispatched again"
    assert a.entry_states()["ten-seconds"].by == "someone"
    clock.advance(10)
    a.tick()
    assert [s.tick for s in a.sent] == [state.slot + timedelta(seconds=20)]


def test_a_lost_token_dispatches_nothing_and_demotes(
    make: Any, clock: ManualNow, server: MemoryServer
) -> None:
    a, _ = leader_and_follower(make)
    a.tick()
    # The role's key now holds another term (as after this process was paused).
    record = encode_record(instance_id="x", token="t", epoch=None, priority=0, meta={})
    revision = poke(server, "leaders", "beat", record)
    clock.advance(10)
    a.tick()
    assert a.sent == []
    assert not a.is_leader
    assert (
        server.buckets["leaders_beat"].keys[state_key("beat", "ten-seconds")].entry.revision
        < revision
    )


def test_a_failed_send_hands_the_tick_back(make: Any, clock: ManualNow, caplog: Any) -> None:
    a, _ = leader_and_follower(make)
    a.tick()
    before = a.entry_states()["ten-seconds"]
    a.fail_sends = 2
    clock.advance(10)
    with caplog.at_level(logging.WARNING, logger="celery_nats_leader.beat"):
        assert a.tick() == 0.0
    assert a.sent == []
    undone = a.entry_states()["ten-seconds"]
    assert (undone.slot, undone.runs) == (before.slot, before.runs)
    assert "commit undone" in caplog.text
    # The entry backs off (0.125 s: half the heartbeat), doubling per failure;
    # as Celery, tick() asks to wake up 10 ms early.
    first = a.tick()
    assert first == pytest.approx(0.125 - 0.010, abs=0.01)
    clock.advance(first + 0.010)
    assert a.tick() == 0.0 and a.sent == []
    second = a.tick()
    assert second == pytest.approx(0.25 - 0.010, abs=0.01)
    clock.advance(second + 0.010)
    a.tick()
    assert [s.tick for s in a.sent] == [before.slot + timedelta(seconds=10)]
    counts = a.nats_leader_metrics.snapshot()["ten-seconds"]
    assert (counts["send_failed"], counts["reverted"], counts["dispatched"]) == (2, 2, 1)


def test_the_lease_ending_before_the_send_hands_the_tick_back(make: Any, clock: ManualNow) -> None:
    a, _ = leader_and_follower(make)
    a.tick()
    before = a.entry_states()["ten-seconds"]
    handle = a.beat_role
    assert handle is not None
    store = a.nats_leader_election.store
    assert store is not None
    real_update = store.update
    committed: list[Any] = []

    def update(state: EntryState, *, last: int) -> EntryState:
        result = real_update(state, last=last)
        if not committed:
            committed.append(result)
            # The lease runs out right after the commit (a pause, a slow loop).
            handle.election._lease_deadline = 0.0  # type: ignore[attr-defined]
        return result

    store.update = update  # type: ignore[method-assign]
    clock.advance(10)
    a.tick()
    assert committed and a.sent == []
    assert a.entry_states()["ten-seconds"].slot == before.slot


def test_a_new_leader_continues_without_duplicate_or_gap(make: Any, clock: ManualNow) -> None:
    # A hand-over that lasts three 10-s periods: inside a catch-up window of 60 s
    # (the default, 2 x ttl + 5 = 7 s here, is for a 1-s TTL's failovers).
    a, b = leader_and_follower(make, nats_leader_beat_catch_up_window=60)
    a.tick()
    for _ in range(3):
        clock.advance(10)
        a.tick()
    assert len(a.sent) == 3
    last = a.sent[-1].tick
    a.close()  # releases the role: b takes over
    assert b.beat_role is not None and b.beat_role.wait_for_leadership(5)
    # Three ticks were missed during the hand-over: each is dispatched once.
    clock.advance(30)
    drive(b)
    assert [s.tick for s in b.sent] == [last + timedelta(seconds=10 * k) for k in (1, 2, 3)]
    assert b.entry_states()["ten-seconds"].runs == 6


def test_too_many_overdue_ticks_are_coalesced(make: Any, clock: ManualNow, caplog: Any) -> None:
    a = make("a", nats_leader_beat_max_catch_up=2)
    assert a.beat_role is not None and a.beat_role.wait_for_leadership(5)
    a.tick()
    anchor = a.entry_states()["ten-seconds"].slot
    clock.advance(100)
    with caplog.at_level(logging.WARNING, logger="celery_nats_leader.beat"):
        drive(a)
    assert [s.tick for s in a.sent] == [anchor + timedelta(seconds=100)]
    state = a.entry_states()["ten-seconds"]
    assert (state.runs, state.skipped) == (1, 9)
    assert "skipped all but the latest" in caplog.text


def test_a_gate_holds_a_due_tick(make: Any, clock: ManualNow) -> None:
    a, _ = leader_and_follower(make)
    gated: list[str] = []

    def gate(entry: Any, state: EntryState) -> float | None:
        gated.append(entry.name)
        return 2.5

    a.dispatch_gate = gate  # type: ignore[method-assign]
    a.tick()
    clock.advance(10)
    assert a.tick() == 2.5 - 0.010  # as Celery: 10 ms early
    assert a.sent == [] and gated == ["ten-seconds"]


class DueEveryOtherCheck:
    """A custom schedule with ``is_due`` only (no ``remaining_estimate``)."""

    def __init__(self) -> None:
        self.nowfun: Any = None
        self.checks = 0

    def now(self) -> datetime:
        return manual_now()

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        raise NotImplementedError

    def is_due(self, last_run_at: datetime) -> tuple[bool, float]:
        self.checks += 1
        return (self.checks % 2 == 0, 3.0)

    def __eq__(self, other: object) -> bool:
        # As Celery's own schedules: equal when unedited (shelve copies compare equal).
        return type(other) is type(self)

    __hash__ = None  # type: ignore[assignment]


class Broken(DueEveryOtherCheck):
    """A schedule that cannot say when it is due."""

    def is_due(self, last_run_at: datetime) -> tuple[bool, float]:
        raise ValueError("broken schedule")


def test_a_schedule_without_slots_still_dispatches_once_per_due_check(
    make: Any, clock: ManualNow
) -> None:
    a, _ = leader_and_follower(make)
    entry = a.schedule["ten-seconds"]
    entry.schedule = DueEveryOtherCheck()
    # First check: not due, ask again in 3 s (honoured: nothing asked
    # before); as Celery, tick() asks to wake up 10 ms early.
    assert a.tick() == 3.0 - 0.010
    assert a.tick() == pytest.approx(3.0 - 0.010) and entry.schedule.checks == 1
    clock.advance(3)
    assert a.tick() == 0.0
    [sent] = a.sent
    assert sent.tick == clock.now
    assert a.tick() == 3.0 - 0.010
    assert len(a.sent) == 1


def test_an_entry_that_cannot_be_calculated_does_not_stop_the_others(
    make: Any, clock: ManualNow, caplog: Any
) -> None:
    a, _ = leader_and_follower(make)
    a.tick()
    clock.advance(10)
    a.add(name="broken", task="unit.broken", schedule=Broken())
    # Logged as Celery logs it, on the celery.beat logger.
    with caplog.at_level(logging.ERROR, logger="celery.beat"):
        drive(a)
        drive(a)
    assert [s.name for s in a.sent] == ["ten-seconds"]
    # Asked again after max_interval (5 s) on its clock, as Celery: not in a loop.
    assert caplog.text.count("Cannot calculate the next run of 'broken'") == 1
    clock.advance(5)
    with caplog.at_level(logging.ERROR, logger="celery.beat"):
        drive(a)
    assert caplog.text.count("Cannot calculate the next run of 'broken'") == 2


def test_a_persistent_state_bucket_with_max_age_is_refused(make: Any, server: MemoryServer) -> None:
    server.buckets["leaders_beat"] = _MemoryBucketState(ttl=60.0)
    with pytest.raises(BucketConfigError, match="must not expire"):
        make("a")


def test_a_missing_state_bucket_stops_beat_with_the_command_to_fix_it(
    server: MemoryServer, tmp_path: Path
) -> None:
    server.buckets["leaders"] = _MemoryBucketState(ttl=1.0)
    app = Celery("missing", set_as_current=False)
    app.conf.update(broker_url="memory://", nats_leader_ttl=1.0, nats_leader_required=True)
    cls = type("Scheduler", (MemoryScheduler,), {"server": server})
    with pytest.raises(BucketNotFoundError, match="leaders_beat"):
        cls(app=app, schedule_filename=str(tmp_path / "s"), max_interval=1)


def test_unreachable_nats_with_required_stops_beat_loudly(tmp_path: Path) -> None:
    app = Celery("unreachable", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        nats_leader_servers="nats://127.0.0.1:1",
        nats_leader_required=True,
        nats_leader_start_timeout=1.0,
    )
    with pytest.raises(NatsUnavailableError):
        LeaderScheduler(app=app, schedule_filename=str(tmp_path / "s"), max_interval=1)


def test_an_allcall_beat_role_is_refused_with_the_setting_that_fixes_it(tmp_path: Path) -> None:
    # Workers fence beat's messages by the role's KV key, which ALLCALL does not write.
    app = Celery("allcall", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        nats_leader_servers="nats://127.0.0.1:1",
        nats_leader_strategy="allcall",
    )
    with pytest.raises(ConfigError) as refused:
        LeaderScheduler(app=app, schedule_filename=str(tmp_path / "s"), max_interval=1)
    assert str(refused.value) == (
        "the beat role 'beat' is elected with the 'allcall' strategy; beat needs 'kv' "
        "(workers fence its messages by the role's KV key, which an ALLCALL election does "
        "not write). Set nats_leader_role_options={'beat': {'strategy': 'kv'}}, or "
        "nats_leader_strategy='kv'"
    )
    # The setting it names gives the beat role the KV strategy, the others keep ALLCALL.
    fixed = LeaderSettings(strategy="allcall", role_options={"beat": {"strategy": "kv"}})
    assert fixed.election_config("beat").strategy == "kv"
    assert fixed.election_config("reports").strategy == "allcall"


def test_dispatch_check_without_io_for_unfenced_and_malformed() -> None:
    app = Celery("check", set_as_current=False)

    class Request:
        def __init__(self, headers: dict[str, Any]) -> None:
            self.headers = headers

    verdict = check_dispatch_token(Request({}), app)
    assert verdict.ok and not verdict.fenced
    verdict = check_dispatch_token(Request({TOKEN_HEADER: "nope"}), app)
    assert not verdict.ok and verdict.fenced and "malformed" in verdict.reason
    for bad in ("nope", "-3", 0, True, "12:abc"):
        verdict = check_dispatch_token(Request({EPOCH_HEADER: bad}), app)
        assert not verdict.ok and verdict.fenced and "malformed" in verdict.reason, bad


@pytest.mark.parametrize(
    ("error", "needs_operator"),
    [
        (PermissionDeniedError("permissions violation for $JS.API.STREAM.INFO"), True),
        (BucketNotFoundError("KV bucket 'leaders' does not exist"), True),
        (BackendTimeoutError("no answer"), False),
    ],
)
def test_the_dispatch_fence_says_when_an_unreadable_term_needs_an_operator(
    error: Exception, needs_operator: bool
) -> None:
    # An unreadable term keeps the message (it is checked again); a missing
    # bucket or permission does not pass by itself: said at ERROR, checked
    # less often. A timeout or an outage passes: checked every second.
    from celery_nats_leader.beat.dispatch_fence import DispatchFence
    from celery_nats_leader.config.connection import ConnectOptions

    class Unreadable(DispatchFence):
        def read_role(self, role: str) -> tuple[int | None, int]:
            raise error

    fence = Unreadable(ConnectOptions(), "leaders")
    verdict = fence.check("beat", 7, "every-minute")
    assert (verdict.ok, verdict.certain) == (False, False)
    assert verdict.needs_operator is needs_operator
