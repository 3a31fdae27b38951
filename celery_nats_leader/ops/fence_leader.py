"""Fence a leader: ask it to hand over first; end its term at once if it does not answer.

A leader that is paused (SIGSTOP, a frozen VM, a debugger), hung or cut off
keeps its key until the key expires: up to one TTL in which nobody leads.
``fence`` ends its term in two steps:

1. **Hand-over.** It asks the leader to resign on the resign control subject
   (the one ``resign`` uses), naming the term's instance id, and waits up to
   ``handover_wait`` seconds (default :data:`DEFAULT_HANDOVER_WAIT`) for the
   key to be released. A live leader turns ``is_leader`` off, runs its demote
   callbacks and only then deletes its key; a successor can only win after
   the delete. So a leader that answers hands over with **no overlap**: no
   marker is written and the outcome says ``handed_over``.
2. **Fence.** A leader that does not answer (or answers but has not released
   the key within ``handover_wait``) is fenced: a *fence marker* replaces its
   record with a conditional update at the revision observed::

       update(role, <fence marker>, last=<revision of the leader's record>)

   * The term is over at once: the marker's revision (its epoch) is newer
     than the term's, so every fenced check of the old token fails
     (``validate_token``, the beat scheduler's check before each dispatch,
     ``@leader_only(validate=True)`` read the key and find another token; the
     Django database fence, raised to the marker's epoch by
     ``manage.py election_fence``, refuses older epochs).
   * Live candidates treat a marker as a vacant key and campaign at once,
     taking it with an update at the marker's revision (exactly one wins): a
     successor leads within milliseconds.
   * The write is conditional: if the leader renewed in between, the same
     term is fenced at its new revision; if the term ended meanwhile (it
     handed over late), nothing is written.

What a fenced leader can overlap: a *paused* one none while it stays paused
(it runs nothing), and when it resumes its ``is_leader`` is ``False`` once
its lease deadline passed (``TTL - lease_margin`` after its last confirmed
renewal, on its own monotonic clock), else until it reads the pending
request (which asks it to confirm its term against the key first:
``"verify": true``) or its watch delivers the marker (milliseconds), at the
latest when its next renewal fails (one heartbeat). A
leader that is alive but did not answer (its connection to NATS is down, or
its control subscription is gone) keeps ``is_leader`` until the marker
reaches it or its lease deadline, whichever comes first: at most
``TTL - lease_margin`` after its last confirmed renewal. Fenced paths refuse
it throughout. A leader that agreed but was still in its demote callbacks
when the wait ran out has ``is_leader == False`` already; only those
callbacks can overlap the successor's term.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.backend import Backend, KVEntry, Operation
from celery_nats_leader.core.errors import (
    BackendTimeoutError,
    ElectionError,
    NotLeaderError,
    RevisionMismatchError,
)
from celery_nats_leader.election.control import ResignRequest
from celery_nats_leader.ops.oneshot import with_backend
from celery_nats_leader.ops.resign import ask_to_resign
from celery_nats_leader.term.current import term_of
from celery_nats_leader.term.record import LeaderRecord, encode_fence

logger = logging.getLogger(__name__)

#: Conditional writes attempted while the fenced term keeps renewing.
_ATTEMPTS = 3

#: Seconds a fence waits for a live leader to hand over before fencing it.
#: A live leader answers and releases in milliseconds; a stuck one never
#: does, and this is what fencing it costs. Well under any sane TTL.
DEFAULT_HANDOVER_WAIT = 1.0


@dataclass(frozen=True)
class FenceOutcome:
    """What :func:`fence_leader` did.

    Attributes:
        role: The role.
        fenced: The term that ended (the leader's record as observed).
        revision: Revision at which the term ended: the fence marker's, or
            (after a hand-over) the deletion's. Every later term has a larger
            epoch, and a fence in a resource can be raised to it.
        token: A random token of that revision (``FencingToken(revision,
            token)`` raises a resource's fence without naming any leader's term).
        successor: The next leader's record, if one was seen within ``wait``.
        promoted_after: Seconds from the end of the term (the resign request
            or the fence write) to the successor's record arriving here (this
            host's monotonic clock), or ``None``.
        handed_over: ``True`` when the leader stepped down on request (no
            marker was written, no overlap); ``False`` when it was fenced.
        reason: Why it was fenced (or how it handed over), in words.
        ended_at: :func:`time.monotonic` of this process when the term was
            ended (the request that it accepted, or the fence write).

    """

    role: str
    fenced: LeaderRecord
    revision: int
    token: str = ""
    successor: LeaderRecord | None = None
    promoted_after: float | None = None
    handed_over: bool = False
    reason: str = ""
    ended_at: float = 0.0

    @property
    def action(self) -> str:
        """``"handed_over"`` or ``"fenced"``."""
        return "handed_over" if self.handed_over else "fenced"

    def to_dict(self) -> dict[str, object]:
        """The ``--json`` form.

        Keys: role, action (``handed_over`` / ``fenced``), reason, fenced
        {id, epoch} (the term that ended, either way), revision, new_leader,
        promoted_after.
        """
        successor = self.successor
        return {
            "role": self.role,
            "action": self.action,
            "reason": self.reason,
            "fenced": {"id": self.fenced.id, "epoch": self.fenced.epoch},
            "revision": self.revision,
            "new_leader": (
                None if successor is None else {"id": successor.id, "epoch": successor.epoch}
            ),
            "promoted_after": self.promoted_after,
        }

    def describe(self) -> str:
        """The outcome in one line, as the CLI, ``election_fence`` and the admin say it."""
        term = f"{self.fenced.id} (epoch {self.fenced.epoch})"
        if self.handed_over:
            return f"{term} handed {self.role!r} over cleanly on request (nothing fenced)"
        return f"fenced {term} from {self.role!r} at revision {self.revision}: {self.reason}"


def _record(entry: KVEntry | None) -> LeaderRecord | None:
    term = term_of(entry)
    return None if term is None else term.record


class _KeyWatch:
    """What the watch of the role's key delivered since it started."""

    def __init__(self) -> None:
        self.records: list[LeaderRecord] = []
        self.deleted: list[int] = []  # revisions of DEL / PURGE entries
        self.changed = asyncio.Event()

    def on_entry(self, entry: KVEntry) -> None:
        if entry.operation is not Operation.PUT:
            self.deleted.append(entry.revision)
        else:
            record = _record(entry)
            if record is not None and not record.is_fence:
                self.records.append(record)
        self.changed.set()

    def next_term(self, after: int) -> LeaderRecord | None:
        return next((record for record in self.records if record.epoch > after), None)

    def released(self, observed: int) -> int | None:
        """Revision of a deletion after revision ``observed`` (it ended that term), if one came."""
        return next((revision for revision in self.deleted if revision > observed), None)

    async def until(self, deadline: float, done: Callable[[], bool]) -> None:
        """Wait until ``done()`` is true or the monotonic ``deadline`` passes."""
        while not done() and time.monotonic() < deadline:
            self.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), deadline - time.monotonic())


