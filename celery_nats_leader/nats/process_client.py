"""The synchronous NATS client of a process: one loop thread, one connection.

Synchronous code outside the election needs NATS too: a prefork child
validating a token for ``@leader_only(validate=True)`` and reading the beat
term for :class:`~celery_nats_leader.beat.dispatch_fence.FencedBeatTask`, the
once-guard claiming a task id, any :class:`~celery_nats_leader.term.TermReader`.
They all go through :class:`ProcessClient`: per process and per connection
settings, one daemon event-loop thread and one NATS connection (opened at
first use through :func:`~celery_nats_leader.nats.open_backend`, the one
door to NATS), reused for the process's life and closed at exit.

Fork-safe: a thread does not survive ``fork()``, so a child never uses its
parent's client; the first use in the child builds the child's own (the
registry is emptied in the child at fork, and keyed by pid besides).

A worker's main process runs an :class:`~celery_nats_leader.election.elector.Elector`
too, with a connection of its own, and keeps the two apart on purpose: a warm
shutdown closes the election's connection first (a successor takes over in
milliseconds) while the tasks still running must renew and record their
once-guard claims and read terms until they end. A prefork child has no
elector: one connection.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import socket
import threading
from collections.abc import Callable, Coroutine, Hashable
from typing import TYPE_CHECKING, Any, TypeVar

from celery_nats_leader.core.errors import BackendTimeoutError
from celery_nats_leader.core.loop_thread import EventLoopThread

if TYPE_CHECKING:
    from concurrent.futures import Future

    from celery_nats_leader.config.connection import ConnectOptions
    from celery_nats_leader.config.settings import LeaderSettings
    from celery_nats_leader.core.backend import Backend, Bucket, KVEntry

__all__ = ["ProcessClient", "connection_key"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _frozen(value: Any) -> Hashable:
    """A hashable, equal-for-equal form of a connect option's value."""
    if isinstance(value, dict):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value  # type: ignore[no-any-return]


def connection_key(connection: ConnectOptions) -> Hashable:
    """What makes two connection settings the same connection (servers and options)."""
    options = tuple(sorted((str(k), _frozen(v)) for k, v in connection.options.items()))
    return (connection.servers, options)


