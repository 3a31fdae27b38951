"""Running user callbacks without letting them stall the election.

Callbacks run one at a time, in the order their events happened, on a task
of their own: never under a lock and never on the election's critical path.
Synchronous callbacks run on a dedicated worker thread so that a blocking
one cannot freeze the event loop (and with it the renewals). A callback
that raises is logged and the next one runs. A callback that has not
returned after :data:`SLOW_CALLBACK_WARNING` seconds is logged (again at each
doubling), since every callback after it waits for it.

With ``abandon_after`` (an election passes its ``demote_timeout``), a
callback that has run that long while later callbacks are queued behind it
is abandoned: an async one is cancelled, a synchronous one is left running on
its thread (a thread cannot be stopped) and the later callbacks move to a
fresh thread. The election stops waiting for its demote callbacks after
``demote_timeout`` anyway; an ``on_demote`` that runs promptly is safer than
one stuck behind a hung ``on_promote`` while a successor leads.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
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


@dataclass
class _Batch:
    """Callbacks queued together, and the future their submitter awaits."""

    callbacks: list[Callback]
    args: tuple[Any, ...]
    done: asyncio.Future[None]
    #: Whether its callbacks count as queued behind a running one (they
    #: then get it abandoned once it overruns). A barrier or a stop's drain
    #: marker only watches: waiting must not cut a slow callback short.
    counted: bool = True
    #: Whether ``done`` also waits for the abandoned callbacks still
    #: running (a barrier: "every callback queued so far has returned").
    covers_abandoned: bool = False


def _done_after(done: asyncio.Future[None], futures: Iterable[asyncio.Future[None]]) -> None:
    """Resolve ``done`` once all of ``futures`` are done (at once when they are)."""
    remaining = [f for f in futures if not f.done()]

    def one_done(_: object) -> None:
        if all(f.done() for f in remaining) and not done.done():
            done.set_result(None)

    if not remaining:
        one_done(None)
    for future in remaining:
        future.add_done_callback(one_done)


class CallbackRunner:
    """Runs callbacks sequentially on an event loop.

    Args:
        name: Used for the worker thread's name and in log messages.
        slow_warning: Seconds after which a callback still running is logged.
        abandon_after: Seconds a callback may run while later callbacks are
            queued behind it; past them it is abandoned and the later ones
            run (an async callback is cancelled, a synchronous one keeps its
            thread). ``None``: never, later callbacks wait however long it
            takes. A callback with nothing queued behind it is never
            abandoned. Abandoning changes only what the later callbacks wait
            for: the future of the abandoned callback's own submission (and
            of a later :meth:`barrier`) is done only once it has returned.

    """

    def __init__(
        self,
        name: str,
        *,
        slow_warning: float = SLOW_CALLBACK_WARNING,
        abandon_after: float | None = None,
    ) -> None:
        self._name = name
        self._slow_warning = slow_warning
        self._abandon_after = abandon_after
        self._queue: asyncio.Queue[_Batch]
        self._task: asyncio.Task[None] | None = None
        self._executor: DaemonExecutor | None = None
        self._threads = 0
        # Callbacks queued (in counted batches) and not yet started.
        self._queued = 0
        # Resolved by submit(): wakes the watch of a running callback.
        self._arrival: asyncio.Future[None] | None = None
        # Abandoned callbacks still running: resolved when each returns.
        self._abandoned: set[asyncio.Future[None]] = set()

    def start(self) -> None:
        """Start the runner on the running loop."""
        self._queue = asyncio.Queue()
        self._queued = 0
        # A new set: a thread abandoned before a restart only ever touches the old one.
        self._abandoned = set()
        self._executor = self._new_executor()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"cb-{self._name}")

    def _new_executor(self) -> DaemonExecutor:
        self._threads += 1
        suffix = "" if self._threads == 1 else f"-{self._threads}"
        return DaemonExecutor(f"callbacks-{self._name}{suffix}")

    def submit(self, callbacks: list[Callback], *args: Any) -> asyncio.Future[None]:
        """Queue ``callbacks`` to be called with ``args``.

        Returns:
            A future done once all of them returned (or raised).

        """
        return self._enqueue(callbacks, args)

    def barrier(self) -> asyncio.Future[None]:
        """A future done once every callback queued so far has returned.

        Abandoned callbacks included: a barrier waits for a hung one, it
        never gets it abandoned.
        """
        return self._enqueue([_nothing], (), counted=False, covers_abandoned=True)

    def _enqueue(
        self,
        callbacks: list[Callback],
        args: tuple[Any, ...],
        *,
        counted: bool = True,
        covers_abandoned: bool = False,
    ) -> asyncio.Future[None]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._task is None or not callbacks:
            done.set_result(None)
            return done
        self._queue.put_nowait(_Batch(list(callbacks), args, done, counted, covers_abandoned))
        if counted:
            self._queued += len(callbacks)
            arrival = self._arrival
            if arrival is not None and not arrival.done():
                arrival.set_result(None)
        return done

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = await self._queue.get()
            still_running: list[asyncio.Future[None]] = []
            for callback in batch.callbacks:
                if batch.counted:
                    self._queued -= 1
                try:
                    abandoned = await self._watched(loop, callback, batch.args)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.exception("%s: callback %r raised", self._name, callback)
                else:
                    if abandoned is not None:
                        still_running.append(abandoned)
            if batch.covers_abandoned:
                still_running = list(self._abandoned)
            _done_after(batch.done, still_running)

    async def _call(self, callback: Callback, args: tuple[Any, ...]) -> None:
        await callback(*args)

    async def _await_thread(self, thread_call: concurrent.futures.Future[Any]) -> None:
        result = await asyncio.wrap_future(thread_call)
        if inspect.isawaitable(result):
            await result

    async def _watched(
        self, loop: asyncio.AbstractEventLoop, callback: Callback, args: tuple[Any, ...]
    ) -> asyncio.Future[None] | None:
        """Run ``callback``, saying so when it runs long: later callbacks wait for it.

        Returns:
            ``None`` once it returned; a future done when it returns if it
            was abandoned while still running.

        """
        thread_call: concurrent.futures.Future[Any] | None = None
        if inspect.iscoroutinefunction(callback):
            call = loop.create_task(self._call(callback, args))
        else:
            assert self._executor is not None
            thread_call = self._executor.submit(callback, *args)
            call = loop.create_task(self._await_thread(thread_call))
        started = time.monotonic()
        ran, warn_at, bound = 0.0, self._slow_warning, self._abandon_after
        try:
            while True:
                behind = self._queued > 0
                if bound is not None and behind and ran >= bound:
                    return await self._abandon(loop, callback, call, thread_call, started)
                deadline = min(warn_at, bound) if bound is not None and behind else warn_at
                watched: set[asyncio.Future[Any]] = {call}
                if bound is not None and not behind:
                    # A callback queued now may make this one overdue at once.
                    self._arrival = loop.create_future()
                    watched.add(self._arrival)
                try:
                    woken, _ = await asyncio.wait(
                        watched,
                        timeout=max(0.0, deadline - ran),
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    self._arrival = None
                # A timeout counts as reaching the deadline, should the
                # loop's timer fire a hair early.
                ran = max(time.monotonic() - started, ran if woken else deadline)
                if call.cancelled():
                    # The callback cancelled itself (it awaited something a
                    # closed connection cancelled): its error, not the
                    # runner's; the callbacks after it still run.
                    raise CallbackCancelledError(f"callback {callback!r} was cancelled")
                if call.done():
                    call.result()
                    return None
                if ran >= warn_at:
                    logger.warning(
                        "%s: callback %r still running after %gs; the callbacks after it "
                        "wait for it (they run in order)",
                        self._name,
                        callback,
                        warn_at,
                    )
                    warn_at *= 2
        except asyncio.CancelledError:
            # The runner is stopping: the callback unwinds (its finally
            # blocks run) before stop() returns, as when it ran in the
            # runner's own task. A synchronous one keeps its thread.
            call.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait({call})
            raise

    async def _abandon(
        self,
        loop: asyncio.AbstractEventLoop,
        callback: Callback,
        call: asyncio.Task[None],
        thread_call: concurrent.futures.Future[Any] | None,
        started: float,
    ) -> asyncio.Future[None] | None:
        """Give up on ``callback`` so that the ones queued behind it run.

        Returns:
            ``None`` if it unwound; else a future done when it returns.

        """
        ran = time.monotonic() - started
        returned: asyncio.Future[None] = loop.create_future()
        abandoned = self._abandoned
        abandoned.add(returned)

        def settle() -> None:
            abandoned.discard(returned)
            if not returned.done():
                returned.set_result(None)

        if thread_call is not None and not thread_call.done():
            logger.error(
                "%s: callback %r still running after %.1fs with later callbacks queued "
                "behind it; they now run without waiting for it, on a new thread "
                "(it keeps its own: a thread cannot be stopped)",
                self._name,
                callback,
                ran,
            )
            # Later calls go to a new thread; the old one ends once this call
            # returns (nothing else was queued on it: one call at a time).
            assert self._executor is not None
            self._executor.shutdown(wait=False)
            self._executor = self._new_executor()
            thread_call.add_done_callback(
                lambda finished: self._late_return(loop, settle, callback, started, finished)
            )
            # The task only awaits the thread's future: it unwinds at once, and
            # the late result, dropped by asyncio, reaches nothing of the runner.
            call.cancel()
            await asyncio.wait({call})
            return returned
        logger.error(
            "%s: callback %r still running after %.1fs with later callbacks queued "
            "behind it; cancelled, they now run without waiting for it",
            self._name,
            callback,
            ran,
        )
        call.cancel()
        # Bounded too: a callback that will not unwind must not hold up the others.
        await asyncio.wait({call}, timeout=self._abandon_after)
        if not call.done():
            logger.error(
                "%s: cancelled callback %r has not unwound after %gs; the later callbacks "
                "run without waiting for it",
                self._name,
                callback,
                self._abandon_after,
            )

            def unwound(task: asyncio.Task[None]) -> None:
                settle()
                if not task.cancelled() and task.exception() is not None:
                    logger.error(
                        "%s: abandoned callback %r raised",
                        self._name,
                        callback,
                        exc_info=task.exception(),
                    )

            call.add_done_callback(unwound)
            return returned
        settle()
        if not call.cancelled() and call.exception() is not None:
            logger.error(
                "%s: abandoned callback %r raised", self._name, callback, exc_info=call.exception()
            )
        return None

    def _late_return(
        self,
        loop: asyncio.AbstractEventLoop,
        settle: Callable[[], None],
        callback: Callback,
        started: float,
        finished: concurrent.futures.Future[Any],
    ) -> None:
        """On the abandoned thread: say how the callback ended; tell the loop, if still open."""
        ran = time.monotonic() - started
        exc = None if finished.cancelled() else finished.exception()
        if exc is not None:
            logger.error(
                "%s: abandoned callback %r raised after %.1fs",
                self._name,
                callback,
                ran,
                exc_info=exc,
            )
        else:
            result = None if finished.cancelled() else finished.result()
            if inspect.iscoroutine(result):
                result.close()  # not awaited: the callbacks after it have run
            logger.warning(
                "%s: abandoned callback %r returned after %.1fs", self._name, callback, ran
            )
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(settle)

    async def stop(self, timeout: float | None = None) -> None:
        """Let queued callbacks finish (for at most ``timeout`` seconds), then stop.

        A synchronous callback still running then is left to its thread (a
        daemon: it cannot keep the process from exiting). Abandoned
        callbacks get no second wait.
        """
        if self._task is None:
            return
        drained = self._enqueue([_nothing], (), counted=False)
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
