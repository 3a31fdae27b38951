"""An in-process backend for fast unit tests of the election logic.

It behaves like a JetStream KV bucket with ``history=1`` on nats-server 2.9:
conditional writes by revision, delete markers, ``max_age`` expiry measured
on an injectable clock and, like the real server, *no* watch event on expiry.
Several :class:`MemoryBackend` objects sharing one :class:`MemoryServer` play
separate processes. It is a stub for logic tests only: behaviour that matters
to users is also tested against a real nats-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field

from celery_nats_leader.core.backend import (
    BucketInfo,
    KVEntry,
    MessageHandler,
    Operation,
    StreamMessage,
    StreamState,
    WatchCallback,
)
from celery_nats_leader.core.clock import SYSTEM_CLOCK, Clock
from celery_nats_leader.core.errors import (
    BackendError,
    BackendTimeoutError,
    BucketConfigError,
    BucketNotFoundError,
    EpochFloorRaceError,
    KeyExistsError,
    NotConnectedError,
    RevisionMismatchError,
)


@dataclass
class _Stored:
    entry: KVEntry
    stored_at: float


@dataclass
class _MemoryBucketState:
    ttl: float
    description: str = ""
    keys: dict[str, _Stored] = field(default_factory=dict)
    watchers: list[tuple[str, WatchCallback]] = field(default_factory=list)
    #: The backend each watch (by ``id`` of its ``watchers`` item) belongs to:
    #: a disconnected or blackholed one gets no events, as a real watch
    #: (a subscription) does not.
    watcher_owners: dict[int, MemoryBackend] = field(default_factory=dict)


@dataclass
class _MemoryStream:
    subjects: tuple[str, ...]
    max_age: float
    # (stored at on the server's clock, subject, message), oldest first.
    messages: list[tuple[float, str, StreamMessage]] = field(default_factory=list)
    last_seq: int = 0


class MemoryServer:
    """Shared state: buckets, a revision counter and a subject bus.

    Args:
        clock: Clock that drives ``max_age`` expiry.

    """

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        #: Every KV write fails with :class:`BackendError` while reads
        #: succeed, as on a JetStream server out of storage.
        self.storage_full = False
        self.buckets: dict[str, _MemoryBucketState] = {}
        self.revision = 0
        self.subscribers: list[tuple[str, MessageHandler, MemoryBackend]] = []
        self.streams: dict[str, _MemoryStream] = {}
        # Deliveries in flight: the loop only keeps weak references to tasks.
        self.deliveries: set[asyncio.Future[None]] = set()

    def expire(self, bucket: _MemoryBucketState) -> None:
        """Drop entries older than the bucket's ``max_age`` (silently, as 2.9 does)."""
        if not bucket.ttl:
            return  # no max_age: entries never expire
        now = self.clock.monotonic()
        for key, stored in list(bucket.keys.items()):
            if now - stored.stored_at >= bucket.ttl:
                del bucket.keys[key]

    def keep(self, subject: str, data: bytes) -> None:
        """Store a published message in every stream that keeps its subject."""
        now = self.clock.monotonic()
        for stream in self.streams.values():
            if any(_subject_matches(pattern, subject) for pattern in stream.subjects):
                stream.last_seq += 1
                stream.messages.append(
                    (now, subject, StreamMessage(seq=stream.last_seq, data=data))
                )

    def expire_stream(self, stream: _MemoryStream) -> None:
        """Drop messages older than the stream's ``max_age``."""
        now = self.clock.monotonic()
        stream.messages = [kept for kept in stream.messages if now - kept[0] < stream.max_age]


