"""Migrating to the leader scheduler from each previous scheduler, as docs/migrating.md says.

For each previous scheduler, the real one runs first (``celery beat`` with
Celery's ``PersistentScheduler``, the same under single-beat on two hosts
with its Redis lock, celery-redbeat on Redis, django-celery-beat's
``DatabaseScheduler`` on PostgreSQL) and sends a 2-second interval entry to a
real worker; then the documented cut-over: stop it gracefully, seed our state
from its storage (``celery nats-leader seed-beat`` / ``manage.py
election_seed_beat``), start ``celery beat -S nats_leader`` (or
``django_nats_leader``). The ledger must show, across the cut-over, none lost
(the first tick is the old scheduler's last run + 2 s, then every slot), none
doubled (each tick once, the old last run not again) and no burst (only the
ticks that came due during the cut-over are caught up).

The new scheduler runs with a schedule file of its own (``-s``): as on a
host other than the old beat's, it sees none of the old file's ``last_run_at``.
The TTL is 5 s (catch-up window 15 s): a cut-over on a loaded machine takes
several seconds, and only ticks missed inside the window are caught up one by one.
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from cnl_beat_harness import CELERY, HERE, BeatCluster, Database, wait_for
from cnl_beat_ledger import Run

from celery_nats_leader.beat.ticks import parse_slot
from celery_nats_leader.config.settings import LeaderSettings
from tests.support.brokers import REDIS_URL
from tests.support.services import require_service

pytestmark = [pytest.mark.integration, pytest.mark.celery, pytest.mark.timeout(240)]

PERIOD = 2
ENTRY = "every-two-seconds"
ENTRIES = [{"name": ENTRY, "kind": "interval", "seconds": PERIOD}]
TTL = 5.0
WINDOW = LeaderSettings(ttl=TTL).catch_up_window()
STEP = timedelta(seconds=PERIOD)


def old_runs(cluster: BeatCluster) -> list[Run]:
    """The runs the previous scheduler sent (no tick header)."""
    return [r for r in cluster.ledger.runs("cnl_beat.record") if r.tick is None]


def run_old_then_stop(cluster: BeatCluster, runs: int = 3, hosts: int = 1) -> float:
    """Run the previous scheduler until the worker ran ``runs`` ticks, then stop it (SIGTERM).

    Args:
        cluster: Where it runs.
        runs: Ticks to see first.
        hosts: Beat processes started (under a wrapper such as single-beat,
            which runs the scheduler on one of them).

    Returns:
        When it had stopped (wall clock).

    """
    cluster.start_worker()
    old = [cluster.start_beat() for _ in range(hosts)]
    deadline = time.monotonic() + 60
    while len(old_runs(cluster)) < runs:
        assert all(proc.alive for proc in old), [proc.log()[-3000:] for proc in old]
        assert time.monotonic() < deadline, cluster.diagnostics()
        # Nothing to await but the worker's ledger rows (another process's writes).
        time.sleep(0.1)
    for proc in old:
        proc.signal(signal.SIGTERM)
    for proc in old:
        assert proc.wait(30) == 0, proc.log()[-3000:]
    return time.time()


def seed(cluster: BeatCluster, argv: list[str], entry: str = ENTRY) -> dict[str, Any]:
    """Run a seed command the way an operator would; its JSON outcome for ``entry``."""
    result = subprocess.run(
        argv,
        env=cluster.env,
        cwd=str(HERE),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    body = json.loads(result.stdout.strip().splitlines()[-1])
    by_name = {e["entry"]: e for e in body["entries"]}
    return dict(by_name[entry])


def start_ours_and_check(
    cluster: BeatCluster, scheduler: str, seeded: dict[str, Any], stopped: float
) -> None:
    """Start our scheduler, let it run, and check the ticks across the cut-over."""
    assert seeded["action"] == "seeded", seeded
    last = parse_slot(seeded["last_run_at"])
    before = old_runs(cluster)
    # The seed is the old scheduler's own count and last run.
    assert seeded["runs"] == len(before) >= 3, (seeded, len(before))
    assert abs(last.timestamp() - before[-1].wall) < 1.0, (last, before[-1].wall)

    # A cut-over of three periods (a deploy): ticks come due while no
    # scheduler runs, inside the catch-up window. The duration is the thing
    # under test: nothing to await but the clock.
    wait_for(lambda: time.time() >= stopped + 3 * PERIOD, 3 * PERIOD + 5, "the cut-over")
    cluster.scheduler = scheduler
    cluster.start_beat()
    leader = cluster.wait_leader()
    cluster.wait_runs_by(leader.epoch, 7)
    cluster.drain()
    assert old_runs(cluster) == before  # the old scheduler is gone

    new = sorted(cluster.runs(ENTRY), key=lambda r: parse_slot(r.tick or ""))
    slots = [parse_slot(r.tick or "") for r in new]
    # None lost: the first tick is the one the old scheduler would have sent
    # next, then every slot; none doubled: each once, the old last run not again.
    assert slots[0] == last + STEP, (slots[0], last)
    assert slots == [last + k * STEP for k in range(1, len(slots) + 1)]
    assert len({r.task_id for r in new}) == len(new)
    state = cluster.recorder.state_writes(ENTRY)[-1][1]
    assert (state.runs, state.skipped) == (seeded["runs"] + len(new), 0)
    # No burst: only the ticks that came due during the cut-over went out at
    # once (each late by the cut-over), the rest on time.
    first_run = new[0].wall
    caught_up = [s for s in slots if s.timestamp() < first_run - 0.3]
    due_in_cut_over = [
        s for s in (last + k * STEP for k in range(1, 100)) if s.timestamp() < first_run - 0.3
    ]
    assert 2 <= len(caught_up) == len(due_in_cut_over) <= WINDOW / PERIOD
    for run, slot in zip(new, slots, strict=True):
        if slot.timestamp() >= first_run:
            assert run.wall <= slot.timestamp() + 2.0, (slot, run.wall)
    print(
        f"{scheduler}: old scheduler {len(before)} runs, last {last.isoformat()}; cut-over "
        f"{first_run - stopped:.1f}s after its stop; {len(caught_up)} missed ticks caught up; "
        f"{len(new)} ticks by ours, first {slots[0].isoformat()}"
    )


def test_from_celerys_persistent_scheduler(
    cluster_factory: Callable[..., BeatCluster], tmp_path: Path
) -> None:
    cluster = cluster_factory(entries=ENTRIES, scheduler="celery.beat:PersistentScheduler", ttl=TTL)
    stopped = run_old_then_stop(cluster)
    seeded = seed(
        cluster,
        [CELERY, "-A", "cnl_beat_app", "nats-leader", "seed-beat", "--json",
         "--shelve", str(tmp_path / "schedule0")],
    )  # fmt: skip
    start_ours_and_check(cluster, "nats_leader", seeded, stopped)


def test_from_single_beat(cluster_factory: Callable[..., BeatCluster], tmp_path: Path) -> None:
    """single-beat on two hosts ran Celery's PersistentScheduler on one of them."""
    require_service("redis (single-beat)", REDIS_URL)
    import redis

    identifier = f"cnl-migrate-{uuid.uuid4().hex[:10]}"
    cluster = cluster_factory(entries=ENTRIES, scheduler="celery.beat:PersistentScheduler", ttl=TTL)
    cluster.beat_wrapper = [str(Path(sys.executable).parent / "single-beat")]
    cluster.wrapper_env = {
        "SINGLE_BEAT_REDIS_SERVER": REDIS_URL,
        "SINGLE_BEAT_IDENTIFIER": identifier,
        "SINGLE_BEAT_LOCK_TIME": "5",
        "SINGLE_BEAT_HEARTBEAT_INTERVAL": "1",
        "SINGLE_BEAT_LOG_LEVEL": "info",
    }
    client = redis.Redis.from_url(REDIS_URL)
    try:
        # single-beat on two hosts; the cut-over's first step stops it on
        # both (it stops its celery beat child with SIGTERM).
        stopped = run_old_then_stop(cluster, hosts=2)
        # Only the host whose single-beat held the lock ran celery beat and
        # wrote a schedule file: seed from that one.
        written = [i for i in (0, 1) if list(tmp_path.glob(f"schedule{i}*"))]
        assert len(written) == 1, sorted(p.name for p in tmp_path.iterdir())
        seeded = seed(
            cluster,
            [CELERY, "-A", "cnl_beat_app", "nats-leader", "seed-beat", "--json",
             "--shelve", str(tmp_path / f"schedule{written[0]}")],
        )  # fmt: skip
        # Then celery beat -S nats_leader directly, without single-beat.
        cluster.beat_wrapper, cluster.wrapper_env = [], {}
        start_ours_and_check(cluster, "nats_leader", seeded, stopped)
    finally:
        for key in client.scan_iter(f"*{identifier}*"):
            client.delete(key)
        client.close()


