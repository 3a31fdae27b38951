"""The JetStream backend: the only module that talks to NATS JetStream.

Every nats-py error is translated here into the package's errors, with
``raise ... from`` so the original stays attached.

Election writes never sit in nats-py's reconnect buffer: a write is refused
with :class:`~celery_nats_leader.core.errors.NotConnectedError` while the
connection is down (a buffered renewal could land long after the leader
stepped down). Connections made by :func:`celery_nats_leader.nats.connection.connect`
also disable the buffer entirely (``pending_size=0``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig, StorageType
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from celery_nats_leader.core.backend import (
    BucketInfo,
    KVEntry,
    MessageHandler,
    Operation,
    StreamMessage,
    StreamState,
    WatchCallback,
)
from celery_nats_leader.core.errors import (
    BackendError,
    BackendTimeoutError,
    BucketConfigError,
    BucketNotFoundError,
    ElectionError,
    EpochFloorRaceError,
    JetStreamUnavailableError,
    KeyExistsError,
    NotConnectedError,
    PermissionDeniedError,
    RevisionMismatchError,
)
from celery_nats_leader.nats.refusals import permission_violation

logger = logging.getLogger(__name__)

T = TypeVar("T")

# JetStream API error codes (nats-server's errors.json).
_STREAM_NOT_FOUND = 10059
_NO_MESSAGE_FOUND = 10037
_WRONG_LAST_SEQUENCE = 10071
_WRONG_LAST_SEQUENCE_CONSTANT = 10164
_KV_OPERATION = "KV-Operation"
_JS_API = "$JS.API"
# nats-server 2.11+ places its own markers (a key expired by max_age, a purge)
# with this header instead of KV-Operation.
_MARKER_REASON = "Nats-Marker-Reason"
_MARKER_OPERATIONS = {
    "MaxAge": Operation.PURGE,
    "Purge": Operation.PURGE,
    "Remove": Operation.DELETE,
}


def kv_operation(headers: Mapping[str, str] | None) -> Operation:
    """What a message of a KV stream records, from its headers."""
    if not headers:
        return Operation.PUT
    op_header = headers.get(_KV_OPERATION)
    if op_header == Operation.DELETE.value:
        return Operation.DELETE
    if op_header == Operation.PURGE.value:
        return Operation.PURGE
    if _MARKER_REASON in headers:
        # A server-placed marker is never a value: an unknown reason counts
        # as a purge rather than as someone's record.
        return _MARKER_OPERATIONS.get(headers[_MARKER_REASON], Operation.PURGE)
    return Operation.PUT


#: First server version with subject delete markers on max_age (and per-message TTLs).
MARKERS_SINCE = (2, 11)
_EXPECTED_LAST_SUBJECT_SEQUENCE = "Nats-Expected-Last-Subject-Sequence"
# Seconds of slack tolerated between the bucket's max_age and the election TTL.
_TTL_TOLERANCE = 0.001
#: 503s that mean JetStream is off (for the server or the account): permanent.
#: Every other 503 ("JetStream system temporarily unavailable" while a cluster
#: elects a leader, insufficient resources, ...) may pass: transient.
_JETSTREAM_NOT_ENABLED = frozenset({10076, 10039})


def _bucket_missing_message(name: str, ttl: float) -> str:
    return (
        f"KV bucket {name!r} does not exist. Create it once with "
        f"`celery -A <app> nats-leader bucket --create` or `manage.py election_bucket --create` "
        f"(both use the configured TTL), or `nats kv add {name} --ttl {ttl:g}s --history 1`; "
        f"or set create_bucket=True (nats_leader_create_bucket in Celery)."
    )


def _persistent_bucket_missing_message(name: str) -> str:
    return (
        f"KV bucket {name!r} does not exist. Create it once with "
        f"`celery -A <app> nats-leader bucket --create --beat-state`, `manage.py "
        f"election_bucket --create --beat-state` or `nats kv add {name} --history 1` (no --ttl: "
        f"its data must not expire), or set create_bucket=True (nats_leader_create_bucket in "
        f"Celery)."
    )


def _jetstream_refusal(exc: Exception) -> ElectionError:
    """Translate "no responders" or a 503 from the JetStream API.

    Nobody answering, or a 503 that says JetStream is not enabled, is a
    server (or account) without JetStream: permanent. Any other 503 (for
    example "temporarily unavailable": a cluster between leaders) is worth
    retrying.
    """
    # nats-py reports a 503 *status* (nobody serves the JetStream API: a
    # server without JetStream) as a ServiceUnavailableError without err_code.
    if (
        isinstance(exc, nats.js.errors.ServiceUnavailableError)
        and exc.err_code is not None
        and exc.err_code not in _JETSTREAM_NOT_ENABLED
    ):
        return BackendError(f"JetStream: {exc}")
    return JetStreamUnavailableError(
        "the NATS server has no JetStream: start nats-server with -js "
        "(or enable jetstream {} in its configuration)"
    )


def _is_permission_refusal(exc: nats.js.errors.APIError) -> bool:
    """Whether a JetStream API error says the account may not do this."""
    return exc.code == 403 or "permission" in str(exc.description or "").lower()


def _bucket_api_error(exc: nats.js.errors.APIError, name: str) -> ElectionError:
    """Translate a JetStream API error answering the opening or creation of a bucket."""
    if isinstance(exc, nats.js.errors.BadBucketError):
        return BucketConfigError(
            f"stream KV_{name} exists but is not a KV bucket ({exc}); use another bucket name"
        )
    if _is_permission_refusal(exc):
        return PermissionDeniedError(f"JetStream refused: {exc}")
    return BackendError(f"JetStream: {exc}")


def _raise_stream_refusal(name: str, answer: dict[str, Any], code: int | None) -> None:
    """Raise what a raw stream API answer about bucket ``name`` refused, if it refused."""
    if code is None:
        return
    error = answer.get("error") or {}
    if code == _STREAM_NOT_FOUND:
        raise BucketNotFoundError(f"KV bucket {name!r} does not exist")
    if code in _JETSTREAM_NOT_ENABLED:
        raise JetStreamUnavailableError(
            "the NATS server has no JetStream: start nats-server with -js "
            "(or enable jetstream {} in its configuration)"
        )
    if error.get("code") == 403 or "permission" in str(error.get("description", "")).lower():
        raise PermissionDeniedError(f"JetStream refused: {error}")
    raise BackendError(f"JetStream: {error}")


def _connection_error(exc: Exception) -> BackendError:
    """Translate a nats-py error that is about the connection, not the request."""
    if isinstance(
        exc, (nats.errors.OutboundBufferLimitError, nats.errors.ConnectionReconnectingError)
    ):
        return NotConnectedError("not connected to NATS")
    if isinstance(exc, (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError)):
        return NotConnectedError("the NATS connection is closed")
    return BackendError(f"NATS: {exc}")


def _retrieve_outcome(request: asyncio.Future[Any]) -> None:
    """Mark a finished request's exception as seen (its caller may be gone)."""
    if not request.cancelled():
        request.exception()