class MemoryBucket:
    """One bucket as seen through one :class:`MemoryBackend`."""

    def __init__(self, backend: MemoryBackend, name: str) -> None:
        self.name = name
        self._backend = backend

    @property
    def description(self) -> str:
        """The bucket's description."""
        state = self._backend.server.buckets.get(self.name)
        return state.description if state is not None else ""

    @property
    def _state(self) -> _MemoryBucketState:
        try:
            return self._backend.server.buckets[self.name]
        except KeyError:
            raise BucketNotFoundError(f"KV bucket {self.name!r} no longer exists") from None

    async def _io(self, timeout: float = 5.0, *, write: bool = False) -> _MemoryBucketState:
        self._backend.require_connected()
        if self._backend.latency:
            if self._backend.latency > timeout:
                # Like a request the server never answered in time: not applied.
                await asyncio.sleep(timeout)
                raise BackendTimeoutError(f"no answer within {timeout:g}s")
            await asyncio.sleep(self._backend.latency)
        hook = self._backend.fail_next
        if hook is not None:
            self._backend.fail_next = None
            raise hook()
        if write and self._backend.server.storage_full:
            raise BackendError("JetStream: insufficient resources (code 10047)")
        state = self._state
        self._backend.server.expire(state)
        return state

    def _store(self, state: _MemoryBucketState, key: str, value: bytes, op: Operation) -> int:
        server = self._backend.server
        server.revision += 1
        entry = KVEntry(key=key, value=value, revision=server.revision, operation=op)
        state.keys[key] = _Stored(entry=entry, stored_at=server.clock.monotonic())
        for item in list(state.watchers):
            pattern, callback = item
            owner = state.watcher_owners.get(id(item))
            if owner is not None and (not owner.connected or owner.blackholed):
                continue
            if fnmatch.fnmatchcase(key, pattern.replace(">", "*")):
                callback(entry)
        return entry.revision

    async def create(self, key: str, value: bytes, *, timeout: float) -> int:
        """Write only if the key holds no value."""
        state = await self._io(timeout, write=True)
        current = state.keys.get(key)
        if current is not None and current.entry.operation is Operation.PUT:
            raise KeyExistsError(f"{key!r} is held at revision {current.entry.revision}")
        return self._store(state, key, value, Operation.PUT)

    async def update(self, key: str, value: bytes, *, last: int, timeout: float) -> int:
        """Write only if the latest revision is ``last``."""
        state = await self._io(timeout, write=True)
        current = state.keys.get(key)
        if current is None or current.entry.revision != last:
            raise RevisionMismatchError(f"{key!r} is not at revision {last}")
        return self._store(state, key, value, Operation.PUT)

    async def put(self, key: str, value: bytes, *, timeout: float) -> int:
        """Write unconditionally."""
        state = await self._io(timeout, write=True)
        return self._store(state, key, value, Operation.PUT)

    async def delete(self, key: str, *, last: int, timeout: float) -> int:
        """Delete only if the latest revision is ``last``."""
        state = await self._io(timeout, write=True)
        current = state.keys.get(key)
        if current is None or current.entry.revision != last:
            raise RevisionMismatchError(f"{key!r} is not at revision {last}")
        return self._store(state, key, b"", Operation.DELETE)

    async def get(self, key: str, *, timeout: float) -> KVEntry | None:
        """Return the latest value or ``None``."""
        state = await self._io(timeout)
        current = state.keys.get(key)
        if current is None or current.entry.operation is not Operation.PUT:
            return None
        return current.entry

    async def latest(self, key: str, *, timeout: float) -> KVEntry | None:
        """Return the latest entry, a delete marker too, or ``None``."""
        state = await self._io(timeout)
        current = state.keys.get(key)
        return current.entry if current is not None else None

    async def watch(self, key: str, callback: WatchCallback) -> _MemorySubscription:
        """Deliver the current entry, then every change."""
        state = await self._io()
        item = (key, callback)
        state.watchers.append(item)
        state.watcher_owners[id(item)] = self._backend
        current = state.keys.get(key)
        if current is not None:
            callback(current.entry)

        def stop() -> None:
            with contextlib.suppress(ValueError, BucketNotFoundError):
                self._state.watchers.remove(item)
            with contextlib.suppress(BucketNotFoundError):
                self._state.watcher_owners.pop(id(item), None)

        return _MemorySubscription(stop)

    async def keys(self, *, timeout: float) -> list[str]:
        """Every key with an entry (a value or a marker), sorted."""
        state = await self._io(timeout)
        return sorted(state.keys)

    async def entries(self, *, timeout: float) -> list[KVEntry]:
        """Return every live value."""
        state = await self._io(timeout)
        return [s.entry for s in state.keys.values() if s.entry.operation is Operation.PUT]

    async def ttl(self, *, timeout: float) -> float:
        """Return the bucket's ``max_age``."""
        return self._state.ttl