def test_from_celery_redbeat(cluster_factory: Callable[..., BeatCluster]) -> None:
    require_service("redis (celery-redbeat)", REDIS_URL)
    import redis

    prefix = f"cnl-migrate-{uuid.uuid4().hex[:10]}:redbeat"
    cluster = cluster_factory(entries=ENTRIES, scheduler="redbeat.RedBeatScheduler", ttl=TTL)
    cluster.config["celery"] = {
        "redbeat_redis_url": REDIS_URL,
        "redbeat_key_prefix": prefix,
        "redbeat_lock_timeout": 5,
    }
    client = redis.Redis.from_url(REDIS_URL)
    try:
        stopped = run_old_then_stop(cluster)
        argv = [CELERY, "-A", "cnl_beat_app", "nats-leader", "seed-beat", "--redbeat", "--json"]
        seeded = seed(cluster, argv)
        start_ours_and_check(cluster, "nats_leader", seeded, stopped)
    finally:
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        client.close()


def test_from_django_celery_beats_database_scheduler(
    cluster_factory: Callable[..., BeatCluster], database: Database
) -> None:
    cluster = cluster_factory(
        entries=ENTRIES,
        scheduler="django_celery_beat.schedulers:DatabaseScheduler",
        database=database,
        ttl=TTL,
    )
    cluster.django_setup()
    stopped = run_old_then_stop(cluster)
    seeded = seed(cluster, [sys.executable, "-m", "django", "election_seed_beat", "--json"])
    start_ours_and_check(cluster, "django_nats_leader", seeded, stopped)


