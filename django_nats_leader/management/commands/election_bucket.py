"""``manage.py election_bucket``: inspect or create the elections' KV buckets.

Without options it prints each bucket's settings and whether they suit the
configured elections: the election bucket needs ``max_age`` equal to the TTL
and ``history=1``; the beat schedule's state bucket (when the leader
scheduler is used) needs ``history=1`` and no ``max_age``. With ``--create``
it creates the missing ones with exactly those settings, so no other tool
(``nats kv add``) is needed.

Exit status: 0 when every bucket exists and fits, 1 when one is missing or
misconfigured, 2 when NATS cannot be used.
"""

from __future__ import annotations

import json
from argparse import ArgumentParser
from dataclasses import asdict, dataclass
from typing import Any

from django.core.management.base import BaseCommand, CommandError

from celery_nats_leader.config import validate_bucket
from celery_nats_leader.errors import BucketNotFoundError, ConfigError, ElectionError
from celery_nats_leader.nats import open_backend
from celery_nats_leader.ops.bucket import BucketInfo, bucket_info, bucket_ttls, ensure_bucket
from celery_nats_leader.ops.events import StreamInfo, ensure_events_stream, stream_info
from celery_nats_leader.ops.oneshot import operator_name, run_once
from celery_nats_leader.settings import LeaderSettings
from django_nats_leader import conf
from django_nats_leader.management.common import EXIT_ERROR, EXIT_NO_LEADER, load_settings

#: What a bucket holds: election keys, or the beat schedule's state.
ELECTION, BEAT_STATE = "election", "beat_state"


@dataclass(frozen=True)
class Target:
    """A bucket to inspect or create.

    Attributes:
        name: The bucket.
        kind: :data:`ELECTION` or :data:`BEAT_STATE`.
        ttl: The ``max_age`` it must have (``None`` for the beat state: none).
        replicas: Replicas when creating it.
        expect_replicas: Replicas an existing one must have (``--replicas``), if any.

    """

    name: str
    kind: str
    ttl: float | None
    replicas: int
    expect_replicas: int | None = None

    @property
    def persistent(self) -> bool:
        """Whether its data must never expire."""
        return self.kind == BEAT_STATE


@dataclass(frozen=True)
class Outcome:
    """One bucket's settings, or why it is missing."""

    target: Target
    info: BucketInfo | None
    problems: list[str]

    def to_dict(self) -> dict[str, Any]:
        """One entry of ``--json``'s ``buckets``."""
        body: dict[str, Any] = {"name": self.target.name, "kind": self.target.kind}
        if self.info is None:
            body.update(exists=False, problems=self.problems)
            return body
        info = self.info.to_dict()
        info.pop("name")
        body.update(exists=True, **info, problems=self.problems)
        return body


def expected_ttl(settings: LeaderSettings, bucket: str) -> float:
    """The TTL the roles using ``bucket`` want (the base ``TTL`` if none or several)."""
    ttls = bucket_ttls(settings).get(bucket, set())
    return next(iter(ttls)) if len(ttls) == 1 else settings.ttl


def targets(settings: LeaderSettings, options: dict[str, Any]) -> list[Target]:
    """The buckets the command looks at, from the settings and the options."""
    replicas = int(
        options["replicas"] if options["replicas"] is not None else settings.bucket_replicas
    )
    name = options["bucket"] or settings.bucket
    ttl = float(options["ttl"] if options["ttl"] is not None else expected_ttl(settings, name))
    expect = options["replicas"]
    found = [Target(name, ELECTION, ttl, replicas, expect)]
    if not options["bucket"] and (options["beat_state"] or conf.beat_is_elected()):
        found.append(Target(settings.beat_state_bucket, BEAT_STATE, None, replicas, expect))
    return found


def inspect_or_create(
    settings: LeaderSettings, wanted: list[Target], *, create: bool, timeout: float
) -> list[Outcome]:
    """Read every bucket's settings, creating the missing ones when ``create`` is set."""

    async def run() -> list[Outcome]:
        name = operator_name("manage.py election_bucket")
        found: list[Outcome] = []
        async with await open_backend(settings.connection, timeout=timeout, name=name) as backend:
            for target in wanted:
                try:
                    if create:
                        info = await ensure_bucket(
                            backend,
                            target.name,
                            ttl=target.ttl,
                            replicas=target.replicas,
                            timeout=timeout,
                            persistent=target.persistent,
                        )
                    else:
                        info = await bucket_info(backend, target.name, timeout=timeout)
                except BucketNotFoundError:
                    found.append(
                        Outcome(target, None, ["does not exist: run with --create to create it"])
                    )
                    continue
                problems = info.problems(
                    ttl=target.ttl, replicas=target.expect_replicas, persistent=target.persistent
                )
                found.append(Outcome(target, info, problems))
        return found

    return run_once(run)


