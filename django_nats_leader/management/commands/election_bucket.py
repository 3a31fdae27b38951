"""``manage.py election_bucket``: inspect or create the elections' KV buckets.

Without options it prints each bucket's settings and whether they suit the
configured elections: the election bucket needs ``max_age`` equal to the TTL
and ``history=1``; the beat schedule's state bucket (when the leader
scheduler is used) needs ``history=1`` and no ``max_age``. With ``--create``
it creates the missing ones with exactly those settings, so no other tool
(``nats kv add``) is needed. ``--migrate-from OLD`` (a TTL change) creates
the election bucket so that its terms' epochs continue above ``OLD``'s.

Exit status: 0 when every bucket exists and fits, 1 when one is missing or
misconfigured, 2 when NATS cannot be used.
"""

from __future__ import annotations

from argparse import ArgumentParser
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from celery_nats_leader.config import validate_bucket
from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.errors import ConfigError, ElectionError
from celery_nats_leader.ops.bucket import (
    BucketAction,
    BucketOutcome,
    BucketTarget,
    EpochFloor,
    bucket_targets,
    buckets_document,
    events_stream_of,
    floor_lines,
    outcome_lines,
    set_up_buckets,
)
from celery_nats_leader.ops.events import StreamInfo
from celery_nats_leader.ops.oneshot import operator_name, with_backend
from django_nats_leader import conf
from django_nats_leader.management.common import EXIT_ERROR, EXIT_NO_LEADER, load_settings

#: Who the command is, in NATS monitoring (see :func:`operator_name`).
TOOL = "manage.py election_bucket"


def inspect_or_create(
    settings: LeaderSettings, wanted: list[BucketTarget], *, create: bool, timeout: float
) -> list[BucketOutcome]:
    """Read every bucket's settings, creating the missing ones when ``create`` is set."""
    action: BucketAction = "create" if create else "check"
    outcomes, _ = with_backend(
        settings,
        lambda backend: set_up_buckets(backend, wanted, action, timeout=timeout),
        timeout=timeout,
        name=operator_name(TOOL),
    )
    return outcomes


def migrate(
    settings: LeaderSettings,
    wanted: list[BucketTarget],
    *,
    source: str | None,
    floor: int,
    timeout: float,
) -> tuple[list[BucketOutcome], EpochFloor | None]:
    """Create the election bucket with its epochs above ``source``'s (and ``floor``)."""
    return with_backend(
        settings,
        lambda backend: set_up_buckets(
            backend,
            wanted,
            "create",
            migrate_from=source,
            epoch_floor=floor,
            settings=settings,
            timeout=timeout,
        ),
        timeout=timeout,
        name=operator_name(TOOL),
    )


def stream_of(
    settings: LeaderSettings,
    bucket: str,
    *,
    max_age: float,
    create: bool,
    timeout: float,
    replicas: int | None = None,
) -> StreamInfo | None:
    """The bucket's events stream (created with ``create``, ``replicas`` or the setting's)."""
    return with_backend(
        settings,
        lambda backend: events_stream_of(
            backend,
            bucket,
            create=create,
            max_age=max_age,
            replicas=settings.bucket_replicas if replicas is None else replicas,
            timeout=timeout,
        ),
        timeout=timeout,
        name=operator_name(TOOL),
    )