def test_seeding_twice_keeps_the_state(cluster_factory: Callable[..., BeatCluster]) -> None:
    # A second run (an operator repeating the step) leaves the seeded state alone.
    cluster = cluster_factory(entries=ENTRIES, scheduler="celery.beat:PersistentScheduler", ttl=TTL)
    run_old_then_stop(cluster, runs=1)
    argv = [CELERY, "-A", "cnl_beat_app", "nats-leader", "seed-beat", "--json",
            "--shelve", str(cluster.tmp / "schedule0")]  # fmt: skip
    first = seed(cluster, argv)
    again = seed(cluster, argv)
    assert (first["action"], again["action"]) == ("seeded", "kept")
    assert again["state"]["slot"] == first["state"]["slot"]
    assert datetime.fromisoformat(first["last_run_at"]) == parse_slot(first["state"]["slot"])


# ------------------------------------------- the first start after a cut-over

#: docs/migrating.md's cut-over table at scale: TTL 1.5 s, so the default
#: catch-up window is 2 x 1.5 + 5 = 8 s, and an entry with one tick a second.
CUT_TTL = 1.5
CUT_WINDOW = LeaderSettings(ttl=CUT_TTL).catch_up_window()
#: Seconds from the old beat's stop to the new one's start (its own start-up,
#: one to a few seconds, adds to the cut-over): well inside the window, or
#: longer than the window plus a period whatever the start-up.
CUT_OVERS = {"shorter": 3.0, "longer": CUT_WINDOW + 4.0}
#: "No burst": at most floor(window / period) + 1 ticks of an entry are
#: dispatched back to back at the first start (9 here).
BURST = math.floor(CUT_WINDOW / 1.0) + 1


