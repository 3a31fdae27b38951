"""What the operator tools do, free of Django: status, resignation, the bucket.

The management commands, the system checks and the admin page are thin
layers over these functions. Each opens one NATS connection, does its work
and closes it. They are one-shot operations, so running them with
``asyncio.run`` (:func:`run_once`) is right; long-lived processes use the
:class:`~celery_nats_leader.elector.Elector` instead.

The bucket's settings are read through the JetStream API's request/reply
subject (``$JS.API.STREAM.INFO.<stream>``) with the backend's generic
``request``, so that :mod:`celery_nats_leader.nats.jetstream` stays the
only module importing nats-py's JetStream client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from celery_nats_leader import constants as c
from celery_nats_leader.backend import Backend, KVEntry, Operation
from celery_nats_leader.election import control_subject
from celery_nats_leader.errors import (
    BackendError,
    BackendTimeoutError,
    BucketNotFoundError,
    ElectionError,
    JetStreamUnavailableError,
    NotLeaderError,
    RecordFormatError,
)
from celery_nats_leader.nats.connection import connect
from celery_nats_leader.nats.jetstream import JetStreamBackend
from celery_nats_leader.ops.status import RoleStatus, read_status
from celery_nats_leader.record import LeaderRecord, decode_record
from celery_nats_leader.settings import LeaderSettings

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Version of the ``election_status --json`` document; bumped only on an
#: incompatible change (fields are only ever added within one version).
STATUS_SCHEMA_VERSION = 1

#: Keys of every candidate entry of the ``--json`` document, in order.
CANDIDATE_FIELDS = (
    "id",
    "state",
    "priority",
    "is_leader",
    "epoch",
    "term_age",
    "lease_remaining",
    "last_heartbeat_age",
    "meta",
)

#: JetStream API error code for "stream not found".
_JS_STREAM_NOT_FOUND = 10059


# ------------------------------------------------------------------ plumbing


def run_once(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run one coroutine to completion from synchronous code.

    Uses ``asyncio.run``; when the calling thread already runs an event loop
    (an ASGI server calling a sync view, a notebook), a short-lived helper
    thread runs it instead.

    Args:
        factory: Builds the coroutine (called in the thread that runs it).

    Returns:
        The coroutine's result.

    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nats-leader-op") as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()


def operator_name(tool: str) -> str:
    """How an operator tool identifies itself to leaders and in NATS monitoring."""
    return f"{tool} ({socket.gethostname()}:{os.getpid()})"


@contextlib.asynccontextmanager
async def open_backend(
    settings: LeaderSettings, *, timeout: float, name: str
) -> AsyncIterator[JetStreamBackend]:
    """Connect for one operation and close the connection afterwards.

    Args:
        settings: Where and how to connect.
        timeout: Seconds to wait for the connection.
        name: Connection name shown by the server's monitoring.

    Yields:
        The backend.

    Raises:
        NatsUnavailableError: No server answered in time.

    """
    nc = await connect(settings.connection, timeout=timeout, name=name)
    try:
        yield JetStreamBackend(nc)
    finally:
        with contextlib.suppress(Exception):  # closing a dead connection may raise
            await nc.close()


# -------------------------------------------------------------------- status


@dataclass(frozen=True)
class StatusReport:
    """Who leads what in one bucket, as the status command and admin page show it.

    Attributes:
        bucket: The KV bucket.
        servers: The NATS servers asked.
        configured_roles: Roles that must have a leader (the health probe).
        roles: One entry per role, sorted by name.

    """

    bucket: str
    servers: tuple[str, ...]
    configured_roles: tuple[str, ...]
    roles: tuple[RoleStatus, ...]

    @property
    def leaderless(self) -> list[str]:
        """Configured roles that nobody holds."""
        return [s.role for s in self.roles if s.role in self.configured_roles and not s.has_leader]

    @property
    def healthy(self) -> bool:
        """Whether every configured role has a leader."""
        return not self.leaderless

    @property
    def silent(self) -> list[str]:
        """Configured roles whose leader did not answer (paused, hung or dead)."""
        return [s.role for s in self.roles if s.role in self.configured_roles and s.silent]

    def to_dict(self) -> dict[str, Any]:
        """The ``election_status --json`` document (see the README's Django section)."""
        return {
            "schema_version": STATUS_SCHEMA_VERSION,
            "bucket": self.bucket,
            "servers": list(self.servers),
            "configured_roles": list(self.configured_roles),
            "leaderless": self.leaderless,
            "silent": self.silent,
            "healthy": self.healthy,
            "roles": [
                role_to_dict(s, configured=s.role in self.configured_roles) for s in self.roles
            ],
        }


def candidate_to_dict(candidate: dict[str, Any]) -> dict[str, Any]:
    """One live candidate, with exactly the documented keys (missing ones are ``None``)."""
    body = {name: candidate.get(name) for name in CANDIDATE_FIELDS}
    body["is_leader"] = bool(candidate.get("is_leader"))
    body["meta"] = dict(candidate.get("meta") or {})
    return body


def role_to_dict(status: RoleStatus, *, configured: bool) -> dict[str, Any]:
    """One role of the ``--json`` document."""
    return {
        "role": status.role,
        "configured": configured,
        "has_leader": status.has_leader,
        "leader_id": status.leader_id,
        "epoch": status.epoch,
        "revision": status.revision,
        "priority": status.priority,
        "term_age": status.term_age,
        "expires_in": status.expires_in,
        "leader_meta": dict(status.leader_meta),
        "candidates": [candidate_to_dict(cand) for cand in status.candidates],
        "problem": status.problem,
        "answering": status.answering,
        "expires_within": status.expires_within,
        "fenced": status.fenced,
        "note": status.note,
    }


async def read_report(
    backend: Backend,
    settings: LeaderSettings,
    *,
    configured_roles: Sequence[str],
    only: Sequence[str] = (),
    timeout: float = 5.0,
    roster_window: float = c.DEFAULT_ROSTER_WINDOW_SECONDS,
) -> StatusReport:
    """Read every role of the settings' bucket.

    Args:
        backend: A connected backend.
        settings: Bucket and servers.
        configured_roles: Roles that must have a leader (listed even when unheld).
        only: If given, report just these roles (and require a leader for each).
        timeout: Seconds for the KV reads.
        roster_window: Seconds to collect the live candidates' answers.

    Returns:
        The report.

    Raises:
        BucketNotFoundError: If the bucket does not exist.

    """
    expected = tuple(dict.fromkeys(only or configured_roles))
    statuses = await read_status(
        backend,
        settings.bucket,
        roles=expected,
        timeout=timeout,
        roster_window=roster_window,
        strategy=settings.strategy,
    )
    if only:
        statuses = [s for s in statuses if s.role in expected]
    return StatusReport(
        bucket=settings.bucket,
        servers=tuple(settings.servers),
        configured_roles=expected,
        roles=tuple(statuses),
    )


def fetch_report(
    settings: LeaderSettings,
    *,
    configured_roles: Sequence[str],
    only: Sequence[str] = (),
    timeout: float = 5.0,
) -> StatusReport:
    """Synchronous :func:`read_report` on a connection of its own.

    Raises:
        ElectionError: NATS unreachable, bucket missing, ...

    """

    async def run() -> StatusReport:
        async with open_backend(settings, timeout=timeout, name=operator_name("status")) as be:
            return await read_report(
                be, settings, configured_roles=configured_roles, only=only, timeout=timeout
            )

    return run_once(run)


# -------------------------------------------------------------------- resign


@dataclass(frozen=True)
class ResignOutcome:
    """What happened when an operator asked a leader to step down.

    Attributes:
        role: The role.
        previous: The record of the leader that was asked.
        accepted: Whether it agreed to step down.
        answered_by: Instance id of the process that answered.
        successor: The next term's record, if one appeared in time.
        handover_seconds: From the request to the successor's record, measured
            on this process's monotonic clock.

    """

    role: str
    previous: LeaderRecord | None
    accepted: bool
    answered_by: str | None
    successor: LeaderRecord | None = None
    handover_seconds: float | None = None


def _decode(entry: KVEntry | None) -> LeaderRecord | None:
    if entry is None or entry.operation is not Operation.PUT:
        return None
    try:
        record = decode_record(entry.value, entry.revision)
    except RecordFormatError:
        return None
    return None if record.is_fence else record  # a fence marker: nobody leads


async def resign_leader(
    backend: Backend,
    bucket: str,
    role: str,
    *,
    timeout: float = 5.0,
    wait: float = 5.0,
    requester: str = "manage.py election_resign",
) -> ResignOutcome:
    """Ask the leader of ``role`` to step down and wait for the next term.

    The leader runs its demote callbacks, deletes its key and sits out one
    TTL, so another live candidate is promoted within milliseconds.

    Args:
        backend: A connected backend.
        bucket: The KV bucket.
        role: The role.
        timeout: Seconds to wait for the leader's answer.
        wait: Seconds to wait for a successor (``0``: do not wait).
        requester: Who asks (the leader logs it).

    Returns:
        The outcome.

    Raises:
        NotLeaderError: Nobody holds the role.
        BackendTimeoutError: The holder did not answer (crashed, its key
            not expired yet).

    """
    kv = await backend.open_bucket(bucket, ttl=None, create=False, replicas=1, timeout=timeout)
    previous = _decode(await kv.get(role, timeout=timeout))
    if previous is None:
        raise NotLeaderError(f"nobody leads role {role!r} in bucket {bucket!r}")
    successor: list[LeaderRecord] = []
    arrived = asyncio.Event()

    def on_entry(entry: KVEntry) -> None:
        record = _decode(entry)
        if record is not None and record.epoch > previous.epoch and not successor:
            successor.append(record)
            arrived.set()

    watch = await kv.watch(role, on_entry)
    try:
        body = json.dumps({"requester": requester}).encode()
        started = time.monotonic()
        try:
            reply = await backend.request(
                control_subject(bucket, role, c.RESIGN_VERB), body, timeout=timeout
            )
        except BackendTimeoutError as exc:
            raise BackendTimeoutError(
                f"the leader of {role!r} ({previous.id}) did not answer within {timeout:g}s: "
                "it may have crashed; its term ends when the key expires"
            ) from exc
        try:
            answer = json.loads(reply)
        except ValueError:
            answer = {}
        if not isinstance(answer, dict):
            answer = {}
        accepted = bool(answer.get("accepted"))
        answered_by = answer.get("id") if isinstance(answer.get("id"), str) else None
        handover = None
        if accepted and wait > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(arrived.wait(), wait)
            if successor:
                handover = round(time.monotonic() - started, 4)
        return ResignOutcome(
            role=role,
            previous=previous,
            accepted=accepted,
            answered_by=answered_by,
            successor=successor[0] if successor else None,
            handover_seconds=handover,
        )
    finally:
        await watch.unsubscribe()


# -------------------------------------------------------------------- bucket


@dataclass(frozen=True)
class BucketInfo:
    """A KV bucket's settings, as JetStream reports them.

    Attributes:
        name: The bucket.
        ttl: ``max_age`` in seconds (``0`` = no expiry).
        history: Values kept per key.
        replicas: Stream replicas.
        storage: ``file`` or ``memory``.
        keys: Messages stored (one per role that holds a value or a delete marker).
        created: Whether this call created it.

    """

    name: str
    ttl: float
    history: int
    replicas: int
    storage: str
    keys: int
    created: bool = False

    def problems(
        self, *, ttl: float | None, replicas: int | None = None, persistent: bool = False
    ) -> list[str]:
        """What is wrong with this bucket for an election with ``ttl`` (empty if nothing).

        Args:
            ttl: The election TTL the bucket's ``max_age`` must equal (None: not checked).
            replicas: The expected replica count (None: not checked).
            persistent: The bucket holds data that must not expire (the beat
                schedule's state): it must have no ``max_age``.

        """
        found = []
        if persistent and self.ttl:
            found.append(
                f"max_age is {self.ttl:g}s but this bucket's data must never expire "
                "(recreate it without a TTL)"
            )
        if ttl is not None and abs(self.ttl - ttl) > 0.001:
            found.append(
                f"max_age is {self.ttl:g}s but the election ttl is {ttl:g}s: they must be equal "
                f"(recreate the bucket with --ttl {ttl:g}, or set TTL to {self.ttl:g})"
            )
        if self.history != 1:
            found.append(f"history is {self.history}, expected 1 (older values are useless here)")
        if replicas is not None and self.replicas != replicas:
            found.append(f"replicas is {self.replicas}, expected {replicas}")
        return found

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable dict."""
        return {
            "name": self.name,
            "ttl": self.ttl,
            "history": self.history,
            "replicas": self.replicas,
            "storage": self.storage,
            "keys": self.keys,
            "created": self.created,
        }


async def bucket_info(backend: Backend, bucket: str, *, timeout: float = 5.0) -> BucketInfo:
    """Read a bucket's settings.

    Raises:
        BucketNotFoundError: The bucket does not exist.
        JetStreamUnavailableError: The server has no JetStream.

    """
    subject = f"$JS.API.STREAM.INFO.KV_{bucket}"
    try:
        reply = await backend.request(subject, b"", timeout=timeout)
    except BackendTimeoutError as exc:
        raise JetStreamUnavailableError(
            f"JetStream did not answer ({exc}): start nats-server with -js "
            "(or enable jetstream {} in its configuration)"
        ) from exc
    try:
        body = json.loads(reply)
    except ValueError as exc:
        raise BackendError(f"unreadable JetStream answer: {reply[:100]!r}") from exc
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        if error.get("err_code") == _JS_STREAM_NOT_FOUND or error.get("code") == 404:
            raise BucketNotFoundError(f"KV bucket {bucket!r} does not exist")
        raise BackendError(f"JetStream: {error.get('description', error)}")
    config = body.get("config") or {}
    state = body.get("state") or {}
    return BucketInfo(
        name=bucket,
        ttl=int(config.get("max_age") or 0) / 1e9,
        history=int(config.get("max_msgs_per_subject") or 0),
        replicas=int(config.get("num_replicas") or 1),
        storage=str(config.get("storage") or "file"),
        keys=int(state.get("messages") or 0),
    )


async def ensure_bucket(
    backend: Backend,
    bucket: str,
    *,
    ttl: float | None,
    replicas: int,
    timeout: float = 5.0,
    persistent: bool = False,
) -> BucketInfo:
    """Create the bucket (``history=1``, ``max_age=ttl``) unless it exists.

    An existing bucket is left as it is (see :meth:`BucketInfo.problems`).
    With ``persistent`` (the beat schedule's state) it gets no ``max_age``.

    Returns:
        Its settings, with ``created`` telling whether this call made it.

    Raises:
        JetStreamUnavailableError: The server has no JetStream.

    """
    try:
        return await bucket_info(backend, bucket, timeout=timeout)
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
    )
    logger.info(
        "created KV bucket %r (max_age=%s, history=1, replicas=%d)",
        bucket,
        "none" if persistent else f"{ttl:g}s",
        replicas,
    )
    info = await bucket_info(backend, bucket, timeout=timeout)
    return BucketInfo(**{**info.to_dict(), "created": True})


def bucket_ttls(settings: LeaderSettings) -> dict[str, set[float]]:
    """Each bucket the configured roles use, with the TTLs those roles want."""
    found: dict[str, set[float]] = {}
    for role in dict.fromkeys((*settings.roles, settings.beat_role)):
        config = settings.election_config(role)
        found.setdefault(config.bucket, set()).add(config.ttl)
    return found


# --------------------------------------------------------------- deploy probe


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


async def probe(settings: LeaderSettings, buckets: Iterable[str], *, timeout: float) -> ProbeResult:
    """Connect and look up ``buckets``, for the ``check --deploy`` checks."""
    try:
        async with open_backend(settings, timeout=timeout, name=operator_name("check")) as be:
            found: dict[str, BucketInfo | None] = {}
            for name in buckets:
                try:
                    found[name] = await bucket_info(be, name, timeout=timeout)
                except BucketNotFoundError:
                    found[name] = None
            return ProbeResult(reachable=True, buckets=found)
    except JetStreamUnavailableError as exc:
        return ProbeResult(reachable=True, error=str(exc))
    except ElectionError as exc:
        return ProbeResult(reachable=False, error=str(exc))


__all__ = [
    "CANDIDATE_FIELDS",
    "STATUS_SCHEMA_VERSION",
    "BucketInfo",
    "ProbeResult",
    "ResignOutcome",
    "StatusReport",
    "bucket_info",
    "bucket_ttls",
    "candidate_to_dict",
    "ensure_bucket",
    "fetch_report",
    "open_backend",
    "operator_name",
    "probe",
    "read_report",
    "resign_leader",
    "role_to_dict",
    "run_once",
]
