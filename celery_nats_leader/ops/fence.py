"""Fence a stuck leader: end its term at once, without waiting for the TTL.

A leader that is paused (SIGSTOP, a frozen VM, a debugger), hung or cut off
keeps its key until the key expires: up to one TTL in which nobody leads. An
operator who knows it is stuck writes a *fence marker* over its record with a
conditional update at the revision they observed::

    update(role, <fence marker>, last=<revision of the leader's record>)

* The term is over at once: the marker's revision (its epoch) is newer than
  the term's, so every fenced check of the old token fails (``validate_token``,
  the beat scheduler's check before each dispatch, ``@leader_only(validate=True)``
  read the key and find another token; the Django database fence, raised to
  the marker's epoch by ``manage.py election_fence``, refuses older epochs).
* Live candidates treat a marker as a vacant key and campaign at once, taking
  it with an update at the marker's revision (exactly one wins): a successor
  leads within milliseconds.
* The write is conditional: if the leader renewed in between (it is not
  stuck), the same term is fenced at its new revision; if the term ended
  meanwhile, nothing is written.

A leader that was *not* stuck sees the marker on its watch (or at its next
renewal, within one heartbeat) and steps down with reason ``fenced``; until
then its fenced paths already reject it. It then sits out one TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass

from celery_nats_leader.backend import Backend, KVEntry, Operation
from celery_nats_leader.errors import NotLeaderError, RecordFormatError, RevisionMismatchError
from celery_nats_leader.nats import open_backend
from celery_nats_leader.ops.oneshot import run_once
from celery_nats_leader.record import LeaderRecord, decode_record, encode_fence
from celery_nats_leader.settings import LeaderSettings

logger = logging.getLogger(__name__)

#: Conditional writes attempted while the fenced term keeps renewing.
_ATTEMPTS = 3


@dataclass(frozen=True)
class FenceOutcome:
    """What :func:`fence_leader` did.

    Attributes:
        role: The role.
        fenced: The term that ended (the leader's record as observed).
        revision: Revision of the fence marker: every term after it has a
            larger epoch, and a fence in a resource can be raised to it.
        token: The marker's own random token (``FencingToken(revision, token)``
            raises a resource's fence without naming any leader's term).
        successor: The next leader's record, if one was seen within ``wait``.
        promoted_after: Seconds from the fence write to the successor's
            record arriving here (this host's monotonic clock), or ``None``.

    """

    role: str
    fenced: LeaderRecord
    revision: int
    token: str = ""
    successor: LeaderRecord | None = None
    promoted_after: float | None = None

    def to_dict(self) -> dict[str, object]:
        """The ``--json`` form: role, fenced {id, epoch}, revision, new_leader, promoted_after."""
        successor = self.successor
        return {
            "role": self.role,
            "fenced": {"id": self.fenced.id, "epoch": self.fenced.epoch},
            "revision": self.revision,
            "new_leader": (
                None if successor is None else {"id": successor.id, "epoch": successor.epoch}
            ),
            "promoted_after": self.promoted_after,
        }


def _record(entry: KVEntry | None) -> LeaderRecord | None:
    if entry is None or entry.operation is not Operation.PUT:
        return None
    try:
        return decode_record(entry.value, entry.revision)
    except RecordFormatError:
        return None


async def fence_leader(
    backend: Backend,
    bucket: str,
    role: str,
    *,
    requester: str,
    epoch: int | None = None,
    timeout: float = 5.0,
    wait: float = 0.0,
) -> FenceOutcome:
    """End the current term of ``role`` now, whatever its leader is doing.

    Args:
        backend: A connected backend.
        bucket: The KV bucket.
        role: The role.
        requester: Who fences (kept in the marker and logged).
        epoch: Fence only this term; ``None``: the term found in the key.
        timeout: Seconds for each KV operation.
        wait: Seconds to wait for a successor's record (``0``: do not wait).

    Returns:
        The outcome: the ended term, the marker's revision, the successor.

    Raises:
        NotLeaderError: Nobody leads the role (no record, or already fenced),
            or the term ``epoch`` is not the current one.
        BucketNotFoundError: The bucket does not exist.

    """
    kv = await backend.open_bucket(bucket, ttl=None, create=False, replicas=1, timeout=timeout)
    # Leaders' records as the watch delivers them: the successor's may come
    # before the fence write's acknowledgement is read.
    seen: list[LeaderRecord] = []
    arrived = asyncio.Event()

    def on_entry(entry: KVEntry) -> None:
        record = _record(entry)
        if record is not None and not record.is_fence:
            seen.append(record)
            arrived.set()

    def next_term(after: int) -> LeaderRecord | None:
        return next((record for record in seen if record.epoch > after), None)

    watch = await kv.watch(role, on_entry)
    try:
        entry = await kv.get(role, timeout=timeout)
        target = _record(entry)
        for _ in range(_ATTEMPTS):
            if entry is None or target is None or target.is_fence:
                raise NotLeaderError(f"nobody leads role {role!r} in bucket {bucket!r}")
            if epoch is not None and target.epoch != epoch:
                raise NotLeaderError(
                    f"the term of role {role!r} is epoch {target.epoch}, not {epoch}; "
                    "nothing fenced"
                )
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
                # that term at its new revision) or another term (stop).
                entry = await kv.get(role, timeout=timeout)
                current = _record(entry)
                if current is None or current.token != target.token:
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
            "%s: fenced the term of %s (epoch %d) at revision %d, requested by %s",
            role,
            target.id,
            target.epoch,
            fence_revision,
            requester,
        )
        successor = next_term(fence_revision)
        deadline = started + wait
        while successor is None and time.monotonic() < deadline:
            arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(arrived.wait(), deadline - time.monotonic())
            successor = next_term(fence_revision)
        return FenceOutcome(
            role=role,
            fenced=target,
            revision=fence_revision,
            token=marker_token,
            successor=successor,
            promoted_after=None if successor is None else round(time.monotonic() - started, 4),
        )
    finally:
        await watch.unsubscribe()


def request_fence(
    settings: LeaderSettings,
    role: str,
    *,
    epoch: int | None,
    timeout: float,
    wait: float,
    requester: str,
) -> FenceOutcome:
    """Synchronous :func:`fence_leader` on a connection of its own.

    Args:
        settings: Where to connect, and the role's bucket.
        role: The role.
        epoch: Fence only this term (``None``: whichever term is current).
        timeout: Seconds per NATS operation.
        wait: Seconds to wait for a successor (``0``: do not wait).
        requester: Who fences (written into the marker; the connection is named after it).

    Returns:
        The outcome.

    Raises:
        NotLeaderError: Nobody holds the role, or its term is not ``epoch``.
        ElectionError: NATS unreachable, bucket missing, ...

    """
    bucket = settings.election_config(role).bucket

    async def run() -> FenceOutcome:
        async with await open_backend(
            settings.connection, timeout=timeout, name=requester
        ) as backend:
            return await fence_leader(
                backend,
                bucket,
                role,
                requester=requester,
                epoch=epoch,
                timeout=timeout,
                wait=wait,
            )

    return run_once(run)


__all__ = ["FenceOutcome", "fence_leader", "request_fence"]
