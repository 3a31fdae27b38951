"""Running user callbacks without letting them stall the election.

Callbacks run one at a time, in the order their events happened, on a task
of their own: never under a lock and never on the election's critical path.
Synchronous callbacks run on a dedicated worker thread so that a blocking
one cannot freeze the event loop (and with it the renewals). A callback
that raises is logged and the next one runs. A callback that has not
returned after :data:`SLOW_CALLBACK_WARNING` seconds is logged (again at each
doubling), since every callback after it waits for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

Callback = Callable[..., Any]

#: Seconds after which a callback still running is logged at WARNING.
SLOW_CALLBACK_WARNING = 30.0


async def _nothing() -> None:
    """A callback that does nothing: queued behind others, it marks their end.

    A coroutine function, so that it runs on the loop: a barrier must not
    start the worker thread that only synchronous callbacks need.
    """


class DaemonExecutor(concurrent.futures.Executor):
    """One daemon thread running submitted calls in order.

    Unlike :class:`concurrent.futures.ThreadPoolExecutor`, whose threads the
    interpreter joins at exit, a user callback that never returns cannot keep
    the process from exiting (a Celery worker would hang after its shutdown).

    Args:
        name: The thread's name.

    """

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[
            tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]] | None
        ] = queue.SimpleQueue()
        self._name = name
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(  # type: ignore[override]  # positional arguments only
        self, fn: Callable[..., Any], /, *args: Any
    ) -> concurrent.futures.Future[Any]:
        """Queue ``fn(*args)``; returns its future."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._calls.put((future, fn, args))
        with self._lock:
            if self._thread is None:
                # Started on first use: many elections in one process, most
                # with no synchronous callback, need no thread each.
                self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._thread.start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop after the calls queued so far (``wait`` joins the thread)."""
        self._calls.put(None)
        thread = self._thread
        if wait and thread is not None:
            thread.join()

    def _work(self) -> None:
        while True:
            call = self._calls.get()
            if call is None:
                return
            future, fn, args = call
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the awaiting coroutine
                future.set_exception(exc)


class CallbackCancelledError(Exception):
    """A callback's own task was cancelled while the runner was not stopping."""


class CallbackRunner:
    """Runs callbacks sequentially on an event loop.

    Args:
        name: Used for the worker thread's name and in log messages.
        slow_warning: Seconds after which a callback still running is logged.

    """

    def __init__(self, name: str, *, slow_warning: float = SLOW_CALLBACK_WARNING) -> None:
        self._name = name
        self._slow_warning = slow_warning
        self._queue: asyncio.Queue[tuple[list[Callback], tuple[Any, ...], asyncio.Future[None]]]
        self._task: asyncio.Task[None] | None = None
        self._executor: DaemonExecutor | None = None

    def start(self) -> None:
        """Start the runner on the running loop."""
        self._queue = asyncio.Queue()
        self._executor = DaemonExecutor(f"callbacks-{self._name}")
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"cb-{self._name}")

    def submit(self, callbacks: list[Callback], *args: Any) -> asyncio.Future[None]:
        """Queue ``callbacks`` to be called with ``args``.

        Returns:
            A future done once all of them returned (or raised).

        """
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._task is None or not callbacks:
            done.set_result(None)
            return done
        self._queue.put_nowait((list(callbacks), args, done))
        return done

    def barrier(self) -> asyncio.Future[None]:
        """A future done once every callback queued so far has returned."""
        return self.submit([_nothing])

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            callbacks, args, done = await self._queue.get()
            for callback in callbacks:
                try:
                    await self._watched(
                        loop.create_task(self._call(loop, callback, args)), callback
                    )
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.exception("%s: callback %r raised", self._name, callback)
            if not done.done():
                done.set_result(None)

    async def _call(
        self, loop: asyncio.AbstractEventLoop, callback: Callback, args: tuple[Any, ...]
    ) -> None:
        if inspect.iscoroutinefunction(callback):
            await callback(*args)
            return
        result = await loop.run_in_executor(self._executor, callback, *args)
        if inspect.isawaitable(result):
            await result

    async def _watched(self, call: asyncio.Task[None], callback: Callback) -> None:
        """Await ``call``, saying so when it runs long: later callbacks wait for it."""
        waited, limit = 0.0, self._slow_warning
        try:
            while True:
                await asyncio.wait({call}, timeout=limit - waited)
                if call.cancelled():
                    # The callback cancelled itself (it awaited something a
                    # closed connection cancelled): its error, not the
                    # runner's; the callbacks after it still run.
                    raise CallbackCancelledError(f"callback {callback!r} was cancelled")
                if call.done():
                    return call.result()
                waited = limit
                logger.warning(
                    "%s: callback %r still running after %gs; the callbacks after it "
                    "wait for it (they run in order)",
                    self._name,
                    callback,
                    waited,
                )
                limit *= 2
        except asyncio.CancelledError:
            # The runner is stopping: the callback unwinds (its finally
            # blocks run) before stop() returns, as when it ran in the
            # runner's own task. A synchronous one keeps its thread.
            call.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait({call})
            raise

    async def stop(self, timeout: float | None = None) -> None:
        """Let queued callbacks finish (for at most ``timeout`` seconds), then stop.

        A synchronous callback still running then is left to its thread (a
        daemon: it cannot keep the process from exiting).
        """
        if self._task is None:
            return
        drained = self.barrier()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait({drained}, timeout=timeout)
        if not drained.done():
            logger.warning(
                "%s: callbacks still running after %.1fs; stopping without them",
                self._name,
                timeout,
            )
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None
