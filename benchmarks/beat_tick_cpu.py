"""CPU time of one leader beat ``tick()`` with 100 entries, one a year behind.

Run: ``python benchmarks/beat_tick_cpu.py [--ticks N]`` (needs ``nats-server``;
the Django part uses SQLite in a temporary directory). Prints a markdown table.

Two schedulers, each the leader of its beat role on a real nats-server:

* ``LeaderScheduler`` (Celery's ``PersistentScheduler``): 100 entries
  (intervals of 1 min to 1 day and crontabs), one of them, a 60-s interval,
  last run a year ago;
* ``LeaderDatabaseScheduler`` (django-celery-beat): 100 rows, one a 60-s
  interval last run a year ago, one a 10-s interval whose ``start_time`` is a
  few seconds ahead (django-celery-beat backdates such a row's ``last_run_at``
  by 30 years).

Measured with ``time.process_time()`` (the whole process: the scheduler's
thread and the election's event-loop thread), per ``tick()``:

* **catch-up**: the tick that dispatches the year-behind entry (one tick, then
  the latest slot only: 525,600 missed ticks skipped) and, for the database
  scheduler, the tick that dispatches the row at its start time;
* **every entry asked**: a tick with no cached answer, where every entry's
  ``is_due()`` is asked (the cost after a schedule change);
* **steady**: a tick while nothing is due (answers cached until due).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from celery_nats_leader.testing import NatsServer, find_nats_server_binary

UTC = timezone.utc


def cpu_ms(action: Callable[[], Any]) -> float:
    started = time.process_time()
    action()
    return (time.process_time() - started) * 1000


def summary(samples: list[float]) -> str:
    if len(samples) == 1:
        return f"{samples[0]:.2f}"
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return f"{statistics.median(ordered):.2f} / {p99:.2f}"


def recording(base: type) -> type:
    class Recording(base):  # type: ignore[misc, valid-type]
        sent: list[str]

        def apply_async(self, entry: Any, producer: Any = None, **kw: Any) -> Any:
            self.sent.append(entry.name)
            return None

        @property
        def producer(self) -> Any:
            return None

    return Recording


def conf(url: str) -> dict[str, Any]:
    return {
        "broker_url": "memory://",
        "result_expires": None,
        "timezone": "UTC",
        "nats_leader_servers": url,
        "nats_leader_bucket": f"bench{uuid.uuid4().hex[:8]}",
        "nats_leader_create_bucket": True,
        "nats_leader_required": True,
        "nats_leader_ttl": 5.0,
    }


def measure(scheduler: Any, ticks: int, rows: list[tuple[str, str]], label: str) -> None:
    """Steady ticks and every-entry ticks of a leading scheduler."""
    steady = [cpu_ms(scheduler.tick) for _ in range(ticks)]
    asked = []
    for _ in range(ticks):
        scheduler.nats_leader_agenda.clear()  # no cached is_due() answers: every entry asked
        asked.append(cpu_ms(scheduler.tick))
    rows.append((f"{label}: every entry's is_due() asked", summary(asked)))
    rows.append((f"{label}: steady (nothing due)", summary(steady)))


def bench_persistent(url: str, ticks: int, rows: list[tuple[str, str]]) -> None:
    from celery import Celery
    from celery.schedules import crontab, schedule

    from celery_nats_leader.beat import LeaderScheduler

    now = datetime.now(UTC)
    entries: dict[str, Any] = {}
    for index in range(99):  # and a 100th added later
        if index % 3 == 0:
            every: Any = crontab(minute=index % 60, hour=index % 24)
        else:
            every = schedule(timedelta(minutes=1 + index * 14))
        entries[f"entry-{index:03d}"] = {"task": "bench.noop", "schedule": every}
    app = Celery("bench-persistent", set_as_current=False)
    app.conf.update(beat_schedule=entries, **conf(url))
    with tempfile.TemporaryDirectory() as tmp:
        scheduler = recording(LeaderScheduler)(
            app=app, schedule_filename=str(Path(tmp) / "s"), max_interval=5
        )
        scheduler.sent = []
        try:
            assert scheduler.beat_role.wait_for_leadership(10)
            scheduler.tick()  # adopts the entries (creates their KV state)
            # The 100th entry: last run a year ago (its first tick also creates its state).
            scheduler.add(
                name="a-year-behind",
                task="bench.noop",
                schedule=schedule(timedelta(seconds=60)),
                last_run_at=now - timedelta(days=365),
            )
            catch_up = []
            while "a-year-behind" not in scheduler.sent:
                catch_up.append(cpu_ms(scheduler.tick))
            skipped = scheduler.nats_leader_metrics.snapshot()["a-year-behind"]["skipped"]
            rows.append(
                (
                    f"LeaderScheduler: the tick dispatching the year-behind entry "
                    f"({skipped:,} ticks skipped)",
                    summary(catch_up[-1:]),
                )
            )
            measure(scheduler, ticks, rows, "LeaderScheduler")
        finally:
            scheduler.close()


DJANGO_PROGRAM = r"""
import json, os, sys, time, uuid
from datetime import timedelta
import django
from django.conf import settings
settings.configure(
    INSTALLED_APPS=["django_celery_beat"], USE_TZ=True, TIME_ZONE="UTC",
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": sys.argv[2]}},
    DEFAULT_AUTO_FIELD="django.db.models.AutoField",
)
django.setup()
sys.path.insert(0, sys.argv[4])
import beat_tick_cpu as bench
from celery import Celery
from django.core.management import call_command
from django.utils import timezone
from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask
from django_nats_leader.schedulers import LeaderDatabaseScheduler

