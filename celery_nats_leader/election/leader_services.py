"""Leader services: code that runs for exactly as long as this process leads a role.

The Python form of client-go's ``OnStartedLeading(ctx)``. A *leader service*
is a function given a :class:`LeaderContext` (the term's fencing token and a
stop signal). It is started when the election promotes this process and
stopped when the term ends, whatever the reason (resign, stop, lease expiry,
a successor's write, lost connection):

* a coroutine function runs as a task on the election's event loop and is
  cancelled;
* a plain function runs on a thread of its own, whose :class:`LeaderContext`
  reports :attr:`~LeaderContext.stopped`; the thread is expected to return.

Why two clocks of "stopped". The stop is requested synchronously at the
instant the election leaves the LEADER state (not through the callback
queue, which a slow user callback could hold up). And
:attr:`LeaderContext.stopped` also reads the lease deadline on the monotonic
clock, so a service that checks it before each unit of work sees the end of
the term on time even when the event loop is late (a paused and resumed
process): the same guarantee :attr:`KvElection.is_leader
<celery_nats_leader.election.base.BaseElection.is_leader>` gives.

Safety (see docs/design.md): on a graceful hand-over (stop, resign) the
election awaits the service's end, bounded by ``grace``, *before* it releases
the key, so the successor cannot start its copy earlier. On a lease expiry
the old leader's service is told to stop at its lease deadline
(``send + ttl - lease_margin``) and the successor cannot win before
``send + ttl``: a service that returns within ``lease_margin`` of being
told never overlaps its successor. ``grace`` therefore defaults to the
role's ``lease_margin``; with fast failover to the promise margin
(0.2 s), when shorter: a successor may start that long after the old
leader's promises ran out.

Example::

    async def poll_feed(ctx: LeaderContext) -> None:
        while True:
            await fetch_and_store(fence=ctx.token)
            await asyncio.sleep(1)

    election.run_while_leading(poll_feed)

    async with election.leading() as ctx:   # waits until leading
        await consume(ctx.token)            # cancelled on demotion
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from celery_nats_leader.config import ElectionConfig
from celery_nats_leader.core import constants as c
from celery_nats_leader.core.errors import LeadershipLostError
from celery_nats_leader.election.vocabulary import DemoteReason, ElectionState, ServiceHost

if TYPE_CHECKING:
    from celery_nats_leader.term.token import FencingToken

__all__ = ["LeaderContext", "LeaderServiceRunner", "LeadingScope"]

logger = logging.getLogger(__name__)

#: A leader service: ``service(ctx)``, a coroutine function or a plain one.
ServiceFunction = Callable[["LeaderContext"], "Awaitable[None] | None"]

#: Pause before the first restart of a service that raised, seconds (doubles).
_FIRST_RESTART_DELAY = 1.0
#: Longest pause between restarts of a service that keeps raising, seconds.
_MAX_RESTART_DELAY = 30.0


def default_grace(config: ElectionConfig) -> float:
    """How long a stopping service is waited for, unless its runner says otherwise.

    The time between the old leader's end and the earliest moment a
    successor may start: ``lease_margin`` after a lost lease; with fast
    failover, the promise margin (``PROMISE_MARGIN_SECONDS``), the shorter.
    """
    if config.fast_failover:
        return min(config.lease_margin, c.PROMISE_MARGIN_SECONDS)
    return config.lease_margin


class LeaderContext:
    """What a leader service is given: its term, and a way to learn that it ended.

    Thread-safe. Created by the library for each run of a service.

    Args:
        election: The election whose term this is.
        token: The term's fencing token.

    """

    def __init__(self, election: ServiceHost, token: FencingToken) -> None:
        self._election = election
        self.token = token
        """The fencing token of the term (pass it to fenced resources)."""
        self._reason: DemoteReason | None = None
        self._stop = threading.Event()
        self._stop_callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    @property
    def role(self) -> str:
        """The role led."""
        return self._election.role

    @property
    def reason(self) -> DemoteReason | None:
        """Why the term ended, once it has (``None`` while leading)."""
        if self._stop.is_set() or not self.stopped:
            # Told to stop (with its reason, or none when the service is
            # closed or its scope left), or still leading: final as it is.
            return self._reason
        # The term is over but nothing has told this context yet: another
        # thread reads this while the election's loop is ending the term.
        # The election sets its reason before it drops the token and clears
        # it only after its hooks recorded it here (under the lock, with the
        # stop flag): read the election's, then this context's again.
        election = self._election
        was_leading = election.recorded_state is ElectionState.LEADER
        reason = election.ending_reason or self._reason
        if reason is not None:
            return reason
        if was_leading and election.token is None:
            # The lease ran out on the clock before the loop demoted.
            return DemoteReason.LEASE_EXPIRED
        return None

    @property
    def stopped(self) -> bool:
        """Whether the term is over (or the service is being stopped).

        Reads the lease clock too: turns ``True`` at the lease deadline even
        if nothing has told the service yet.
        """
        return self._stop.is_set() or self._election.token != self.token

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep up to ``timeout`` seconds, waking as soon as the term ends.

        Args:
            timeout: Seconds; ``None`` waits until the term ends.

        Returns:
            ``True`` if the term is over (stop working), ``False`` on timeout.

        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.stopped:
            # Wake at the lease deadline too: a renewal moves it later, an
            # expiry is then seen by ``stopped`` without any event.
            step = max(0.001, self._election.lease_remaining)
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                step = min(step, left)
            self._stop.wait(step)
        return True

    def add_stop_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` (from any thread) when the service is told to stop.

        Called at once if it was told already. For example, to cancel a task
        of another event loop: ``ctx.add_stop_callback(lambda:
        loop.call_soon_threadsafe(task.cancel))``.
        """
        with self._lock:
            if not self._stop.is_set():
                self._stop_callbacks.append(callback)
                return
        callback()

    def _set_stopped(self, reason: DemoteReason | None) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            self._reason = reason
            self._stop.set()
            callbacks, self._stop_callbacks = self._stop_callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:
                logger.exception("%s: a leader service's stop callback raised", self.role)


