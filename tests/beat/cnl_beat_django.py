"""Django settings of the beat tests, and ``python -m cnl_beat_django setup``.

``DATABASES['default']`` comes from ``$CNL_BEAT_DB`` (JSON, set by the test:
PostgreSQL in a schema of its own, or SQLite). ``setup`` migrates and creates
one django-celery-beat row per entry of ``$CNL_BEAT_CONFIG``, as a deployment
would before starting its beat replicas.
"""

from __future__ import annotations

import json
import os
import sys

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
    from django_celery_beat.models import CrontabSchedule, IntervalSchedule, PeriodicTask

    call_command("migrate", verbosity=0)
    config = json.loads(os.environ["CNL_BEAT_CONFIG"])
    for spec in config["entries"]:
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
        else:
            raise ValueError(f"no database row for a {spec['kind']!r} entry")
        PeriodicTask.objects.create(
            name=spec["name"],
            task=spec.get("task", "cnl_beat.record"),
            queue=config["queue"],
            headers=json.dumps(spec.get("headers", {})),
            **schedule,
        )


if __name__ == "__main__":
    if sys.argv[1:] != ["setup"]:
        sys.exit("usage: python -m cnl_beat_django setup")
    setup()