async def _ask_to_hand_over(
    backend: Backend,
    bucket: str,
    role: str,
    target: LeaderRecord,
    *,
    requester: str,
    handover_wait: float,
    answer_within: float,
) -> tuple[bool, str]:
    """Ask the term's holder to resign; return (accepted, what happened in words).

    The request waits ``answer_within`` seconds for the answer; the words
    speak of ``handover_wait``, the wait the operator asked for.
    """
    request = ResignRequest(requester=requester, leader_id=target.id, reason="fence", verify=True)
    try:
        answer = await ask_to_resign(backend, bucket, role, request, timeout=answer_within)
    except BackendTimeoutError:
        # A stuck (paused, hung) or unreachable leader: no answer, or nobody
        # subscribed at all. Either way only a fence ends its term.
        return False, f"it did not answer a request to hand over within {handover_wait:g}s"
    except ElectionError as exc:
        # Not allowed to ask (permissions), or NATS failed: the operator asked
        # to end the term, so fence; the reason says why it was not asked.
        return False, f"it could not be asked to hand over ({exc})"
    if answer.accepted:
        return True, (
            f"it agreed to hand over but had not released the key within {handover_wait:g}s"
        )
    return False, "it refused to hand over"


async def fence_leader(
    backend: Backend,
    bucket: str,
    role: str,
    *,
    requester: str,
    epoch: int | None = None,
    timeout: float = 5.0,
    wait: float = 0.0,
    handover_wait: float = DEFAULT_HANDOVER_WAIT,
) -> FenceOutcome:
    """End the current term of ``role`` now: a clean hand-over if the leader answers, else a fence.

    Args:
        backend: A connected backend.
        bucket: The KV bucket.
        role: The role.
        requester: Who fences (kept in the marker and logged).
        epoch: Fence only this term; ``None``: the term found in the key.
        timeout: Seconds for each KV operation.
        wait: Seconds to wait for a successor's record (``0``: do not wait).
        handover_wait: Seconds to wait for the leader to answer a request to
            hand over and release its key before fencing it (``0``: fence at
            once, without asking).

    Returns:
        The outcome: the ended term, how it ended (``handed_over``), the
        revision it ended at, the successor.

    Raises:
        NotLeaderError: Nobody leads the role (no record, or already fenced),
            or the term ``epoch`` is not the current one.
        BucketNotFoundError: The bucket does not exist.

    """
    if handover_wait < 0:
        raise ValueError(f"handover_wait must be >= 0, not {handover_wait!r}")
    kv = await backend.open_bucket(bucket, ttl=None, create=False, replicas=1, timeout=timeout)
    # Entries as the watch delivers them: the successor's record may come
    # before the fence write's acknowledgement is read.
    key = _KeyWatch()
    watch = await kv.watch(role, key.on_entry)
    asking: asyncio.Future[tuple[bool, str]] | None = None
    try:
        entry = await kv.get(role, timeout=timeout)
        target = _record(entry)
        if entry is None or target is None or target.is_fence:
            raise NotLeaderError(f"nobody leads role {role!r} in bucket {bucket!r}")
        if epoch is not None and target.epoch != epoch:
            raise NotLeaderError(
                f"the term of role {role!r} is epoch {target.epoch}, not {epoch}; nothing fenced"
            )
        observed = entry.revision
        accepted = False
        reason = "fenced at once, without asking it to hand over"
        asked_at = time.monotonic()

        async def handed_over_by(
            deadline: float, target: LeaderRecord = target
        ) -> FenceOutcome | None:
            """The hand-over, if the leader's delete shows by ``deadline``."""
            await key.until(deadline, lambda: key.released(observed) is not None)
            released = key.released(observed)
            if released is None:
                return None
            return await _handed_over(
                key,
                role=role,
                target=target,
                released=released,
                requester=requester,
                asked_at=asked_at,
                wait=wait,
            )

        # The request stays open past handover_wait (by one operation
        # timeout): a leader checks its term before answering, for up to its
        # request timeout, so a late "yes" still says whose delete it was.
        if handover_wait > 0:
            asking = asyncio.ensure_future(
                _ask_to_hand_over(
                    backend,
                    bucket,
                    role,
                    target,
                    requester=requester,
                    handover_wait=handover_wait,
                    answer_within=handover_wait + timeout,
                )
            )
            await asyncio.wait({asking}, timeout=handover_wait)
            if asking.done():
                accepted, reason = asking.result()
            else:
                reason = f"it did not answer a request to hand over within {handover_wait:g}s"
            if accepted and (outcome := await handed_over_by(asked_at + handover_wait)):
                return outcome
        for _ in range(_ATTEMPTS):
            marker_token = str(uuid.uuid4())
            marker = encode_fence(
                token=marker_token,
                fenced_id=target.id,
                fenced_epoch=target.epoch,
                by=requester,
            )
            started = time.monotonic()
            try:
                fence_revision = await kv.update(role, marker, last=entry.revision, timeout=timeout)
            except RevisionMismatchError:
                # Written since we read it: a renewal of the same term (fence
                # that term at its new revision), its release, or another term.
                entry = await kv.get(role, timeout=timeout)
                current = _record(entry)
                if entry is None or current is None or current.token != target.token:
                    # Ended since we read it. A hand-over only if the leader
                    # said yes, if late (it checks its term before answering,
                    # for up to its request timeout): a delete alone may be a
                    # follower's conditional delete of an expired key, the end
                    # of a leader that never answered. Its delete may not have
                    # come through the watch yet (it comes before any
                    # successor's record).
                    if await _said_yes(asking) and (
                        outcome := await handed_over_by(time.monotonic() + timeout)
                    ):
                        return outcome
                    raise NotLeaderError(
                        f"the term of role {role!r} (epoch {target.epoch}) ended meanwhile; "
                        "nothing fenced"
                    ) from None
                target = current
                continue
            break
        else:
            raise NotLeaderError(
                f"the leader of role {role!r} renewed {_ATTEMPTS} times while fencing; try again"
            )
        logger.warning(
            "%s: fenced the term of %s (epoch %d) at revision %d, requested by %s: %s",
            role,
            target.id,
            target.epoch,
            fence_revision,
            requester,
            reason,
        )
        outcome = FenceOutcome(
            role=role,
            fenced=target,
            revision=fence_revision,
            token=marker_token,
            reason=reason,
            ended_at=started,
        )
        return await _successor(key, outcome, wait)
    finally:
        if asking is not None:
            asking.cancel()
        await watch.unsubscribe()


