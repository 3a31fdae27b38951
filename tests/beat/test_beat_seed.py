"""Seeding the beat state (``ops/seed.py``): the readers of each source, and the KV writes.

The readers are checked against what the previous schedulers themselves
write (Celery's ``PersistentScheduler`` shelve, celery-redbeat's JSON
encoder); the writes against the in-memory KV. The whole cut-over, with the
real schedulers, is ``test_beat_migrate.py``.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.beat import PersistentScheduler
from celery.schedules import crontab, schedule
from click.testing import CliRunner, Result
from redbeat.decoder import RedBeatJSONDecoder, RedBeatJSONEncoder

from celery_nats_leader.beat.schedule_store import state_key
from celery_nats_leader.core.errors import ConfigError
from celery_nats_leader.nats.memory import MemoryBackend, MemoryServer
from celery_nats_leader.ops.cli import nats_leader
from celery_nats_leader.ops.seed import (
    LastRun,
    _redbeat_datetime,
    last_runs_from_rows,
    last_runs_from_shelve,
    seed_lines,
    seed_schedule_state,
)
from celery_nats_leader.testing import NatsServer
from tests.support.brokers import REDIS_URL
from tests.support.services import require_service

UTC = timezone.utc
T0 = datetime(2026, 11, 27, 10, 0, 0, 123456, tzinfo=UTC)


def test_the_shelve_of_celerys_persistent_scheduler(tmp_path: Path) -> None:
    app = Celery("seed-shelve", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        timezone="UTC",
        result_expires=None,
        beat_schedule={
            "every-minute": {"task": "t.minute", "schedule": schedule(timedelta(minutes=1))},
            "nightly": {"task": "t.night", "schedule": crontab(minute=0, hour=3)},
        },
    )
    path = str(tmp_path / "celerybeat-schedule")
    old = PersistentScheduler(app=app, schedule_filename=path)
    old.schedule["every-minute"].last_run_at = T0
    old.schedule["every-minute"].total_run_count = 42
    old.sync()
    old.close()

    found = {run.entry: run for run in last_runs_from_shelve(path)}
    assert set(found) == {"every-minute", "nightly"}
    assert found["every-minute"] == LastRun("every-minute", T0, 42, "t.minute")
    # An entry that never ran has the time Celery first saw it, as Celery counts from it.
    assert found["nightly"].runs == 0 and found["nightly"].last_run_at is not None


def test_a_file_that_is_not_a_schedule_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot open the schedule file"):
        last_runs_from_shelve(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "moment",
    [
        T0,
        T0.astimezone(ZoneInfo("Europe/Paris")),
        T0.astimezone(timezone(timedelta(hours=-5))),
        T0.replace(tzinfo=None),  # redbeat writes a naive time as UTC
    ],
)
def test_redbeats_datetimes_read_as_redbeat_reads_them(moment: datetime) -> None:
    encoded = json.loads(json.dumps({"last_run_at": moment}, cls=RedBeatJSONEncoder))
    theirs = json.loads(json.dumps(encoded), cls=RedBeatJSONDecoder)["last_run_at"]
    ours = _redbeat_datetime(encoded["last_run_at"])
    assert ours == theirs
    assert ours is not None and ours.astimezone(UTC) == T0


def test_django_rows_naive_times_are_in_the_given_zone() -> None:
    rows = [
        SimpleNamespace(name="b", task="t.b", last_run_at=None, total_run_count=0),
        SimpleNamespace(
            name="a", task="t.a", last_run_at=datetime(2026, 11, 27, 11, 0), total_run_count=3
        ),
    ]
    found = last_runs_from_rows(rows, zone=ZoneInfo("Europe/Paris"))
    assert [run.entry for run in found] == ["a", "b"]
    assert found[0].last_run_at is not None
    assert found[0].last_run_at.astimezone(UTC) == datetime(2026, 11, 27, 10, 0, tzinfo=UTC)
    assert found[1].last_run_at is None


async def test_seeding_writes_each_last_run_once_and_keeps_existing_states() -> None:
    backend = MemoryBackend(MemoryServer())
    runs = [
        LastRun("report", T0, 7, "t.report"),
        LastRun("fresh", None, 0, "t.fresh"),
    ]
    first = await seed_schedule_state(
        backend, "leaders_beat", "beat", runs, create_bucket=True, timeout=1
    )
    assert [(o.entry, o.action) for o in first] == [("report", "seeded"), ("fresh", "never ran")]
    seeded = first[0].state
    assert seeded is not None
    assert (seeded.slot, seeded.runs, seeded.epoch, seeded.by) == (T0, 7, 0, "seed")
    assert first[1].state is None

    # Again (an operator repeating the step, or a leader wrote since): kept.
    later = [LastRun("report", T0 + timedelta(hours=1), 8, "t.report")]
    again = await seed_schedule_state(backend, "leaders_beat", "beat", later, timeout=1)
    assert again[0].action == "kept" and again[0].state == seeded
    replaced = await seed_schedule_state(
        backend, "leaders_beat", "beat", later, replace=True, timeout=1
    )
    assert replaced[0].action == "replaced"
    assert replaced[0].state is not None and replaced[0].state.runs == 8

    bucket = await backend.open_bucket(
        "leaders_beat", ttl=None, create=False, replicas=1, timeout=1, persistent=True
    )
    stored = await bucket.get(state_key("beat", "report"), timeout=1)
    assert stored is not None and json.loads(stored.value)["slot"].startswith("2026-11-27T11:00")
    lines = seed_lines([*first, *again])
    assert lines[0] == "report: seeded: last run 2026-11-27T10:00:00.123456+00:00, 7 runs"
    assert lines[1].startswith("fresh: never ran")
    assert lines[2].startswith("report: kept its state (last tick 2026-11-27T10:00:00.123456")


def seed_cli(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(nats_leader, ["seed-beat", *args], obj=SimpleNamespace(app=app))


def test_the_seed_beat_command(nats_server: NatsServer, tmp_path: Path) -> None:
    app = Celery("seed-cli", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        timezone="UTC",
        result_expires=None,
        nats_leader_servers=[nats_server.url],
        beat_schedule={"every-minute": {"task": "t.minute", "schedule": 60.0}},
    )
    path = str(tmp_path / "celerybeat-schedule")
    old = PersistentScheduler(app=app, schedule_filename=path)
    old.schedule["every-minute"].last_run_at = T0
    old.schedule["every-minute"].total_run_count = 5
    old.sync()
    old.close()

    # One source, exactly.
    assert seed_cli(app).exit_code == 2
    assert seed_cli(app, "--shelve", path, "--redbeat").exit_code == 2
    missing = seed_cli(app, "--shelve", str(tmp_path / "nothing"))
    assert missing.exit_code == 2 and "cannot open the schedule file" in missing.output
    # No state bucket yet: says so, exit 2.
    no_bucket = seed_cli(app, "--shelve", path)
    assert no_bucket.exit_code == 2, no_bucket.output
    assert "cannot seed 'leaders_beat'" in no_bucket.output

    assert (
        CliRunner()
        .invoke(nats_leader, ["bucket", "--create", "--beat-state"], obj=SimpleNamespace(app=app))
        .exit_code
        == 0
    )
    done = seed_cli(app, "--shelve", path)
    assert done.exit_code == 0, done.output
    assert "every-minute: seeded: last run 2026-11-27T10:00:00.123456+00:00, 5 runs" in done.output
    again = seed_cli(app, "--shelve", path, "--json")
    entries = {e["entry"]: e for e in json.loads(again.output)["entries"]}
    assert entries["every-minute"]["action"] == "kept"
    assert entries["every-minute"]["state"]["runs"] == 5


def test_a_source_with_no_entry_is_an_error(nats_server: NatsServer, tmp_path: Path) -> None:
    # A wrong schedule file (an empty one) or a wrong redbeat key prefix used
    # to seed nothing and exit 0: the new beat then started from an empty
    # state. Nothing to seed from is an error that names the source.
    app = Celery("seed-empty", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        timezone="UTC",
        result_expires=None,
        nats_leader_servers=[nats_server.url],
    )
    path = str(tmp_path / "celerybeat-schedule")
    empty = PersistentScheduler(app=app, schedule_filename=path)
    empty.sync()
    empty.close()
    result = seed_cli(app, "--shelve", path)
    assert result.exit_code == 2, result.output
    assert f"no periodic entry found in the schedule file {path!r}" in result.output

    require_service("Redis", REDIS_URL)
    prefix = f"nothing-here-{uuid.uuid4().hex[:8]}:"
    result = seed_cli(app, "--redbeat", "--redis-url", REDIS_URL, "--key-prefix", prefix)
    assert result.exit_code == 2, result.output
    assert f"under the key prefix {prefix!r}" in result.output