@pytest.mark.parametrize("cut_over", ["shorter", "longer"])
@pytest.mark.parametrize("kind", ["interval", "fastcron"])
def test_the_first_start_after_a_cut_over(
    cluster_factory: Callable[..., BeatCluster], tmp_path: Path, kind: str, cut_over: str
) -> None:
    """A cut-over shorter than the window: each missed tick once, back to back; longer: one run.

    ``interval`` is a 1-s interval; ``fastcron`` a real ``crontab(minute="*")``
    on the 60x schedule clock (one cron minute a second, the window measured
    on that clock: 8 s x 60), through the crontab's own code path.
    """
    name = f"{kind}-cut-over"
    cluster = cluster_factory(
        entries=[{"name": name, "kind": kind, "seconds": 1}],
        scheduler="celery.beat:PersistentScheduler",
        ttl=CUT_TTL,
    )
    speed = float(cluster.config["speed"]) if kind == "fastcron" else 1.0
    step = timedelta(seconds=speed)  # one period, on the schedule's clock

    def real(slot: datetime) -> float:
        """The wall-clock time of a slot (a fastcron's clock runs ``speed`` x from t0)."""
        return cluster.t0 + (slot.timestamp() - cluster.t0) / speed

    stopped = run_old_then_stop(cluster, runs=1)
    seeded = seed(
        cluster,
        [CELERY, "-A", "cnl_beat_app", "nats-leader", "seed-beat", "--json",
         "--shelve", str(tmp_path / "schedule0")],
        entry=name,
    )  # fmt: skip
    assert seeded["action"] == "seeded", seeded
    last = parse_slot(seeded["last_run_at"])
    # The tick the old scheduler would have sent next: the oldest one missed.
    first_due = last + step if kind == "interval" else last.replace(second=0, microsecond=0) + step

    # The cut-over's length is the thing under test: nothing to await but the clock.
    pause = CUT_OVERS[cut_over]
    wait_for(lambda: time.time() >= stopped + pause, pause + 5, "the cut-over")
    cluster.scheduler = "nats_leader"
    cluster.start_beat()
    leader = cluster.wait_leader()
    # The ticks of the first start (up to 6 after the shorter cut-over, 1
    # after the longer one), then some on time.
    cluster.wait_runs_by(leader.epoch, 8 if cut_over == "shorter" else 4)
    cluster.drain()

    new = sorted(cluster.runs(name), key=lambda r: parse_slot(r.tick or ""))
    slots = [parse_slot(r.tick or "") for r in new]
    # None twice: each tick once (one task id each), the old last run not again.
    assert len({r.task_id for r in new}) == len(new) == len(set(slots))
    assert slots[0] > last
    # None lost after the first: every slot from the first start on.
    assert slots == [slots[0] + k * step for k in range(len(slots))]
    writes = [(seen, s) for seen, s in cluster.recorder.state_writes(name) if s.by != "seed"]
    final = writes[-1][1]
    assert final.runs == seeded["runs"] + len(new)
    # The recorder's clock is the monotonic one: the first commit on the wall clock.
    to_wall = time.time() - time.monotonic()
    started = writes[0][0].mono + to_wall
    committed = {s.slot: seen.mono + to_wall for seen, s in writes if s.pending}

    if cut_over == "shorter":
        # The oldest missed tick was inside the window at the first start.
        age = started - real(first_due)
        assert age <= CUT_WINDOW, f"the first start came {age:.1f}s after the tick: a loaded host"
        # Each tick that came due during the cut-over: once, oldest first, none skipped...
        assert slots[0] == first_due, (slots[0], first_due)
        assert all(s.skipped == 0 for _, s in writes)
        overdue = [s for s in slots if real(s) <= started]
        assert 2 <= len(overdue) <= BURST, (len(overdue), BURST)
        # ... back to back: one after another at the first start, faster than
        # one a period (a scheduler that waited for each tick's own period
        # would take (n - 1) periods), and all before the next tick on time.
        # Not "before the next tick came due": that is anything from 0 to a
        # period after the first start, and a loaded host's commits take
        # part of one.
        assert len(slots) > len(overdue), (slots, overdue)
        caught_up = [committed[s] for s in overdue]
        assert caught_up == sorted(caught_up), (overdue, committed)
        span = caught_up[-1] - caught_up[0]
        assert span < (len(overdue) - 1) * 1.0, (span, overdue, committed)
        assert caught_up[-1] < committed[slots[len(overdue)]], (overdue, committed)
        outcome = f"{len(overdue)} caught up back to back, 0 skipped"
    else:
        # One run: the latest overdue tick; the others counted as skipped.
        coalesced = slots[0]
        jumped = (coalesced - first_due) // step
        assert jumped >= CUT_WINDOW, (jumped, coalesced, first_due)
        state = next(s for _, s in writes if s.slot == coalesced)
        # An interval counts every tick jumped over; a crontab's count is a
        # lower bound (1: the search for its latest slot does not walk them).
        assert state.skipped == final.skipped == (jumped if kind == "interval" else 1)
        outcome = f"1 run, {jumped} jumped over, skipped counted {state.skipped}"
    # No burst after that: each later tick committed at its slot, not before.
    later = [s for s in slots if real(s) > started + 1.0]
    assert later, slots
    for slot in later:
        assert real(slot) - 0.05 <= committed[slot] <= real(slot) + 2.0, (slot, committed[slot])
    print(
        f"{kind}, cut-over {cut_over} than the {CUT_WINDOW:g}s window "
        f"({started - stopped:.1f}s from the old stop to the first commit): {outcome}"
    )


