"""``celery nats-leader``: see and steer the elections from the command line.

Registered through Celery's ``celery.commands`` entry point, so it runs with
the app's configuration::

    celery -A proj nats-leader status            # table; exit 1 if a role has no leader
    celery -A proj nats-leader status --json     # machine-readable
    celery -A proj nats-leader resign reports    # ask the leader of "reports" to step down
    celery -A proj nats-leader resign reports --json  # ... and report the successor as JSON
    celery -A proj nats-leader bucket --create   # the KV buckets, with the configured TTL

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

import asyncio
import json
import sys
from collections.abc import Sequence
from typing import Any

import click

from celery_nats_leader import constants as c
from celery_nats_leader.config import validate_bucket, validate_key
from celery_nats_leader.errors import (
    BackendTimeoutError,
    ConfigError,
    ElectionError,
    NotLeaderError,
)
from celery_nats_leader.nats import open_backend
from celery_nats_leader.ops.bucket import (
    BucketAction,
    BucketOutcome,
    apply_to_buckets,
    bucket_targets,
)
from celery_nats_leader.ops.bucket import outcome_lines as bucket_lines
from celery_nats_leader.ops.oneshot import operator_name
from celery_nats_leader.ops.resign import outcome_lines, outcome_to_dict, request_resignation
from celery_nats_leader.ops.status import RoleStatus, read_status
from celery_nats_leader.settings import LeaderSettings

__all__ = ["nats_leader"]

EXIT_OK = 0
EXIT_NO_LEADER = 1
EXIT_ERROR = 2


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


async def _read(
    settings: LeaderSettings, roles: Sequence[str], timeout: float, window: float
) -> list[RoleStatus]:
    async with await open_backend(
        settings.connection, timeout=timeout, name="celery-nats-leader-cli"
    ) as backend:
        return await read_status(
            backend,
            settings.bucket,
            roles=roles,
            timeout=timeout,
            roster_window=window,
            strategy=settings.strategy,
        )


def _table(statuses: Sequence[RoleStatus], configured: Sequence[str]) -> str:
    headers = ("ROLE", "LEADER", "EPOCH", "TERM AGE", "EXPIRES IN", "HOST", "PID", "WORKER")
    rows = []
    for status in statuses:
        meta = status.leader_meta
        leader = status.leader_id or ("-- none --" if status.role in configured else "-")
        if status.problem:
            leader = f"?? {status.problem}"
        rows.append(
            (
                status.role,
                leader,
                "" if status.epoch is None else str(status.epoch),
                "" if status.term_age is None else f"{status.term_age:.1f}s",
                "" if status.expires_in is None else f"{status.expires_in:.1f}s",
                str(meta.get("hostname", "")),
                str(meta.get("pid", "")),
                str(meta.get("worker", "")),
            )
        )
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    return "\n".join(lines)


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
@click.pass_context
def status(
    ctx: click.Context,
    as_json: bool,
    timeout: float,
    extra_roles: tuple[str, ...],
    window: float,
) -> None:
    """Print every role of the bucket with its leader and term.

    Exits 1 when a configured role (nats_leader_roles, plus --role) has no leader.
    """
    settings = _settings(ctx)
    configured = list(dict.fromkeys([*settings.roles, *extra_roles]))
    try:
        statuses = asyncio.run(_read(settings, configured, timeout, window))
    except ElectionError as exc:
        click.echo(
            f"Error: cannot read the elections of bucket {settings.bucket!r}: {exc}", err=True
        )
        ctx.exit(EXIT_ERROR)
    leaderless = [s.role for s in statuses if s.role in configured and not s.has_leader]
    if as_json:
        body = {
            "bucket": settings.bucket,
            "configured_roles": configured,
            "leaderless": leaderless,
            "roles": [s.to_dict() for s in statuses],
        }
        click.echo(json.dumps(body, indent=2, sort_keys=True, default=str))
    else:
        click.echo(f"bucket {settings.bucket!r} on {', '.join(settings.servers)}")
        click.echo(_table(statuses, configured))
        if leaderless:
            click.echo(f"no leader: {', '.join(leaderless)}", err=True)
    ctx.exit(EXIT_NO_LEADER if leaderless else EXIT_OK)


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
    try:
        validate_key(role, "ROLE")
    except ConfigError as exc:
        click.echo(f"Error: {exc}", err=True)
        ctx.exit(EXIT_ERROR)
    if wait is None:
        wait = settings.election_config(role).ttl + 1.0
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
        for good, line in outcome_lines(outcome, wait):
            click.echo(line, err=not good)
    ctx.exit(EXIT_OK if outcome.accepted else EXIT_NO_LEADER)


def _beat_is_elected(conf: Any) -> bool:
    """Whether the app's beat runs under a leader scheduler (then it needs a state bucket)."""
    scheduler = conf.get("beat_scheduler")
    text = scheduler if isinstance(scheduler, str) else getattr(scheduler, "__module__", "")
    return "nats_leader" in str(text)


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
    as_json: bool,
    timeout: float,
) -> None:
    """Check, create or delete the elections' KV buckets.

    The election bucket needs max_age equal to the TTL and history 1; the beat
    schedule's state bucket needs history 1 and no max_age. --create makes the
    missing ones with exactly those settings (no `nats` CLI needed) and never
    changes an existing one. Exits 1 when a bucket is missing or does not fit,
    2 when NATS cannot be used.
    """
    settings = _settings(ctx)
    app = ctx.find_root().obj.app
    try:
        wanted = bucket_targets(
            settings,
            bucket=only,
            ttl=ttl,
            replicas=replicas,
            beat_state=beat_state or _beat_is_elected(app.conf),
        )
        for target in wanted:
            validate_bucket(target.name)
    except ConfigError as exc:
        click.echo(f"Error: {exc}", err=True)
        ctx.exit(EXIT_ERROR)
    if action == "delete" and not yes:
        names = ", ".join(repr(t.name) for t in wanted)
        click.confirm(
            f"Delete {names}? Every role's record goes (epochs restart at 1, so clear any "
            "fence that remembers them) and so does the beat schedule's state",
            abort=True,
        )

    async def run() -> list[BucketOutcome]:
        name = operator_name("celery nats-leader bucket")
        async with await open_backend(settings.connection, timeout=timeout, name=name) as backend:
            return await apply_to_buckets(backend, wanted, action, timeout=timeout)

    try:
        outcomes = asyncio.run(run())
    except ElectionError as exc:
        click.echo(f"Error: cannot use the buckets: {exc}", err=True)
        ctx.exit(EXIT_ERROR)
    failing = [o for o in outcomes if o.problems]
    if as_json:
        body = {"ok": not failing, "buckets": [o.to_dict() for o in outcomes]}
        click.echo(json.dumps(body, sort_keys=True))
    else:
        create = f"celery -A {app.main or '<app>'} nats-leader bucket --create"
        for outcome in outcomes:
            for style, text in bucket_lines(outcome, create_command=create):
                click.echo(click.style(text, **_STYLES[style]) if style else text)
    ctx.exit(EXIT_NO_LEADER if failing else EXIT_OK)


_STYLES: dict[str, dict[str, Any]] = {
    "heading": {"bold": True},
    "error": {"fg": "red"},
    "success": {"fg": "green"},
}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(nats_leader())