async def _discard_watcher(start: asyncio.Future[KeyValue.KeyWatcher]) -> None:
    """Let a KV watch start that was given up end, then stop its watcher.

    Cancels that come meanwhile are held until then: the start is bounded by
    nats-py's own request timeouts, and a watcher left running would be fed
    by the server for as long as the connection lives.
    """
    cancelled = False
    while not start.done():
        try:
            await asyncio.wait([start])  # cancelling this wait leaves ``start`` alone
        except asyncio.CancelledError:
            cancelled = True
    if not start.cancelled() and start.exception() is None:
        with contextlib.suppress(Exception):
            await start.result().stop()  # type: ignore[no-untyped-call]
    if cancelled:
        raise asyncio.CancelledError


class JetStreamSubscription:
    """A core NATS subscription or a KV watch, behind one ``unsubscribe``."""

    def __init__(self, stop: Callable[[], Awaitable[None]]) -> None:
        self._stop: Callable[[], Awaitable[None]] | None = stop

    async def unsubscribe(self) -> None:
        """Stop delivering; idempotent."""
        stop, self._stop = self._stop, None
        if stop is not None:
            with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
                await stop()


class _StreamBoundJetStream:
    """A JetStream context whose ``subscribe()`` names the KV bucket's stream.

    nats-py 2.14's ``KeyValue.watch()`` subscribes without ``stream=``, so
    nats-py first looks the stream up by subject (``$JS.API.STREAM.NAMES``),
    a request the documented ``worker``/``beat``/``viewer`` users may not
    send: their watch failed with a permissions violation. Newer nats-py
    (2.16) pass the stream themselves; an explicit one is kept.
    """

    def __init__(self, js: JetStreamContext, stream: str) -> None:
        self._js = js
        self._stream = stream

    def __getattr__(self, name: str) -> Any:
        return getattr(self._js, name)

    async def subscribe(self, subject: str, *args: Any, **kwargs: Any) -> Any:
        kwargs["stream"] = kwargs.get("stream") or self._stream
        return await self._js.subscribe(subject, *args, **kwargs)


