"""One thread hosting one asyncio event loop, for synchronous callers.

Celery workers, beat and Django are not asyncio programs. They share one
long-lived loop per process (one NATS connection, its reconnect logic and the
renewal timers all live there) and submit coroutines to it. Never
``asyncio.run()`` per call in a long-lived process: that would tear the
connection and the renewals down between calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class EventLoopThread:
    """A daemon thread running an event loop until :meth:`stop`.

    Args:
        name: The thread's name.

    """

    def __init__(self, name: str = "nats-leader-loop") -> None:
        self._name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop.

        Raises:
            RuntimeError: If the thread is not running.

        """
        if self._loop is None or not self._loop.is_running():
            raise RuntimeError(
                f"the event loop thread {self._name!r} is not running: call start() first"
            )
        return self._loop

    @property
    def is_running(self) -> bool:
        """Whether the loop is running."""
        return self._loop is not None and self._loop.is_running()

    def start(self) -> None:
        """Start the thread and wait until its loop runs. Idempotent."""
        if self.is_running:
            return
        self._ready.clear()
        self._thread = threading.Thread(target=self._main, name=self._name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        loop.call_soon(self._ready.set)
        try:
            loop.run_forever()
        finally:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop from any other thread.

        Returns:
            A future for its result.

        """
        try:
            loop = self.loop
        except RuntimeError:
            coro.close()
            raise
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result.

        Args:
            coro: The coroutine.
            timeout: Seconds to wait; ``None`` waits indefinitely.

        Returns:
            The coroutine's result.

        Raises:
            RuntimeError: If called from the loop's own thread (it would deadlock)
                or if the loop is not running.
            TimeoutError: If ``timeout`` passed; the coroutine is cancelled.

        """
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("EventLoopThread.run() called from its own loop: await instead")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no result within {timeout}s") from None

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop (cancelling leftover tasks) and join the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)
        self._loop = None
        self._thread = None