async def _said_yes(asking: asyncio.Future[tuple[bool, str]] | None) -> bool:
    """Whether the leader accepted the request to hand over, if late (waits for its answer)."""
    if asking is None:
        return False
    await asyncio.wait({asking})  # bounded: the request's own timeout
    return not asking.cancelled() and asking.exception() is None and asking.result()[0]


async def _handed_over(
    key: _KeyWatch,
    *,
    role: str,
    target: LeaderRecord,
    released: int,
    requester: str,
    asked_at: float,
    wait: float,
) -> FenceOutcome:
    logger.warning(
        "%s: %s (epoch %d) handed over on a fence request by %s; nothing fenced",
        role,
        target.id,
        target.epoch,
        requester,
    )
    outcome = FenceOutcome(
        role=role,
        fenced=target,
        revision=released,
        token=str(uuid.uuid4()),
        handed_over=True,
        reason="it stepped down on request and released the key",
        ended_at=asked_at,
    )
    return await _successor(key, outcome, wait)


async def _successor(key: _KeyWatch, outcome: FenceOutcome, wait: float) -> FenceOutcome:
    after = outcome.revision
    await key.until(outcome.ended_at + wait, lambda: key.next_term(after) is not None)
    successor = key.next_term(after)
    if successor is None:
        return outcome
    return dataclasses.replace(
        outcome,
        successor=successor,
        promoted_after=round(time.monotonic() - outcome.ended_at, 4),
    )


