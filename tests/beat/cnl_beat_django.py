"""Django settings of the beat tests, and ``python -m cnl_beat_django setup``.

``DATABASES['default']`` comes from ``$CNL_BEAT_DB`` (JSON, set by the test:
PostgreSQL in a schema of its own, or SQLite). ``setup`` migrates and creates
one django-celery-beat row per entry of ``$CNL_BEAT_CONFIG``, as a deployment
would before starting its beat replicas; ``rows SPECS`` creates the rows of
the entries in the JSON list ``SPECS`` (an admin adding rows later).

An entry's row: ``kind`` ``interval`` (``seconds``), ``cron`` or ``clocked``
(``at``: the clocked time, seconds since the epoch; a clocked row is one-off,
as django-celery-beat requires); ``one_off`` and ``start_time`` (seconds since
the epoch) as the row's fields.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

SECRET_KEY = "cnl-beat-tests"
USE_TZ = True
TIME_ZONE = "UTC"
# django_nats_leader for its management commands (election_seed_beat).
INSTALLED_APPS = ["django_celery_beat", "django_nats_leader"]
_CONFIG = json.loads(os.environ.get("CNL_BEAT_CONFIG", "{}"))
# What the management commands read (the Celery app reads its nats_leader_* keys).
NATS_LEADER = (
    {
        "SERVERS": _CONFIG["nats_url"],
        "BUCKET": _CONFIG["bucket"],
        "BEAT_ROLE": _CONFIG.get("beat_role", "beat"),
        "TTL": _CONFIG["ttl"],
    }
    if _CONFIG
    else {}
)
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
DATABASES = {
    "default": json.loads(
        os.environ.get(
            "CNL_BEAT_DB", '{"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}'
        )
    )
}


def setup() -> None:
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    create_rows(json.loads(os.environ["CNL_BEAT_CONFIG"])["entries"])


def create_rows(specs: list[dict[str, Any]]) -> None:
    from datetime import datetime, timezone

    from django_celery_beat.models import (
        ClockedSchedule,
        CrontabSchedule,
        IntervalSchedule,
        PeriodicTask,
    )

    def moment(seconds: float) -> datetime:
        return datetime.fromtimestamp(seconds, tz=timezone.utc)

    config = json.loads(os.environ["CNL_BEAT_CONFIG"])
    for spec in specs:
        fields: dict[str, Any] = {"one_off": bool(spec.get("one_off", False))}
        if spec.get("start_time") is not None:
            fields["start_time"] = moment(spec["start_time"])
        schedule: dict[str, Any]
        if spec["kind"] == "interval":
            interval = IntervalSchedule.objects.create(
                every=spec["seconds"], period=IntervalSchedule.SECONDS
            )
            schedule = {"interval": interval}
        elif spec["kind"] == "cron":
            crontab = CrontabSchedule.objects.create(
                minute="*",
                hour="*",
                day_of_week="*",
                day_of_month="*",
                month_of_year="*",
                timezone="UTC",
            )
            schedule = {"crontab": crontab}
        elif spec["kind"] == "clocked":
            clocked = ClockedSchedule.objects.create(clocked_time=moment(spec["at"]))
            schedule = {"clocked": clocked}
            fields["one_off"] = True
        else:
            raise ValueError(f"no database row for a {spec['kind']!r} entry")
        PeriodicTask.objects.create(
            name=spec["name"],
            task=spec.get("task", "cnl_beat.record"),
            queue=config["queue"],
            headers=json.dumps(spec.get("headers", {})),
            **schedule,
            **fields,
        )


if __name__ == "__main__":
    if sys.argv[1:] == ["setup"]:
        setup()
    elif sys.argv[1:2] == ["rows"] and len(sys.argv) == 3:
        import django

        django.setup()
        create_rows(json.loads(sys.argv[2]))
    else:
        sys.exit("usage: python -m cnl_beat_django setup | rows SPECS")