class JetStreamBucket:
    """A JetStream KV bucket, addressed through its stream ``KV_<name>``."""

    def __init__(self, backend: JetStreamBackend, name: str, kv: KeyValue) -> None:
        self.name = name
        #: The stream's description as :meth:`ttl` last read it.
        self.description = ""
        self._backend = backend
        self._kv = kv
        self._stream = f"KV_{name}"
        self._prefix = f"$KV.{name}."
        # The same bucket, for watches: their consumer names the stream on any
        # nats-py (see _StreamBoundJetStream).
        self._watch_kv = KeyValue(
            name=kv._name,
            stream=kv._stream,
            pre=kv._pre,
            js=_StreamBoundJetStream(backend.js, kv._stream),  # type: ignore[arg-type]
            direct=kv._direct,
        )

    @property
    def _js(self) -> JetStreamContext:
        return self._backend.js

    async def create(self, key: str, value: bytes, *, timeout: float) -> int:
        """Write ``value`` only if ``key`` holds nothing; return the new revision."""
        try:
            return await self._write(key, value, last=0, timeout=timeout)
        except RevisionMismatchError:
            pass
        # Something is stored under the key: a live value, or a delete marker
        # left by a graceful release. Only the latter may be overwritten, and
        # only at exactly that revision, so the create stays atomic.
        current = await self.latest(key, timeout=timeout)
        if current is not None and current.operation is Operation.PUT:
            raise KeyExistsError(f"{key!r} is held at revision {current.revision}")
        last = 0 if current is None else current.revision
        try:
            return await self._write(key, value, last=last, timeout=timeout)
        except RevisionMismatchError as exc:
            raise KeyExistsError(f"{key!r} was taken concurrently") from exc

    async def update(self, key: str, value: bytes, *, last: int, timeout: float) -> int:
        """Write ``value`` only if ``key``'s latest revision is ``last``."""
        return await self._write(key, value, last=last, timeout=timeout)

    async def put(self, key: str, value: bytes, *, timeout: float) -> int:
        """Write ``value`` unconditionally; return the revision."""
        return await self._write(key, value, last=None, timeout=timeout)

    async def delete(self, key: str, *, last: int, timeout: float) -> int:
        """Delete ``key`` only if its latest revision is ``last``; return the delete's revision."""
        headers = {_KV_OPERATION: Operation.DELETE.value}
        return await self._write(key, b"", last=last, timeout=timeout, headers=headers)

    async def _write(
        self,
        key: str,
        value: bytes,
        *,
        last: int | None,
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> int:
        self._backend.require_connected()
        hdrs = dict(headers or {})
        if last is not None:
            hdrs[_EXPECTED_LAST_SUBJECT_SEQUENCE] = str(last)
        ack = await self._backend.call(
            # nats-py bounds the publish request by ``timeout`` itself.
            self._js.publish(self._prefix + key, value, timeout=timeout, headers=hdrs),
            timeout=timeout,
            bucket=self.name,
            bounded=True,
        )
        return int(ack.seq)

    async def get(self, key: str, *, timeout: float) -> KVEntry | None:
        """Return the key's latest value, or ``None`` if absent or deleted."""
        entry = await self.latest(key, timeout=timeout)
        if entry is None or entry.operation is not Operation.PUT:
            return None
        return entry

    async def latest(self, key: str, *, timeout: float) -> KVEntry | None:
        """Return the key's latest entry, a delete or purge marker too."""
        subject = self._prefix + key
        try:
            msg = await self._backend.call(
                self._backend.jetstream_for(timeout).get_msg(
                    self._stream, subject=subject, direct=False
                ),
                timeout=timeout,
                bucket=self.name,
            )
        except _NoMessage:
            return None
        return KVEntry(
            key=key,
            value=msg.data or b"",
            revision=int(msg.seq or 0),
            operation=kv_operation(msg.headers),
        )

    async def watch(self, key: str, callback: WatchCallback) -> JetStreamSubscription:
        """Call ``callback`` with the key's current entry and every later change.

        All watches of one bucket on one connection share a single KV watch
        (one ordered consumer on the whole bucket), dispatched by key: nats-py
        runs background tasks per consumer, and a process holding a thousand
        roles must not pay for a thousand of them.
        """
        shared = await self._backend.shared_watch(self)
        unregister = shared.register(key, callback)
        try:
            # The shared watch may have started long ago: hand over the
            # current entry ourselves, after registering so nothing is missed
            # (the election ignores entries older than one it has seen).
            current = await self.latest(key, timeout=self._backend.js_timeout)
        except BaseException:
            await unregister()
            raise
        if current is not None:
            callback(current)
        return JetStreamSubscription(unregister)

    async def watch_all(self, callback: WatchCallback) -> Callable[[], Awaitable[None]]:
        """Deliver every change of every key to ``callback``; returns the stop function."""
        # nats-py's watch subscribes (and the server makes its consumer)
        # before it asks for the consumer's info, and cleans up after an
        # error there but not after a cancel: a start given up in that await
        # (an election stopped, close() ending a restart, our timeout) left
        # its subscription fed on the connection for as long as that lives,
        # for good on a connection the user owns. So the start runs shielded,
        # and whoever gives up on it waits for its end and stops what it made.
        start = asyncio.ensure_future(self._watch_kv.watchall())
        try:
            watcher = await self._backend.call(
                asyncio.shield(start), timeout=self._backend.js_timeout, bucket=self.name
            )
        except BaseException:
            await _discard_watcher(start)
            raise

        async def pump() -> None:
            async for update in watcher:
                if update is None:  # "no more history" marker
                    continue
                op = Operation.PUT
                if update.operation == Operation.DELETE.value:
                    op = Operation.DELETE
                elif update.operation == Operation.PURGE.value:
                    op = Operation.PURGE
                callback(
                    KVEntry(
                        key=update.key,
                        value=update.value or b"",
                        revision=int(update.revision or 0),
                        operation=op,
                    )
                )

        task = asyncio.get_running_loop().create_task(pump(), name=f"kv-watch-{self.name}")

        async def stop() -> None:
            with contextlib.suppress(Exception):
                await watcher.stop()  # type: ignore[no-untyped-call]
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        return stop

    async def keys(self, *, timeout: float) -> list[str]:
        """Every key with an entry (a value or a marker), as the stream's leader knows them."""
        info = await self._backend.call(
            self._backend.jetstream_for(timeout).stream_info(
                self._stream, subjects_filter=self._prefix + ">"
            ),
            timeout=timeout,
            bucket=self.name,
        )
        return sorted(subject[len(self._prefix) :] for subject in info.state.subjects or {})

    async def entries(self, *, timeout: float) -> list[KVEntry]:
        """Return the latest value of every key that holds one."""

        async def collect() -> list[KVEntry]:
            watcher = await self._watch_kv.watchall()
            found: list[KVEntry] = []
            try:
                async for update in watcher:
                    if update is None:
                        # nats-py sends its "nothing (more) to deliver" marker
                        # when the consumer reports nothing pending and no
                        # message was parsed yet. Under load the server may have
                        # sent every message already while none was parsed: the
                        # marker then comes first and a full bucket would look
                        # empty (a status page showing "no leader"). Only the
                        # server's delivered count tells the two apart.
                        if await self._nothing_delivered(watcher):
                            break
                        continue  # the messages are on their way; the last has delta 0
                    if update.operation is None:
                        found.append(
                            KVEntry(
                                key=update.key,
                                value=update.value or b"",
                                revision=int(update.revision or 0),
                            )
                        )
                    if update.delta == 0:
                        break
            finally:
                with contextlib.suppress(Exception):
                    await watcher.stop()  # type: ignore[no-untyped-call]
            return found

        return await self._backend.call(collect(), timeout=timeout, bucket=self.name)

    @staticmethod
    async def _nothing_delivered(watcher: KeyValue.KeyWatcher) -> bool:
        """Whether the server delivered no message at all to ``watcher`` (an empty bucket)."""
        subscription = watcher._sub
        if subscription is None:
            return True
        info = await subscription.consumer_info()
        return not info.num_pending and not info.delivered.consumer_seq

    async def ttl(self, *, timeout: float) -> float:
        """Return the bucket's ``max_age`` in seconds (and note its description)."""
        status = await self._backend.call(self._kv.status(), timeout=timeout, bucket=self.name)
        config = getattr(getattr(status, "stream_info", None), "config", None)
        self.description = str(getattr(config, "description", None) or "")
        return float(status.ttl or 0.0)


#: Seconds a replicated bucket's create may wait for its answer, at least.
#: The server answers once the new stream's servers have elected its leader,
#: a RAFT election of seconds that a loaded cluster has taken more than 5 s
#: for (2.9.10, three members on two busy cores). JetStream has answered
#: that the bucket is missing by then, so only that election is waited for.
REPLICATED_CREATE_SECONDS = 30.0

#: Seconds between attempts to restart a watch after a reconnect (doubling, capped).
_REWATCH_FIRST_DELAY = 0.05
_REWATCH_MAX_DELAY = 1.0


class _SharedWatch:
    """One KV watch of a whole bucket, fanned out to per-key callbacks."""

    def __init__(self, bucket: JetStreamBucket, on_empty: Callable[[], Awaitable[None]]) -> None:
        self.bucket = bucket
        self.callbacks: dict[str, list[WatchCallback]] = {}
        self.stop: Callable[[], Awaitable[None]] | None = None
        self.ready = asyncio.Event()
        self._on_empty = on_empty

    def dispatch(self, entry: KVEntry) -> None:
        for callback in list(self.callbacks.get(entry.key, ())):
            try:
                callback(entry)
            except Exception:
                logger.exception("watch callback for %r failed", entry.key)

    def register(self, key: str, callback: WatchCallback) -> Callable[[], Awaitable[None]]:
        self.callbacks.setdefault(key, []).append(callback)

        async def unregister() -> None:
            callbacks = self.callbacks.get(key, [])
            with contextlib.suppress(ValueError):
                callbacks.remove(callback)
            if not callbacks:
                self.callbacks.pop(key, None)
            if not self.callbacks:
                await self._on_empty()

        return unregister


class _NoMessage(Exception):
    """Internal: a direct get found no message for the subject."""


class JetStreamBackend:
    """The election backend on a nats-py connection.

    Usually obtained from :func:`celery_nats_leader.nats.open_backend`, which
    connects first and hands the connection over. Usable as an async context
    manager that closes it.

    Args:
        nc: A connected nats-py client.
        js_timeout: Default timeout for JetStream API calls, seconds.
        owns_connection: Whether :meth:`close` closes ``nc`` (a connection
            shared with other code is left open).

    """

    def __init__(
        self, nc: Client, *, js_timeout: float = 5.0, owns_connection: bool = False
    ) -> None:
        self.nc = nc
        self.js_timeout = js_timeout
        self.js = nc.jetstream(timeout=js_timeout)
        self.owns_connection = owns_connection
        self._watches: dict[str, _SharedWatch] = {}
        #: Per bucket: the task restarting its watch, and whether a reconnect
        #: came during that task's pass (it then makes one more).
        self._rewatch_tasks: dict[str, asyncio.Task[None]] = {}
        self._rewatch_pending: set[str] = set()

    def jetstream_for(self, timeout: float) -> JetStreamContext:
        """The JetStream context for a call allowed ``timeout`` seconds.

        nats-py bounds each API request by its context's own timeout: a call
        allowed longer (``bucket --create --timeout 30``, for a replicated
        bucket answered only once its servers elected the stream's leader)
        would otherwise end at ``js_timeout``.
        """
        return self.js if timeout <= self.js_timeout else self.nc.jetstream(timeout=timeout)

    def reconnected(self) -> None:
        """The connection is back: restart every shared watch.

        nats-py subscribes a watch's inbox again after a reconnect, but a
        nats-server that restarted no longer has the consumer that fed it: the
        watch stays silent for good (seen on 2.9.10 and 2.15.1), and followers
        learned of a release only at their next periodic read, a whole
        ``resync_interval`` late, instead of in milliseconds. A new watch
        delivers each key's latest entry first, so a change made while the
        connection was down is reported at once too. Called on the loop by
        :func:`~celery_nats_leader.nats.open_backend`'s connection.
        """
        # One task per bucket restarts its watch: a bucket whose watch cannot
        # start again (deleted, or its permission revoked) retries for as long
        # as the connection is up, and must hold back neither the other
        # buckets' restart nor their restart after the next reconnect. A
        # reconnect during a bucket's pass asks for another pass instead of
        # cancelling it: a cancel that lands inside watch_all() would leave
        # the watch being created running, owned by nobody, and every entry
        # would then be dispatched twice.
        loop = asyncio.get_running_loop()
        for name in self._watches:
            self._rewatch_pending.add(name)
            task = self._rewatch_tasks.get(name)
            if task is None or task.done():
                self._rewatch_tasks[name] = loop.create_task(
                    self._rewatch_passes(name), name=f"kv-rewatch-{name}"
                )

    async def _rewatch_passes(self, name: str) -> None:
        while name in self._rewatch_pending:
            self._rewatch_pending.discard(name)
            shared = self._watches.get(name)
            if shared is None:  # its last watcher left
                return
            try:
                await self._rewatch(name, shared)
            except Exception as exc:  # e.g. stopping the replaced watch failed
                logger.warning("after a reconnect, the watch of %r: %s", name, exc)

    async def _rewatch(self, name: str, shared: _SharedWatch) -> None:
        # A watch whose first start is still under way is restarted only
        # once that start has ended: replacing it now would leave the start's
        # watch running beside ours (and, if the start failed, ours unowned).
        await shared.ready.wait()
        delay = _REWATCH_FIRST_DELAY
        while self._watches.get(name) is shared and self.nc.is_connected:
            try:
                stop = await shared.bucket.watch_all(shared.dispatch)
            except Exception as exc:  # never let this task die: retry
                # JetStream may take a moment to serve again after a
                # restart; meanwhile the periodic reads stand in.
                logger.debug("could not restart the watch of %r yet: %s", name, exc)
                await asyncio.sleep(delay)
                delay = min(2 * delay, _REWATCH_MAX_DELAY)
                continue
            if self._watches.get(name) is not shared:
                await stop()  # its last watcher left meanwhile
                return
            old, shared.stop = shared.stop, stop
            logger.debug("restarted the watch of %r after a reconnect", name)
            if old is not None:
                await old()
            return

    async def close(self) -> None:
        """Close the connection if this backend owns it; idempotent, never raises."""
        tasks = list(self._rewatch_tasks.values())
        self._rewatch_tasks.clear()
        self._rewatch_pending.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            # Waited for, so that no restart is still running (or logging)
            # once close() returns; asyncio.wait() raises neither a task's
            # cancellation nor its error, and a cancel of close() itself passes.
            await asyncio.wait(tasks)
        if not self.owns_connection or self.nc.is_closed:
            return
        # close() flushes to the socket and can raise when the server is
        # already gone; the connection is closed either way.
        try:
            await self.nc.close()
        except Exception as exc:  # closing must not fail a shutdown
            logger.debug("closing the NATS connection: %s", exc)

    async def __aenter__(self) -> JetStreamBackend:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def _stop_shared_watch(self, name: str, shared: _SharedWatch) -> None:
        if self._watches.get(name) is shared and shared.stop is not None:
            del self._watches[name]
            await shared.stop()

    async def shared_watch(self, bucket: JetStreamBucket) -> _SharedWatch:
        """The bucket's shared watch on this connection.

        Started by the first watch of the bucket, stopped when the last one
        leaves (so nothing outlives the elections that used it).
        """
        shared = self._watches.get(bucket.name)
        if shared is None:
            new = _SharedWatch(bucket, lambda: self._stop_shared_watch(bucket.name, new))
            shared = self._watches[bucket.name] = new
            try:
                shared.stop = await bucket.watch_all(shared.dispatch)
            except BaseException:
                del self._watches[bucket.name]
                shared.ready.set()
                raise
            shared.ready.set()
        else:
            await shared.ready.wait()
            if bucket.name not in self._watches:  # its start failed
                return await self.shared_watch(bucket)
        return shared

    @property
    def is_connected(self) -> bool:
        """Whether the connection is up right now."""
        return bool(self.nc.is_connected)

    def require_connected(self) -> None:
        """Refuse to hand a write to nats-py while the connection is down.

        Raises:
            NotConnectedError: The connection is not up.

        """
        if not self.nc.is_connected:
            raise NotConnectedError("not connected to NATS; write not sent")

    async def call(
        self, awaitable: Awaitable[T], *, timeout: float, bucket: str, bounded: bool = False
    ) -> T:
        """Await a nats-py call under ``timeout``, translating its errors.

        Args:
            awaitable: The nats-py coroutine.
            timeout: Seconds before the outcome is declared unknown.
            bucket: Bucket name, for error messages.
            bounded: The call enforces ``timeout`` itself (a request given
                that timeout): awaited directly, without the task and timer
                an outer ``wait_for`` costs on every renewal.

        Returns:
            The call's result.

        """
        started = time.monotonic()
        try:
            if bounded:
                return await awaitable
            request = asyncio.ensure_future(awaitable)
            # If our caller is cancelled (stop()) just as the answer arrives, the
            # request can finish with an error nobody reads, and asyncio logs
            # "Task exception was never retrieved" at garbage collection.
            request.add_done_callback(_retrieve_outcome)
            return await asyncio.wait_for(request, timeout)
        except nats.js.errors.KeyWrongLastSequenceError as exc:
            raise RevisionMismatchError(str(exc)) from exc
        except nats.js.errors.NotFoundError as exc:
            if exc.err_code == _NO_MESSAGE_FOUND or isinstance(
                exc, nats.js.errors.KeyNotFoundError
            ):
                raise _NoMessage from exc
            if exc.err_code == _STREAM_NOT_FOUND or isinstance(
                exc, nats.js.errors.BucketNotFoundError
            ):
                raise BucketNotFoundError(
                    f"KV bucket {bucket!r} no longer exists (deleted while in use?)"
                ) from exc
            raise BackendError(f"JetStream: {exc}") from exc
        except nats.js.errors.APIError as exc:
            if exc.err_code in (_WRONG_LAST_SEQUENCE, _WRONG_LAST_SEQUENCE_CONSTANT):
                raise RevisionMismatchError(str(exc.description)) from exc
            if _is_permission_refusal(exc):
                raise PermissionDeniedError(f"JetStream refused: {exc}") from exc
            raise BackendError(f"JetStream: {exc}") from exc
        except nats.js.errors.NoStreamResponseError as exc:
            # Nobody serves the bucket's subjects: the bucket is gone, unless
            # the stream is merely between leaders in a cluster. Ask.
            # Within what is left of the call's own timeout: between stream
            # leaders, the stream API answers no sooner than the new leader
            # (up to js_timeout), and the caller would wait past its bound.
            remaining = max(0.05, timeout - (time.monotonic() - started))
            if await self._stream_missing(bucket, remaining):
                raise BucketNotFoundError(
                    f"KV bucket {bucket!r} no longer exists (deleted while in use?)"
                ) from exc
            raise BackendError(f"no response from bucket {bucket!r}") from exc
        except (asyncio.TimeoutError, nats.errors.TimeoutError) as exc:
            self._raise_if_refused(started, f"bucket {bucket!r}")
            raise BackendTimeoutError(f"no answer within {timeout:g}s") from exc
        except nats.errors.NoRespondersError as exc:
            raise BackendError("no responders") from exc
        except nats.errors.Error as exc:
            raise _connection_error(exc) from exc

    async def _stream_missing(self, bucket: str, timeout: float) -> bool:
        try:
            await asyncio.wait_for(
                self.js.stream_info(f"KV_{bucket}"), min(timeout, self.js_timeout)
            )
        except nats.js.errors.NotFoundError as exc:
            return exc.err_code == _STREAM_NOT_FOUND
        except (nats.errors.Error, asyncio.TimeoutError):
            return False
        return False

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
    ) -> JetStreamBucket:
        """Open (and optionally create) a bucket, checking its ``max_age``.

        With ``persistent`` the bucket holds data that must not expire: it is
        created without ``max_age`` and refused if it has one.
        """
        timeout = max(timeout, self.js_timeout)
        started = time.monotonic()
        try:
            kv = await asyncio.wait_for(self.jetstream_for(timeout).key_value(name), timeout)
        except nats.js.errors.BucketNotFoundError as exc:
            if persistent:
                if not create:
                    raise BucketNotFoundError(_persistent_bucket_missing_message(name)) from exc
            elif not create or ttl is None:
                raise BucketNotFoundError(_bucket_missing_message(name, ttl or 10.0)) from exc
            kv = await self._create_bucket(
                name,
                ttl=None if persistent else ttl,
                replicas=replicas,
                timeout=timeout,
                description=description,
            )
        except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError) as exc:
            raise _jetstream_refusal(exc) from exc
        except (asyncio.TimeoutError, nats.errors.TimeoutError) as exc:
            self._raise_if_refused(started, f"opening KV bucket {name!r}")
            raise BackendTimeoutError(f"opening KV bucket {name!r} timed out") from exc
        except nats.js.errors.APIError as exc:
            raise _bucket_api_error(exc, name) from exc
        except nats.errors.Error as exc:
            raise _connection_error(exc) from exc
        bucket = JetStreamBucket(self, name, kv)
        if persistent:
            max_age = await bucket.ttl(timeout=timeout)
            if max_age > 0:
                raise BucketConfigError(
                    f"KV bucket {name!r} has max_age={max_age:g}s, but its data must not expire. "
                    f"Recreate it without a TTL (`nats kv add {name} --history 1`) or use "
                    f"another bucket."
                )
            return bucket
        if ttl is None:
            return bucket
        actual = await bucket.ttl(timeout=timeout)
        if abs(actual - ttl) > _TTL_TOLERANCE:
            raise BucketConfigError(
                f"KV bucket {name!r} has max_age={actual:g}s but the election ttl is {ttl:g}s. "
                f"They must be equal: set ttl={actual:g}, or recreate the bucket with "
                f"--ttl {ttl:g}s (or use another bucket)."
            )
        return bucket

    def server_version(self) -> tuple[int, int]:
        """``(major, minor)`` of the server this connection is on (``(0, 0)``: unknown)."""
        version = self.nc.connected_server_version
        try:
            return version.major, version.minor
        except (AttributeError, ValueError, TypeError):
            return 0, 0

    def expiry_markers_available(self) -> bool:
        """Whether a bucket created now can have the server mark max_age expiry.

        Needs nats-server 2.11+ and a nats-py that knows the setting (2.11+ as
        well); neither is required, both are used when present.
        """
        return self.server_version() >= MARKERS_SINCE and hasattr(
            KeyValueConfig, "limit_marker_ttl"
        )

    async def _create_bucket(
        self, name: str, *, ttl: float | None, replicas: int, timeout: float, description: str
    ) -> Any:
        options: dict[str, Any] = {}
        if ttl and self.expiry_markers_available():
            # Watchers (followers, operators' tools) then see an expiry as a
            # purge instead of the key silently vanishing; the marker itself
            # is kept one TTL.
            options["limit_marker_ttl"] = ttl
        if description:
            options["description"] = description
        config = KeyValueConfig(
            bucket=name, history=1, ttl=ttl, replicas=replicas, storage=StorageType.FILE, **options
        )
        logger.debug(
            "creating KV bucket %s on nats-server %s (expiry markers: %s)",
            name,
            ".".join(map(str, self.server_version())),
            "limit_marker_ttl" in options,
        )
        # Called from open_bucket's handler of a missing bucket: the errors
        # are translated here, the handlers beside that one do not see them.
        if replicas > 1:
            timeout = max(timeout, REPLICATED_CREATE_SECONDS)
        js = self.jetstream_for(timeout)
        started = time.monotonic()
        try:
            try:
                return await asyncio.wait_for(js.create_key_value(config), timeout)
            except nats.js.errors.BadRequestError:
                # Another candidate created it first (or its settings differ,
                # which the max_age check that follows reports).
                return await asyncio.wait_for(js.key_value(name), timeout)
        except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError) as exc:
            raise _jetstream_refusal(exc) from exc
        except (asyncio.TimeoutError, nats.errors.TimeoutError) as exc:
            # A user who may not create streams sees a timeout: say why.
            self._raise_if_refused(started, f"creating KV bucket {name!r}")
            replicated = (
                f": a bucket of {replicas} replicas is answered once its servers have elected "
                "its stream's leader, so it may still be created; run again"
                if replicas > 1
                else ""
            )
            raise BackendTimeoutError(
                f"creating KV bucket {name!r} timed out after {timeout:g}s{replicated}"
            ) from exc
        except nats.js.errors.APIError as exc:
            raise _bucket_api_error(exc, name) from exc
        except nats.errors.Error as exc:
            raise _connection_error(exc) from exc

    async def bucket_info(self, name: str, *, timeout: float) -> BucketInfo:
        """Read a bucket's settings from its stream (``KV_<name>``).

        Raises:
            BucketNotFoundError: The bucket does not exist.
            JetStreamUnavailableError: The server has no JetStream.
            BackendError: Any other failure.

        """
        async with self._stream_api(name, timeout):
            info = await asyncio.wait_for(
                self.jetstream_for(timeout).stream_info(f"KV_{name}"), timeout
            )
        config, state = info.config, info.state
        # nats-py leaves the storage type as the server's string in replies.
        storage = getattr(config.storage, "value", config.storage) or "file"
        return BucketInfo(
            name=name,
            ttl=float(config.max_age or 0.0),
            history=int(config.max_msgs_per_subject or 0),
            replicas=int(config.num_replicas or 1),
            storage=str(storage),
            keys=int(state.messages or 0),
            description=str(config.description or ""),
        )

    async def describe_bucket(self, name: str, description: str, *, timeout: float) -> None:
        """Set the bucket's stream description (an in-place stream update).

        The update sends the server's own configuration back with only the
        description changed. Through nats-py's ``StreamConfig``, ``max_age``
        and ``duplicate_window`` pass through float seconds (1.000000007 s
        comes back 1 ns shorter), and fields the installed nats-py does not
        model are dropped (nats-py 2.14 has no ``subject_delete_marker_ttl``,
        which nats-server 2.11+ sets on buckets with expiry markers): the
        update would have changed the bucket's TTL or settings.

        Raises:
            BucketNotFoundError: The bucket does not exist.
            PermissionDeniedError: The account may not read or update the stream.
            JetStreamUnavailableError: The server has no JetStream.
            BackendError: Any other failure.

        """
        stream = f"KV_{name}"
        answer, code = await self._stream_request(f"{_JS_API}.STREAM.INFO.{stream}", {}, timeout)
        _raise_stream_refusal(name, answer, code)
        config = answer.get("config")
        if not isinstance(config, dict):
            raise BackendError(f"JetStream: no configuration in the stream info of {stream}")
        if description:
            config["description"] = description
        else:
            config.pop("description", None)
        answer, code = await self._stream_request(
            f"{_JS_API}.STREAM.UPDATE.{stream}", config, timeout
        )
        _raise_stream_refusal(name, answer, code)

    async def delete_bucket(self, name: str, *, timeout: float) -> bool:
        """Delete a bucket's stream; ``False`` when there was none.

        Raises:
            JetStreamUnavailableError: The server has no JetStream.
            BackendError: Any other failure.

        """
        try:
            async with self._stream_api(name, timeout):
                await asyncio.wait_for(
                    self.jetstream_for(timeout).delete_stream(f"KV_{name}"), timeout
                )
        except BucketNotFoundError:
            return False
        return True

    async def next_revision(self, name: str, *, timeout: float) -> int:
        """The revision the bucket's next write gets (its stream's last sequence + 1).

        The stream keeps its last sequence after ``max_age`` removed every
        message, and across server restarts.

        Raises:
            BucketNotFoundError: The bucket does not exist.
            JetStreamUnavailableError: The server has no JetStream.

        """
        async with self._stream_api(name, timeout):
            info = await asyncio.wait_for(
                self.jetstream_for(timeout).stream_info(f"KV_{name}"), timeout
            )
        state = info.state
        return max(int(state.last_seq or 0) + 1, int(state.first_seq or 0), 1)

    async def raise_next_revision(self, name: str, revision: int, *, timeout: float) -> int:
        """Make the bucket's next write get at least ``revision``; return its next revision.

        A stream purge up to sequence ``revision`` (``{"seq": revision}``):
        when that is past the stream's last sequence, nats-server compacts
        the stream so that its first sequence, and so the next write's
        revision, is ``revision`` (checked on 2.9.10 and 2.15.1, and across a
        restart). The purge removes every entry below ``revision``: callers
        only do this on a bucket that holds no entry.

        Raises:
            BucketNotFoundError: The bucket does not exist.
            JetStreamUnavailableError: The server has no JetStream.
            BackendError: The server refused the purge.

        """
        if await self.next_revision(name, timeout=timeout) >= revision:
            return await self.next_revision(name, timeout=timeout)
        async with self._stream_api(name, timeout):
            # nats-py's purge_stream takes no sequence: the API request directly.
            reply = await self.nc.request(
                f"{_JS_API}.STREAM.PURGE.KV_{name}",
                json.dumps({"seq": revision}).encode(),
                timeout=timeout,
            )
        body = json.loads(reply.data or b"{}")
        error = body.get("error")
        if error:
            if error.get("err_code") == _STREAM_NOT_FOUND:
                raise BucketNotFoundError(f"KV bucket {name!r} does not exist")
            raise BackendError(f"JetStream refused the purge of {name!r}: {error}")
        purged = int(body.get("purged", 0))
        if purged:
            raise EpochFloorRaceError(name, purged)
        return await self.next_revision(name, timeout=timeout)

    @contextlib.asynccontextmanager
    async def _stream_api(self, name: str, timeout: float) -> AsyncIterator[None]:
        """Translate the errors of a JetStream stream API call about bucket ``name``."""
        started = time.monotonic()
        try:
            yield
        except nats.js.errors.NotFoundError as exc:
            if exc.err_code == _STREAM_NOT_FOUND:
                raise BucketNotFoundError(f"KV bucket {name!r} does not exist") from exc
            raise BackendError(f"JetStream: {exc}") from exc
        except nats.js.errors.ServiceUnavailableError as exc:
            raise _jetstream_refusal(exc) from exc
        except (
            asyncio.TimeoutError,
            nats.errors.TimeoutError,
            nats.errors.NoRespondersError,
        ) as exc:
            # A user who may not call this API sees a timeout: say why.
            self._raise_if_refused(started, f"the stream API of KV bucket {name!r}")
            raise JetStreamUnavailableError(
                f"JetStream did not answer within {timeout:g}s ({type(exc).__name__}): start "
                "nats-server with -js (or enable jetstream {} in its configuration); in a "
                "cluster, the bucket's stream may have no leader yet (try again)"
            ) from exc
        except nats.js.errors.APIError as exc:
            if _is_permission_refusal(exc):
                raise PermissionDeniedError(f"JetStream refused: {exc}") from exc
            raise BackendError(f"JetStream: {exc}") from exc
        except nats.errors.Error as exc:
            raise _connection_error(exc) from exc

    async def subscribe(self, subject: str, handler: MessageHandler) -> JetStreamSubscription:
        """Deliver messages on ``subject`` to ``handler``."""

        async def on_message(msg: Msg) -> None:
            try:
                await handler(msg.data, msg.reply or None)
            except Exception:
                logger.exception("handler for %s failed", subject)

        started = time.monotonic()
        sub = await self.nc.subscribe(subject, cb=on_message)
        # A refused subscription is only reported asynchronously: a round trip
        # makes sure the refusal, if any, has arrived.
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
            await self.nc.flush(timeout=max(1, int(self.js_timeout)))
        self._raise_if_refused(started, f"subscription to {subject}")
        return JetStreamSubscription(sub.unsubscribe)

    def _raise_if_refused(self, since: float, what: str) -> None:
        """Raise :class:`PermissionDeniedError` if the server refused something since ``since``."""
        refusal = permission_violation(self.nc, since)
        if refusal is not None:
            raise PermissionDeniedError(
                f"NATS refused {what}: {refusal}. Grant this user the permission "
                "(see the permission sets in docs/operating.md)"
            )

    async def publish(self, subject: str, data: bytes, reply: str | None = None) -> None:
        """Publish one message; dropped while disconnected."""
        if not self.nc.is_connected:
            return
        with contextlib.suppress(nats.errors.Error):
            await self.nc.publish(subject, data, reply=reply or "")

    async def request(self, subject: str, data: bytes, *, timeout: float) -> bytes:
        """Send a request and return the first reply."""
        self.require_connected()
        started = time.monotonic()
        try:
            msg = await self.nc.request(subject, data, timeout=timeout)
        except (nats.errors.TimeoutError, asyncio.TimeoutError) as exc:
            self._raise_if_refused(started, f"a request on {subject}")
            raise BackendTimeoutError(f"no reply on {subject} within {timeout:g}s") from exc
        except nats.errors.NoRespondersError as exc:
            raise BackendTimeoutError(f"nobody answers on {subject}") from exc
        except nats.errors.Error as exc:
            raise BackendError(f"NATS: {exc}") from exc
        return bytes(msg.data)

    async def request_many(
        self, subject: str, data: bytes, *, window: float, max_replies: int | None = None
    ) -> list[bytes]:
        """Send a request and collect every reply that arrives within ``window``."""
        self.require_connected()
        inbox = self.nc.new_inbox()
        replies: list[bytes] = []
        enough = asyncio.Event()

        async def on_reply(msg: Msg) -> None:
            replies.append(bytes(msg.data))
            if max_replies is not None and len(replies) >= max_replies:
                enough.set()

        sub = await self.nc.subscribe(inbox, cb=on_reply)
        try:
            await self.nc.publish(subject, data, reply=inbox)
            await self.nc.flush(timeout=max(1, round(window)))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(enough.wait(), window)
        except nats.errors.Error as exc:
            raise BackendError(f"NATS: {exc}") from exc
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        return list(replies)

    async def _stream_request(
        self, subject: str, body: dict[str, Any], timeout: float
    ) -> tuple[dict[str, Any], int | None]:
        """Send one JetStream API request; return its answer and its error code, if any.

        nats-py has no call for a stream message by subject from a sequence
        (``next_by_subj``), so the stream methods speak the API's JSON directly.
        """
        try:
            reply = await self.request(subject, json.dumps(body).encode(), timeout=timeout)
        except BackendTimeoutError as exc:
            raise JetStreamUnavailableError(f"JetStream did not answer ({exc})") from exc
        try:
            answer = json.loads(reply)
        except ValueError as exc:
            raise BackendError(f"unreadable JetStream answer: {reply[:100]!r}") from exc
        if not isinstance(answer, dict):
            raise BackendError(f"unreadable JetStream answer: {reply[:100]!r}")
        error = answer.get("error")
        code = (
            int(error.get("err_code") or error.get("code") or 0)
            if isinstance(error, dict)
            else None
        )
        return answer, code

    async def stream_state(self, name: str, *, timeout: float) -> StreamState | None:
        """The stream ``name``, or ``None`` when it does not exist."""
        answer, code = await self._stream_request(f"{_JS_API}.STREAM.INFO.{name}", {}, timeout)
        if code == _STREAM_NOT_FOUND:
            return None
        if code is not None:
            raise BackendError(f"JetStream: {answer['error']}")
        config = answer.get("config") or {}
        state = answer.get("state") or {}
        return StreamState(
            subjects=tuple(config.get("subjects") or ()),
            max_age=int(config.get("max_age") or 0) / 1e9,
            messages=int(state.get("messages") or 0),
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
        """Create a file stream keeping messages on ``subjects`` for ``max_age`` seconds."""
        config = {
            "name": name,
            "subjects": list(subjects),
            "retention": "limits",
            "max_age": int(max_age * 1e9),
            "storage": "file",
            "num_replicas": replicas,
            "discard": "old",
        }
        answer, code = await self._stream_request(
            f"{_JS_API}.STREAM.CREATE.{name}", config, timeout
        )
        if code is not None:
            raise BackendError(f"JetStream: {answer['error']}")

    async def stream_messages(
        self, name: str, subject: str, *, timeout: float
    ) -> list[StreamMessage] | None:
        """The messages ``name`` keeps on ``subject``, oldest first (``None``: no stream)."""
        found: list[StreamMessage] = []
        seq = 1
        while True:
            answer, code = await self._stream_request(
                f"{_JS_API}.STREAM.MSG.GET.{name}",
                {"seq": seq, "next_by_subj": subject},
                timeout,
            )
            if code == _STREAM_NOT_FOUND:
                return None
            if code == _NO_MESSAGE_FOUND:
                return found
            if code is not None:
                raise BackendError(f"JetStream: {answer['error']}")
            message = answer.get("message") or {}
            stream_seq = int(message.get("seq") or 0)
            found.append(
                StreamMessage(
                    seq=stream_seq,
                    data=base64.b64decode(message.get("data") or ""),
                    time=message.get("time"),
                )
            )
            if stream_seq < seq:  # pragma: no cover - a server that ignores next_by_subj
                return found
            seq = stream_seq + 1
