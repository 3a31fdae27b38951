"""``celery nats-leader``: see and steer the elections from the command line.

Registered through Celery's ``celery.commands`` entry point, so it runs with
the app's configuration::

    celery -A proj nats-leader status            # table; exit 1 if a role has no leader
    celery -A proj nats-leader status --json     # machine-readable
    celery -A proj nats-leader resign reports    # ask the leader of "reports" to step down
    celery -A proj nats-leader resign reports --json  # ... and report the successor as JSON
    celery -A proj nats-leader bucket --create   # the KV buckets, with the configured TTL
    celery -A proj nats-leader fence reports     # end the term now (hand-over, else fence)
    celery -A proj nats-leader events --follow   # every transition, as it happens
    celery -A proj nats-leader release           # hand over what this host leads (preStop)
    celery -A proj nats-leader seed-beat --shelve celerybeat-schedule  # migrating to beat

Exit codes: 0 all right; 1 a configured role has no leader (``status``), no
leader stepped down (``resign``) or a bucket is missing or wrong
(``bucket``); 2 the elections could not be read (NATS unreachable, bucket
missing, bad configuration).

The commands are thin layers over :mod:`celery_nats_leader.ops`, which the
Django management commands use too. They are one-shot: each opens a NATS
connection, does its work and closes it (``asyncio.run`` is fine here,
unlike in long-lived processes).
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Sequence
from typing import Any

import click

from celery_nats_leader.config import validate_bucket, validate_key
from celery_nats_leader.config.settings import LeaderSettings, is_leader_scheduler
from celery_nats_leader.core import constants as c
from celery_nats_leader.core.backend import Backend
from celery_nats_leader.core.errors import (
    BackendTimeoutError,
    ConfigError,
    ElectionError,
    NotLeaderError,
)
from celery_nats_leader.election.events import TransitionEvent
from celery_nats_leader.ops.bucket import (
    BucketAction,
    BucketOutcome,
    EpochFloor,
    bucket_targets,
    buckets_document,
    events_stream_of,
    floor_lines,
    set_up_buckets,
)
from celery_nats_leader.ops.bucket import outcome_lines as bucket_lines
from celery_nats_leader.ops.events import StreamInfo, show_events
from celery_nats_leader.ops.fence_leader import (
    DEFAULT_HANDOVER_WAIT,
    fence_lines,
    fence_wait,
    request_fence,
)
from celery_nats_leader.ops.oneshot import operator_name, with_backend
from celery_nats_leader.ops.output import (
    EXIT_ERROR,
    EXIT_NO_LEADER,
    EXIT_OK,
    status_document,
    status_exit_code,
    status_lines,
)
from celery_nats_leader.ops.resign import (
    outcome_lines,
    outcome_to_dict,
    release_host,
    release_lines,
    request_resignation,
    resign_wait,
)
from celery_nats_leader.ops.status import fetch_report

__all__ = ["nats_leader"]

#: The name of the CLI's connections in NATS monitoring.
CONNECTION_NAME = "celery-nats-leader-cli"


def _settings(ctx: click.Context) -> LeaderSettings:
    obj = ctx.find_root().obj
    app = getattr(obj, "app", None)
    if app is None:  # pragma: no cover - always set by the celery command
        raise click.UsageError("no Celery app: use celery -A <app> nats-leader ...")
    try:
        return LeaderSettings.from_celery(app.conf)
    except ElectionError as exc:
        click.echo(f"Error: invalid nats_leader settings: {exc}", err=True)
        ctx.exit(EXIT_ERROR)
        raise  # pragma: no cover - ctx.exit raises


def _check_role(ctx: click.Context, role: str) -> None:
    """Exit 2 with the reason when ``role`` is not a valid key."""
    try:
        validate_key(role, "ROLE")
    except ConfigError as exc:
        click.echo(f"Error: {exc}", err=True)
        ctx.exit(EXIT_ERROR)


def _echo(lines: Sequence[tuple[bool, str]]) -> None:
    """Print ``(good, line)`` pairs: the good ones on stdout, the others on stderr."""
    for good, line in lines:
        click.echo(line, err=not good)


@click.group(name="nats-leader")
def nats_leader() -> None:
    """Leader election on NATS JetStream KV: status and operator commands."""


@nats_leader.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--timeout", default=5.0, show_default=True, help="Seconds to wait for NATS.")
@click.option(
    "--role",
    "extra_roles",
    multiple=True,
    help="Also require a leader for this role (repeatable); default: nats_leader_roles.",
)
@click.option(
    "--window",
    default=c.DEFAULT_ROSTER_WINDOW_SECONDS,
    show_default=True,
    help="Seconds to collect the live candidates' own answers (term age, lease).",
)
@click.option(
    "--strict",
    is_flag=True,
    help="Also exit 1 when a configured role's leader does not answer (paused, hung, dead).",
)
@click.pass_context
def status(
    ctx: click.Context,
    *,
    as_json: bool,
    timeout: float,
    extra_roles: tuple[str, ...],
    window: float,
    strict: bool,
) -> None:
    """Print every role of the bucket with its leader and term.

    Exits 1 when a configured role (nats_leader_roles; the beat role when
    beat_scheduler is a leader scheduler; --role) has no leader, or with
    --strict when its leader does not answer.
    """
    settings = _settings(ctx)
    beat = [settings.beat_role] if _beat_is_elected(ctx.find_root().obj.app.conf) else []
    try:
        report = fetch_report(
            settings,
            configured_roles=[*settings.roles, *beat, *extra_roles],
            timeout=timeout,
            roster_window=window,
            name=CONNECTION_NAME,
        )
    except ElectionError as exc:
        click.echo(
            f"Error: cannot read the elections of bucket {settings.bucket!r}: {exc}", err=True
        )
        ctx.exit(EXIT_ERROR)
    if as_json:
        click.echo(status_document(report))
    else:
        _echo(status_lines(report))
    ctx.exit(status_exit_code(report, strict=strict))


@nats_leader.command()
@click.argument("role")
@click.option(
    "--wait",
    type=float,
    default=None,
    help="Seconds to wait for the new leader (default: the role's TTL + 1; 0: no wait).",
)
@click.option(
    "--timeout", default=5.0, show_default=True, help="Seconds to wait for the leader's answer."
)
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_context
def resign(
    ctx: click.Context, role: str, wait: float | None, timeout: float, as_json: bool
) -> None:
    """Ask the current leader of ROLE to step down, and report the new leader.

    The leader runs its demote callbacks, releases the key and sits out one
    TTL, so another candidate takes the role within milliseconds. Exits 1
    when nobody leads ROLE, its leader did not answer, or it refused.
    """
    settings = _settings(ctx)
    _check_role(ctx, role)
    wait = resign_wait(settings, role, wait)
    try:
        outcome = request_resignation(
            settings,
            role,
            timeout=timeout,
            wait=wait,
            requester=operator_name("celery nats-leader resign"),
        )
    except (NotLeaderError, BackendTimeoutError) as exc:
        click.echo(f"Error: {exc}", err=True)
        ctx.exit(EXIT_NO_LEADER)
    except ElectionError as exc:
        click.echo(f"Error: cannot reach the election: {exc}", err=True)
        ctx.exit(EXIT_ERROR)
    if as_json:
        click.echo(json.dumps(outcome_to_dict(outcome), sort_keys=True))
    else:
        _echo(outcome_lines(outcome, wait))
    ctx.exit(EXIT_OK if outcome.accepted else EXIT_NO_LEADER)


def _beat_is_elected(conf: Any) -> bool:
    """Whether the app's beat runs under a leader scheduler (then it needs a state bucket)."""
    return is_leader_scheduler(conf.get("beat_scheduler"))


