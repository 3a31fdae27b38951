"""django-celery-beat's ``DatabaseScheduler`` and ours, side by side on the same rows.

``python cnl_beat_contract_django.py <nats url> <seconds>`` (Django settings:
``cnl_beat_django``, its database from ``$CNL_BEAT_DB``). Every row of
:data:`ROWS` is created twice, ``oracle:<name>`` for django-celery-beat's
own scheduler and ``ours:<name>`` for the leader scheduler; each scheduler
only reads its own rows. Both run in this process on the real clock (the
rows' schedules read Django's ``now()``), ticked by one loop, and the
program changes some rows in the database while they run, as an admin
would. It prints one JSON document: for each side, every message sent
(row, seconds since the start) and the ticks' delays.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cnl_beat_django")

#: The rows: name -> how to build it (see ``create``).
ROWS = [
    "every-second",
    "disabled",
    "enabled-later",
    "start-later",
    "expires",
    "one-off",
    "clocked-now",
    "clocked-just-before",
    "slowed-down",
    "cron",
]
SIDES = ("oracle", "ours")


def main() -> None:
    import django

    django.setup()
    from celery import Celery
    from django.core.management import call_command
    from django.utils import timezone
    from django_celery_beat.models import (
        ClockedSchedule,
        CrontabSchedule,
        IntervalSchedule,
        PeriodicTask,
        PeriodicTasks,
    )
    from django_celery_beat.schedulers import DatabaseScheduler

    from django_nats_leader.schedulers import LeaderDatabaseScheduler

    url, seconds = sys.argv[1], float(sys.argv[2])
    call_command("migrate", verbosity=0)
    started = time.monotonic()  # reset below, when the rows exist
    record: dict[str, Any] = {side: {"sent": [], "delays": []} for side in SIDES}

    def interval(every: int) -> IntervalSchedule:
        return IntervalSchedule.objects.create(every=every, period=IntervalSchedule.SECONDS)

    def create(side: str, name: str, now: Any) -> None:
        row: dict[str, Any] = {"name": f"{side}:{name}", "task": "contract.noop"}
        if name == "every-second":
            row["interval"] = interval(1)
        elif name == "disabled" or name == "enabled-later":
            row.update(interval=interval(1), enabled=False)
        elif name == "start-later":
            # Issue 10 #3: django-celery-beat backdates last_run_at by 30 years.
            row.update(interval=interval(30), start_time=now + timedelta(seconds=2))
        elif name == "expires":
            row.update(interval=interval(1), expires=now + timedelta(seconds=6))
        elif name == "one-off":
            row.update(interval=interval(1), one_off=True)
        elif name == "clocked-now":
            # Issue 10 #4: "run once, now", the recipe of django-celery-beat's docs.
            clocked = ClockedSchedule.objects.create(clocked_time=now)
            row.update(clocked=clocked, one_off=True)
        elif name == "clocked-just-before":
            clocked = ClockedSchedule.objects.create(clocked_time=now - timedelta(seconds=5))
            row.update(clocked=clocked, one_off=True)
        elif name == "slowed-down":
            row["interval"] = interval(1)
        elif name == "cron":
            row["crontab"] = CrontabSchedule.objects.create(
                minute="*",
                hour="*",
                day_of_week="*",
                day_of_month="*",
                month_of_year="*",
                timezone="UTC",
            )
        PeriodicTask.objects.create(**row)

    def recording(base: type, side: str) -> type:
        prefix = f"{side}:"

        class Side(base):  # type: ignore[misc, valid-type]
            def all_as_schedule(self) -> Any:
                # Each side reads only its own rows, on every django-celery-beat:
                # before 2.8 the rows come from ``Model.objects.enabled()``
                # (there is no ``enabled_models_qs()`` to narrow), and a side
                # that ran the other's rows would change them under it (a
                # one-off row sent by one side was disabled unsent by the other).
                rows = super().all_as_schedule()
                return {name: row for name, row in rows.items() if name.startswith(prefix)}

            def apply_async(self, entry: Any, producer: Any = None, **kw: Any) -> Any:
                result = super().apply_async(entry, producer=producer, **kw)
                headers = (entry.options or {}).get("headers") or {}
                record[side]["sent"].append(
                    [
                        entry.name.removeprefix(prefix),
                        round(time.monotonic() - started, 3),
                        headers.get("nats_leader_tick"),
                    ]
                )
                return result

        return Side

    schedulers = {}
    for side, base in (("oracle", DatabaseScheduler), ("ours", LeaderDatabaseScheduler)):
        app = Celery(f"contract-{side}", set_as_current=False)
        app.conf.update(
            broker_url="memory://",
            result_expires=None,
            timezone="UTC",
            nats_leader_servers=url,
            nats_leader_bucket=f"contract{os.getpid()}",
            nats_leader_create_bucket=True,
            nats_leader_required=True,
            nats_leader_ttl=5.0,
            nats_leader_beat_max_catch_up=0,
            nats_leader_instance_id=f"contract-{side}",
        )
        schedulers[side] = recording(base, side)(app=app, max_interval=1)
    ours = schedulers["ours"]
    assert ours.beat_role.wait_for_leadership(10), "the leader scheduler never led"
    # django-celery-beat notices a change only against an earlier one: record one.
    PeriodicTasks.update_changed()
    for scheduler in schedulers.values():
        scheduler.tick()  # the initial read of the (still empty) schedule

    # Start 4-6 s before a wall-clock minute: the cron row's tick falls inside the run.
    while not 54.0 <= time.time() % 60 < 56.0:
        time.sleep(0.2)
    # The rows appear while both schedulers run (a change each re-reads at its next tick).
    # Each pair of rows at once, their times from one "now": a loaded machine
    # must not give one side's rows a different start time or expiry.
    base = timezone.now()
    for name in ROWS:
        for side in SIDES:
            create(side, name, base)
    started, started_wall = time.monotonic(), time.time()

    changes = {
        # An admin enables a row, and slows another one down, while beat runs.
        5.0: lambda side: PeriodicTask.objects.filter(name=f"{side}:enabled-later").update(
            enabled=True
        ),
        6.0: lambda side: _slow_down(PeriodicTask.objects.get(name=f"{side}:slowed-down")),
    }

    def _slow_down(task: Any) -> None:
        task.interval = interval(100)
        task.save()

    due = dict.fromkeys(SIDES, 0.0)
    done: set[float] = set()
    while (elapsed := time.monotonic() - started) < seconds:
        for at, change in changes.items():
            if elapsed >= at and at not in done:
                done.add(at)
                for side in SIDES:
                    change(side)
                PeriodicTasks.update_changed()
        for side, scheduler in schedulers.items():
            if elapsed >= due[side]:
                delay = float(scheduler.tick())
                record[side]["delays"].append(delay)
                due[side] = elapsed + delay
        time.sleep(max(0.0, min(min(due.values()) - (time.monotonic() - started), 0.05)))
    for scheduler in schedulers.values():
        scheduler.close()
    rows = {
        task.name: {"enabled": task.enabled, "total_run_count": task.total_run_count}
        for task in PeriodicTask.objects.all()
    }
    # Where the installed django-celery-beat anchors a row that never ran:
    # at its ``date_changed`` (2.8+), or at "now" each time it reads the
    # schedule (before: any change to any row re-anchors it).
    probe = PeriodicTask.objects.create(
        name="probe:anchor", task="contract.noop", interval=interval(60), enabled=False
    )
    PeriodicTask.objects.filter(pk=probe.pk).update(
        date_changed=timezone.now() - timedelta(hours=1)
    )
    probe.refresh_from_db()
    anchored = DatabaseScheduler.Entry(probe, app=schedulers["oracle"].app).last_run_at
    print(
        json.dumps(
            {
                **record,
                "rows": rows,
                "base": base.timestamp(),
                "started": started_wall,
                "anchors_at_date_changed": anchored == probe.date_changed,
            }
        )
    )


if __name__ == "__main__":
    main()
