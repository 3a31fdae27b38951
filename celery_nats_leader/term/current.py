"""Reading a role's current term: the one way, from any process.

A role's term is what its key in the bucket holds. Everything that must know
it reads it here: the election validating its own token, ``status``, prefork
children validating a token for ``@leader_only(validate=True)`` and the
worker-side beat check (:class:`~celery_nats_leader.beat.dispatch_fence.DispatchFence`).

* :func:`term_of` turns a KV entry into a :class:`Term` (or ``None`` when the
  role is free): the one decoding of an entry.
* :meth:`Term.holds` is the one "does the store still hold this term" check.
* :func:`read_term` reads it from an open bucket (async code).
* :class:`TermReader` reads it from synchronous code in any process, through
  the process's one :class:`~celery_nats_leader.nats.process_client.ProcessClient`
  (never ``asyncio.run`` per call: that would reconnect every time).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from celery_nats_leader.core.backend import Bucket, KVEntry, Operation
from celery_nats_leader.core.errors import ElectionError, RecordFormatError
from celery_nats_leader.nats.process_client import ProcessClient
from celery_nats_leader.term.record import LeaderRecord, decode_record
from celery_nats_leader.term.token import FencingToken

if TYPE_CHECKING:
    from celery_nats_leader.config.connection import ConnectOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Term:
    """What a role's key holds now.

    Attributes:
        revision: The KV revision of the entry.
        record: The leader record, or ``None`` when the value is not a record
            of this package (someone else's data: a term of unknown holder).
        problem: Why the value is not a record (``None`` when it is one).

    """

    revision: int
    record: LeaderRecord | None
    problem: str | None = None

    @property
    def epoch(self) -> int:
        """The term's epoch; for a foreign value, its revision (a term newer than any before it)."""
        return self.record.epoch if self.record is not None else self.revision

    def holds(self, token: FencingToken, instance_id: str | None = None) -> bool:
        """Whether this is the term of ``token`` (held by ``instance_id``, if given)."""
        return self.record is not None and self.record.holds(token, instance_id)


def term_of(entry: KVEntry | None) -> Term | None:
    """The term a KV entry records, or ``None`` when the role is free.

    Free means no entry, or a delete or purge marker (a released term).

    Args:
        entry: The role's latest entry, or ``None``.

    Returns:
        The term.

    """
    if entry is None or entry.operation is not Operation.PUT:
        return None
    try:
        return Term(revision=entry.revision, record=decode_record(entry.value, entry.revision))
    except RecordFormatError as exc:
        return Term(revision=entry.revision, record=None, problem=str(exc))


async def read_term(bucket: Bucket, role: str, *, timeout: float) -> Term | None:
    """Read ``role``'s current term (one KV read).

    Raises:
        ElectionError: The read failed (timeout, disconnected, bucket gone).

    """
    return term_of(await bucket.get(role, timeout=timeout))


class TermReader:
    """Reads roles' current terms from synchronous code, in this process.

    Reads go through the process's one
    :class:`~celery_nats_leader.nats.process_client.ProcessClient` for
    ``connection``: the first read of the process starts its event-loop
    thread and opens its connection, later reads cost one KV round trip. A
    reader inherited over ``fork()`` reads through the child's own client.
    Safe to use from several threads.

    Args:
        connection: Where and how to connect.
        bucket: The KV bucket of the roles.

    """

    def __init__(self, connection: ConnectOptions, bucket: str) -> None:
        self.bucket_name = bucket
        self.connection = connection

    def read(self, role: str, *, timeout: float) -> Term | None:
        """Read ``role``'s current term.

        Args:
            role: The role (the key).
            timeout: Seconds for connecting (first use) and for the read.

        Returns:
            The term, or ``None`` when nobody holds the role.

        Raises:
            ElectionError: The term could not be read (NATS unreachable, bucket
                missing, no answer in time).

        """
        return term_of(self.read_latest(role, timeout=timeout))

    def read_latest(self, role: str, *, timeout: float) -> KVEntry | None:
        """Read ``role``'s key as it is: a term's record, or the marker of its release.

        Returns:
            The latest entry (a delete or purge marker too), or ``None`` when
            the key holds nothing (never written, or expired without a marker).

        Raises:
            ElectionError: The key could not be read.

        """
        client = ProcessClient.for_connection(self.connection)
        return client.read_key(
            self.bucket_name, role, timeout=timeout, what=f"could not read the term of {role!r}"
        )

    def holds(
        self, role: str, token: FencingToken, instance_id: str | None = None, *, timeout: float
    ) -> bool:
        """Whether ``role``'s key holds the term of ``token``; ``False`` on any doubt.

        A failed read is logged at WARNING and answers ``False``.
        """
        try:
            term = self.read(role, timeout=timeout)
        except ElectionError as exc:
            logger.warning("could not validate the token of %r: %s", role, exc)
            return False
        return term is not None and term.holds(token, instance_id)

    def close(self, timeout: float = 5.0) -> None:
        """Close this process's client for the reader's connection (the next read reopens it)."""
        ProcessClient.for_connection(self.connection).close(timeout)


__all__ = ["Term", "TermReader", "read_term", "term_of"]