class ProcessClient:
    """This process's synchronous NATS client for one set of connection settings.

    Get it with :meth:`for_settings` or :meth:`for_connection`, never build
    it: every caller in the process then shares its loop thread and its
    connection. Safe to use from several threads.

    Attributes:
        connection: Where and how it connects.
        pid: The process it belongs to.
        name: Its connection's name in the server's monitoring (``connz``):
            ``celery-nats-leader client HOST:PID``.

    """

    _clients: dict[tuple[int, Hashable], ProcessClient] = {}  # noqa: RUF012
    _clients_lock = threading.Lock()

    def __init__(self, connection: ConnectOptions) -> None:
        self.connection = connection
        self.pid = os.getpid()
        self.name = f"celery-nats-leader client {socket.gethostname()}:{self.pid}"
        self._loop = EventLoopThread(name="nats-leader-client")
        self._start_lock = threading.Lock()
        self._closed = False
        self._backend: Backend | None = None
        self._buckets: dict[tuple[Any, ...], Bucket] = {}
        self._opening: asyncio.Lock | None = None
        self._bucket_opening: asyncio.Lock | None = None
        self._objects: dict[Hashable, Any] = {}
        self._objects_lock = threading.Lock()

    # ------------------------------------------------------------ registry

    @classmethod
    def for_connection(cls, connection: ConnectOptions) -> ProcessClient:
        """The client of this process for ``connection`` (created on first use)."""
        key = (os.getpid(), connection_key(connection))
        with cls._clients_lock:
            client = cls._clients.get(key)
            if client is None:
                client = cls._clients[key] = cls(connection)
            return client

    @classmethod
    def for_settings(cls, settings: LeaderSettings) -> ProcessClient:
        """The client of this process for the ``nats_leader_*`` settings' servers."""
        return cls.for_connection(settings.connection)

    @classmethod
    def close_all(cls) -> None:
        """Close every client this process opened (registered to run at exit)."""
        pid = os.getpid()
        with cls._clients_lock:
            clients = [c for (owner, _), c in cls._clients.items() if owner == pid]
        for client in clients:
            client.close()

    @classmethod
    def _forget_after_fork(cls) -> None:
        # In a fork child: the parent's loop threads do not exist here, and a
        # lock held by one of its threads at the fork would never be released.
        cls._clients_lock = threading.Lock()
        cls._clients = {}

    # --------------------------------------------------------------- using

    def run(self, coro: Coroutine[Any, Any, T], timeout: float, *, what: str = "") -> T:
        """Run ``coro`` on the client's loop (started at first use) and wait for it.

        Args:
            coro: The coroutine; it gets the connection with :meth:`backend`
                or a bucket with :meth:`bucket`.
            timeout: Seconds to wait.
            what: What the caller was doing, for the timeout's message.

        Returns:
            What ``coro`` returned.

        Raises:
            BackendTimeoutError: No answer within ``timeout`` (the coroutine
                is cancelled), or the client was closed.

        """
        message = what or "no answer from NATS"
        try:
            loop = self._started(coro)
        except RuntimeError as exc:  # closed
            raise BackendTimeoutError(f"{message}: {exc}") from exc
        try:
            return loop.run(coro, timeout)
        except TimeoutError as exc:
            raise BackendTimeoutError(f"{message}: {exc}") from exc
        except concurrent.futures.CancelledError as exc:
            # close() stopped the loop under the call (its tasks are cancelled).
            raise BackendTimeoutError(f"{message}: the client was closed meanwhile") from exc
        except RuntimeError as exc:
            if loop.is_running:
                raise  # the coroutine's own error, or a call from the loop's thread: a bug
            raise BackendTimeoutError(f"{message}: {exc}") from exc

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule ``coro`` on the client's loop (for work that runs alongside the caller).

        Raises:
            RuntimeError: The client was closed.

        """
        return self._started(coro).submit(coro)

    def _started(self, coro: Coroutine[Any, Any, Any]) -> EventLoopThread:
        with self._start_lock:
            if self._closed:
                coro.close()  # never to be awaited
                # Someone kept a closed client: never reopen it beside the
                # registered one (that would be a second connection).
                raise RuntimeError("this NATS client was closed; get the process's current one")
            self._loop.start()
        return self._loop

    async def backend(self, timeout: float) -> Backend:
        """The connection (opened at first use); on the client's loop only.

        Raises:
            NatsUnavailableError: No connection within ``timeout``.

        """
        if self._backend is not None:
            return self._backend
        if self._opening is None:
            # Created on the loop: every coroutine of this client runs there.
            self._opening = asyncio.Lock()
        async with self._opening:
            if self._backend is None:
                # Imported here: getting a client needs no nats-py.
                from celery_nats_leader.nats import open_backend

                self._backend = await open_backend(self.connection, timeout=timeout, name=self.name)
            return self._backend

    async def bucket(
        self,
        name: str,
        *,
        timeout: float,
        ttl: float | None = None,
        create: bool = False,
        replicas: int = 1,
    ) -> Bucket:
        """A KV bucket on the connection, opened once; on the client's loop only.

        Args:
            name: The bucket.
            timeout: Seconds for connecting (first use) and opening it.
            ttl: The ``max_age`` it must have; ``None`` skips the check.
            create: Create it when missing.
            replicas: Replicas when creating it.

        Raises:
            ElectionError: Not reachable, missing, or with other settings.

        """
        key = (name, ttl, create, replicas)
        bucket = self._buckets.get(key)
        if bucket is not None:
            return bucket
        backend = await self.backend(timeout)
        if self._bucket_opening is None:
            self._bucket_opening = asyncio.Lock()
        async with self._bucket_opening:
            # Tasks of a threads pool ask at once: one opens, the others reuse it.
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = await backend.open_bucket(
                    name, ttl=ttl, create=create, replicas=replicas, timeout=timeout
                )
                self._buckets[key] = bucket
            return bucket

    def read_key(self, bucket: str, key: str, *, timeout: float, what: str) -> KVEntry | None:
        """Read ``key``'s latest entry in ``bucket``, from any thread but the client's loop.

        Args:
            bucket: The bucket (opened once, without a ``max_age`` check).
            key: The key.
            timeout: Seconds for connecting (first use), opening and the read.
            what: What the caller was reading, for the error's message.

        Returns:
            The entry (a delete marker too), or ``None`` when the key was never
            written or its last entry expired.

        Raises:
            ElectionError: Not read (NATS unreachable, bucket missing, no
                answer in time).

        """

        async def read() -> KVEntry | None:
            opened = await self.bucket(bucket, timeout=timeout)
            return await opened.latest(key, timeout=timeout)

        return self.run(read(), timeout + 1.0, what=what)

    def shared(self, key: Hashable, factory: Callable[[ProcessClient], T]) -> T:
        """The process's one object for ``key`` living on this client (built at first use).

        The once-guard and the dispatch fence keep their per-process state
        here, so that it is forgotten with the client (after a fork, at close).
        """
        with self._objects_lock:
            if key not in self._objects:
                self._objects[key] = factory(self)
            value: T = self._objects[key]
            return value

    def close(self, timeout: float = 5.0) -> None:
        """Close the connection and stop the thread; the next use opens a new client."""
        with self._start_lock:
            self._closed = True
        with ProcessClient._clients_lock:
            for key, registered in list(ProcessClient._clients.items()):
                if registered is self:
                    del ProcessClient._clients[key]
        with self._objects_lock:
            self._objects.clear()
        if self._loop.is_running:

            async def close() -> None:
                backend, self._backend = self._backend, None
                self._buckets.clear()
                # Bound to this loop; a restart runs a new one.
                self._opening = self._bucket_opening = None
                if backend is not None:
                    await backend.close()

            try:
                self._loop.run(close(), timeout)
            except (TimeoutError, RuntimeError) as exc:
                logger.debug("closing the process's NATS client: %s", exc)
        self._loop.stop()


os.register_at_fork(after_in_child=ProcessClient._forget_after_fork)
atexit.register(ProcessClient.close_all)
