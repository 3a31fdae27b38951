"""``manage.py election_status``: who leads every role, and every live candidate.

Exit status: 0 when every configured role has a leader, 1 when one has none
(so the command serves as a health probe) or, with ``--strict``, when its
leader does not answer (paused, hung or dead: its key still names it), 2 when
the elections cannot be read (NATS unreachable, bucket missing, invalid settings).
"""

from __future__ import annotations

import json
from argparse import ArgumentParser
from datetime import datetime, timezone
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.errors import ElectionError
from celery_nats_leader.election.status import StatusReport
from celery_nats_leader.ops.oneshot import operator_name
from celery_nats_leader.ops.output import EXIT_ERROR, EXIT_NO_LEADER, status_text
from celery_nats_leader.ops.status import fetch_report, watch_reports
from django_nats_leader import conf
from django_nats_leader.management.common import checked_role, load_settings


def _iso(at: datetime) -> str:
    """``2026-11-23T13:40:01.123Z``: UTC, milliseconds."""
    return (
        at.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.")
        + f"{at.microsecond // 1000:03d}Z"
    )


#: ANSI: cursor home, clear screen (``--watch`` on a terminal).
_CLEAR = "\x1b[H\x1b[2J"


class Command(BaseCommand):
    """Print the leader and live candidates of every role."""

    help = (
        "Show who leads every election role (term epoch, age, expiry) and every live "
        "candidate (state, priority, last heartbeat). Exits 1 when a role has no leader."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        """Declare the options (see ``--help``)."""
        parser.add_argument(
            "--role",
            action="append",
            default=[],
            metavar="ROLE",
            help="Only this role (repeatable); it must have a leader.",
        )
        parser.add_argument(
            "--json", action="store_true", help="Print JSON (schema: docs/django.md)."
        )
        parser.add_argument(
            "--watch", action="store_true", help="Refresh the view until interrupted."
        )
        parser.add_argument(
            "--interval", type=float, default=2.0, help="Seconds between refreshes (--watch)."
        )
        parser.add_argument(
            "--count",
            type=int,
            default=0,
            help="Stop --watch after this many refreshes (0: until interrupted).",
        )
        parser.add_argument("--timeout", type=float, default=5.0, help="Seconds to wait for NATS.")
        parser.add_argument(
            "--strict",
            action="store_true",
            help="Also exit 1 when a role's leader does not answer (paused, hung or dead).",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        """Read the status once (or repeatedly with ``--watch``) and print it."""
        settings = load_settings()
        expected = conf.expected_roles(settings)
        only: list[str] = [checked_role(role, "--role") for role in options["role"]]
        if options["watch"]:
            report = self._watch(settings, expected, only, options)
        else:
            try:
                report = fetch_report(
                    settings, configured_roles=expected, only=only, timeout=options["timeout"]
                )
            except ElectionError as exc:
                raise CommandError(
                    f"cannot read the elections of bucket {settings.bucket!r}: {exc}",
                    returncode=EXIT_ERROR,
                ) from exc
            self._show(report, as_json=options["json"])
        if report is not None and report.leaderless:
            raise CommandError(
                f"no leader for role(s): {', '.join(report.leaderless)}", returncode=EXIT_NO_LEADER
            )
        if report is not None and options["strict"] and report.silent:
            raise CommandError(
                f"leader not answering for role(s): {', '.join(report.silent)}",
                returncode=EXIT_NO_LEADER,
            )

    def _show(
        self,
        report: StatusReport,
        *,
        as_json: bool,
        clear: bool = False,
        refresh: tuple[int, datetime] | None = None,
    ) -> None:
        if as_json:
            doc = report.to_dict()
            if refresh is not None:
                # Added fields (schema version 1 only ever gains fields).
                doc["refresh"] = refresh[0]
                doc["refreshed_at"] = _iso(refresh[1])
            self.stdout.write(json.dumps(doc, sort_keys=True))
            return
        text = status_text(
            report,
            ok=self.style.SUCCESS,
            bad=self.style.ERROR,
            heading=self.style.MIGRATE_HEADING,
        )
        if refresh is not None:
            # One separator per refresh, so that a log or a pipe shows where each
            # view starts and when it was read (this host's clock, display only).
            number, at = refresh
            text = self.style.MIGRATE_HEADING(
                f"--- {at:%Y-%m-%d %H:%M:%S} UTC, refresh {number}"
            ) + ("\n" + text)
        self.stdout.write((_CLEAR if clear else "") + text)

    def _watch(
        self,
        settings: LeaderSettings,
        expected: tuple[str, ...],
        only: list[str],
        options: dict[str, Any],
    ) -> StatusReport | None:
        """Refresh on one connection; return the last report (None if interrupted first)."""
        clear = not options["json"] and self.stdout.isatty()

        def show(report: StatusReport, number: int) -> None:
            at = datetime.now(timezone.utc)
            self._show(report, as_json=options["json"], clear=clear, refresh=(number, at))

        def failed(exc: ElectionError) -> None:
            self.stderr.write(f"cannot read the elections: {exc}")

        try:
            last = watch_reports(
                settings,
                configured_roles=expected,
                only=only,
                timeout=options["timeout"],
                interval=options["interval"],
                count=int(options["count"]),
                show=show,
                failed=failed,
                name=operator_name("election_status --watch"),
            )
        except KeyboardInterrupt:
            return None  # the operator stopped watching: not a failed probe
        except ElectionError as exc:
            raise CommandError(f"cannot watch the elections: {exc}", returncode=EXIT_ERROR) from exc
        if last is None:
            raise CommandError("no refresh could read the elections", returncode=EXIT_ERROR)
        return last
