"""``manage.py election_fence ROLE``: end a stuck leader's term at once.

A conditional update at the observed revision replaces the leader's record
with a fence marker (see :mod:`celery_nats_leader.ops.fence`): every fenced check
of the old term fails from then on, and a live candidate takes the role in
milliseconds instead of after the TTL. The database fence
(:func:`django_nats_leader.fencing.fenced`) of the role is raised to the
marker's epoch as well, so the stuck leader's fenced database writes are
refused even before its successor's first one (``--no-database`` skips it).

Exit status: 0 when the term was fenced, 1 when nobody leads the role (or its
term is not ``--epoch``), 2 when NATS cannot be used.
"""

from __future__ import annotations

import json
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand
from django.db import DatabaseError

from celery_nats_leader.ops.fence import FenceOutcome, request_fence
from celery_nats_leader.ops.oneshot import operator_name
from celery_nats_leader.settings import LeaderSettings
from celery_nats_leader.token import FencingToken
from django_nats_leader.management.common import (
    checked_role,
    election_errors,
    load_settings,
)


def fence_role(
    settings: LeaderSettings, role: str, *, epoch: int | None, timeout: float, wait: float
) -> FenceOutcome:
    """Fence the current term of ``role``; wait up to ``wait`` seconds for a successor."""
    return request_fence(
        settings,
        role,
        epoch=epoch,
        timeout=timeout,
        wait=wait,
        requester=operator_name("manage.py election_fence"),
    )


def raise_database_fence(outcome: FenceOutcome, *, using: str | None = None) -> int:
    """Raise the role's database fence to the marker's epoch; return the fence's epoch."""
    from django_nats_leader.fencing import fenced

    token = FencingToken(epoch=outcome.revision, value=outcome.token)
    with fenced(outcome.role, token, using=using, holder="election_fence") as row:
        return row.epoch


class Command(BaseCommand):
    """End the current term of a role."""

    help = (
        "End the current term of ROLE at once (a stuck or paused leader): fenced checks of "
        "the old term fail and a live candidate leads within milliseconds."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        """Declare ``ROLE`` and the options (see ``--help``)."""
        parser.add_argument("role", help="The role whose current term ends.")
        parser.add_argument(
            "--epoch", type=int, default=None, help="Fence only this term (its epoch)."
        )
        parser.add_argument(
            "--wait",
            type=float,
            default=None,
            help="Seconds to wait for the new leader (default: the role's TTL; 0: no wait).",
        )
        parser.add_argument(
            "--timeout", type=float, default=5.0, help="Seconds per NATS operation."
        )
        parser.add_argument(
            "--no-database",
            action="store_true",
            help="Do not raise the role's database fence (django_nats_leader.fencing).",
        )
        parser.add_argument("--json", action="store_true", help="Print the outcome as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        """Fence the term and report the successor."""
        settings = load_settings()
        role = checked_role(options["role"])
        wait = options["wait"]
        if wait is None:
            wait = settings.election_config(role).ttl
        with election_errors():
            outcome = fence_role(
                settings,
                role,
                epoch=options["epoch"],
                timeout=options["timeout"],
                wait=float(wait),
            )
        database_epoch = None
        if not options["no_database"]:
            try:
                database_epoch = raise_database_fence(outcome)
            except DatabaseError as exc:
                self.stderr.write(
                    self.style.WARNING(f"database fence of {role!r} not raised: {exc}")
                )
        if options["json"]:
            body = outcome.to_dict()
            body["database_epoch"] = database_epoch
            self.stdout.write(json.dumps(body, sort_keys=True))
            return
        self.stdout.write(
            self.style.SUCCESS(
                f"fenced {outcome.fenced.id} (epoch {outcome.fenced.epoch}) from role {role!r} "
                f"at revision {outcome.revision}"
            )
        )
        if database_epoch is not None:
            self.stdout.write(f"database fence of {role!r} at epoch {database_epoch}")
        if outcome.successor is not None:
            took = (outcome.promoted_after or 0.0) * 1000
            self.stdout.write(
                self.style.SUCCESS(
                    f"new leader of {role!r}: {outcome.successor.id} "
                    f"(epoch {outcome.successor.epoch}) after {took:.0f} ms"
                )
            )
        elif float(wait) > 0:
            self.stdout.write(self.style.WARNING(f"no new leader of {role!r} within {wait:g}s"))