class LeaderServiceRunner:
    """Runs one service for every term this process leads one role.

    Built by :meth:`BaseElection.run_while_leading
    <celery_nats_leader.election.base.BaseElection.run_while_leading>`; its
    methods are called on the election's event loop.

    Args:
        election: The role's election.
        service: ``service(ctx)``: a coroutine function (a task on the loop)
            or a plain function (a thread of its own).
        name: Used in logs and thread names; default the function's name.
        grace: Seconds a stopping service is waited for before the election
            goes on (releases its key); default the role's ``lease_margin``
            (with fast failover, at most 0.2 s: :func:`default_grace`).

    """

    def __init__(
        self,
        election: ServiceHost,
        service: ServiceFunction,
        *,
        name: str | None = None,
        grace: float | None = None,
    ) -> None:
        self.election = election
        self.service = service
        self.name = name or getattr(service, "__qualname__", None) or repr(service)
        self.grace = default_grace(election.config) if grace is None else float(grace)
        self.is_async = inspect.iscoroutinefunction(service)
        self.runs = 0
        """How many times the service was started."""
        self._context: LeaderContext | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._cancel_sent = False
        self._closed = False
        # A run is active from its start until it returned (set on the run's
        # own thread or task, read on the loop).
        self._active = False
        self._start_when_done = False
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def running(self) -> bool:
        """Whether a run of the service has not returned yet."""
        return self._active

    # ---------------------------------------------------- election hooks

    def transition(self, old: ElectionState, new: ElectionState) -> None:
        """The election's state changed (called synchronously on its loop)."""
        if new is ElectionState.LEADER:
            self._start()
        elif old is ElectionState.LEADER:
            self._signal_stop(self.election.ending_reason)

    async def demoted(self, reason: DemoteReason) -> None:
        """Demote callback: wait (bounded) for the stopping run to end.

        The election awaits its demote callbacks before it releases the key,
        so on a graceful hand-over the successor starts after this returns.
        """
        context = self._context
        if context is not None and context._reason is None:
            context._reason = reason
        self._signal_stop(reason)
        await self.join(self.grace)

    async def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the current run to end; whether it did."""
        task, thread = self._task, self._thread
        if task is not None and not task.done():
            await asyncio.wait({task}, timeout=timeout)
            if not task.done():
                self._warn_late()
                return False
        if thread is not None and thread.is_alive():
            await asyncio.to_thread(thread.join, timeout)
            if thread.is_alive():
                self._warn_late()
                return False
        return True

    def close(self) -> None:
        """Never start the service again (the current run is told to stop)."""
        self._closed = True
        self._signal_stop(None)

    # ---------------------------------------------------------- internals

    def _start(self) -> None:
        election = self.election
        token = election.token
        self._loop = asyncio.get_running_loop()
        if self._closed or token is None:
            return
        if self.running:
            # Never two copies here either: start this term's once the old
            # run returns (if this process still leads then).
            self._start_when_done = True
            logger.error(
                "%s: leader service %s from the previous term is still running; "
                "starting this term's copy when it returns",
                election.role,
                self.name,
            )
            return
        context = LeaderContext(election, token)
        self._context = context
        self._cancel_sent = False
        self._active = True
        self.runs += 1
        logger.info(
            "%s: starting leader service %s (epoch %d)", election.role, self.name, token.epoch
        )
        if self.is_async:
            self._task = asyncio.get_running_loop().create_task(
                self._run_async(context), name=f"leader-service-{election.role}-{self.name}"
            )
            self._task.add_done_callback(functools.partial(self._task_done, context))
        else:
            self._thread = threading.Thread(
                target=self._run_thread,
                args=(context,),
                name=f"leader-service-{election.role}-{self.name}",
                daemon=True,
            )
            self._thread.start()

    def _signal_stop(self, reason: DemoteReason | None) -> None:
        context = self._context
        if context is not None:
            context._set_stopped(reason)
        task = self._task
        if task is not None and not task.done() and not self._cancel_sent:
            # Once per run: a second cancel would interrupt the service's own
            # cleanup (its ``finally``), which the hand-over waits for.
            self._cancel_sent = True
            task.cancel()

    async def _run_async(self, context: LeaderContext) -> None:
        try:
            await self._serve_async(context)
        finally:
            self._finished(context)

    async def _serve_async(self, context: LeaderContext) -> None:
        delay = _FIRST_RESTART_DELAY
        while not context.stopped:
            try:
                result = self.service(context)
                if inspect.isawaitable(result):
                    await result
            except asyncio.CancelledError:
                if context.stopped:
                    break  # the term ended: the expected way out
                raise
            except Exception:
                logger.exception(
                    "%s: leader service %s raised; restarting in %.1fs while leading",
                    context.role,
                    self.name,
                    delay,
                )
                try:
                    await asyncio.sleep(delay)  # cancelled when the term ends
                except asyncio.CancelledError:
                    if context.stopped:
                        break
                    raise
                delay = min(delay * 2, _MAX_RESTART_DELAY)
                continue
            break

    def _run_thread(self, context: LeaderContext) -> None:
        try:
            self._serve_thread(context)
        finally:
            self._finished(context)

    def _serve_thread(self, context: LeaderContext) -> None:
        delay = _FIRST_RESTART_DELAY
        while not context.stopped:
            try:
                self.service(context)
            except Exception:
                logger.exception(
                    "%s: leader service %s raised; restarting in %.1fs while leading",
                    context.role,
                    self.name,
                    delay,
                )
                context.wait(delay)
                delay = min(delay * 2, _MAX_RESTART_DELAY)
                continue
            break

    def _task_done(self, context: LeaderContext, task: asyncio.Task[None]) -> None:
        # A task cancelled before its first step never ran _run_async's finally.
        if self._active and self._context is context:
            self._finished(context)

    def _finished(self, context: LeaderContext) -> None:
        if not self._active or self._context is not context:
            return  # reported already
        logger.info(
            "%s: leader service %s stopped (%s)",
            context.role,
            self.name,
            context.reason.value if context.reason is not None else "returned",
        )
        self._active = False
        loop = self._loop
        if self._start_when_done and loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to start
                loop.call_soon_threadsafe(self._start_late)

    def _start_late(self) -> None:
        self._start_when_done = False
        if self.election.is_leader:
            self._start()

    def _warn_late(self) -> None:
        logger.error(
            "%s: leader service %s did not stop within %.3fs of the end of its term; "
            "it may still run while another replica leads",
            self.election.role,
            self.name,
            self.grace,
        )


class LeadingScope:
    """``async with election.leading() as ctx:``: a block cancelled when the term ends.

    Entering waits until this process leads. If the term ends inside the
    block, the task running it is cancelled and the block exits with
    :class:`~celery_nats_leader.core.errors.LeadershipLostError` (the way
    ``asyncio.timeout()`` turns its cancellation into ``TimeoutError``).

    Args:
        election: The role's election.
        timeout: Seconds to wait for leadership; ``None`` waits indefinitely.

    """

    def __init__(self, election: ServiceHost, timeout: float | None = None) -> None:
        self._election = election
        self._timeout = timeout
        self._task: asyncio.Task[Any] | None = None
        self._context: LeaderContext | None = None
        self._cancelling = 0
        self._cancelled = False

    async def __aenter__(self) -> LeaderContext:
        election = self._election
        token = None
        while token is None:
            if not await election.wait_for_leadership(self._timeout):
                raise TimeoutError(f"not leading {election.role!r} within {self._timeout}s")
            token = election.token
        task = asyncio.current_task()
        assert task is not None, "LeadingScope must be entered from a task"
        self._task = task
        # Python 3.11+: count cancellations requested by others (asyncio.timeout does too).
        cancelling = getattr(task, "cancelling", None)
        self._cancelling = cancelling() if cancelling is not None else 0
        self._context = LeaderContext(election, token)
        election.add_transition_hook(self._transition)
        if election.token != token:  # the term ended while we registered
            self._end()
        return self._context

    def _transition(self, old: ElectionState, new: ElectionState) -> None:
        if old is ElectionState.LEADER and new is not ElectionState.LEADER:
            self._end()

    def _end(self) -> None:
        if self._context is not None:
            self._context._set_stopped(self._election.ending_reason)
        task = self._task
        if task is not None and not task.done() and not self._cancelled:
            self._cancelled = True
            task.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self._election.remove_transition_hook(self._transition)
        if self._context is not None:
            self._context._set_stopped(None)
        if not self._cancelled or self._task is None:
            return False
        uncancel = getattr(self._task, "uncancel", None)
        # On 3.10 a cancellation of ours cannot be told from another one.
        ours = uncancel() <= self._cancelling if uncancel is not None else True
        if ours and exc_type is asyncio.CancelledError:
            raise LeadershipLostError(
                f"leadership of {self._election.role!r} ended inside the block"
            ) from None
        return False
