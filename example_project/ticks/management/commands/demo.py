"""``manage.py demo``: three replicas, a singleton job, the leader killed, one run per tick."""

from __future__ import annotations

import sys
from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    """Run the demo of the getting-started page (``scripts/demo``)."""

    help = (
        "Start a nats-server if none is reachable, three worker replicas with embedded beat, "
        "kill the leader, and check that the singleton job ran exactly once per tick."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        """Declare the options (see ``--help``)."""
        parser.add_argument("--replicas", type=int, default=3, help="Worker replicas to start.")
        parser.add_argument("--before", type=int, default=5, help="Runs to see before the kill.")
        parser.add_argument("--after", type=int, default=8, help="Runs to see after the kill.")
        parser.add_argument(
            "--timeout", type=float, default=60.0, help="Seconds each waiting phase may take."
        )

    def handle(self, *args: Any, **options: Any) -> None:
        """Run it; exit 1 when a tick ran twice, went missing, or the job stopped; 130 on Ctrl-C."""
        from ticks import demo

        status = demo.main(
            self.stdout.write,
            self.style,
            replicas=options["replicas"],
            before=options["before"],
            after=options["after"],
            timeout=options["timeout"],
        )
        if status == demo.EXIT_INTERRUPTED:
            sys.exit(status)  # Ctrl-C: already said so; no "CommandError" line
        if status:
            raise CommandError("the demo failed (see above)", returncode=status)