async def await_successor(
    backend: Backend,
    bucket: str,
    outcome: FenceOutcome,
    *,
    wait: float,
    timeout: float = 5.0,
) -> FenceOutcome:
    """Wait for the term after ``outcome`` (one started after its revision).

    For callers that do something between ending the term and waiting for the
    next one (``election_fence`` raises the database fence there, before any
    successor can write). ``wait`` counts from ``outcome.ended_at``; a
    successor already in the key is found at once.

    Args:
        backend: A connected backend.
        bucket: The KV bucket.
        outcome: What :func:`fence_leader` returned (with ``wait=0``).
        wait: Seconds after the end of the term to wait for the successor.
        timeout: Seconds for each KV operation.

    Returns:
        ``outcome`` with ``successor`` and ``promoted_after`` set when one came.

    """
    kv = await backend.open_bucket(bucket, ttl=None, create=False, replicas=1, timeout=timeout)
    key = _KeyWatch()
    # The watch delivers the key's current value first: a successor that is
    # already there counts.
    watch = await kv.watch(outcome.role, key.on_entry)
    try:
        return await _successor(key, outcome, wait)
    finally:
        await watch.unsubscribe()


def fence_wait(settings: LeaderSettings, role: str, wait: float | None) -> float:
    """Seconds a fence command waits for a successor: ``wait``, else the role's TTL.

    A fenced term's key is free at once; a live candidate takes it within a
    heartbeat, and a follower that missed the change within the TTL.
    """
    return settings.election_config(role).ttl if wait is None else float(wait)


