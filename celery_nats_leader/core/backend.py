"""What the election needs from a store: the seam between the core and NATS.

A KV bucket with conditional writes and a key watch, and plain request/reply
messaging for the side channel (roster and resign requests); plus what the
operator tools need to inspect and remove a bucket, and to keep and read a
message stream (the optional events stream).
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol


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

    Every write raises :class:`~celery_nats_leader.core.errors.NotConnectedError`
    instead of buffering when the connection is down, and
    :class:`~celery_nats_leader.core.errors.BackendTimeoutError` when its outcome
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

    async def delete(self, key: str, *, last: int, timeout: float) -> int:
        """Delete ``key`` only if its latest revision is ``last``; return the delete's revision.

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

    async def latest(self, key: str, *, timeout: float) -> KVEntry | None:
        """Return the key's latest entry, a delete or purge marker too (``None``: none).

        A marker's revision says when the key was vacated: a term created
        below it has ended.
        """
        ...

    async def watch(self, key: str, callback: WatchCallback) -> Subscription:
        """Call ``callback`` with the key's current entry and every later change.

        A watch may miss expiries (the server sends no event when ``max_age``
        removes an entry) and may go blind after a server restart: callers
        back it up with periodic :meth:`get`.
        """
        ...

    async def keys(self, *, timeout: float) -> list[str]:
        """Every key with an entry (a value or a marker), sorted, as the server's log has them.

        Unlike :meth:`entries`, never from a copy that lags: on a replicated
        bucket the stream's leader answers.
        """
        ...

    async def entries(self, *, timeout: float) -> list[KVEntry]:
        """Return the latest value of every key that holds one.

        Read through a consumer, which the server may place on a member of a
        replicated bucket that is still catching up: a key may be missing or
        older. Decide nothing from it that a compare-and-set does not check.
        """
        ...

    async def ttl(self, *, timeout: float) -> float:
        """Return the bucket's ``max_age`` in seconds."""
        ...

    @property
    def description(self) -> str:
        """The bucket's description as last read (opening it with a ``ttl`` reads it)."""
        ...