def events_stream_of(
    settings: LeaderSettings, bucket: str, *, max_age: float, create: bool, timeout: float
) -> StreamInfo | None:
    """The bucket's events stream (created with ``create``), or ``None``."""

    async def run() -> StreamInfo | None:
        name = operator_name("manage.py election_bucket")
        async with await open_backend(settings.connection, timeout=timeout, name=name) as backend:
            if create:
                return await ensure_events_stream(
                    backend,
                    bucket,
                    max_age=max_age,
                    replicas=settings.bucket_replicas,
                    timeout=timeout,
                )
            return await stream_info(backend, bucket, timeout=timeout)

    return run_once(run)


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
            "--events-max-age",
            type=float,
            default=None,
            metavar="SECONDS",
            help=(
                "Keep the transition events in a JetStream stream for this long (with --create "
                "it is created; never required by the elections)."
            ),
        )
        parser.add_argument("--json", action="store_true", help="Print the settings as JSON.")
        parser.add_argument("--timeout", type=float, default=5.0, help="Seconds to wait for NATS.")

    def handle(self, *args: Any, **options: Any) -> None:
        """Inspect (or create) the buckets and say whether they fit the settings."""
        settings = load_settings()
        try:
            wanted = targets(settings, options)
            for target in wanted:
                validate_bucket(target.name)
        except ConfigError as exc:
            raise CommandError(str(exc), returncode=EXIT_ERROR) from exc
        try:
            outcomes = inspect_or_create(
                settings, wanted, create=options["create"], timeout=options["timeout"]
            )
        except ElectionError as exc:
            raise CommandError(f"cannot inspect the buckets: {exc}", returncode=EXIT_ERROR) from exc
        failing = [o for o in outcomes if o.problems]
        stream = None
        if options["events_max_age"] is not None:
            try:
                stream = events_stream_of(
                    settings,
                    wanted[0].name,
                    max_age=options["events_max_age"],
                    create=options["create"],
                    timeout=options["timeout"],
                )
            except (ElectionError, ValueError) as exc:
                raise CommandError(
                    f"cannot set up the events stream: {exc}", returncode=EXIT_ERROR
                ) from exc
        if options["json"]:
            body = {"ok": not failing, "buckets": [o.to_dict() for o in outcomes]}
            if options["events_max_age"] is not None:
                body["events_stream"] = None if stream is None else asdict(stream)
            self.stdout.write(json.dumps(body, sort_keys=True))
        else:
            for outcome in outcomes:
                self._show(outcome)
            if options["events_max_age"] is not None:
                self._show_stream(stream)
        if failing:
            raise CommandError(
                "; ".join(f"KV bucket {o.target.name!r}: {', '.join(o.problems)}" for o in failing),
                returncode=EXIT_NO_LEADER,
            )

    def _show_stream(self, stream: StreamInfo | None) -> None:
        if stream is None:
            self.stdout.write("events stream: none (create it with --create --events-max-age)")
            return
        verb = "created" if stream.created else "exists"
        self.stdout.write(
            self.style.MIGRATE_HEADING(f"events stream {stream.name!r} {verb}")
            + f"\n  max_age        {stream.max_age:g}s\n  events         {stream.messages}"
        )

    def _show(self, outcome: Outcome) -> None:
        target, info = outcome.target, outcome.info
        what = "election bucket" if target.kind == ELECTION else "beat state bucket"
        if info is None:
            self.stdout.write(self.style.ERROR(f"{what} {target.name!r} does not exist"))
            self.stdout.write("  create it with `manage.py election_bucket --create`")
            return
        verb = "created" if info.created else "exists"
        self.stdout.write(self.style.MIGRATE_HEADING(f"{what} {info.name!r} {verb}"))
        for label, item in (
            ("max_age (TTL)", f"{info.ttl:g}s" if info.ttl else "none"),
            ("history", str(info.history)),
            ("replicas", str(info.replicas)),
            ("storage", info.storage),
            ("entries", str(info.keys)),
        ):
            self.stdout.write(f"  {label:<15}{item}")
        for problem in outcome.problems:
            self.stdout.write(self.style.ERROR(f"  problem: {problem}"))
        if not outcome.problems:
            self.stdout.write(self.style.SUCCESS("  fits the election settings"))