class PeriodicRow(NamedTuple):
    """What a django-celery-beat row records of its runs."""

    enabled: bool
    total_run_count: int
    ran: bool  # it has a last_run_at

    @property
    def spent(self) -> bool:
        """A one-off row that has run, by django-celery-beat's own rule (``ModelEntry.is_due``).

        It disables a one-off row at its first look after a run; disabling
        resets the row's run count to 0 and its ``last_run_at`` to none.
        """
        return not self.enabled or self.total_run_count > 0


def periodic_rows(database: Database) -> dict[str, PeriodicRow]:
    """django-celery-beat's rows as the database has them, by name."""
    query = (
        "SELECT name, enabled, total_run_count, last_run_at IS NOT NULL"
        " FROM django_celery_beat_periodictask"
    )
    settings = database.settings
    if database.vendor == "postgresql":
        import psycopg2

        conn = psycopg2.connect(
            host=settings["HOST"],
            port=settings["PORT"],
            dbname=settings["NAME"],
            user=settings["USER"],
            options=settings["OPTIONS"]["options"],
            connect_timeout=5,
        )
    else:
        import sqlite3

        conn = sqlite3.connect(settings["NAME"], timeout=30)
    try:
        cur = conn.cursor()
        cur.execute(query)
        return {
            str(name): PeriodicRow(bool(on), int(count), bool(ran))
            for name, on, count, ran in cur.fetchall()
        }
    finally:
        conn.close()