def request_fence(
    settings: LeaderSettings,
    role: str,
    *,
    epoch: int | None,
    timeout: float,
    wait: float,
    requester: str,
    handover_wait: float = DEFAULT_HANDOVER_WAIT,
) -> FenceOutcome:
    """Synchronous :func:`fence_leader` on a connection of its own.

    Args:
        settings: Where to connect, and the role's bucket.
        role: The role.
        epoch: Fence only this term (``None``: whichever term is current).
        timeout: Seconds per NATS operation.
        wait: Seconds to wait for a successor (``0``: do not wait).
        requester: Who fences (written into the marker; the connection is named after it).
        handover_wait: Seconds for a live leader to hand over before it is
            fenced (``0``: fence at once).

    Returns:
        The outcome.

    Raises:
        NotLeaderError: Nobody holds the role, or its term is not ``epoch``.
        ElectionError: NATS unreachable, bucket missing, ...

    """
    bucket = settings.election_config(role).bucket
    return with_backend(
        settings,
        lambda backend: fence_leader(
            backend,
            bucket,
            role,
            requester=requester,
            epoch=epoch,
            timeout=timeout,
            wait=wait,
            handover_wait=handover_wait,
        ),
        timeout=timeout,
        name=requester,
    )


def wait_for_successor(
    settings: LeaderSettings, outcome: FenceOutcome, *, wait: float, timeout: float, requester: str
) -> FenceOutcome:
    """Synchronous :func:`await_successor` on a connection of its own.

    Args:
        settings: Where to connect, and the role's bucket.
        outcome: What :func:`request_fence` returned (with ``wait=0``).
        wait: Seconds after the end of the term to wait for the successor.
        timeout: Seconds per NATS operation.
        requester: The connection's name.

    Returns:
        ``outcome`` with the successor, if one came in time.

    Raises:
        ElectionError: NATS unreachable, bucket missing, ...

    """
    bucket = settings.election_config(outcome.role).bucket
    return with_backend(
        settings,
        lambda backend: await_successor(backend, bucket, outcome, wait=wait, timeout=timeout),
        timeout=timeout,
        name=requester,
    )


def fence_lines(outcome: FenceOutcome, wait: float) -> list[tuple[bool, str]]:
    """The outcome in words, as both the CLI and the Django command print it.

    Args:
        outcome: What :func:`fence_leader` (and :func:`await_successor`) returned.
        wait: The seconds it waited for a successor (``0``: it did not wait).

    Returns:
        ``(good, line)`` pairs: what ended the term, then the successor, or
        (not good) that none came within ``wait``.

    """
    lines = [(True, outcome.describe())]
    role = outcome.role
    if outcome.successor is not None:
        took = (outcome.promoted_after or 0.0) * 1000
        lines.append(
            (
                True,
                f"new leader of {role!r}: {outcome.successor.id} "
                f"(epoch {outcome.successor.epoch}) after {took:.0f} ms",
            )
        )
    elif wait > 0:
        lines.append((False, f"no new leader of {role!r} within {wait:g}s"))
    return lines


__all__ = [
    "DEFAULT_HANDOVER_WAIT",
    "FenceOutcome",
    "await_successor",
    "fence_leader",
    "fence_lines",
    "request_fence",
    "wait_for_successor",
]
