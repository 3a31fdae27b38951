"""``manage.py election_fence ROLE``: end the term of a role's leader now.

The leader is first asked to hand over (the ``election_resign`` request); a
live leader steps down before anyone else can lead, with no overlap. A leader
that does not answer within ``--handover-wait`` (stuck, paused, cut off) is
fenced: a conditional update at the observed revision replaces its record
with a fence marker (see :mod:`celery_nats_leader.ops.fence_leader`), every fenced
check of the old term fails from then on, and a live candidate takes the role
in milliseconds instead of after the TTL.

Either way the role's database fence (:func:`django_nats_leader.fencing.fenced`)
is raised to the revision at which the term ended *right after it ended and
before waiting for a successor*, so the old leader's fenced database writes
are refused even before its successor's first one (``--no-database`` skips
it). A successor whose first fenced write got there first already raised the
fence above that revision: that is success too.

Exit status: 0 when the term ended (handed over or fenced; the output says
which), also when the database fence could not be raised (a database error,
or a fence that holds an epoch of the other strategy: stderr says what to
run, and ``--json`` has it as ``database_problem``); 1 when nobody leads the
role (or its term is not ``--epoch``); 2 when NATS cannot be used.
"""

from __future__ import annotations

import json
import logging
from argparse import ArgumentParser
from typing import TYPE_CHECKING, Any

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError

from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.errors import ElectionError
from celery_nats_leader.ops.fence_leader import (
    DEFAULT_HANDOVER_WAIT,
    FenceOutcome,
    fence_lines,
    fence_wait,
    request_fence,
    wait_for_successor,
)
from celery_nats_leader.ops.oneshot import operator_name
from celery_nats_leader.term.token import FencingToken

if TYPE_CHECKING:
    from django_nats_leader.fencing import StrategyChangedError

from django_nats_leader.management.common import (
    checked_role,
    election_errors,
    load_settings,
)

REQUESTER = "manage.py election_fence"

logger = logging.getLogger(__name__)


def fence_role(
    settings: LeaderSettings,
    role: str,
    *,
    epoch: int | None,
    timeout: float,
    wait: float,
    handover_wait: float = DEFAULT_HANDOVER_WAIT,
) -> FenceOutcome:
    """End the current term of ``role`` (hand-over, else fence); wait ``wait`` s for a successor.

    Does not touch the database: see :func:`fence_role_and_database` for the
    order the command and the admin use.
    """
    return request_fence(
        settings,
        role,
        epoch=epoch,
        timeout=timeout,
        wait=wait,
        requester=operator_name(REQUESTER),
        handover_wait=handover_wait,
    )


def raise_database_fence(outcome: FenceOutcome, *, using: str | None = None) -> int:
    """Raise the role's database fence to the revision where the term ended; return its epoch.

    A successor whose fenced write came first has raised the fence above that
    revision already: the old term is refused either way, so its epoch is
    returned, not an error.

    Raises:
        StrategyChangedError: The fence holds an epoch of the other strategy.
    """
    from django_nats_leader.fencing import StaleLeaderError, StrategyChangedError, fenced

    token = FencingToken(epoch=outcome.revision, value=outcome.token)
    try:
        with fenced(outcome.role, token, using=using, holder="election_fence") as row:
            return row.epoch
    except StrategyChangedError:
        # Not a successor's epoch: the fence holds another strategy's, which
        # cannot be ordered against this term (its message says what to do).
        raise
    except StaleLeaderError as exc:
        if exc.current_epoch is not None and exc.current_epoch > outcome.revision:
            return exc.current_epoch
        raise


def fence_role_and_database(
    settings: LeaderSettings,
    role: str,
    *,
    epoch: int | None,
    timeout: float,
    wait: float,
    handover_wait: float = DEFAULT_HANDOVER_WAIT,
    database: bool = True,
    using: str | None = None,
) -> tuple[FenceOutcome, int | None, DatabaseError | StrategyChangedError | None]:
    """End the term, raise the database fence at once, then wait for the successor.

    Returns:
        The outcome (with the successor, if one came within ``wait`` and
        NATS could be asked: a failure while waiting is logged at WARNING,
        the term has ended all the same), the database fence's epoch
        (``None`` when not raised) and what prevented raising it, if
        anything: a database error, or a fence that holds another
        strategy's epoch (:class:`StrategyChangedError`, whose message says
        what to run).

    """
    outcome = fence_role(
        settings, role, epoch=epoch, timeout=timeout, wait=0.0, handover_wait=handover_wait
    )
    database_epoch: int | None = None
    from django_nats_leader.fencing import StrategyChangedError

    problem: DatabaseError | StrategyChangedError | None = None
    if database:
        # The term has ended whatever the database says: a failure to raise
        # the fence is reported beside the outcome, never instead of it (a
        # reported failure invites a retry, which would end the successor's
        # term).
        try:
            database_epoch = raise_database_fence(outcome, using=using)
        except (DatabaseError, StrategyChangedError) as exc:
            problem = exc
    if wait > 0:
        try:
            outcome = wait_for_successor(
                settings, outcome, wait=wait, timeout=timeout, requester=operator_name(REQUESTER)
            )
        except ElectionError as exc:
            # The term has ended (and the fence is raised): that is the
            # outcome. Reporting a failure would make a retry without
            # --epoch end the successor's term.
            logger.warning("the term of %r ended; could not wait for its successor: %s", role, exc)
    return outcome, database_epoch, problem


class Command(BaseCommand):
    """End the current term of a role."""

    help = (
        "End the current term of ROLE now: a live leader is asked to hand over (no overlap); "
        "a stuck one is fenced (its fenced checks fail) and a live candidate leads within "
        "milliseconds."
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
            "--handover-wait",
            type=float,
            default=DEFAULT_HANDOVER_WAIT,
            help="Seconds for a live leader to hand over on request before it is fenced "
            f"(default {DEFAULT_HANDOVER_WAIT:g}; 0: fence at once, without asking).",
        )
        parser.add_argument(
            "--timeout", type=float, default=5.0, help="Seconds per NATS operation."
        )
        parser.add_argument(
            "--no-database",
            action="store_true",
            help="Do not raise the role's database fence (django_nats_leader.fencing).",
        )
        parser.add_argument(
            "--database",
            default=None,
            help="Database alias of the fence (default: the router's choice).",
        )
        parser.add_argument("--json", action="store_true", help="Print the outcome as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        """Fence the term and report the successor."""
        settings = load_settings()
        role = checked_role(options["role"])
        wait = fence_wait(settings, role, options["wait"])
        if options["handover_wait"] < 0:
            raise CommandError("--handover-wait must be 0 or more seconds")
        with election_errors():
            outcome, database_epoch, problem = fence_role_and_database(
                settings,
                role,
                epoch=options["epoch"],
                timeout=options["timeout"],
                wait=float(wait),
                handover_wait=options["handover_wait"],
                database=not options["no_database"],
                using=options["database"],
            )
        if problem is not None:
            self.stderr.write(
                self.style.WARNING(f"database fence of {role!r} not raised: {problem}")
            )
        if options["json"]:
            body = outcome.to_dict()
            body["database_epoch"] = database_epoch
            body["database_problem"] = None if problem is None else str(problem)
            self.stdout.write(json.dumps(body, sort_keys=True))
            return
        (_, ended), *successor = fence_lines(outcome, float(wait))
        self.stdout.write(self.style.SUCCESS(ended))
        if database_epoch is not None:
            self.stdout.write(f"database fence of {role!r} at epoch {database_epoch}")
        for good, line in successor:
            self.stdout.write(self.style.SUCCESS(line) if good else self.style.WARNING(line))
