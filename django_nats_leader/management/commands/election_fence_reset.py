"""``manage.py election_fence_reset ROLE``: move a role's database fence to its new strategy.

KV epochs are stream revisions, ALLCALL epochs wall-clock milliseconds; the
database fence (:func:`django_nats_leader.fencing.fenced`) never orders one
against the other and refuses every term of the other strategy with
:class:`~django_nats_leader.fencing.StrategyChangedError`. After a role moved
from one strategy to the other, and once every process of the old strategy
is stopped, this command forgets the old strategy's epoch: the next fenced
write of the role's configured strategy sets the fence again.

A fence that already holds an epoch of the configured strategy is never
lowered (that would let stale leaders write): the command refuses.

Exit status: 0 when the fence was reset or the role had none, 1 when the
fence already belongs to the role's strategy.
"""

from __future__ import annotations

import json
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from django_nats_leader.management.common import EXIT_NO_LEADER, checked_role, load_settings


class Command(BaseCommand):
    """Forget a role's database fence epoch of the strategy it no longer uses."""

    help = (
        "After moving ROLE from one election strategy to the other (ALLCALL <-> KV) and "
        "stopping every process of the old one: forget the database fence's epoch of the "
        "old strategy, so the new strategy's terms can write."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        """Declare ``ROLE``, ``--database`` and ``--json``."""
        parser.add_argument("role", help="The role whose database fence moves to its strategy.")
        parser.add_argument(
            "--database", default=None, help="Database alias (default: the router's choice)."
        )
        parser.add_argument("--json", action="store_true", help="Print the outcome as JSON.")

    def handle(self, *args: Any, **options: Any) -> None:
        """Reset the fence, or refuse."""
        from django_nats_leader.fencing import reset_fence

        settings = load_settings()
        role = checked_role(options["role"])
        strategy = settings.election_config(role).strategy
        try:
            forgotten = reset_fence(role, strategy, using=options["database"])
        except ValueError as exc:
            raise CommandError(str(exc), returncode=EXIT_NO_LEADER) from exc
        if options["json"]:
            body = {"role": role, "strategy": strategy, "forgotten_epoch": forgotten}
            self.stdout.write(json.dumps(body, sort_keys=True))
            return
        if forgotten is None:
            self.stdout.write(f"role {role!r} has no database fence yet; nothing to reset")
            return
        self.stdout.write(
            self.style.SUCCESS(
                f"database fence of {role!r}: forgot epoch {forgotten}; the next fenced write "
                f"of a {strategy} term sets it again"
            )
        )
