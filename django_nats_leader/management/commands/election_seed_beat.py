"""``manage.py election_seed_beat``: seed the beat schedule's state from django-celery-beat's rows.

Run it once when moving from django-celery-beat's ``DatabaseScheduler`` to
``django_nats_leader``'s: with the old beat stopped (gracefully: it saves the
rows' ``last_run_at`` when it stops), before the first leader scheduler
starts. Each ``PeriodicTask`` row's ``last_run_at`` and ``total_run_count``
become the entry's last tick in KV, so the first tick is the one
django-celery-beat would have sent next. Entries that already have a state
keep it (``--replace`` overwrites them).

Exit status: 0 when done, 2 when the rows or NATS cannot be read.
"""

from __future__ import annotations

import json
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from celery_nats_leader.core.errors import ElectionError
from celery_nats_leader.ops.oneshot import operator_name
from celery_nats_leader.ops.seed import (
    LastRun,
    last_runs_from_rows,
    seed_lines,
    seed_with_settings,
)
from django_nats_leader.management.common import EXIT_ERROR, load_settings


def periodic_task_last_runs() -> list[LastRun]:
    """Every django-celery-beat ``PeriodicTask`` row's last run."""
    from django.utils import timezone
    from django_celery_beat.models import PeriodicTask

    rows = PeriodicTask.objects.only("name", "task", "last_run_at", "total_run_count")
    return last_runs_from_rows(rows, zone=timezone.get_default_timezone())


class Command(BaseCommand):
    """Seed the beat state bucket from django-celery-beat's PeriodicTask rows."""

    help = (
        "Seed the leader beat scheduler's state (the KV state bucket) with the last "
        "runs of django-celery-beat's PeriodicTask rows, before the first start of "
        "the django_nats_leader scheduler."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        """Options: ``--replace``, ``--json``, ``--timeout``."""
        parser.add_argument(
            "--replace", action="store_true", help="Overwrite entries that already have a state."
        )
        parser.add_argument("--json", action="store_true", help="Print the outcome as JSON.")
        parser.add_argument(
            "--timeout", type=float, default=5.0, help="Seconds per NATS operation (5)."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        """Read the rows, seed, print one line per entry."""
        settings = load_settings()
        timeout = float(options["timeout"])
        last_runs = periodic_task_last_runs()
        if not last_runs:
            raise CommandError(
                "no PeriodicTask row found in this database: nothing seeded (is this the "
                "database django-celery-beat's DatabaseScheduler used?)",
                returncode=EXIT_ERROR,
            )

        try:
            outcomes = seed_with_settings(
                settings,
                last_runs,
                replace=bool(options["replace"]),
                timeout=timeout,
                requester=operator_name("manage.py election_seed_beat"),
            )
        except ElectionError as exc:
            raise CommandError(
                f"cannot seed {settings.beat_state_bucket!r}: {exc}", returncode=EXIT_ERROR
            ) from exc
        if options["json"]:
            body = {"entries": [o.to_dict() for o in outcomes]}
            self.stdout.write(json.dumps(body, sort_keys=True))
            return
        for line in seed_lines(outcomes):
            self.stdout.write(line)
