"""``manage.py election_events``: the leadership transitions, kept and live.

Prints the events the bucket's stream kept (when an operator created it with
``election_bucket --create --events-max-age``), then with ``--follow`` every
new one as it happens: promoted, demoted (with the reason), released,
resigned, fenced. Each carries the publisher's instance, the term's epoch and
the publisher's own monotonic offsets.

Exit status: 0, or 2 when NATS cannot be used.
"""

from __future__ import annotations

import json
from argparse import ArgumentParser
from collections.abc import Awaitable
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from celery_nats_leader.core.backend import Backend
from celery_nats_leader.core.errors import ElectionError
from celery_nats_leader.election.events import TransitionEvent
from celery_nats_leader.ops.events import show_events
from celery_nats_leader.ops.oneshot import operator_name, with_backend
from django_nats_leader.management.common import EXIT_ERROR, load_settings


class Command(BaseCommand):
    """Print the event trail of the elections."""

    help = (
        "Print the leadership transitions (promoted, demoted, released, resigned, fenced) "
        "kept by the events stream; --follow prints new ones as they happen."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        """Declare the options (see ``--help``)."""
        parser.add_argument("--role", default=None, help="Only this role's events.")
        parser.add_argument("--follow", action="store_true", help="Keep printing new events.")
        parser.add_argument("--json", action="store_true", help="One JSON object per line.")
        parser.add_argument("--limit", type=int, default=None, help="Only the newest N kept.")
        parser.add_argument(
            "--count", type=int, default=None, help="With --follow: stop after N new events."
        )
        parser.add_argument("--timeout", type=float, default=5.0, help="Seconds per operation.")

    def handle(self, *args: Any, **options: Any) -> None:
        """Read (and follow) the events."""
        settings = load_settings()

        def emit(event: TransitionEvent) -> None:
            if options["json"]:
                self.stdout.write(json.dumps(event.to_dict(), sort_keys=True))
            else:
                self.stdout.write(event.describe())
            self.stdout.flush()

        def run(backend: Backend) -> Awaitable[bool]:
            return show_events(
                backend,
                settings.bucket,
                emit,
                role=options["role"],
                follow=options["follow"],
                limit=options["limit"],
                count=options["count"],
                timeout=options["timeout"],
            )

        try:
            kept = with_backend(
                settings,
                run,
                timeout=options["timeout"],
                name=operator_name("manage.py election_events"),
            )
        except KeyboardInterrupt:
            return
        except ElectionError as exc:
            raise CommandError(f"cannot read the events: {exc}", returncode=EXIT_ERROR) from exc
        if not kept:
            self.stderr.write(
                f"no events stream for bucket {settings.bucket!r}: only new events (--follow) "
                "can be shown; keep them with `manage.py election_bucket --create "
                "--events-max-age SECONDS`"
            )
