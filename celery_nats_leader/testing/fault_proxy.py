"""A TCP proxy that injects network faults between a NATS client and its server.

Point the client at :attr:`FaultProxy.url` instead of the server's URL, then
call the fault methods while the test runs:

* :meth:`~FaultProxy.blackhole` / :meth:`~FaultProxy.heal`: a partition. The
  TCP connections stay up but every byte, in both directions, is dropped.
* :meth:`~FaultProxy.reset`: abort all current connections with a TCP RST.
* :meth:`~FaultProxy.refuse` / :meth:`~FaultProxy.accept`: reset every new
  connection right after accepting it, until told otherwise.
* :meth:`~FaultProxy.delay`: add latency to every chunk, in both directions.

:class:`FaultProxy` lives on the running asyncio event loop.
:class:`ThreadedFaultProxy` runs one in a private thread and event loop, with a
synchronous API that may be called from any thread (sync tests, benchmarks,
code that blocks the caller's loop).

Note that a blackhole drops whole chunks as they are read, so after
:meth:`~FaultProxy.heal` the peers may see a protocol stream with a hole in it
(a real partition would stall and retransmit instead). NATS servers and clients
answer that by closing the connection, and the client then reconnects.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import socket
import struct
import threading
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, Final, TypeAlias, TypeVar

__all__ = ["FaultProxy", "ThreadedFaultProxy"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_CHUNK_SIZE: Final = 64 * 1024
# Bounds what one direction buffers: when its writer falls behind (a delay, a
# slow peer) the reader stops reading, so TCP backpressure reaches the sender
# instead of the proxy's memory growing without limit.
_QUEUE_CHUNKS: Final = 256
_CONNECT_TIMEOUT: Final = 5.0
# SO_LINGER on with a zero timeout makes close() send RST instead of FIN.
_LINGER_RST: Final = struct.pack("ii", 1, 0)

# A queued chunk: (due time on the loop clock, bytes); None marks end of stream.
_Item: TypeAlias = "tuple[float, bytes] | None"


def _set_rst_on_close(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)


class _Connection:
    """One proxied client connection: client <-> proxy <-> upstream server."""

    def __init__(
        self,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.client_reader, self.client_writer = client
        self.upstream_reader, self.upstream_writer = upstream

    def abort(self, *, rst: bool) -> None:
        """Drop both sockets at once, discarding buffered data."""
        for writer in (self.client_writer, self.upstream_writer):
            if rst:
                _set_rst_on_close(writer)
            writer.transport.abort()


class FaultProxy:
    """Asyncio TCP proxy with fault injection, forwarding to ``target_host:target_port``.

    Each accepted connection opens its own upstream connection; each direction
    is pumped by a reader task and a writer task joined by a bounded queue, so
    that delayed chunks keep their order. The fault methods are plain (not
    coroutine) methods and must be called from the proxy's event loop thread;
    use :class:`ThreadedFaultProxy` to control a proxy from other threads.

    Example:
        >>> async with FaultProxy("127.0.0.1", server.port) as proxy:  # doctest: +SKIP
        ...     nc = await nats.connect(proxy.url)
        ...     proxy.blackhole()

    Args:
        target_host: Host to forward to.
        target_port: Port to forward to.
        listen_host: Address to listen on.
        listen_port: Port to listen on; 0 lets the kernel pick a free one.

    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
    ) -> None:
        self._target = (target_host, target_port)
        self._listen_host = listen_host
        self._listen_port = listen_port
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._connections: set[_Connection] = set()
        self._blackholed = False
        self._refusing = False
        self._delay = 0.0
        self._accepted = 0
        self._in_flight = 0
        self._changed: asyncio.Condition | None = None
        self._stopping = False

    # -- properties ---------------------------------------------------------

    @property
    def port(self) -> int:
        """The port the proxy listens on (kept across stop/start).

        Raises:
            RuntimeError: If the proxy was never started (and no port was given).

        """
        if not self._listen_port:
            raise RuntimeError("FaultProxy is not started")
        return self._listen_port

    @property
    def host(self) -> str:
        """The address the proxy listens on."""
        return self._listen_host

    @property
    def url(self) -> str:
        """NATS URL of the proxy, ``nats://127.0.0.1:PORT``."""
        return f"nats://{self._listen_host}:{self.port}"

    @property
    def target(self) -> tuple[str, int]:
        """``(host, port)`` the proxy forwards to."""
        return self._target

    @property
    def connections(self) -> int:
        """Number of live proxied connections."""
        return len(self._connections)

    @property
    def accepted(self) -> int:
        """Number of connections proxied so far (refused ones not counted)."""
        return self._accepted

    @property
    def in_flight(self) -> int:
        """Chunks read from one side and not yet written to the other.

        Non-zero mostly while a :meth:`delay` holds data back; lets a test know
        that data it sent has reached the proxy.
        """
        return self._in_flight

    @property
    def is_blackholed(self) -> bool:
        """Whether traffic is currently being dropped."""
        return self._blackholed

    @property
    def is_refusing(self) -> bool:
        """Whether new connections are currently being refused."""
        return self._refusing

    @property
    def current_delay(self) -> float:
        """Latency, in seconds, currently added to each chunk."""
        return self._delay

    # -- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        """Start listening. The port is known (``port``/``url``) once this returns.

        After a :meth:`stop`, starting again listens on the same port, so that
        clients see the proxy (their "server") go away and come back.
        """
        if self._server is not None:
            return
        self._stopping = False
        self._changed = asyncio.Condition()
        self._server = await asyncio.start_server(
            self._handle, self._listen_host, self._listen_port
        )
        self._listen_port = int(self._server.sockets[0].getsockname()[1])
        logger.debug("fault proxy %s -> %s:%d started", self.url, *self._target)

    async def stop(self) -> None:
        """Stop listening, abort all connections and wait for their tasks to end."""
        server = self._server
        if server is None:
            return
        self._server = None
        # A connection accepted just now may have a handler task that has not
        # run yet (so is not in _handlers); the flag makes it drop the socket.
        self._stopping = True
        server.close()
        for connection in list(self._connections):
            connection.abort(rst=False)
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await server.wait_closed()
        logger.debug("fault proxy -> %s:%d stopped", *self._target)

    async def __aenter__(self) -> FaultProxy:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    # -- faults -------------------------------------------------------------

    def blackhole(self) -> None:
        """Silently drop all bytes in both directions; connections stay open.

        Chunks already queued (e.g. delayed) are dropped too, as in-flight
        packets would be. New connections are accepted and connected upstream,
        but see no traffic either.
        """
        logger.info("fault proxy %s: blackhole", self._describe())
        self._blackholed = True

    def heal(self) -> None:
        """Forward bytes again after :meth:`blackhole` (what was dropped stays lost)."""
        logger.info("fault proxy %s: heal", self._describe())
        self._blackholed = False

    def reset(self) -> None:
        """Abort every current connection with a TCP RST, on both sides.

        New connections are accepted afterwards as usual.
        """
        logger.info(
            "fault proxy %s: reset %d connection(s)", self._describe(), len(self._connections)
        )
        for connection in list(self._connections):
            connection.abort(rst=True)

    def refuse(self) -> None:
        """Reset new connections right after accepting them, until :meth:`accept`.

        Existing connections are left alone (combine with :meth:`reset` to
        simulate a server that went away).
        """
        logger.info("fault proxy %s: refuse new connections", self._describe())
        self._refusing = True

    def accept(self) -> None:
        """Proxy new connections again after :meth:`refuse`."""
        logger.info("fault proxy %s: accept new connections", self._describe())
        self._refusing = False

    def delay(self, seconds: float) -> None:
        """Add ``seconds`` of latency to every chunk from now on; 0 removes it.

        The order of bytes in each direction is preserved: a chunk is never
        written before an earlier one, even if the delay was lowered meanwhile.

        Args:
            seconds: Latency per direction (a round trip gets it twice).

        Raises:
            ValueError: If ``seconds`` is negative.

        """
        if seconds < 0:
            raise ValueError("delay must be >= 0")
        logger.info("fault proxy %s: delay %.3fs", self._describe(), seconds)
        self._delay = float(seconds)

    async def wait_for_connections(self, count: int, timeout: float = 10.0) -> None:
        """Wait until exactly ``count`` connections are live.

        Handy after :meth:`reset` (wait for 0, or for the client's reconnect).

        Args:
            count: The number of live connections to wait for.
            timeout: Seconds to wait.

        Raises:
            asyncio.TimeoutError: If that does not happen in time (the builtin
                ``TimeoutError`` on Python >= 3.11).
            RuntimeError: If the proxy was never started.

        """
        if self._changed is None:
            raise RuntimeError("FaultProxy is not started")
        changed = self._changed
        async with changed:
            await asyncio.wait_for(
                changed.wait_for(lambda: len(self._connections) == count), timeout
            )

    # -- internals ----------------------------------------------------------

    def _describe(self) -> str:
        return f":{self._listen_port}->{self._target[0]}:{self._target[1]}"

    async def _notify(self) -> None:
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None  # always true inside a task
        self._handlers.add(task)
        try:
            await self._proxy(reader, writer)
        except asyncio.CancelledError:
            # Only stop() cancels handlers, and it waits for them. End normally
            # rather than re-raise: asyncio's start_server (3.11) calls
            # task.exception() on the finished handler, which raises for a
            # cancelled task and gets logged as "Exception in callback".
            pass
        finally:
            self._handlers.discard(task)

    async def _proxy(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._refusing or self._stopping:
            _set_rst_on_close(writer)
            writer.transport.abort()
            return
        try:
            upstream = await asyncio.wait_for(
                asyncio.open_connection(*self._target), _CONNECT_TIMEOUT
            )
        except (OSError, asyncio.TimeoutError) as exc:
            # Server down: pass the failure on to the client as an RST.
            logger.debug("fault proxy %s: upstream connect failed: %s", self._describe(), exc)
            _set_rst_on_close(writer)
            writer.transport.abort()
            return
        except BaseException:  # cancelled by stop(): do not leak the client socket
            writer.transport.abort()
            raise
        connection = _Connection((reader, writer), upstream)
        self._connections.add(connection)
        self._accepted += 1
        to_upstream: asyncio.Queue[_Item] = asyncio.Queue(_QUEUE_CHUNKS)
        to_client: asyncio.Queue[_Item] = asyncio.Queue(_QUEUE_CHUNKS)
        readers = [
            asyncio.create_task(self._read_side(reader, to_upstream)),
            asyncio.create_task(self._read_side(connection.upstream_reader, to_client)),
        ]
        writers = [
            asyncio.create_task(self._write_side(to_upstream, connection.upstream_writer)),
            asyncio.create_task(self._write_side(to_client, writer)),
        ]
        try:
            await self._notify()
            # A writer ends once its direction hit end-of-stream (and flushed
            # what was queued) or its socket failed; either way this
            # connection is over, so close the whole thing.
            await asyncio.wait(writers, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in readers + writers:
                task.cancel()
            await asyncio.gather(*readers, *writers, return_exceptions=True)
            for queue in (to_upstream, to_client):
                while not queue.empty():
                    if queue.get_nowait() is not None:
                        self._in_flight -= 1  # never delivered
            for side in (writer, connection.upstream_writer):
                side.close()
            for side in (writer, connection.upstream_writer):
                with contextlib.suppress(OSError):
                    await side.wait_closed()
            self._connections.discard(connection)
            # Shielded: the notification must go out even if we are being cancelled.
            await asyncio.shield(self._notify())

    async def _read_side(self, reader: asyncio.StreamReader, queue: asyncio.Queue[_Item]) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await reader.read(_CHUNK_SIZE):
                if self._blackholed:
                    continue
                self._in_flight += 1
                try:
                    await queue.put((loop.time() + self._delay, data))
                except BaseException:
                    self._in_flight -= 1  # cancelled while the queue was full
                    raise
        except OSError:
            pass  # reset by the peer (or by us): same as end of stream
        await queue.put(None)

    async def _write_side(self, queue: asyncio.Queue[_Item], writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        while (item := await queue.get()) is not None:
            due, data = item
            try:
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                if self._blackholed:
                    continue  # in flight when the partition started: lost
                writer.write(data)
            finally:
                self._in_flight -= 1
            try:
                await writer.drain()
            except OSError:
                return


class ThreadedFaultProxy:
    """A :class:`FaultProxy` running in its own thread and event loop.

    All methods are synchronous, thread-safe, and block until the proxy's loop
    has carried them out, so e.g. after ``reset()`` returns the RSTs are sent.
    Usable from synchronous code and from asyncio code whose loop must not
    host the proxy (e.g. while that loop is blocked in a synchronous call).

    Example:
        >>> with ThreadedFaultProxy("127.0.0.1", server.port) as proxy:  # doctest: +SKIP
        ...     client = connect(proxy.url)
        ...     proxy.delay(0.2)

    Args:
        target_host: Host to forward to.
        target_port: Port to forward to.
        listen_host: Address to listen on.
        listen_port: Port to listen on; 0 lets the kernel pick a free one.
        call_timeout: Seconds to wait for the proxy's loop to run each call.

    """

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        call_timeout: float = 10.0,
    ) -> None:
        self._proxy = FaultProxy(
            target_host, target_port, listen_host=listen_host, listen_port=listen_port
        )
        self._call_timeout = call_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def proxy(self) -> FaultProxy:
        """The underlying proxy (only touch it from its own loop)."""
        return self._proxy

    @property
    def port(self) -> int:
        """The port the proxy listens on."""
        return self._proxy.port

    @property
    def url(self) -> str:
        """NATS URL of the proxy, ``nats://127.0.0.1:PORT``."""
        return self._proxy.url

    @property
    def connections(self) -> int:
        """Number of live proxied connections."""
        return self._call(lambda: self._proxy.connections)

    @property
    def accepted(self) -> int:
        """Number of connections proxied so far."""
        return self._call(lambda: self._proxy.accepted)

    @property
    def in_flight(self) -> int:
        """Chunks read from one side and not yet written to the other."""
        return self._call(lambda: self._proxy.in_flight)

    def start(self) -> None:
        """Start the proxy's thread and loop, and the proxy. Idempotent."""
        with self._lock:
            if self._thread is not None:
                return
            loop = asyncio.new_event_loop()
            ready = threading.Event()
            thread = threading.Thread(
                target=self._run_loop, args=(loop, ready), name="fault-proxy", daemon=True
            )
            thread.start()
            ready.wait()
            self._loop, self._thread = loop, thread
            try:
                self._await(self._proxy.start())
            except BaseException:
                self._shutdown_loop()
                raise

    def stop(self) -> None:
        """Stop the proxy, its loop and thread. Idempotent."""
        with self._lock:
            if self._thread is None:
                return
            try:
                self._await(self._proxy.stop())
            finally:
                self._shutdown_loop()

    def blackhole(self) -> None:
        """See :meth:`FaultProxy.blackhole`."""
        self._call(self._proxy.blackhole)

    def heal(self) -> None:
        """See :meth:`FaultProxy.heal`."""
        self._call(self._proxy.heal)

    def reset(self) -> None:
        """See :meth:`FaultProxy.reset`."""
        self._call(self._proxy.reset)

    def refuse(self) -> None:
        """See :meth:`FaultProxy.refuse`."""
        self._call(self._proxy.refuse)

    def accept(self) -> None:
        """See :meth:`FaultProxy.accept`."""
        self._call(self._proxy.accept)

    def delay(self, seconds: float) -> None:
        """See :meth:`FaultProxy.delay`."""
        self._call(lambda: self._proxy.delay(seconds))

    def wait_for_connections(self, count: int, timeout: float = 10.0) -> None:
        """See :meth:`FaultProxy.wait_for_connections` (blocks the calling thread).

        Raises:
            asyncio.TimeoutError: If the count is not reached within ``timeout``.

        """
        self._await(self._proxy.wait_for_connections(count, timeout), timeout + 1.0)

    def __enter__(self) -> ThreadedFaultProxy:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- internals ----------------------------------------------------------

    @staticmethod
    def _run_loop(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    def _shutdown_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join()

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("ThreadedFaultProxy is not started")
        return self._loop

    def _await(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        loop = self._running_loop()
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("cannot block on the proxy's loop from its own thread")
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(self._call_timeout if timeout is None else timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def _call(self, func: Callable[[], _T]) -> _T:
        loop = self._running_loop()
        if threading.current_thread() is self._thread:
            return func()  # already on the proxy's loop: waiting would deadlock
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(func())
            except BaseException as exc:
                future.set_exception(exc)

        loop.call_soon_threadsafe(run)
        return future.result(self._call_timeout)