call_command("migrate", verbosity=0)
now = timezone.now()
for index in range(98):  # and two more, below
    if index % 3 == 0:
        cron = CrontabSchedule.objects.create(minute=str(index % 60), hour=str(index % 24))
        PeriodicTask.objects.create(name=f"row-{index:03d}", task="bench.noop", crontab=cron)
    else:
        every = IntervalSchedule.objects.create(every=60 + index * 840, period="seconds")
        PeriodicTask.objects.create(name=f"row-{index:03d}", task="bench.noop", interval=every)
app = Celery("bench-django", set_as_current=False)
app.conf.update(**bench.conf(sys.argv[1]))
scheduler = bench.recording(LeaderDatabaseScheduler)(app=app, max_interval=5)
scheduler.sent = []
rows = []
try:
    assert scheduler.beat_role.wait_for_leadership(10)
    scheduler.tick()
    # Added while beat runs, last run a year ago (its first tick also creates its state).
    minute = IntervalSchedule.objects.create(every=60, period="seconds")
    PeriodicTask.objects.create(
        name="a-year-behind", task="bench.noop", interval=minute,
        last_run_at=now - timedelta(days=365),
    )
    scheduler.schedule  # django-celery-beat re-reads its rows (its cost, not the tick's)
    catch_up = []
    while "a-year-behind" not in scheduler.sent:
        catch_up.append(bench.cpu_ms(scheduler.tick))
    skipped = scheduler.nats_leader_metrics.snapshot()["a-year-behind"]["skipped"]
    rows.append((
        f"LeaderDatabaseScheduler: the tick dispatching the year-behind row ({skipped:,} skipped)",
        bench.summary(catch_up[-1:]),
    ))
    ten = IntervalSchedule.objects.create(every=10, period="seconds")
    start = timezone.now() + timedelta(seconds=3)
    PeriodicTask.objects.create(
        name="starts-later", task="bench.noop", interval=ten, start_time=start
    )
    scheduler.tick()  # re-reads the rows, creates the new row's state
    waiting = []
    while timezone.now() < start - timedelta(seconds=0.5):
        waiting.append(bench.cpu_ms(scheduler.tick))
        time.sleep(0.01)
    rows.append((
        "LeaderDatabaseScheduler: steady, a row waiting for its start_time "
        f"({len(waiting)} ticks)",
        bench.summary(waiting),
    ))
    at_start = []
    while "starts-later" not in scheduler.sent:
        at_start.append(bench.cpu_ms(scheduler.tick))
        time.sleep(0.01)
    rows.append((
        "LeaderDatabaseScheduler: the tick dispatching the row at its start_time "
        "(last_run_at backdated 30 years)",
        bench.summary(at_start[-1:]),
    ))
    bench.measure(scheduler, int(sys.argv[3]), rows, "LeaderDatabaseScheduler")
    assert scheduler.sent.count("starts-later") == 1, scheduler.sent
finally:
    scheduler.close()
print(json.dumps(rows))
"""


def bench_django(url: str, ticks: int, rows: list[tuple[str, str]]) -> None:
    import json

    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                DJANGO_PROGRAM,
                url,
                str(Path(tmp) / "db.sqlite3"),
                str(ticks),
                str(Path(__file__).resolve().parent),
            ],
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        )
        if done.returncode != 0:
            raise SystemExit(done.stderr)
        rows.extend(tuple(row) for row in json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ticks", type=int, default=200, help="ticks per steady measurement")
    args = parser.parse_args()
    rows: list[tuple[str, str]] = []
    with NatsServer() as server:
        version = subprocess.run(
            [find_nats_server_binary(), "--version"], capture_output=True, text=True, check=False
        ).stdout.strip()
        bench_persistent(server.url, args.ticks, rows)
        bench_django(server.url, args.ticks, rows)
    print(
        f"100 entries, CPU ms per tick() (median / p99 over {args.ticks} ticks; one value for "
        f"single ticks); {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}, {version}\n"
    )
    print("| tick | CPU ms |")
    print("|---|---|")
    for label, value in rows:
        print(f"| {label} | {value} |")


if __name__ == "__main__":
    main()
