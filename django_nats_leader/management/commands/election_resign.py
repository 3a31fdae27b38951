"""``manage.py election_resign ROLE``: ask the current leader to step down gracefully.

The leader runs its demote callbacks, releases its key and sits out one TTL,
so another live candidate is promoted within milliseconds. The command prints
who stepped down and, after waiting briefly, the new leader.

Exit status: 0 when the leader stepped down, 1 when nobody leads the role or
the leader refused, 2 when NATS cannot be used.
"""

from __future__ import annotations

import json
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from celery_nats_leader.core.errors import (
    BackendTimeoutError,
    NotLeaderError,
)
from celery_nats_leader.ops.oneshot import operator_name
from celery_nats_leader.ops.resign import (
    ResignOutcome,
    outcome_lines,
    outcome_to_dict,
    request_resignation,
    resign_wait,
)
from django_nats_leader.management.common import (
    EXIT_NO_LEADER,
    checked_role,
    election_errors,
    load_settings,
)


class Command(BaseCommand):
    """Ask a role's leader to hand over."""

    help = (
        "Ask the current leader of ROLE to step down gracefully; prints who stepped down "
        "and the new leader."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        """Declare ``ROLE``, ``--wait``, ``--timeout`` and ``--json``."""
        parser.add_argument("role", help="The role whose leader should step down.")
        parser.add_argument(
            "--wait",
            type=float,
            default=None,
            help="Seconds to wait for the new leader (default: the role's TTL + 1; 0: no wait).",
        )
        parser.add_argument(
            "--timeout", type=float, default=5.0, help="Seconds to wait for the leader's answer."
        )
        parser.add_argument("--json", action="store_true", help="Print the outcome as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        """Send the request and report the hand-over."""
        settings = load_settings()
        role = checked_role(options["role"])
        wait = resign_wait(settings, role, options["wait"])
        # A leader that does not answer counts as no leader (exit 1), like none at all.
        with election_errors((NotLeaderError, BackendTimeoutError)):
            outcome = request_resignation(
                settings,
                role,
                timeout=options["timeout"],
                wait=float(wait),
                requester=operator_name("manage.py election_resign"),
            )
        if options["json"]:
            self.stdout.write(json.dumps(outcome_to_dict(outcome), sort_keys=True))
        else:
            self._report(outcome, float(wait))
        if not outcome.accepted:
            raise CommandError(
                f"the leader of {role!r} refused to step down", returncode=EXIT_NO_LEADER
            )

    def _report(self, outcome: ResignOutcome, wait: float) -> None:
        for good, line in outcome_lines(outcome, wait):
            self.stdout.write(self.style.SUCCESS(line) if good else self.style.WARNING(line))
