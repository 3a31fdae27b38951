"""Asking a leader to step down, and reporting its successor.

The leader runs its demote callbacks, deletes its key and sits out one TTL,
so another live candidate is promoted within milliseconds; the operator sees
who stepped down, who took over and how long the hand-over took (on this
process's monotonic clock).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from celery_nats_leader.config import Strategy
from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core import constants as c
from celery_nats_leader.core.backend import Backend, KVEntry
from celery_nats_leader.core.errors import BackendTimeoutError, ElectionError, NotLeaderError
from celery_nats_leader.election.control import ResignAnswer, ResignRequest
from celery_nats_leader.election.status import read_report
from celery_nats_leader.election.vocabulary import control_subject
from celery_nats_leader.ops.oneshot import with_backend
from celery_nats_leader.term import read_term, term_of
from celery_nats_leader.term.record import LeaderRecord


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


async def ask_to_resign(
    backend: Backend, bucket: str, role: str, request: ResignRequest, *, timeout: float
) -> ResignAnswer:
    """Send ``request`` to ``role``'s leader on its control channel; return its answer.

    The one request of the resign verb from the operator side (``resign``,
    and ``fence``'s hand-over).

    Raises:
        BackendTimeoutError: Nobody answered within ``timeout``.
        ElectionError: The request could not be sent (permissions, NATS).

    """
    reply = await backend.request(
        control_subject(bucket, role, c.RESIGN_VERB), request.encode(), timeout=timeout
    )
    return ResignAnswer.decode(reply)


async def resign_leader(
    backend: Backend,
    bucket: str,
    role: str,
    *,
    timeout: float = 5.0,
    wait: float = 5.0,
    requester: str = "an operator",
    leader_id: str | None = None,
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
        leader_id: Ask only this instance: it steps down only if it still
            leads (the request names it, so a successor never does), and
            nobody is asked when the key names another.

    Returns:
        The outcome.

    Raises:
        NotLeaderError: Nobody holds the role (or, with ``leader_id``,
            another instance does).
        BackendTimeoutError: The holder did not answer (crashed, its key
            not expired yet).

    """
    kv = await backend.open_bucket(bucket, ttl=None, create=False, replicas=1, timeout=timeout)
    term = await read_term(kv, role, timeout=timeout)
    previous = term.record if term is not None else None
    if previous is not None and previous.is_fence:
        previous = None  # a fence marker: the term was ended, nobody leads
    if previous is None:
        raise NotLeaderError(f"nobody leads role {role!r} in bucket {bucket!r}")
    if leader_id is not None and previous.id != leader_id:
        raise NotLeaderError(f"{leader_id} no longer leads role {role!r} ({previous.id} does)")
    successor: list[LeaderRecord] = []
    arrived = asyncio.Event()

    def on_entry(entry: KVEntry) -> None:
        new = term_of(entry)
        if successor or new is None or new.record is None or new.record.is_fence:
            return
        if new.epoch > previous.epoch:
            successor.append(new.record)
            arrived.set()

    watch = await kv.watch(role, on_entry)
    try:
        request = ResignRequest(requester=requester, leader_id=leader_id)
        started = time.monotonic()
        try:
            answer = await ask_to_resign(backend, bucket, role, request, timeout=timeout)
        except BackendTimeoutError as exc:
            raise BackendTimeoutError(
                f"the leader of {role!r} ({previous.id}) did not answer within {timeout:g}s: "
                "it may have crashed; its term ends when the key expires"
            ) from exc
        accepted, answered_by = answer.accepted, answer.id
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


def resign_wait(settings: LeaderSettings, role: str, wait: float | None) -> float:
    """Seconds a resign command waits for the new leader: ``wait``, else the role's TTL + 1.

    A successor campaigns as soon as it sees the release, or (a successor that
    missed it) once the key's TTL has passed: one TTL and a second covers both.
    """
    return settings.election_config(role).ttl + 1.0 if wait is None else float(wait)


def request_resignation(
    settings: LeaderSettings, role: str, *, timeout: float, wait: float, requester: str
) -> ResignOutcome:
    """Synchronous :func:`resign_leader` on a connection of its own.

    Args:
        settings: Where to connect, and the role's bucket.
        role: The role.
        timeout: Seconds to wait for the connection and the leader's answer.
        wait: Seconds to wait for a successor (``0``: do not wait).
        requester: Who asks (the leader logs it; the connection is named after it).

    Returns:
        The outcome.

    Raises:
        NotLeaderError: Nobody holds the role.
        BackendTimeoutError: The holder did not answer.
        ElectionError: NATS unreachable, bucket missing, ...

    """
    bucket = settings.election_config(role).bucket
    return with_backend(
        settings,
        lambda backend: resign_leader(
            backend, bucket, role, timeout=timeout, wait=wait, requester=requester
        ),
        timeout=timeout,
        name=requester,
    )


async def release_host(
    backend: Backend,
    bucket: str,
    roles: Sequence[str],
    host: str,
    *,
    timeout: float = 5.0,
    requester: str = "an operator",
    strategy: Strategy = "kv",
) -> list[tuple[str, str, bool]]:
    """Ask every leader whose record names ``host`` to step down (a preStop hook).

    Args:
        backend: A connected backend.
        bucket: The KV bucket.
        roles: The configured roles (every role held in the bucket is looked at too).
        host: The ``hostname`` metadata to match (the pod name in Kubernetes).
        timeout: Seconds per NATS operation.
        requester: Who asks (the leaders log it).
        strategy: The roles' strategy (``"allcall"`` has no bucket to read).

    Returns:
        ``(role, leader id, stepping down)`` for each role led from ``host``;
        a leader that did not answer, refused, or no longer leads is not
        stepping down. Empty when nothing is led from ``host``.

    Raises:
        ElectionError: The bucket could not be read.

    """
    report = await read_report(
        backend,
        bucket,
        configured_roles=roles,
        strategy=strategy,
        timeout=timeout,
        roster_window=0.0,
    )
    released: list[tuple[str, str, bool]] = []
    for one in report.roles:
        if one.leader_id is None or one.leader_meta.get("hostname") != host:
            continue
        try:
            outcome = await resign_leader(
                backend,
                bucket,
                one.role,
                timeout=timeout,
                wait=0.0,
                requester=requester,
                leader_id=one.leader_id,
            )
        except ElectionError:
            accepted = False
        else:
            accepted = outcome.accepted
        released.append((one.role, one.leader_id, accepted))
    return released


def release_lines(bucket: str, host: str, released: Sequence[tuple[str, str, bool]]) -> list[str]:
    """What ``celery nats-leader release`` prints for :func:`release_host`'s answer."""
    if not released:
        return [f"no role of bucket {bucket!r} is led from {host}"]
    return [
        f"{role}: {leader} {'stepping down' if accepted else 'did not step down'}"
        for role, leader, accepted in released
    ]


def outcome_to_dict(outcome: ResignOutcome) -> dict[str, Any]:
    """The ``--json`` form: role, accepted, stepped_down {id, epoch}, new_leader {id, epoch}."""

    def record(rec: Any) -> dict[str, Any] | None:
        return None if rec is None else {"id": rec.id, "epoch": rec.epoch, "meta": dict(rec.meta)}

    return {
        "role": outcome.role,
        "accepted": outcome.accepted,
        "answered_by": outcome.answered_by,
        "stepped_down": record(outcome.previous) if outcome.accepted else None,
        "new_leader": record(outcome.successor),
        "handover_seconds": outcome.handover_seconds,
    }


def outcome_lines(outcome: ResignOutcome, wait: float) -> list[tuple[bool, str]]:
    """The outcome in words, as both the CLI and the Django command print it.

    Args:
        outcome: What :func:`resign_leader` returned.
        wait: The seconds it waited for a successor (``0``: it did not wait).

    Returns:
        ``(good, line)`` pairs: ``good`` is ``False`` for a refusal or a
        missing successor (printed as a warning).

    """
    previous = outcome.previous
    who = outcome.answered_by or (previous.id if previous is not None else "the leader")
    if not outcome.accepted:
        return [(False, f"{who} refused to step down from {outcome.role!r}")]
    epoch = "" if previous is None else f" (epoch {previous.epoch})"
    lines = [(True, f"{who} stepped down from role {outcome.role!r}{epoch}")]
    successor = outcome.successor
    if successor is None:
        if wait > 0:
            lines.append((False, f"no new leader of {outcome.role!r} within {wait:g}s"))
        return lines
    took = ""
    if outcome.handover_seconds is not None:
        took = f" after {outcome.handover_seconds * 1000:.0f} ms"
    lines.append(
        (True, f"new leader of {outcome.role!r}: {successor.id} (epoch {successor.epoch}){took}")
    )
    return lines


__all__ = [
    "ResignOutcome",
    "outcome_lines",
    "outcome_to_dict",
    "release_host",
    "release_lines",
    "request_resignation",
    "resign_leader",
]
