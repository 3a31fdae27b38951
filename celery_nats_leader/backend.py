"""What the election needs from a store: the seam between the core and NATS.

A KV bucket with conditional writes and a key watch, and plain request/reply
messaging for the side channel (roster and resign requests).
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol


class Operation(enum.Enum):
    """What a KV entry records."""

    PUT = "PUT"
    DELETE = "DEL"
    PURGE = "PURGE"


@dataclass(frozen=True)
class KVEntry:
    """One revision of one key.

    Attributes:
        key: The key.
        value: The bytes stored (empty for delete and purge markers).
        revision: The bucket-wide sequence number of this revision.
        operation: Whether this is a value, a delete marker or a purge marker.

    """

    key: str
    value: bytes
    revision: int
    operation: Operation = Operation.PUT


#: Called (on the event loop) for every entry a watch sees.
WatchCallback = Callable[[KVEntry], None]

#: Handles one message: ``(data, reply_subject_or_None)``.
MessageHandler = Callable[[bytes, "str | None"], Awaitable[None]]


class Subscription(Protocol):
    """A live watch or subscription."""

    async def unsubscribe(self) -> None:
        """Stop delivering; idempotent."""
        ...


class Bucket(Protocol):
    """A KV bucket with compare-and-set writes.

    Every write raises :class:`~celery_nats_leader.errors.NotConnectedError`
    instead of buffering when the connection is down, and
    :class:`~celery_nats_leader.errors.BackendTimeoutError` when its outcome
    is unknown.
    """

    name: str

    async def create(self, key: str, value: bytes, *, timeout: float) -> int:
        """Write ``value`` only if ``key`` holds nothing; return the new revision.

        Raises:
            KeyExistsError: The key holds a value.

        """
        ...

    async def update(self, key: str, value: bytes, *, last: int, timeout: float) -> int:
        """Write ``value`` only if ``key``'s latest revision is ``last``.

        Raises:
            RevisionMismatchError: The key changed since ``last``.

        """
        ...

    async def delete(self, key: str, *, last: int, timeout: float) -> None:
        """Delete ``key`` only if its latest revision is ``last``.

        Raises:
            RevisionMismatchError: The key changed since ``last``.

        """
        ...

    async def put(self, key: str, value: bytes, *, timeout: float) -> int:
        """Write ``value`` unconditionally (operator tools only); return the revision."""
        ...

    async def get(self, key: str, *, timeout: float) -> KVEntry | None:
        """Return the key's latest value, or ``None`` if absent or deleted."""
        ...

    async def watch(self, key: str, callback: WatchCallback) -> Subscription:
        """Call ``callback`` with the key's current entry and every later change.

        A watch may miss expiries (the server sends no event when ``max_age``
        removes an entry) and may go blind after a server restart: callers
        back it up with periodic :meth:`get`.
        """
        ...

    async def entries(self, *, timeout: float) -> list[KVEntry]:
        """Return the latest value of every key that holds one."""
        ...

    async def ttl(self, *, timeout: float) -> float:
        """Return the bucket's ``max_age`` in seconds."""
        ...


class Backend(Protocol):
    """A connection: opens buckets and carries request/reply messages."""

    @property
    def is_connected(self) -> bool:
        """Whether the connection is up right now."""
        ...

    async def open_bucket(
        self,
        name: str,
        *,
        ttl: float | None,
        create: bool,
        replicas: int,
        timeout: float,
        persistent: bool = False,
    ) -> Bucket:
        """Open (and optionally create) a bucket, checking its settings.

        ``ttl=None`` opens the bucket whatever its ``max_age`` (readers only).
        ``persistent=True`` (with ``ttl=None``) is for data that must not
        expire, such as the beat schedule's state: the bucket is created
        without ``max_age`` and refused if it has one.

        Raises:
            BucketNotFoundError: The bucket is missing and ``create`` is false.
            BucketConfigError: The bucket's ``max_age`` differs from ``ttl``
                (or is set on a ``persistent`` bucket).
            JetStreamUnavailableError: The server has no JetStream.

        """
        ...

    async def subscribe(self, subject: str, handler: MessageHandler) -> Subscription:
        """Deliver messages on ``subject`` to ``handler``."""
        ...

    async def publish(self, subject: str, data: bytes, reply: str | None = None) -> None:
        """Publish one message (dropped, not buffered, while disconnected)."""
        ...

    async def request(self, subject: str, data: bytes, *, timeout: float) -> bytes:
        """Send a request and return the first reply.

        Raises:
            BackendTimeoutError: No reply in time.

        """
        ...

    async def request_many(
        self, subject: str, data: bytes, *, window: float, max_replies: int | None = None
    ) -> list[bytes]:
        """Send a request and collect every reply that arrives within ``window`` seconds."""
        ...


__all__ = [
    "Backend",
    "Bucket",
    "KVEntry",
    "MessageHandler",
    "Operation",
    "Subscription",
    "WatchCallback",
]
