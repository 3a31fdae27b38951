"""Run a body once per idempotency key: a KV recipe for the worker side.

A message can reach workers twice: a beat scheduler that died after sending
a tick but before recording the send has it re-sent by its successor (under
the same deterministic task id), a broker redelivers an ``acks_late``
message whose worker died, a producer retries a publish. The guard makes the
*execution* happen once per key anyway, with two KV buckets:

* a **lease** bucket whose ``max_age`` is the lease: ``create(key)`` claims
  the key before the body runs; the runner renews it (``update`` at its
  revision) every third of the lease while the body runs and deletes it
  afterwards. A runner that dies stops renewing and the server expires the
  claim, so the run can be taken up again: an interrupted run executes again
  (at least once, like ``acks_late``), a finished one never;
* a **done** bucket (``max_age`` = the retention, the window in which
  duplicates are recognised): ``create(key)`` records the outcome *before*
  the lease is released.

``claim`` creates the lease first and reads the done record second. Every
runner writes *done* before it deletes its lease, and a new lease can only be
created after the old one is deleted or expired, so a claimant that gets the
lease and finds no done record knows no earlier run finished. No clock is
compared anywhere: the lease ends by the server's own expiry.

What it does not cover: a runner *paused* (not dead) for longer than the
lease loses its claim while its body is still running; a duplicate may then
run beside it. The runner notices (its renewal fails) and logs it at ERROR.
Choose the lease longer than any pause you expect (the default is 30 s);
a longer lease only delays the re-run of a run whose worker died.

This module imports neither Celery nor Django; the Celery wiring is
:mod:`celery_nats_leader.worker.once_tasks`.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import re
import uuid
from dataclasses import dataclass
from typing import Any

from celery_nats_leader.core.backend import Bucket
from celery_nats_leader.core.errors import (
    BackendTimeoutError,
    ElectionError,
    KeyExistsError,
    RevisionMismatchError,
)

__all__ = [
    "ONCE_VERSION",
    "Claim",
    "ClaimLostError",
    "OnceGuard",
    "Verdict",
    "decode_once",
    "once_key",
]

logger = logging.getLogger(__name__)

#: Version of the JSON layout of lease and done records.
ONCE_VERSION = 1

_PLAIN = re.compile(r"[A-Za-z0-9_-]{1,128}")


class ClaimLostError(ElectionError):
    """Raised when a running claim's lease was lost (expired or taken) before the run ended."""


def once_key(idempotency_key: str) -> str:
    """The KV key of an idempotency key (a task id, usually a UUID).

    Plain ids are kept readable; anything else (dots, spaces, long ids) is
    hashed. The two forms have different prefixes, so they never collide.

    Args:
        idempotency_key: Any string.

    Returns:
        ``"id.<key>"`` or ``"h.<sha256 hex>"``.

    """
    if _PLAIN.fullmatch(idempotency_key):
        return f"id.{idempotency_key}"
    return "h." + hashlib.sha256(idempotency_key.encode()).hexdigest()


class Verdict(enum.Enum):
    """What :meth:`OnceGuard.claim` found."""

    RUN = "run"
    """The key is ours: run the body, then :meth:`OnceGuard.complete` (or
    :meth:`OnceGuard.release` to let a retry run it)."""

    DONE = "done"
    """A run finished already: acknowledge the duplicate without running it."""

    BUSY = "busy"
    """Another run holds a live lease: look again later (it may finish, or
    die and let its lease expire)."""


@dataclass(frozen=True)
class Claim:
    """The answer of :meth:`OnceGuard.claim`.

    Attributes:
        key: The idempotency key.
        verdict: What to do.
        revision: The lease's revision (``RUN`` only).
        nonce: This claim's random id (written into the lease and the done record).
        holder: The other side: for ``DONE`` the done record, for ``BUSY``
            the lease holder's record when it could be read (diagnostics).

    """

    key: str
    verdict: Verdict
    revision: int = 0
    nonce: str = ""
    holder: dict[str, Any] | None = None


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps({"v": ONCE_VERSION, **body}, separators=(",", ":"), sort_keys=True).encode()


def decode_once(value: bytes) -> dict[str, Any] | None:
    """Parse a lease or done record (``None`` when it is not one of ours)."""
    try:
        body = json.loads(value)
    except (ValueError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) and "key" in body else None