class Command(BaseCommand):
    """Inspect or create the KV buckets of the elections."""

    help = (
        "Inspect the elections' KV bucket (max_age, history, replicas) and the beat state "
        "bucket, or create them with --create (max_age = TTL, history = 1)."
    )

    def add_arguments(self, parser: ArgumentParser) -> None:
        """Declare the options (see ``--help``)."""
        parser.add_argument(
            "--create", action="store_true", help="Create the buckets that do not exist."
        )
        parser.add_argument(
            "--bucket", help="Only this election bucket (default: NATS_LEADER['BUCKET'])."
        )
        parser.add_argument(
            "--ttl", type=float, help="max_age in seconds (default: NATS_LEADER['TTL'])."
        )
        parser.add_argument(
            "--replicas",
            type=int,
            help=(
                "Replicas when creating (default: NATS_LEADER['BUCKET_REPLICAS']); "
                "when given, an existing bucket must have as many."
            ),
        )
        parser.add_argument(
            "--beat-state",
            action="store_true",
            help="Include the beat state bucket (automatic with the leader beat scheduler).",
        )
        parser.add_argument(
            "--once",
            action="store_true",
            help="Only the once-guard's buckets (<once_bucket>_leases and <once_bucket>). "
            "Without it, --check and --create include them when CELERY_BEAT_SCHEDULER is a "
            "leader scheduler and ticks run once (BEAT_ONCE).",
        )
        parser.add_argument(
            "--events-max-age",
            type=float,
            default=None,
            metavar="SECONDS",
            help=(
                "Keep the transition events in a JetStream stream for this long (with --create "
                "it is created; never required by the elections)."
            ),
        )
        parser.add_argument(
            "--migrate-from",
            metavar="BUCKET",
            help=(
                "Create the election bucket (a TTL change: a new bucket) so that its terms' "
                "epochs continue above BUCKET's, which the replicas use now."
            ),
        )
        parser.add_argument(
            "--epoch-floor",
            type=int,
            metavar="EPOCH",
            help="Create the election bucket so that its first term's epoch is at least EPOCH.",
        )
        parser.add_argument("--json", action="store_true", help="Print the settings as JSON.")
        parser.add_argument("--timeout", type=float, default=5.0, help="Seconds to wait for NATS.")

    def handle(self, *args: Any, **options: Any) -> None:
        """Inspect (or create) the buckets and say whether they fit the settings."""
        settings = load_settings()
        source, floor_at = options.get("migrate_from"), options.get("epoch_floor")
        migrating = source is not None or floor_at is not None
        try:
            if migrating and options["once"]:
                raise ConfigError("--migrate-from and --epoch-floor create an election bucket")
            if floor_at is not None and floor_at < 1:
                raise ConfigError("--epoch-floor must be at least 1")
            if source is not None:
                validate_bucket(source)
            wanted = bucket_targets(
                settings,
                bucket=options["bucket"],
                ttl=options["ttl"],
                replicas=options["replicas"],
                beat_state=bool(options["beat_state"] or conf.beat_is_elected()),
                once=bool(options["once"]),
                # As `celery nats-leader bucket`: see there.
                once_guard=settings.beat_once and conf.beat_is_elected() and not migrating,
            )
            for target in wanted:
                validate_bucket(target.name)
        except ConfigError as exc:
            raise CommandError(str(exc), returncode=EXIT_ERROR) from exc
        carried: EpochFloor | None = None
        try:
            if migrating:
                outcomes, carried = migrate(
                    settings,
                    wanted,
                    source=source,
                    floor=floor_at or 0,
                    timeout=options["timeout"],
                )
            else:
                outcomes = inspect_or_create(
                    settings, wanted, create=options["create"], timeout=options["timeout"]
                )
        except ElectionError as exc:
            raise CommandError(f"cannot inspect the buckets: {exc}", returncode=EXIT_ERROR) from exc
        failing = [o for o in outcomes if o.problems]
        stream = None
        if options["events_max_age"] is not None:
            try:
                stream = stream_of(
                    settings,
                    wanted[0].name,
                    max_age=options["events_max_age"],
                    create=options["create"],
                    timeout=options["timeout"],
                    replicas=options["replicas"],
                )
            except (ElectionError, ValueError) as exc:
                raise CommandError(
                    f"cannot set up the events stream: {exc}", returncode=EXIT_ERROR
                ) from exc
        if options["json"]:
            self.stdout.write(
                buckets_document(
                    outcomes,
                    floor=carried,
                    stream=stream,
                    with_stream=options["events_max_age"] is not None,
                )
            )
        else:
            for outcome in outcomes:
                self._show(outcome)
                if carried is not None and outcome.target.name == carried.bucket:
                    self._show_floor(carried)
            if options["events_max_age"] is not None:
                self._show_stream(stream)
        if failing:
            raise CommandError(
                "; ".join(f"KV bucket {o.target.name!r}: {', '.join(o.problems)}" for o in failing),
                returncode=EXIT_NO_LEADER,
            )

    def _show_floor(self, carried: EpochFloor) -> None:
        for style, text in floor_lines(carried):
            self.stdout.write(self.style.SUCCESS(text) if style else text)

    def _show_stream(self, stream: StreamInfo | None) -> None:
        if stream is None:
            self.stdout.write("events stream: none (create it with --create --events-max-age)")
            return
        verb = "created" if stream.created else "exists"
        self.stdout.write(
            self.style.MIGRATE_HEADING(f"events stream {stream.name!r} {verb}")
            + f"\n  max_age        {stream.max_age:g}s\n  events         {stream.messages}"
        )

    def _show(self, outcome: BucketOutcome) -> None:
        styles = {
            "heading": self.style.MIGRATE_HEADING,
            "error": self.style.ERROR,
            "success": self.style.SUCCESS,
        }
        for style, text in outcome_lines(
            outcome, create_command="manage.py election_bucket --create"
        ):
            self.stdout.write(styles[style](text) if style else text)
