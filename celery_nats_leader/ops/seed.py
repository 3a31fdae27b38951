"""Seeding the beat schedule's state from the scheduler it replaces.

A leader scheduler that finds no state for an entry anchors it at the
entry's ``last_run_at`` as *its* scheduler knows it, or at "now": on a host
without the old scheduler's shelve file, or coming from celery-redbeat, that
is "now", and a tick due during the cut-over would be skipped. Seeding writes
each entry's last run, read from the previous scheduler's own storage, into
the state bucket before the first leader starts, so the first tick is the one
the old scheduler would have sent next: nothing skipped, nothing repeated.

Sources (each read with the previous scheduler stopped):

* Celery's ``PersistentScheduler``: its shelve file (``celery beat -s``),
  :func:`last_runs_from_shelve`;
* celery-redbeat: its Redis hashes ``<redbeat_key_prefix><name>``,
  :func:`last_runs_from_redbeat`;
* django-celery-beat: its ``PeriodicTask`` rows, :func:`last_runs_from_rows`
  (the Django side queries them).

No Celery and no Django imports here: the shelve's entries are Celery objects
that ``pickle`` imports when it reads them, and the Redis client is imported
only when that source is used.
"""

from __future__ import annotations

import dataclasses
import json
import shelve
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone, tzinfo
from typing import TYPE_CHECKING, Any

from celery_nats_leader.beat.schedule_store import EntryState, decode_state, encode_state, state_key
from celery_nats_leader.beat.ticks import slot_text, to_utc
from celery_nats_leader.core.backend import Backend, Bucket
from celery_nats_leader.core.errors import ConfigError, KeyExistsError, RevisionMismatchError
from celery_nats_leader.ops.oneshot import with_backend

if TYPE_CHECKING:
    from celery_nats_leader.config.settings import LeaderSettings

__all__ = [
    "SEED_WRITER",
    "LastRun",
    "SeedOutcome",
    "last_runs_from_redbeat",
    "last_runs_from_rows",
    "last_runs_from_shelve",
    "seed_lines",
    "seed_schedule_state",
    "seed_with_settings",
]

#: The ``by`` of a seeded state (its ``epoch`` is 0: no term wrote it).
SEED_WRITER = "seed"


@dataclass(frozen=True)
class LastRun:
    """What the previous scheduler knew of one entry.

    Attributes:
        entry: The entry's name (the key of ``beat_schedule``, the row's name).
        last_run_at: When it last sent the entry (aware), or ``None`` if never.
        runs: Its run count (``total_run_count``).
        task: The entry's task name (informational).

    """

    entry: str
    last_run_at: datetime | None
    runs: int = 0
    task: str = ""