class OnceGuard:
    """Claims, renews and completes runs by idempotency key (asyncio).

    Args:
        leases: The lease bucket (``max_age`` = the lease).
        done: The done bucket (``max_age`` = the retention).
        claimant: Who runs (written into the records: host, pid, ...).
        timeout: Seconds per KV operation.

    """

    def __init__(self, leases: Bucket, done: Bucket, *, claimant: str, timeout: float) -> None:
        self.leases = leases
        self.done = done
        self.claimant = claimant
        self.timeout = timeout

    async def claim(self, key: str) -> Claim:
        """Claim ``key`` before running its body (two KV round trips).

        Args:
            key: The idempotency key (a task id).

        Returns:
            ``RUN`` with the lease's revision, ``DONE`` or ``BUSY``.

        Raises:
            ElectionError: The store did not answer (the outcome of the
                claim is then settled by one read: a lease carrying our nonce
                is ours; if even that fails, this error, and nothing ran).

        """
        kv_key = once_key(key)
        nonce = uuid.uuid4().hex
        lease = _encode({"key": key, "by": self.claimant, "nonce": nonce})
        try:
            revision = await self.leases.create(kv_key, lease, timeout=self.timeout)
        except KeyExistsError:
            # Held: by a live run, or by one that just finished and is about
            # to delete its lease (then its done record is already there).
            done = await self._done_record(kv_key)
            if done is not None:
                return Claim(key, Verdict.DONE, holder=done)
            entry = await self.leases.get(kv_key, timeout=self.timeout)
            holder = decode_once(entry.value) if entry is not None else None
            return Claim(key, Verdict.BUSY, holder=holder)
        except BackendTimeoutError:
            # The create may have landed: a lease carrying our nonce is ours.
            entry = await self.leases.get(kv_key, timeout=self.timeout)
            mine = decode_once(entry.value) if entry is not None else None
            if entry is None or mine is None or mine.get("nonce") != nonce:
                raise
            revision = entry.revision
        done = await self._done_record(kv_key)
        if done is not None:
            await self._drop(kv_key, revision)
            return Claim(key, Verdict.DONE, holder=done)
        return Claim(key, Verdict.RUN, revision=revision, nonce=nonce)

    async def renew(self, claim: Claim) -> Claim:
        """Extend a running claim's lease by one lease period.

        Returns:
            The claim at its new revision.

        Raises:
            ClaimLostError: The lease expired or was taken since (a duplicate
                may be running).
            ElectionError: The store did not answer (try again).

        """
        lease = _encode({"key": claim.key, "by": self.claimant, "nonce": claim.nonce})
        try:
            revision = await self.leases.update(
                once_key(claim.key), lease, last=claim.revision, timeout=self.timeout
            )
        except RevisionMismatchError as exc:
            raise ClaimLostError(
                f"the claim on {claim.key!r} expired or was taken while it ran"
            ) from exc
        return Claim(claim.key, claim.verdict, revision=revision, nonce=claim.nonce)

    async def complete(self, claim: Claim, outcome: str = "success") -> bool:
        """Record that the run of ``claim`` finished, then release its lease.

        Two KV round trips. The done record is written first: a duplicate
        that claims the key after the lease is gone finds it.

        Args:
            claim: A ``RUN`` claim.
            outcome: What happened (``success``, ``failure``: informational).

        Returns:
            ``False`` if another run had recorded the key as done already
            (this run was a duplicate: its lease had been lost).

        Raises:
            ElectionError: The done record could not be written; the lease
                is kept (it expires), so that a duplicate does not take the
                unrecorded run for an unfinished one before the caller retries.

        """
        kv_key = once_key(claim.key)
        record = _encode(
            {"key": claim.key, "by": self.claimant, "nonce": claim.nonce, "outcome": outcome}
        )
        first = True
        try:
            await self.done.create(kv_key, record, timeout=self.timeout)
        except KeyExistsError:
            # Ours when a retried completion finds its own earlier write.
            found = await self._done_record(kv_key)
            first = found is not None and found.get("nonce") == claim.nonce
        except BackendTimeoutError:
            found = await self._done_record(kv_key)
            if found is None:
                raise
            first = found.get("nonce") == claim.nonce
        if not first:
            logger.error(
                "run of %r finished but another run had already completed it: it ran twice "
                "(its lease was lost while it ran: a pause longer than the lease?)",
                claim.key,
            )
        await self._drop(kv_key, claim.revision, claim.nonce)
        return first

    async def release(self, claim: Claim) -> None:
        """Give a claim up without recording a run (the body will run again).

        For a run that did not happen or asked to be retried (Celery's
        ``Retry``, ``Reject(requeue=True)``). One KV round trip.
        """
        await self._drop(once_key(claim.key), claim.revision, claim.nonce)

    async def status(self, key: str) -> dict[str, Any] | None:
        """The done record of ``key`` (``None`` when no run finished)."""
        return await self._done_record(once_key(key))

    async def _done_record(self, kv_key: str) -> dict[str, Any] | None:
        entry = await self.done.get(kv_key, timeout=self.timeout)
        if entry is None:
            return None
        # A foreign value under our key still means "done": never run twice.
        return decode_once(entry.value) or {"key": kv_key, "outcome": "unknown"}

    async def _drop(self, kv_key: str, revision: int, nonce: str | None = None) -> None:
        try:
            try:
                await self.leases.delete(kv_key, last=revision, timeout=self.timeout)
            except RevisionMismatchError:
                # Expired, taken, or renewed by us after all: a renewal sent
                # before the run ended can land after the caller stopped
                # renewing, one revision later. Still ours (our nonce): delete
                # it at that revision, or a requeued copy sat BUSY until it
                # expired. Anything else is not ours to delete any more.
                entry = await self.leases.get(kv_key, timeout=self.timeout)
                held = decode_once(entry.value) if entry is not None else None
                if entry is None or nonce is None or held is None or held.get("nonce") != nonce:
                    return
                await self.leases.delete(kv_key, last=entry.revision, timeout=self.timeout)
        except RevisionMismatchError:
            pass  # renewed again meanwhile is impossible: taken or expired
        except ElectionError as exc:
            # It expires by itself; until then a duplicate is told "busy".
            logger.warning("could not release the claim on %s (%s); it will expire", kv_key, exc)