@nats_leader.command()
@click.option(
    "--check",
    "action",
    flag_value="check",
    default=True,
    help="Print each bucket's settings and whether they fit (the default).",
)
@click.option("--create", "action", flag_value="create", help="Create the missing buckets.")
@click.option(
    "--delete",
    "action",
    flag_value="delete",
    help="Delete the buckets: every role's record (epochs restart) and the beat state.",
)
@click.option("--yes", is_flag=True, help="Do not ask before --delete.")
@click.option("--bucket", "only", default=None, help="Only this election bucket.")
@click.option("--ttl", type=float, default=None, help="max_age in seconds (default: the TTL).")
@click.option(
    "--replicas",
    type=int,
    default=None,
    help="Replicas when creating (default: nats_leader_bucket_replicas); "
    "when given, an existing bucket must have as many.",
)
@click.option(
    "--beat-state",
    is_flag=True,
    help="Include the beat state bucket (automatic when beat_scheduler is a leader scheduler).",
)
@click.option(
    "--once",
    is_flag=True,
    help="Only the once-guard's buckets (<once_bucket>_leases and <once_bucket>). "
    "Without it, --check and --create include them when beat_scheduler is a leader "
    "scheduler and ticks run once (nats_leader_beat_once); --delete never does.",
)
@click.option(
    "--events-max-age",
    type=float,
    default=None,
    metavar="SECONDS",
    help="Keep the transition events in a stream for this long (created with --create).",
)
@click.option(
    "--migrate-from",
    default=None,
    metavar="BUCKET",
    help="Create the election bucket (a TTL change: a new bucket) so that its terms' "
    "epochs continue above BUCKET's, which the replicas use now.",
)
@click.option(
    "--epoch-floor",
    type=click.IntRange(min=1),
    default=None,
    metavar="EPOCH",
    help="Create the election bucket so that its first term's epoch is at least EPOCH.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.option("--timeout", default=5.0, show_default=True, help="Seconds to wait for NATS.")
@click.pass_context
def bucket(
    ctx: click.Context,
    *,
    action: BucketAction,
    yes: bool,
    only: str | None,
    ttl: float | None,
    replicas: int | None,
    beat_state: bool,
    once: bool,
    events_max_age: float | None,
    migrate_from: str | None,
    epoch_floor: int | None,
    as_json: bool,
    timeout: float,
) -> None:
    """Check, create or delete the elections' KV buckets (and the optional events stream).

    The election bucket needs max_age equal to the TTL and history 1; the beat
    schedule's state bucket needs history 1 and no max_age; the once-guard's
    buckets (--once: those instead) need max_age equal to once_lease and
    once_retention. --create makes the
    missing ones with exactly those settings (no `nats` CLI needed) and never
    changes an existing one. To change the TTL, --migrate-from OLD creates the
    new bucket (--bucket NEW --ttl SECONDS) with its epochs above OLD's.
    Exits 1 when a bucket is missing or does not fit,
    2 when NATS cannot be used.
    """
    settings = _settings(ctx)
    app = ctx.find_root().obj.app
    migrating = migrate_from is not None or epoch_floor is not None
    try:
        if migrating and (once or action == "delete"):
            raise ConfigError("--migrate-from and --epoch-floor create an election bucket")
        if migrating:
            action = "create"
            if migrate_from is not None:
                validate_bucket(migrate_from)
        wanted = bucket_targets(
            settings,
            bucket=only,
            ttl=ttl,
            replicas=replicas,
            beat_state=beat_state or _beat_is_elected(app.conf),
            once=once,
            # The buckets workers claim ticks in: made by the same --create
            # (least-privilege workers may not create them), never deleted
            # by a plain --delete (they remember which ticks ran).
            once_guard=settings.beat_once
            and _beat_is_elected(app.conf)
            and action != "delete"
            and not migrating,
        )
        for target in wanted:
            validate_bucket(target.name)
    except ConfigError as exc:
        click.echo(f"Error: {exc}", err=True)
        ctx.exit(EXIT_ERROR)
    if action == "delete" and not yes:
        names = ", ".join(repr(t.name) for t in wanted)
        click.confirm(
            f"Delete {names}? The once-guard forgets every finished run (a duplicate "
            "arriving later runs again)"
            if once
            else f"Delete {names}? Every role's record goes (epochs restart at 1, so clear "
            "any fence that remembers them) and so does the beat schedule's state",
            abort=True,
        )

    async def run(
        backend: Backend,
    ) -> tuple[list[BucketOutcome], EpochFloor | None, StreamInfo | None]:
        found, floor = await set_up_buckets(
            backend,
            wanted,
            action,
            migrate_from=migrate_from,
            epoch_floor=epoch_floor,
            settings=settings,
            timeout=timeout,
        )
        stream = None
        if events_max_age is not None and action != "delete":
            stream = await events_stream_of(
                backend,
                wanted[0].name,
                create=action == "create",
                max_age=events_max_age,
                replicas=settings.bucket_replicas if replicas is None else replicas,
                timeout=timeout,
            )
        return found, floor, stream

    try:
        outcomes, floor, stream = with_backend(
            settings, run, timeout=timeout, name=operator_name("celery nats-leader bucket")
        )
    except ElectionError as exc:
        click.echo(f"Error: cannot use the buckets: {exc}", err=True)
        ctx.exit(EXIT_ERROR)
    failing = [o for o in outcomes if o.problems]
    if as_json:
        click.echo(
            buckets_document(
                outcomes, floor=floor, stream=stream, with_stream=events_max_age is not None
            )
        )
    else:
        create = f"celery -A {app.main or '<app>'} nats-leader bucket --create"
        for outcome in outcomes:
            for style, text in bucket_lines(outcome, create_command=create):
                click.echo(click.style(text, **_STYLES[style]) if style else text)
            if floor is not None and outcome.target.name == floor.bucket:
                for style, text in floor_lines(floor):
                    click.echo(click.style(text, **_STYLES[style]) if style else text)
        if events_max_age is not None:
            click.echo(
                "events stream: none (create it with --create --events-max-age)"
                if stream is None
                else f"events stream {stream.name!r} {'created' if stream.created else 'exists'}"
                f" (max_age {stream.max_age:g}s, {stream.messages} events)"
            )
    ctx.exit(EXIT_NO_LEADER if failing else EXIT_OK)


_STYLES: dict[str, dict[str, Any]] = {
    "heading": {"bold": True},
    "error": {"fg": "red"},
    "success": {"fg": "green"},
}


@nats_leader.command()
@click.option(
    "--host",
    default=None,
    help="Release the roles led by processes of this host (default: this host's name).",
)
@click.option("--timeout", default=5.0, show_default=True, help="Seconds per NATS operation.")
@click.pass_context
def release(ctx: click.Context, host: str | None, timeout: float) -> None:
    """Ask every leader running on this host to hand its role over (a preStop hook).

    Reads who leads each role; each leader whose record names HOST (its
    ``hostname`` metadata, the pod name in Kubernetes) is asked to step down,
    so successors on other hosts take over in milliseconds before this
    host's processes receive SIGTERM. Exits 0 also when nothing here leads.
    """
    settings = _settings(ctx)
    host = host or socket.gethostname()
    requester = operator_name("celery nats-leader release")
    try:
        released = with_backend(
            settings,
            lambda backend: release_host(
                backend,
                settings.bucket,
                settings.roles,
                host,
                timeout=timeout,
                requester=requester,
                strategy=settings.strategy,
            ),
            timeout=timeout,
            name=CONNECTION_NAME,
        )
    except ElectionError as exc:
        click.echo(f"Error: {exc}", err=True)
        ctx.exit(EXIT_ERROR)
    for line in release_lines(settings.bucket, host, released):
        click.echo(line)
    ctx.exit(EXIT_OK)


@nats_leader.command()
@click.argument("role")
@click.option("--epoch", type=int, default=None, help="Fence only this term (its epoch).")
@click.option(
    "--wait",
    default=None,
    type=float,
    help="Seconds to wait for the new leader (default: the role's TTL; 0: no wait).",
)
@click.option(
    "--handover-wait",
    default=DEFAULT_HANDOVER_WAIT,
    type=click.FloatRange(min=0),
    show_default=True,
    help="Seconds for a live leader to hand over on request before it is fenced "
    "(0: fence at once, without asking).",
)
@click.option("--timeout", default=5.0, show_default=True, help="Seconds per NATS operation.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.pass_context
def fence(
    ctx: click.Context,
    role: str,
    *,
    epoch: int | None,
    wait: float | None,
    handover_wait: float,
    timeout: float,
    as_json: bool,
) -> None:
    """End the current term of ROLE now: a clean hand-over, or a fence if the leader is stuck.

    The leader is first asked to hand over (as ``resign`` does); a live leader
    steps down before anyone else can lead, with no overlap. A leader that
    does not answer within --handover-wait is fenced: a conditional update at
    the observed revision replaces its record with a fence marker, every
    fenced check of the old term fails from then on, and a live candidate
    takes the role in milliseconds instead of after the TTL. The output says
    which of the two happened ("action": "handed_over" or "fenced").
    Exits 0 either way, 1 when nobody leads ROLE (or its term is not --epoch).
    """
    settings = _settings(ctx)
    _check_role(ctx, role)
    wait = fence_wait(settings, role, wait)
    try:
        outcome = request_fence(
            settings,
            role,
            epoch=epoch,
            timeout=timeout,
            wait=wait,
            requester=operator_name("celery nats-leader fence"),
            handover_wait=handover_wait,
        )
    except NotLeaderError as exc:
        click.echo(f"Error: {exc}", err=True)
        ctx.exit(EXIT_NO_LEADER)
    except ElectionError as exc:
        click.echo(f"Error: {exc}", err=True)
        ctx.exit(EXIT_ERROR)
    if as_json:
        click.echo(json.dumps(outcome.to_dict(), sort_keys=True))
    else:
        _echo(fence_lines(outcome, wait))
    ctx.exit(EXIT_OK)


def _events(
    settings: LeaderSettings,
    *,
    role: str | None,
    follow: bool,
    limit: int | None,
    count: int | None,
    as_json: bool,
    timeout: float,
) -> bool:
    def emit(event: TransitionEvent) -> None:
        text = json.dumps(event.to_dict(), sort_keys=True) if as_json else event.describe()
        click.echo(text)

    return with_backend(
        settings,
        lambda backend: show_events(
            backend,
            settings.bucket,
            emit,
            role=role,
            follow=follow,
            limit=limit,
            count=count,
            timeout=timeout,
        ),
        timeout=timeout,
        name=CONNECTION_NAME,
    )


@nats_leader.command()
@click.option("--role", default=None, help="Only this role's events.")
@click.option("--follow", is_flag=True, help="Keep printing events as they happen (Ctrl-C stops).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option("--limit", type=int, default=None, help="Only the newest N kept events.")
@click.option("--count", type=int, default=None, help="With --follow: stop after N live events.")
@click.option("--timeout", default=5.0, show_default=True, help="Seconds per NATS operation.")
@click.pass_context
def events(
    ctx: click.Context,
    *,
    role: str | None,
    follow: bool,
    as_json: bool,
    limit: int | None,
    count: int | None,
    timeout: float,
) -> None:
    """Print the leadership transitions: promoted, demoted (why), released, resigned, fenced.

    The history comes from the bucket's events stream when an operator created
    one (``manage.py election_bucket --create --events-max-age``); live events
    (--follow) need nothing but NATS.
    """
    settings = _settings(ctx)
    try:
        kept = _events(
            settings,
            role=role,
            follow=follow,
            limit=limit,
            count=count,
            as_json=as_json,
            timeout=timeout,
        )
    except KeyboardInterrupt:
        ctx.exit(EXIT_OK)
    except ElectionError as exc:
        click.echo(f"Error: {exc}", err=True)
        ctx.exit(EXIT_ERROR)
    if not kept:
        click.echo(
            f"no events stream for bucket {settings.bucket!r}: only live events (--follow) "
            "can be shown",
            err=True,
        )
    ctx.exit(EXIT_OK)


@nats_leader.command(name="seed-beat")
@click.option(
    "--shelve",
    "shelve_path",
    default=None,
    metavar="PATH",
    help="Celery's PersistentScheduler schedule file (the old beat's -s).",
)
@click.option("--redbeat", is_flag=True, help="celery-redbeat's keys in Redis.")
@click.option(
    "--redis-url",
    default=None,
    help="With --redbeat: Redis (default: redbeat_redis_url, else broker_url).",
)
@click.option(
    "--key-prefix",
    default=None,
    help="With --redbeat: the key prefix (default: redbeat_key_prefix, else 'redbeat:').",
)
@click.option("--replace", is_flag=True, help="Overwrite entries that already have a state.")
@click.option("--json", "as_json", is_flag=True, help="Print the outcome as JSON.")
@click.option("--timeout", default=5.0, show_default=True, help="Seconds per NATS operation.")
@click.pass_context
def seed_beat(
    ctx: click.Context,
    *,
    shelve_path: str | None,
    redbeat: bool,
    redis_url: str | None,
    key_prefix: str | None,
    replace: bool,
    as_json: bool,
    timeout: float,
) -> None:
    """Seed the beat schedule's state with the last runs of the scheduler it replaces.

    Run it once, with the old beat stopped and before the first `beat -S
    nats_leader` starts: each entry's first tick is then the one the old
    scheduler would have sent next (nothing skipped, nothing repeated).
    Entries that already have a state are kept (--replace overwrites them).
    django-celery-beat: `manage.py election_seed_beat`. Exits 2 when a source
    or NATS cannot be read, or when the source holds no entry at all (a wrong
    path, URL or key prefix).
    """
    from celery_nats_leader.ops.seed import (
        last_runs_from_redbeat,
        last_runs_from_shelve,
        seed_lines,
        seed_with_settings,
    )

    settings = _settings(ctx)
    app = ctx.find_root().obj.app
    if (shelve_path is None) == (not redbeat):
        raise click.UsageError("give one source: --shelve PATH or --redbeat")
    try:
        if shelve_path is not None:
            last_runs = last_runs_from_shelve(shelve_path, zone=app.timezone)
        else:
            conf = app.conf
            url = redis_url or conf.get("redbeat_redis_url") or conf.broker_url
            prefix = key_prefix or conf.get("redbeat_key_prefix") or "redbeat:"
            last_runs = last_runs_from_redbeat(str(url), key_prefix=str(prefix))
    except ConfigError as exc:
        click.echo(f"Error: {exc}", err=True)
        ctx.exit(EXIT_ERROR)
    if not last_runs:
        # A wrong path, URL or key prefix reads as "nothing to seed": say so
        # and fail, or the new beat starts from an empty state.
        source = (
            f"the schedule file {shelve_path!r}"
            if shelve_path is not None
            else f"Redis {url!r} under the key prefix {prefix!r}"
        )
        click.echo(
            f"Error: no periodic entry found in {source}: nothing seeded; check the "
            "source (the old beat's -s, --redis-url, --key-prefix)",
            err=True,
        )
        ctx.exit(EXIT_ERROR)

    try:
        outcomes = seed_with_settings(
            settings,
            last_runs,
            replace=replace,
            timeout=timeout,
            requester=operator_name("celery nats-leader seed-beat"),
        )
    except ElectionError as exc:
        click.echo(f"Error: cannot seed {settings.beat_state_bucket!r}: {exc}", err=True)
        ctx.exit(EXIT_ERROR)
    if as_json:
        click.echo(json.dumps({"entries": [o.to_dict() for o in outcomes]}, sort_keys=True))
    else:
        for line in seed_lines(outcomes):
            click.echo(line)
    ctx.exit(EXIT_OK)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(nats_leader())