@dataclass(frozen=True)
class SeedOutcome:
    """What seeding did for one entry.

    Attributes:
        entry: The entry's name.
        action: ``"seeded"`` (written), ``"replaced"`` (an existing state
            overwritten, ``replace=True``), ``"kept"`` (a state exists: left as
            it is) or ``"never ran"`` (nothing to seed: the first leader
            anchors it as usual).
        source: The previous scheduler's last run (``None`` if never).
        state: The entry's state in KV after seeding (``None`` if none).

    """

    entry: str
    action: str
    source: LastRun
    state: EntryState | None

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict."""
        last = self.source.last_run_at
        return {
            "entry": self.entry,
            "action": self.action,
            "last_run_at": None if last is None else slot_text(last),
            "runs": self.source.runs,
            "state": None if self.state is None else self.state.to_dict(),
        }


def _aware(moment: datetime, zone: tzinfo) -> datetime:
    """``moment`` as an aware datetime; a naive one is read in ``zone`` (the app's timezone)."""
    if moment.tzinfo is None or moment.tzinfo.utcoffset(moment) is None:
        return moment.replace(tzinfo=zone)
    return moment


def last_runs_from_shelve(path: str, *, zone: tzinfo = timezone.utc) -> list[LastRun]:
    """The entries of Celery's ``PersistentScheduler`` schedule file (``celery beat -s``).

    Open it only while that beat is stopped (it syncs the file on a clean
    stop; a SIGKILLed beat leaves up to ``beat_sync_every`` / 3 minutes of
    runs unsaved).

    Args:
        path: The file as given to ``celery beat -s`` (default
            ``celerybeat-schedule``; the ``dbm`` module may have added a suffix).
        zone: The timezone of naive ``last_run_at`` values (the app's).

    Returns:
        One :class:`LastRun` per entry, sorted by name. Celery's own
        ``celery.backend_cleanup`` entry is included like any other.

    Raises:
        ConfigError: The file cannot be opened as a schedule.

    """
    try:
        db = shelve.open(path, flag="r")  # noqa: SIM115 - its errors are told apart from the read's
    except Exception as exc:
        raise ConfigError(f"cannot open the schedule file {path!r}: {exc}") from exc
    found = []
    with db:
        try:
            entries: Mapping[str, Any] = db.get("entries") or {}
            for name, entry in entries.items():
                last = getattr(entry, "last_run_at", None)
                found.append(
                    LastRun(
                        entry=str(name),
                        last_run_at=None if last is None else _aware(last, zone),
                        runs=int(getattr(entry, "total_run_count", 0) or 0),
                        task=str(getattr(entry, "task", "") or ""),
                    )
                )
        except Exception as exc:
            raise ConfigError(f"{path!r} is not a Celery schedule file: {exc}") from exc
    return sorted(found, key=lambda run: run.entry)


def _redbeat_datetime(value: Any) -> datetime | None:
    """celery-redbeat's JSON form of a datetime (``RedBeatJSONEncoder``)."""
    if not isinstance(value, dict) or value.get("__type__") != "datetime":
        return None
    fields = {
        k: int(value[k])
        for k in ("year", "month", "day", "hour", "minute", "second", "microsecond")
    }
    zone_name = value.get("timezone", "UTC")
    zone: tzinfo
    if isinstance(zone_name, (int, float)):
        # An offset in seconds, as redbeat writes a fixed-offset timezone.
        zone = timezone(timedelta(seconds=float(zone_name)))
    else:
        from zoneinfo import ZoneInfo

        zone = ZoneInfo(str(zone_name))
    return datetime(tzinfo=zone, **fields)


def last_runs_from_redbeat(redis_url: str, *, key_prefix: str = "redbeat:") -> list[LastRun]:
    """The entries celery-redbeat keeps in Redis, with their last runs.

    Reads the schedule's sorted set ``<key_prefix>:schedule`` and, for each
    member, its hash (``definition``: name and task; ``meta``: ``last_run_at``
    and ``total_run_count``). Needs the ``redis`` package (celery-redbeat's
    own dependency).

    Args:
        redis_url: ``redbeat_redis_url`` (or the broker's URL, redbeat's default).
        key_prefix: ``redbeat_key_prefix``.

    Returns:
        One :class:`LastRun` per entry, sorted by name.

    Raises:
        ConfigError: Redis cannot be read or holds something else.

    """
    try:
        import redis
    except ImportError as exc:  # pragma: no cover - an extra of the user's
        raise ConfigError("reading celery-redbeat's state needs the 'redis' package") from exc
    client = redis.Redis.from_url(redis_url)
    found = []
    try:
        keys = client.zrange(f"{key_prefix}:schedule", 0, -1)
        for raw_key in keys:
            key = raw_key.decode() if isinstance(raw_key, bytes) else str(raw_key)
            definition_raw, meta_raw = client.hmget(key, ["definition", "meta"])
            if definition_raw is None:
                continue
            definition = json.loads(definition_raw)
            meta = json.loads(meta_raw) if meta_raw else {}
            name = str(definition.get("name") or key[len(key_prefix) :])
            found.append(
                LastRun(
                    entry=name,
                    last_run_at=_redbeat_datetime(meta.get("last_run_at")),
                    runs=int(meta.get("total_run_count") or 0),
                    task=str(definition.get("task", "")),
                )
            )
    except redis.RedisError as exc:
        raise ConfigError(f"cannot read celery-redbeat's keys at {redis_url!r}: {exc}") from exc
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(
            f"celery-redbeat's keys under {key_prefix!r} are malformed: {exc}"
        ) from exc
    finally:
        client.close()
    return sorted(found, key=lambda run: run.entry)


def last_runs_from_rows(rows: Iterable[Any], *, zone: tzinfo = timezone.utc) -> list[LastRun]:
    """django-celery-beat's ``PeriodicTask`` rows as last runs.

    Args:
        rows: Objects with ``name``, ``task``, ``last_run_at`` and
            ``total_run_count`` (the rows; the Django side queries them).
        zone: The timezone of naive ``last_run_at`` values (``USE_TZ = False``).

    Returns:
        One :class:`LastRun` per row, sorted by name.

    """
    found = [
        LastRun(
            entry=str(row.name),
            last_run_at=None if row.last_run_at is None else _aware(row.last_run_at, zone),
            runs=int(row.total_run_count or 0),
            task=str(row.task or ""),
        )
        for row in rows
    ]
    return sorted(found, key=lambda run: run.entry)


async def seed_schedule_state(
    backend: Backend,
    bucket_name: str,
    role: str,
    last_runs: Iterable[LastRun],
    *,
    replace: bool = False,
    create_bucket: bool = False,
    replicas: int = 1,
    timeout: float,
) -> list[SeedOutcome]:
    """Write each entry's last run into the state bucket as its last tick.

    A seeded state says "the last tick dispatched was at ``last_run_at``"
    (``runs`` carried over, ``epoch`` 0, ``by`` ``"seed"``): the first leader
    dispatches the entry's next slot after it, as the previous scheduler
    would have; ticks due since then follow the catch-up rules (one by one
    inside ``beat_catch_up_window``, else one run).

    An entry that already has a state keeps it unless ``replace`` is set (a
    leader that dispatched it since knows better). Run it before the first
    leader scheduler starts; a leader running meanwhile notices a replaced
    state at its next compare-and-set and reads it again.

    Args:
        backend: An open backend.
        bucket_name: The state bucket (``nats_leader_beat_state_bucket``).
        role: The beat role (``nats_leader_beat_role``).
        last_runs: What the previous scheduler knew.
        replace: Overwrite existing states.
        create_bucket: Create the state bucket when missing.
        replicas: Its replicas when created.
        timeout: Seconds per KV operation.

    Returns:
        One outcome per entry, in the order given.

    Raises:
        BucketNotFoundError: The bucket is missing and ``create_bucket`` is off.
        BucketConfigError: The bucket has a ``max_age``.
        ElectionError: NATS failed.

    """
    bucket = await backend.open_bucket(
        bucket_name,
        ttl=None,
        create=create_bucket,
        replicas=replicas,
        timeout=timeout,
        persistent=True,
    )
    outcomes = []
    for last in last_runs:
        outcomes.append(await _seed_one(bucket, role, last, replace=replace, timeout=timeout))
    return outcomes


def seed_with_settings(
    settings: LeaderSettings,
    last_runs: Iterable[LastRun],
    *,
    replace: bool,
    timeout: float,
    requester: str,
) -> list[SeedOutcome]:
    """Synchronous :func:`seed_schedule_state` into ``settings``' beat state bucket.

    On a connection of its own (named ``requester``), as the CLI's
    ``seed-beat`` and ``manage.py election_seed_beat`` run it.

    Raises:
        ElectionError: NATS unreachable, bucket missing, ...

    """
    return with_backend(
        settings,
        lambda backend: seed_schedule_state(
            backend,
            settings.beat_state_bucket,
            settings.beat_role,
            last_runs,
            replace=replace,
            create_bucket=settings.create_bucket,
            replicas=settings.bucket_replicas,
            timeout=timeout,
        ),
        timeout=timeout,
        name=requester,
    )


async def _seed_one(
    bucket: Bucket, role: str, last: LastRun, *, replace: bool, timeout: float
) -> SeedOutcome:
    key = state_key(role, last.entry)
    existing = await bucket.get(key, timeout=timeout)
    current = None if existing is None else decode_state(existing.value, existing.revision)
    if last.last_run_at is None:
        return SeedOutcome(last.entry, "never ran", last, current)
    if current is not None and not replace:
        return SeedOutcome(last.entry, "kept", last, current)
    state = EntryState(
        entry=last.entry,
        slot=to_utc(last.last_run_at),
        runs=last.runs,
        by=SEED_WRITER,
        commit=uuid.uuid4().hex[:12],
        task=last.task,
    )
    try:
        if existing is None:
            revision = await bucket.create(key, encode_state(state), timeout=timeout)
            action = "seeded"
        else:
            revision = await bucket.update(
                key, encode_state(state), last=existing.revision, timeout=timeout
            )
            action = "replaced"
    except (KeyExistsError, RevisionMismatchError):
        # Written meanwhile (a leader is running): what it wrote stands.
        fresh = await bucket.get(key, timeout=timeout)
        now = None if fresh is None else decode_state(fresh.value, fresh.revision)
        return SeedOutcome(last.entry, "kept", last, now)
    return SeedOutcome(last.entry, action, last, dataclasses.replace(state, revision=revision))


def seed_lines(outcomes: Iterable[SeedOutcome]) -> list[str]:
    """Human-readable lines, one per entry."""
    lines = []
    for outcome in outcomes:
        last = outcome.source.last_run_at
        if outcome.action == "never ran":
            lines.append(f"{outcome.entry}: never ran; the first leader anchors it at its start")
            continue
        assert last is not None
        if outcome.action == "kept":
            assert outcome.state is not None
            lines.append(
                f"{outcome.entry}: kept its state (last tick {slot_text(outcome.state.slot)}, "
                f"{outcome.state.runs} runs, written by {outcome.state.by or '?'}); "
                "--replace overwrites it"
            )
            continue
        lines.append(
            f"{outcome.entry}: {outcome.action}: last run {slot_text(last)}, "
            f"{outcome.source.runs} runs"
        )
    return lines
