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

from celery_nats_leader.config import validate_key
from celery_nats_leader.errors import (
    BackendTimeoutError,
    ConfigError,
    ElectionError,
    NotLeaderError,
)
from celery_nats_leader.settings import LeaderSettings
from django_nats_leader.management.common import EXIT_ERROR, EXIT_NO_LEADER, load_settings
from django_nats_leader.operations import (
    ResignOutcome,
    open_backend,
    operator_name,
    resign_leader,
    run_once,
)


def request_resignation(
    settings: LeaderSettings, role: str, *, timeout: float, wait: float
) -> ResignOutcome:
    """Ask the leader of ``role`` to step down; wait up to ``wait`` seconds for a successor."""
    bucket = settings.election_config(role).bucket

    async def run() -> ResignOutcome:
        requester = operator_name("manage.py election_resign")
        async with open_backend(settings, timeout=timeout, name=requester) as backend:
            return await resign_leader(
                backend, bucket, role, timeout=timeout, wait=wait, requester=requester
            )

    return run_once(run)


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
        role: str = options["role"]
        try:
            validate_key(role, "ROLE")
        except ConfigError as exc:
            raise CommandError(str(exc), returncode=EXIT_ERROR) from exc
        wait = options["wait"]
        if wait is None:
            wait = settings.election_config(role).ttl + 1.0
        try:
            outcome = request_resignation(
                settings, role, timeout=options["timeout"], wait=float(wait)
            )
        except NotLeaderError as exc:
            raise CommandError(str(exc), returncode=EXIT_NO_LEADER) from exc
        except BackendTimeoutError as exc:
            raise CommandError(str(exc), returncode=EXIT_NO_LEADER) from exc
        except ElectionError as exc:
            raise CommandError(f"cannot reach the election: {exc}", returncode=EXIT_ERROR) from exc
        if options["json"]:
            self.stdout.write(json.dumps(outcome_to_dict(outcome), sort_keys=True))
        else:
            self._report(outcome, float(wait))
        if not outcome.accepted:
            raise CommandError(
                f"the leader of {role!r} refused to step down", returncode=EXIT_NO_LEADER
            )

    def _report(self, outcome: ResignOutcome, wait: float) -> None:
        previous = outcome.previous
        assert previous is not None  # resign_leader raises when nobody leads
        who = outcome.answered_by or previous.id
        if not outcome.accepted:
            self.stdout.write(
                self.style.WARNING(f"{who} refused to step down from {outcome.role!r}")
            )
            return
        self.stdout.write(
            self.style.SUCCESS(
                f"{who} stepped down from role {outcome.role!r} (epoch {previous.epoch})"
            )
        )
        successor = outcome.successor
        if successor is None:
            if wait > 0:
                self.stdout.write(
                    self.style.WARNING(f"no new leader of {outcome.role!r} within {wait:g}s")
                )
            return
        took = (
            ""
            if outcome.handover_seconds is None
            else f" after {outcome.handover_seconds * 1000:.0f} ms"
        )
        self.stdout.write(
            self.style.SUCCESS(
                f"new leader of {outcome.role!r}: {successor.id} (epoch {successor.epoch}){took}"
            )
        )


def outcome_to_dict(outcome: ResignOutcome) -> dict[str, Any]:
    """The ``--json`` form: role, accepted, stepped_down {id, epoch}, new_leader {id, epoch}."""

    def record(rec: Any) -> dict[str, Any] | None:
        return None if rec is None else {"id": rec.id, "epoch": rec.epoch, "meta": dict(rec.meta)}

    return {
        "role": outcome.role,
        "accepted": outcome.accepted,
        "answered_by": outcome.answered_by,
        "stepped_down": record(outcome.previous) if outcome.accepted else None,
        "new_leader": record(outcome.successor),
        "handover_seconds": outcome.handover_seconds,
    }