@pytest.mark.parametrize("cut_over", ["shorter", "longer"])
def test_the_first_start_after_a_cut_over_clocked_and_one_off(
    cluster_factory: Callable[..., BeatCluster], database: Database, cut_over: str
) -> None:
    """Clocked and one-off rows run once whatever the cut-over: if they did not run before it.

    From django-celery-beat's DatabaseScheduler, a cut-over shorter or longer
    than the window (the 8-s window of TTL 1.5 s): a clocked row and a one-off
    row (every second) that the old scheduler ran, and whose rows say so, are
    not run again; a clocked row whose time fell in the cut-over, and a
    one-off row (every second) that started in it and so had several ticks
    overdue, run once each.
    """
    ran_before = [
        {"name": "clocked-ran", "kind": "clocked", "at": time.time()},
        {"name": "one-off-ran", "kind": "interval", "seconds": 1, "one_off": True},
    ]
    cluster = cluster_factory(
        entries=list(ran_before),
        scheduler="django_celery_beat.schedulers:DatabaseScheduler",
        database=database,
        ttl=CUT_TTL,
    )
    cluster.django_setup()
    # The old scheduler runs both rows once (each can run only once), then stops.
    stopped = run_old_then_stop(cluster, runs=2)
    assert len(old_runs(cluster)) == 2
    # Rows due during the cut-over, never run: their times a second after the stop.
    due_in_cut_over = [
        {"name": "clocked-due", "kind": "clocked", "at": stopped + 1.0},
        {"name": "one-off-due", "kind": "interval", "seconds": 1, "one_off": True,
         "start_time": stopped + 1.0},
    ]  # fmt: skip
    created = subprocess.run(
        [sys.executable, "-m", "cnl_beat_django", "rows", json.dumps(due_in_cut_over)],
        env=cluster.env,
        cwd=str(HERE),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert created.returncode == 0, created.stdout + created.stderr
    cluster.entries.extend(due_in_cut_over)
    result = subprocess.run(
        [sys.executable, "-m", "django", "election_seed_beat", "--json"],
        env=cluster.env,
        cwd=str(HERE),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    outcomes = {
        e["entry"]: e for e in json.loads(result.stdout.strip().splitlines()[-1])["entries"]
    }
    seeded = {n: (o["action"], o["runs"]) for n, o in outcomes.items()}
    # The rows as the old scheduler left them. A row it ran is, depending on
    # where its SIGTERM lands: enabled with its run saved (before the row's
    # next look), disabled (after it: disabling resets the row's count and
    # last run), or enabled with no run recorded (inside the save that
    # disables it: celery beat's SIGTERM handler syncs the rows right there,
    # from the database's copy of the row (enabled) and the in-memory count
    # already reset, or fails inside that save's transaction and drops the
    # row, then raises SystemExit, which abandons the disabling save). The
    # last reads as never run, for any scheduler (django-celery-beat's own
    # too): it runs again.
    rows = periodic_rows(database)
    assert set(rows) == {spec["name"] for spec in cluster.entries}, rows
    # The seed is each row's own last run and count.
    assert seeded == {
        name: ("seeded", row.total_run_count) if row.ran else ("never ran", 0)
        for name, row in rows.items()
    }, rows
    assert not any(rows[spec["name"]].spent for spec in due_in_cut_over), rows
    # Run again: none of those whose rows say they ran; once, those whose
    # rows say they did not.
    expected = {name: 0 if row.spent else 1 for name, row in rows.items()}

    # The cut-over: nothing to await but the clock.
    pause = CUT_OVERS[cut_over]
    wait_for(lambda: time.time() >= stopped + pause, pause + 5, "the cut-over")
    cluster.scheduler = "django_nats_leader"
    cluster.start_beat()
    cluster.wait_leader()
    # Spent one-off rows are disabled by the scheduler's next look at them:
    # after that it never reads them again.
    wait_for(
        lambda: all(not row.enabled for row in periodic_rows(database).values()),
        30,
        "every one-off row disabled",
        cluster.diagnostics,
    )
    # Every tick it committed executed: one it ran again is counted below.
    cluster.drain()

    ours = {n: [r for r in cluster.runs() if r.entry == n] for n in outcomes}
    assert {n: len(runs) for n, runs in ours.items()} == expected, rows
    assert len(old_runs(cluster)) == 2  # the old scheduler's two runs, not again
    [clocked] = ours["clocked-due"]
    [one_off] = ours["one-off-due"]
    clocked_state = cluster.recorder.state_writes("clocked-due")[-1][1]
    one_off_state = cluster.recorder.state_writes("one-off-due")[-1][1]
    # The clocked row: its one tick, none skipped.
    assert (clocked_state.runs, clocked_state.skipped) == (1, 0)
    assert one_off_state.runs == 1
    overdue = math.floor(one_off.wall - (stopped + 1.0))
    if cut_over == "shorter":
        # Several ticks overdue inside the window: the oldest ran, then the
        # row was disabled: one run, not a catch-up burst, none skipped.
        assert overdue >= 2, overdue
        assert parse_slot(one_off.tick or "").timestamp() < stopped + 2.0, one_off.tick
        assert one_off_state.skipped == 0
    else:
        # A dozen ticks overdue, older than the window: one run (the
        # latest), the others counted as skipped, then disabled.
        assert one_off_state.skipped >= CUT_WINDOW, one_off_state
    print(
        f"clocked row due in a {cut_over} cut-over ({pause:g}s): ran once, "
        f"{clocked.wall - stopped:.1f}s after "
        f"the old stop; one-off row: ran once, {one_off_state.skipped} ticks skipped; "
        "rows run before the cut-over: "
        + "; ".join(
            f"{n} left {'enabled' if rows[n].enabled else 'disabled'} with "
            f"{rows[n].total_run_count} runs, {'not run again' if expected[n] == 0 else 'ran once'}"
            for n in ("clocked-ran", "one-off-ran")
        )
    )
