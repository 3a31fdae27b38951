"""The elections' KV buckets: inspect, create, delete, and a deploy-time probe.

The election bucket needs ``max_age`` equal to the TTL and ``history=1``;
the beat schedule's state bucket needs ``history=1`` and no ``max_age``
(:meth:`BucketInfo.problems` says what is wrong, in words an operator can act on).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.backend import Backend, BucketInfo
from celery_nats_leader.core.errors import (
    BucketNotFoundError,
    ConfigError,
    ElectionError,
    JetStreamUnavailableError,
)
from celery_nats_leader.election.moves import BucketMarks
from celery_nats_leader.ops.events import StreamInfo, ensure_events_stream, stream_info
from celery_nats_leader.ops.oneshot import operator_name, with_backend
from celery_nats_leader.term.token import ALLCALL_EPOCH_FLOOR

logger = logging.getLogger(__name__)


async def bucket_info(backend: Backend, bucket: str, *, timeout: float = 5.0) -> BucketInfo:
    """Read a bucket's settings.

    Raises:
        BucketNotFoundError: The bucket does not exist.
        JetStreamUnavailableError: The server has no JetStream.

    """
    return await backend.bucket_info(bucket, timeout=timeout)


async def ensure_bucket(
    backend: Backend,
    bucket: str,
    *,
    ttl: float | None,
    replicas: int,
    timeout: float = 5.0,
    persistent: bool = False,
    description: str = "",
) -> BucketInfo:
    """Create the bucket (``history=1``, ``max_age=ttl``) unless it exists.

    An existing bucket is left as it is (see :meth:`BucketInfo.problems`).
    With ``persistent`` (the beat schedule's state) it gets no ``max_age``;
    a bucket created here gets ``description``.

    Returns:
        Its settings, with ``created`` telling whether this call made it.

    Raises:
        JetStreamUnavailableError: The server has no JetStream.

    """
    try:
        return await backend.bucket_info(bucket, timeout=timeout)
    except BucketNotFoundError:
        pass
    # Created through the election backend, so it gets exactly the settings
    # elections check for (a concurrent creator is tolerated there).
    await backend.open_bucket(
        bucket,
        ttl=None if persistent else ttl,
        create=True,
        replicas=replicas,
        timeout=timeout,
        persistent=persistent,
        description=description,
    )
    logger.info(
        "created KV bucket %r (max_age=%s, history=1, replicas=%d)",
        bucket,
        "none" if persistent else f"{ttl:g}s",
        replicas,
    )
    info = await backend.bucket_info(bucket, timeout=timeout)
    return BucketInfo(**{**info.to_dict(), "created": True})


def bucket_ttls(settings: LeaderSettings) -> dict[str, set[float]]:
    """Each bucket the configured roles use, with the TTLs those roles want."""
    found: dict[str, set[float]] = {}
    for role in dict.fromkeys((*settings.roles, settings.beat_role)):
        config = settings.election_config(role)
        found.setdefault(config.bucket, set()).add(config.ttl)
    return found


async def delete_bucket(backend: Backend, bucket: str, *, timeout: float = 5.0) -> bool:
    """Delete a bucket and everything in it (every role's record, or the beat state).

    Live candidates of its roles fail with a missing bucket afterwards: stop
    them first.

    Returns:
        Whether the bucket existed.

    Raises:
        JetStreamUnavailableError: The server has no JetStream.

    """
    existed = await backend.delete_bucket(bucket, timeout=timeout)
    if existed:
        logger.info("deleted KV bucket %r", bucket)
    return existed


#: What a bucket holds: election keys, the beat schedule's state, or the
#: once-guard's leases and done records.
ELECTION, BEAT_STATE = "election", "beat_state"
ONCE_LEASES, ONCE_DONE = "once_leases", "once_done"

#: How the commands name each kind of bucket.
_KIND_NAMES = {
    ELECTION: "election bucket",
    BEAT_STATE: "beat state bucket",
    ONCE_LEASES: "once-guard lease bucket",
    ONCE_DONE: "once-guard done bucket",
}

#: What the create command needs besides its defaults to make each kind.
_CREATE_FLAGS = {BEAT_STATE: " --beat-state", ONCE_LEASES: " --once", ONCE_DONE: " --once"}

#: The setting a once-guard bucket's ``max_age`` must equal.
_ONCE_SETTINGS = {ONCE_LEASES: "once_lease", ONCE_DONE: "once_retention"}

#: What an operator command does with the buckets.
BucketAction = Literal["check", "create", "delete"]


@dataclass(frozen=True)
class BucketTarget:
    """A bucket an operator command inspects, creates or deletes.

    Attributes:
        name: The bucket.
        kind: :data:`ELECTION`, :data:`BEAT_STATE`, :data:`ONCE_LEASES` or
            :data:`ONCE_DONE`.
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

    @property
    def described(self) -> str:
        """What the commands call it (``election bucket``, ...)."""
        return _KIND_NAMES[self.kind]

    def problems(self, info: BucketInfo) -> list[str]:
        """What is wrong with ``info`` for this bucket, each saying what to change."""
        # A once-guard bucket's max_age must equal the guard's setting (it
        # refuses one that differs): the advice names it, not the election TTL.
        return info.problems(
            ttl=self.ttl,
            replicas=self.expect_replicas,
            persistent=self.persistent,
            setting=_ONCE_SETTINGS.get(self.kind),
        )


@dataclass(frozen=True)
class BucketOutcome:
    """One bucket after a command: its settings and problems, or that it is missing or gone.

    Attributes:
        target: The bucket.
        info: Its settings (``None``: missing, or deleted).
        problems: What is wrong with it, each saying what to change.
        deleted: For ``delete``: whether it existed and was deleted (else ``None``).

    """

    target: BucketTarget
    info: BucketInfo | None
    problems: list[str]
    deleted: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        """One entry of the commands' ``--json`` ``buckets`` list."""
        body: dict[str, Any] = {"name": self.target.name, "kind": self.target.kind}
        if self.deleted is not None:
            body.update(exists=False, deleted=self.deleted, problems=self.problems)
        elif self.info is None:
            body.update(exists=False, problems=self.problems)
        else:
            info = self.info.to_dict()
            info.pop("name")
            body.update(exists=True, **info, problems=self.problems)
        return body


def expected_ttl(settings: LeaderSettings, bucket: str) -> float:
    """The TTL the roles using ``bucket`` want (the base ``ttl`` if none or several)."""
    ttls = bucket_ttls(settings).get(bucket, set())
    return next(iter(ttls)) if len(ttls) == 1 else settings.ttl


def bucket_targets(
    settings: LeaderSettings,
    *,
    bucket: str | None = None,
    ttl: float | None = None,
    replicas: int | None = None,
    beat_state: bool = False,
    once: bool = False,
    once_guard: bool = False,
) -> list[BucketTarget]:
    """The buckets an operator command works on.

    Args:
        settings: The elections' settings.
        bucket: Only this election bucket (default: the settings' bucket, and
            the beat state bucket with ``beat_state``).
        ttl: ``max_age`` to create with and expect (default: the configured TTL).
        replicas: Replicas to create with and, when given, to expect.
        beat_state: Include the beat schedule's state bucket (no ``max_age``).
        once: Only the once-guard's two buckets (``max_age`` = ``once_lease``
            and ``once_retention``): they hold tasks' run records, not the
            elections', so ``--delete --once`` deletes them apart.
        once_guard: Add the once-guard's two buckets after the others (the
            deployment uses the guard: ticks run once under a leader
            scheduler), so that one ``--create`` by an operator makes every
            bucket the workers need.

    Returns:
        The election bucket first, then the beat state bucket if asked for,
        then the once-guard's lease bucket and its done bucket if asked for;
        with ``once``, only the last two.

    Raises:
        ConfigError: ``once`` with ``bucket`` (the once-guard's buckets are
            named by the settings).

    """
    create_replicas = replicas if replicas is not None else settings.bucket_replicas
    # The names and settings the worker's once-guard opens them with.
    guard = [
        BucketTarget(
            f"{settings.once_bucket}_leases",
            ONCE_LEASES,
            settings.once_lease,
            create_replicas,
            replicas,
        ),
        BucketTarget(
            settings.once_bucket, ONCE_DONE, settings.once_retention, create_replicas, replicas
        ),
    ]
    if once:
        if bucket is not None:
            raise ConfigError(
                "--bucket names an election bucket; the once-guard's buckets come from "
                "the once_bucket setting (leave out --bucket)"
            )
        return guard
    name = bucket or settings.bucket
    found = [
        BucketTarget(
            name,
            ELECTION,
            ttl if ttl is not None else expected_ttl(settings, name),
            create_replicas,
            replicas,
        )
    ]
    if bucket is None and beat_state:
        found.append(
            BucketTarget(settings.beat_state_bucket, BEAT_STATE, None, create_replicas, replicas)
        )
    if bucket is None and once_guard:
        found += guard
    return found


async def apply_to_buckets(
    backend: Backend, targets: Iterable[BucketTarget], action: BucketAction, *, timeout: float
) -> list[BucketOutcome]:
    """Check, create (missing ones only) or delete each bucket of ``targets``.

    An existing bucket is never changed: a wrong one is reported with its
    problems (which say how to fix it, with the configured TTL).

    Raises:
        JetStreamUnavailableError: The server has no JetStream.

    """
    found: list[BucketOutcome] = []
    for target in targets:
        if action == "delete":
            existed = await delete_bucket(backend, target.name, timeout=timeout)
            found.append(BucketOutcome(target, None, [], deleted=existed))
            continue
        try:
            if action == "create":
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
                BucketOutcome(target, None, ["does not exist: run with --create to create it"])
            )
            continue
        found.append(BucketOutcome(target, info, target.problems(info)))
    return found


#: Revisions a migrated bucket's epochs start above the old bucket's last one:
#: terms the old bucket still starts while the replicas roll over (each
#: renewal takes a revision: ~4 per role per TTL) stay below the new
#: bucket's, so the database fence prefers the new bucket's leader. A
#: million covers a roll of ~7 hours for 100 roles at TTL 10 s (40 renewals
#: a second): delete the old bucket once the roll is done.
MIGRATION_HEADROOM = 1_000_000


@dataclass(frozen=True)
class EpochFloor:
    """The epoch floor a new election bucket was given (a TTL change).

    Attributes:
        bucket: The new bucket.
        floor: The lowest revision, so epoch, its next term may get.
        source: The bucket the floor was read from (``None``: given as a number).
        next_revision: The revision its next write gets now (``>= floor``).

    """

    bucket: str
    floor: int
    source: str | None
    next_revision: int

    def to_dict(self) -> dict[str, Any]:
        """The commands' ``--json`` ``epoch_floor`` entry."""
        return dataclasses.asdict(self)


async def migrate_bucket(
    backend: Backend,
    target: BucketTarget,
    *,
    source: str | None,
    floor: int = 0,
    headroom: int = MIGRATION_HEADROOM,
    timeout: float = 5.0,
) -> tuple[BucketOutcome, EpochFloor]:
    """Create an election bucket whose terms' epochs continue those of ``source``.

    A bucket's ``max_age`` is the election TTL and cannot change, so a new
    TTL needs a new bucket; a new bucket's revisions, and with them the
    epochs, would start again at 1, below every epoch a database fence has
    accepted. This creates ``target`` (unless it exists) and moves its next
    revision to at least ``source``'s next revision plus ``headroom``, and
    to at least ``floor``.

    Args:
        backend: A connection.
        target: The new election bucket, with its TTL.
        source: The bucket the replicas use now (``None``: ``floor`` only).
        floor: The lowest epoch the new bucket may give (for example the
            database fence's highest epoch + 1).
        headroom: Added to ``source``'s next revision: the revisions
            ``source`` may still take while the replicas move over.
        timeout: Seconds per call.

    Returns:
        The new bucket's outcome (as ``--create`` reports it) and its floor.

    Raises:
        BucketNotFoundError: ``source`` does not exist.
        ConfigError: The new bucket holds entries already (a candidate uses
            it: epochs below the floor were given out), it exists without
            the mark of a migration from ``source`` (a replica may have
            opened it unmarked), it is ``source``, or the floor reaches the
            ALLCALL strategy's epochs.

    """
    if source == target.name:
        raise ConfigError(f"--migrate-from {source!r} names the bucket being created")
    if source is not None:
        try:
            floor = max(floor, await backend.next_revision(source, timeout=timeout) + headroom)
        except BucketNotFoundError as exc:
            raise BucketNotFoundError(
                f"KV bucket {source!r} does not exist: nothing to carry the epoch floor from "
                "(name the bucket the replicas use now, or give --epoch-floor with the "
                "database fence's highest epoch + 1)"
            ) from exc
    if floor >= ALLCALL_EPOCH_FLOOR:
        # Such an epoch would read as an ALLCALL term's (a timestamp) at the fence.
        raise ConfigError(
            f"epoch floor {floor} reaches the ALLCALL strategy's epochs "
            f"({ALLCALL_EPOCH_FLOOR}): use a lower --epoch-floor"
        )
    try:
        existing: BucketInfo | None = await backend.bucket_info(target.name, timeout=timeout)
    except BucketNotFoundError:
        existing = None
    if existing is not None:
        _refuse_used(target, existing.keys)
        if source is not None:
            _refuse_unmarked(target, source, existing.description)
    # The marks that make the two buckets one election while the replicas
    # roll over (election/moves.py): the old bucket first, so that no
    # replica ever sees the new bucket without the old one marked.
    restore = None
    if source is not None:
        restore = await _mark(backend, source, moved_to=target.name, timeout=timeout)
    try:
        outcome = await _create_migrated(backend, target, existing, source, timeout=timeout)
        if outcome.info is not None:
            _refuse_used(target, outcome.info.keys)
            if source is not None:
                # A replica with create_bucket made it between our look and
                # our create: ours then found its bucket, unmarked.
                _refuse_unmarked(target, source, outcome.info.description)
        next_revision = await backend.raise_next_revision(target.name, floor, timeout=timeout)
    except BaseException:
        if source is not None and restore is not None:
            # Undo both marks, or neither: NEW still marked "migrated from"
            # beside an unmarked OLD would be two elections. NEW goes when
            # this call made it (it carries our mark; a replica's bucket
            # stays); an existing one was already marked so, and stays.
            if existing is None:
                await _delete_if_marked(backend, target.name, source, timeout=timeout)
            await backend.describe_bucket(source, restore, timeout=timeout)
        raise
    logger.info(
        "KV bucket %r: next epoch %d (floor %d%s)",
        target.name,
        next_revision,
        floor,
        f", carried from {source!r}" if source else "",
    )
    return outcome, EpochFloor(target.name, floor, source, next_revision)


def _refuse_used(target: BucketTarget, held: int) -> None:
    if held:
        raise ConfigError(
            f"KV bucket {target.name!r} already holds {held} entries: candidates "
            "use it, so its epochs cannot be moved up any more. Stop them, delete the bucket "
            "and run this again before any replica uses the new bucket"
        )


def _refuse_unmarked(target: BucketTarget, source: str, description: str) -> None:
    """Refuse a new bucket that this migration did not create (it lacks the mark).

    A replica started with the new settings and ``create_bucket`` creates
    the new bucket unmarked, reads no marks and campaigns without waiting
    for ``source``'s term: marking that bucket afterwards cannot reach it.
    """
    if BucketMarks.parse(description).migrated_from == source:
        return  # made by an earlier run of this migration
    raise ConfigError(
        f"KV bucket {target.name!r} exists but was not created by --migrate-from {source!r}: "
        "a replica that opened it (one started with the new settings creates it when "
        f"create_bucket is on) would not wait for {source!r}'s leaders, and a role could "
        f"lead on both buckets. Stop the replicas that use {target.name!r}, delete it, and "
        "run this again before any replica starts with the new settings"
    )


async def _delete_if_marked(backend: Backend, bucket: str, source: str, *, timeout: float) -> None:
    """Delete ``bucket`` if it carries the mark of a migration from ``source`` (ours)."""
    try:
        info = await backend.bucket_info(bucket, timeout=timeout)
    except BucketNotFoundError:
        return
    if BucketMarks.parse(info.description).migrated_from == source:
        await backend.delete_bucket(bucket, timeout=timeout)


async def _mark(backend: Backend, bucket: str, *, moved_to: str, timeout: float) -> str:
    """Mark ``bucket`` moved to ``moved_to``; return its description before."""
    before = (await backend.bucket_info(bucket, timeout=timeout)).description
    marks = dataclasses.replace(BucketMarks.parse(before), moved_to=moved_to)
    await backend.describe_bucket(bucket, marks.describe(), timeout=timeout)
    return before


async def _create_migrated(
    backend: Backend,
    target: BucketTarget,
    existing: BucketInfo | None,
    source: str | None,
    *,
    timeout: float,
) -> BucketOutcome:
    """Create the new bucket marked as migrated from ``source`` (or read the existing one)."""
    description = BucketMarks(migrated_from=source).describe() if source else ""
    if existing is None:
        info = await ensure_bucket(
            backend,
            target.name,
            ttl=target.ttl,
            replicas=target.replicas,
            timeout=timeout,
            description=description,
        )
    else:
        # Already marked so (_refuse_unmarked): a bucket is never marked
        # "migrated from" after a replica may have opened it.
        info = await backend.bucket_info(target.name, timeout=timeout)
    return BucketOutcome(target, info, target.problems(info))


async def check_carried_buckets(
    backend: Backend, settings: LeaderSettings, source: str, *, timeout: float
) -> None:
    """Refuse a TTL change whose settings would leave beat's state and the once-guard behind.

    Their default names follow the election bucket's (``<bucket>_beat``,
    ``<bucket>_once``): with a new bucket name they would start empty, and
    beat would skip or repeat the ticks around the cut-over (tick ids are
    derived from the state bucket's name too).

    Raises:
        ConfigError: Saying which settings to pin to the old names.

    """
    keep = []
    for setting, what, current, old, consequence in (
        (
            "beat_state_bucket",
            "beat's schedule state",
            settings.beat_state_bucket,
            f"{source}_beat",
            "ticks around the cut-over would be skipped or run twice",
        ),
        (
            "once_bucket",
            "the once-guard's records",
            settings.once_bucket,
            f"{source}_once",
            "work they record as done or running could run again",
        ),
    ):
        if current == old:
            continue
        try:
            await backend.bucket_info(old, timeout=timeout)
        except BucketNotFoundError:
            continue
        keep.append(
            (setting, f"{what} in {current!r} (the replicas use {old!r})", old, consequence)
        )
    if keep:
        pins = "; ".join(f"nats_leader_{name} = {old!r}" for name, _, old, _ in keep)
        django = " / ".join(f"NATS_LEADER[{name.upper()!r}]" for name, _, _, _ in keep)
        moved = " and ".join(what for _, what, _, _ in keep)
        consequences = "; ".join(consequence for _, _, _, consequence in keep)
        raise ConfigError(
            f"the new settings would start from empty buckets: {moved}; {consequences}. "
            f"Keep the old ones: set {pins} (Django: {django}) in the new settings, then run "
            "this again"
        )


def floor_lines(floor: EpochFloor) -> list[tuple[str, str]]:
    """What the operator commands print about a carried epoch floor."""
    origin = f" (carried from {floor.source!r})" if floor.source else ""
    return [
        ("", f"  next epoch     {floor.next_revision}{origin}"),
        ("success", "  its terms' epochs continue above every earlier one"),
    ]


def outcome_lines(outcome: BucketOutcome, *, create_command: str) -> list[tuple[str, str]]:
    """What the operator commands print about one bucket.

    Args:
        outcome: The bucket after the command.
        create_command: The command that creates it, for the hint.

    Returns:
        ``(style, text)`` pairs; style is ``"heading"``, ``"error"``,
        ``"success"`` or ``""``, for the front-end to colour.

    """
    target, info = outcome.target, outcome.info
    what = target.described
    if outcome.deleted is not None:
        if outcome.deleted:
            return [("heading", f"{what} {target.name!r} deleted")]
        return [("", f"{what} {target.name!r} does not exist (nothing to delete)")]
    if info is None:
        return [
            ("error", f"{what} {target.name!r} does not exist"),
            ("", f"  create it with `{create_command}{_CREATE_FLAGS.get(target.kind, '')}`"),
        ]
    verb = "created" if info.created else "exists"
    lines = [("heading", f"{what} {info.name!r} {verb}")]
    for label, item in (
        ("max_age (TTL)", f"{info.ttl:g}s" if info.ttl else "none"),
        ("history", str(info.history)),
        ("replicas", str(info.replicas)),
        ("storage", info.storage),
        ("entries", str(info.keys)),
    ):
        lines.append(("", f"  {label:<15}{item}"))
    lines += [("error", f"  problem: {problem}") for problem in outcome.problems]
    if not outcome.problems:
        settings = "once-guard" if target.kind in _ONCE_SETTINGS else "election"
        lines.append(("success", f"  fits the {settings} settings"))
    return lines


async def set_up_buckets(
    backend: Backend,
    targets: Sequence[BucketTarget],
    action: BucketAction,
    *,
    migrate_from: str | None = None,
    epoch_floor: int | None = None,
    settings: LeaderSettings | None = None,
    timeout: float,
) -> tuple[list[BucketOutcome], EpochFloor | None]:
    """What the ``bucket`` commands do to the buckets: apply ``action``, or migrate.

    With ``migrate_from`` or ``epoch_floor`` (a TTL change), the first target
    (the election bucket) is created with its epochs above the source's
    (:func:`migrate_bucket`) and the rest are created; otherwise ``action``
    applies to every target (:func:`apply_to_buckets`).

    Args:
        backend: A connected backend.
        targets: The buckets (:func:`bucket_targets`).
        action: ``check``, ``create`` or ``delete``.
        migrate_from: The bucket whose epochs the new one continues above.
        epoch_floor: The lowest epoch the new bucket's first term may get.
        settings: The new settings, to check with ``migrate_from`` that beat's
            state and the once-guard stay in their buckets
            (:func:`check_carried_buckets`).
        timeout: Seconds per operation.

    Returns:
        One outcome per target, and the epoch floor when migrating.

    """
    if migrate_from is None and epoch_floor is None:
        return await apply_to_buckets(backend, targets, action, timeout=timeout), None
    if migrate_from is not None and settings is not None:
        await check_carried_buckets(backend, settings, migrate_from, timeout=timeout)
    first, floor = await migrate_bucket(
        backend, targets[0], source=migrate_from, floor=epoch_floor or 0, timeout=timeout
    )
    rest = await apply_to_buckets(backend, targets[1:], "create", timeout=timeout)
    return [first, *rest], floor


async def events_stream_of(
    backend: Backend,
    bucket: str,
    *,
    create: bool,
    max_age: float,
    replicas: int,
    timeout: float,
) -> StreamInfo | None:
    """The bucket's events stream (created when ``create``), or ``None`` when there is none."""
    if create:
        return await ensure_events_stream(
            backend, bucket, max_age=max_age, replicas=replicas, timeout=timeout
        )
    return await stream_info(backend, bucket, timeout=timeout)


def buckets_document(
    outcomes: Sequence[BucketOutcome],
    *,
    floor: EpochFloor | None = None,
    stream: StreamInfo | None = None,
    with_stream: bool = False,
) -> str:
    """The ``--json`` output of both ``bucket`` commands.

    Args:
        outcomes: One per bucket.
        floor: The epoch floor of a migration (``epoch_floor`` key).
        stream: The events stream (``events_stream`` key, with ``with_stream``).
        with_stream: Whether the events stream was asked about (``--events-max-age``).

    """
    body: dict[str, Any] = {
        "ok": not any(o.problems for o in outcomes),
        "buckets": [o.to_dict() for o in outcomes],
    }
    if with_stream:
        body["events_stream"] = None if stream is None else dataclasses.asdict(stream)
    if floor is not None:
        body["epoch_floor"] = floor.to_dict()
    return json.dumps(body, sort_keys=True)


@dataclass(frozen=True)
class ProbeResult:
    """What a deploy-time probe of NATS found.

    Attributes:
        reachable: Whether a NATS server answered.
        error: Why not, or the JetStream problem.
        buckets: Per bucket: its info, or ``None`` when missing.

    """

    reachable: bool
    error: str | None = None
    buckets: dict[str, BucketInfo | None] = field(default_factory=dict)


def probe(settings: LeaderSettings, buckets: Iterable[str], *, timeout: float) -> ProbeResult:
    """Connect and look up ``buckets``, for the ``check --deploy`` checks (synchronous)."""

    async def look(backend: Backend) -> ProbeResult:
        found: dict[str, BucketInfo | None] = {}
        for name in buckets:
            try:
                found[name] = await backend.bucket_info(name, timeout=timeout)
            except BucketNotFoundError:
                found[name] = None
        return ProbeResult(reachable=True, buckets=found)

    try:
        return with_backend(settings, look, timeout=timeout, name=operator_name("check"))
    except JetStreamUnavailableError as exc:
        return ProbeResult(reachable=True, error=str(exc))
    except ElectionError as exc:
        return ProbeResult(reachable=False, error=str(exc))


__all__ = [
    "BEAT_STATE",
    "ELECTION",
    "MIGRATION_HEADROOM",
    "ONCE_DONE",
    "ONCE_LEASES",
    "BucketAction",
    "BucketInfo",
    "BucketOutcome",
    "BucketTarget",
    "EpochFloor",
    "ProbeResult",
    "apply_to_buckets",
    "bucket_info",
    "bucket_targets",
    "bucket_ttls",
    "buckets_document",
    "delete_bucket",
    "ensure_bucket",
    "events_stream_of",
    "expected_ttl",
    "floor_lines",
    "migrate_bucket",
    "outcome_lines",
    "probe",
    "set_up_buckets",
]