@dataclass(frozen=True)
class BucketInfo:
    """A KV bucket's settings, as the server reports them.

    Attributes:
        name: The bucket.
        ttl: ``max_age`` in seconds (``0`` = no expiry).
        history: Values kept per key.
        replicas: Stream replicas.
        storage: ``file`` or ``memory``.
        keys: Messages stored (one per role that holds a value or a delete marker).
        created: Whether the call that returned it created the bucket.
        description: The stream's description (a TTL change leaves its
            marks there: :mod:`celery_nats_leader.election.moves`).

    """

    name: str
    ttl: float
    history: int
    replicas: int
    storage: str
    keys: int
    created: bool = False
    description: str = ""

    def problems(
        self,
        *,
        ttl: float | None,
        replicas: int | None = None,
        persistent: bool = False,
        setting: str | None = None,
    ) -> list[str]:
        """What is wrong with this bucket for an election with ``ttl`` (empty if nothing).

        Args:
            ttl: The election TTL the bucket's ``max_age`` must equal (None: not checked).
            replicas: The expected replica count (None: not checked).
            persistent: The bucket holds data that must not expire (the beat
                schedule's state): it must have no ``max_age``.
            setting: The setting ``ttl`` comes from when it is not the election
                TTL (the once-guard's ``once_lease``, ...), named in the advice.

        Returns:
            One sentence per problem, each saying what to change.

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
                if setting is None
                else f"max_age is {self.ttl:g}s but {setting} is {ttl:g}s: they must be equal "
                f"(delete and recreate the bucket, or set {setting} to {self.ttl:g})"
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
            "description": self.description,
        }


@dataclass(frozen=True)
class StreamState:
    """A message stream's settings and size.

    Attributes:
        subjects: The subjects it keeps.
        max_age: Seconds a message is kept.
        messages: Messages kept now.

    """

    subjects: tuple[str, ...]
    max_age: float
    messages: int


@dataclass(frozen=True)
class StreamMessage:
    """One message a stream kept.

    Attributes:
        seq: Its sequence in the stream.
        data: Its payload.
        time: When the server stored it (RFC 3339, the server's clock), if known.

    """

    seq: int
    data: bytes
    time: str | None = None


class ConnectionListener:
    """Receives connection state changes; override what you need."""

    def disconnected(self) -> None:
        """The connection went down (it will try to reconnect)."""

    def reconnected(self) -> None:
        """The connection is back."""


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
        description: str = "",
    ) -> Bucket:
        """Open (and optionally create) a bucket, checking its settings.

        ``ttl=None`` opens the bucket whatever its ``max_age`` (readers only).
        ``persistent=True`` (with ``ttl=None``) is for data that must not
        expire, such as the beat schedule's state: the bucket is created
        without ``max_age`` and refused if it has one. ``description`` is
        given to a bucket this call creates (one that exists keeps its own).

        Raises:
            BucketNotFoundError: The bucket is missing and ``create`` is false.
            BucketConfigError: The bucket's ``max_age`` differs from ``ttl``
                (or is set on a ``persistent`` bucket).
            JetStreamUnavailableError: The server has no JetStream.

        """
        ...

    async def close(self) -> None:
        """Close the connection if this backend opened it; idempotent, never raises."""
        ...

    async def bucket_info(self, name: str, *, timeout: float) -> BucketInfo:
        """Read a bucket's settings (operator tools; elections never need it).

        Raises:
            BucketNotFoundError: The bucket does not exist.
            JetStreamUnavailableError: The server has no JetStream.

        """
        ...

    async def describe_bucket(self, name: str, description: str, *, timeout: float) -> None:
        """Set a bucket's description, nothing else (operator tools).

        Raises:
            BucketNotFoundError: The bucket does not exist.
            JetStreamUnavailableError: The server has no JetStream.

        """
        ...

    async def delete_bucket(self, name: str, *, timeout: float) -> bool:
        """Delete a bucket and everything in it; return whether it existed.

        Raises:
            JetStreamUnavailableError: The server has no JetStream.

        """
        ...

    async def next_revision(self, name: str, *, timeout: float) -> int:
        """The revision the bucket's next write gets (operator tools).

        Raises:
            BucketNotFoundError: The bucket does not exist.
            JetStreamUnavailableError: The server has no JetStream.

        """
        ...

    async def raise_next_revision(self, name: str, revision: int, *, timeout: float) -> int:
        """Make the bucket's next write get at least ``revision``; return its next revision.

        For a bucket that holds no entry (a new one, before any candidate
        uses it): entries below ``revision`` are removed.

        Raises:
            BucketNotFoundError: The bucket does not exist.
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

    async def stream_state(self, name: str, *, timeout: float) -> StreamState | None:
        """The stream ``name``, or ``None`` when it does not exist.

        Raises:
            JetStreamUnavailableError: The server has no JetStream (or did not answer).
            BackendError: The server refused.

        """
        ...

    async def create_stream(
        self,
        name: str,
        *,
        subjects: tuple[str, ...],
        max_age: float,
        replicas: int,
        timeout: float,
    ) -> None:
        """Create a file stream keeping messages on ``subjects`` for ``max_age`` seconds.

        The oldest messages are discarded first; an existing stream with
        another configuration is an error.

        Raises:
            JetStreamUnavailableError: The server has no JetStream (or did not answer).
            BackendError: The server refused.

        """
        ...

    async def stream_messages(
        self, name: str, subject: str, *, timeout: float
    ) -> list[StreamMessage] | None:
        """Every message the stream ``name`` keeps on ``subject`` (wildcards allowed), oldest first.

        Returns:
            The messages, or ``None`` when the stream does not exist.

        Raises:
            JetStreamUnavailableError: The server has no JetStream (or did not answer).
            BackendError: The server refused.

        """
        ...


__all__ = [
    "Backend",
    "Bucket",
    "BucketInfo",
    "ConnectionListener",
    "KVEntry",
    "MessageHandler",
    "Operation",
    "StreamMessage",
    "StreamState",
    "Subscription",
    "WatchCallback",
]