class _MemorySubscription:
    def __init__(self, stop: Callable[[], None]) -> None:
        self._stop = stop

    async def unsubscribe(self) -> None:
        self._stop()


class MemoryBackend:
    """One simulated process's connection to a :class:`MemoryServer`.

    Attributes:
        latency: Seconds every KV operation takes.
        fail_next: When set, the next KV operation raises what it returns.
        partition: Messages only reach subscribers of backends with the same
            label: set different labels to split the message bus in two (a
            network partition between servers), equal ones to heal it. KV
            operations are not affected.
        blackholed: The connection looks up (``is_connected`` stays true) but
            every message from or to this backend is silently lost, its own
            echo included: a TCP connection whose packets are dropped.

    """

    def __init__(self, server: MemoryServer) -> None:
        self.server = server
        self.connected = True
        self.latency = 0.0
        self.fail_next: Callable[[], Exception] | None = None
        self.partition = ""
        self.blackholed = False

    @property
    def is_connected(self) -> bool:
        """Whether this simulated connection is up."""
        return self.connected

    def require_connected(self) -> None:
        """Raise :class:`NotConnectedError` while disconnected."""
        if not self.connected:
            raise NotConnectedError("memory backend disconnected")

    async def close(self) -> None:
        """Nothing to close: the simulated connection belongs to the test."""

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
    ) -> MemoryBucket:
        """Open or create a bucket, checking its ``max_age`` (none when ``persistent``)."""
        self.require_connected()
        state = self.server.buckets.get(name)
        if state is None:
            if not create or (ttl is None and not persistent):
                raise BucketNotFoundError(f"KV bucket {name!r} does not exist")
            state = self.server.buckets[name] = _MemoryBucketState(
                ttl=0.0 if persistent or ttl is None else ttl, description=description
            )
        if persistent:
            if state.ttl:
                raise BucketConfigError(
                    f"KV bucket {name!r} has max_age={state.ttl:g}s, but its data must not expire"
                )
            return MemoryBucket(self, name)
        if ttl is not None and abs(state.ttl - ttl) > 0.001:
            raise BucketConfigError(f"KV bucket {name!r} has max_age={state.ttl:g}s, not {ttl:g}s")
        return MemoryBucket(self, name)

    async def bucket_info(self, name: str, *, timeout: float) -> BucketInfo:
        """The bucket's settings (history 1, one replica, memory storage)."""
        self.require_connected()
        state = self.server.buckets.get(name)
        if state is None:
            raise BucketNotFoundError(f"KV bucket {name!r} does not exist")
        self.server.expire(state)
        return BucketInfo(
            name=name,
            ttl=state.ttl,
            history=1,
            replicas=1,
            storage="memory",
            keys=len(state.keys),
            description=state.description,
        )

    async def describe_bucket(self, name: str, description: str, *, timeout: float) -> None:
        """Set the bucket's description."""
        self.require_connected()
        state = self.server.buckets.get(name)
        if state is None:
            raise BucketNotFoundError(f"KV bucket {name!r} does not exist")
        state.description = description

    async def delete_bucket(self, name: str, *, timeout: float) -> bool:
        """Drop the bucket; ``False`` when there was none."""
        self.require_connected()
        return self.server.buckets.pop(name, None) is not None

    async def next_revision(self, name: str, *, timeout: float) -> int:
        """The next revision (one counter for every bucket of the server)."""
        self.require_connected()
        if name not in self.server.buckets:
            raise BucketNotFoundError(f"KV bucket {name!r} does not exist")
        return self.server.revision + 1

    async def raise_next_revision(self, name: str, revision: int, *, timeout: float) -> int:
        """Move the shared counter so the next write gets at least ``revision``."""
        self.require_connected()
        state = self.server.buckets.get(name)
        if state is None:
            raise BucketNotFoundError(f"KV bucket {name!r} does not exist")
        if self.server.revision + 1 < revision:
            # As the server's purge up to a sequence: entries below it go.
            purged = 0
            for key, stored in list(state.keys.items()):
                if stored.entry.revision < revision:
                    del state.keys[key]
                    purged += 1
            self.server.revision = revision - 1
            if purged:
                raise EpochFloorRaceError(name, purged)
        return self.server.revision + 1

    async def subscribe(self, subject: str, handler: MessageHandler) -> _MemorySubscription:
        """Deliver messages on ``subject`` (``*``/``>`` wildcards) to ``handler``."""
        item = (subject, handler, self)
        self.server.subscribers.append(item)

        def stop() -> None:
            with contextlib.suppress(ValueError):
                self.server.subscribers.remove(item)

        return _MemorySubscription(stop)

    def _deliver(self, subject: str, data: bytes, reply: str | None) -> None:
        if self.blackholed:
            return
        for pattern, handler, owner in list(self.server.subscribers):
            if (
                owner.connected
                and not owner.blackholed
                and owner.partition == self.partition
                and _subject_matches(pattern, subject)
            ):
                delivery = asyncio.ensure_future(handler(data, reply))
                self.server.deliveries.add(delivery)
                delivery.add_done_callback(self.server.deliveries.discard)

    async def publish(self, subject: str, data: bytes, reply: str | None = None) -> None:
        """Publish (dropped while disconnected); streams keeping ``subject`` store it."""
        if self.connected:
            if not self.blackholed:
                self.server.keep(subject, data)
            self._deliver(subject, data, reply)

    async def request(self, subject: str, data: bytes, *, timeout: float) -> bytes:
        """Return the first reply."""
        replies = await self.request_many(subject, data, window=timeout, max_replies=1)
        if not replies:
            raise BackendTimeoutError(f"no reply on {subject}")
        return replies[0]

    async def request_many(
        self, subject: str, data: bytes, *, window: float, max_replies: int | None = None
    ) -> list[bytes]:
        """Collect replies for ``window`` seconds."""
        self.require_connected()
        inbox = f"_INBOX.{id(self)}.{self.server.revision}.{asyncio.get_running_loop().time()}"
        replies: list[bytes] = []
        enough = asyncio.Event()

        async def on_reply(payload: bytes, _reply: str | None) -> None:
            replies.append(payload)
            if max_replies is not None and len(replies) >= max_replies:
                enough.set()

        sub = await self.subscribe(inbox, on_reply)
        try:
            self._deliver(subject, data, inbox)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(enough.wait(), window)
        finally:
            await sub.unsubscribe()
        return replies

    async def stream_state(self, name: str, *, timeout: float) -> StreamState | None:
        """The stream ``name``, or ``None`` when it does not exist."""
        self.require_connected()
        stream = self.server.streams.get(name)
        if stream is None:
            return None
        self.server.expire_stream(stream)
        return StreamState(
            subjects=stream.subjects, max_age=stream.max_age, messages=len(stream.messages)
        )

    async def create_stream(
        self,
        name: str,
        *,
        subjects: tuple[str, ...],
        max_age: float,
        replicas: int,
        timeout: float,
    ) -> None:
        """Create a stream keeping what is published on ``subjects`` for ``max_age`` seconds."""
        self.require_connected()
        existing = self.server.streams.get(name)
        if existing is not None:
            if existing.subjects != subjects or existing.max_age != max_age:
                raise BackendError(f"stream {name!r} exists with another configuration")
            return
        self.server.streams[name] = _MemoryStream(subjects=subjects, max_age=max_age)

    async def stream_messages(
        self, name: str, subject: str, *, timeout: float
    ) -> list[StreamMessage] | None:
        """The messages ``name`` keeps on ``subject``, oldest first (``None``: no stream)."""
        self.require_connected()
        stream = self.server.streams.get(name)
        if stream is None:
            return None
        self.server.expire_stream(stream)
        return [message for _, kept, message in stream.messages if _subject_matches(subject, kept)]


def _subject_matches(pattern: str, subject: str) -> bool:
    p_tokens = pattern.split(".")
    s_tokens = subject.split(".")
    for i, token in enumerate(p_tokens):
        if token == ">":
            return len(s_tokens) > i
        if i >= len(s_tokens) or (token != "*" and token != s_tokens[i]):
            return False
    return len(p_tokens) == len(s_tokens)
