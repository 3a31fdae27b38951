"""Celery wiring of the once-guard: run each task id's body once.

Two ways to opt a task in (the recipe is :mod:`celery_nats_leader.recipes.once_guard`)::

    @app.task(base=OnceTask)
    def send_report(): ...

    @app.task
    @leader_only          # (optional) leadership is checked first
    @run_once
    def rebuild_index(): ...

The idempotency key is the task id. Beat ticks sent by the leader scheduler
have deterministic ids (one per tick), so a tick re-sent after a failover
runs once; for other tasks, give the message an id of your choosing
(``apply_async(task_id=...)``) to make a resubmission idempotent.

Before the body runs the worker claims the id in KV (two round trips):

* already done: the message is acknowledged without running
  (:class:`~celery.exceptions.Ignore`, logged at INFO);
* running elsewhere: the message is retried after a third of the lease
  (``Retry`` with the same id, not counted against ``max_retries``): if the
  other run finishes, the retry is acknowledged; if its worker died, its
  lease expires and the retry runs it;
* NATS unreachable: retried the same way (fail closed: nothing runs unguarded,
  nothing is dropped).

After the body: success and failure are recorded as done (as Celery
acknowledges a failed task, a failed run is not run again), and so is
``Ignore`` raised by the body (``Task.replace`` has sent the replacement, a
body stored its own state): a copy of the message is not run again.
``Retry``, ``Reject`` and this package's own refusals
(:class:`~celery_nats_leader.worker.refused.NotRun`: a dispatch under an ended
beat term, a leader-only task skipped or forwarded under the same id) release
the claim so that the retry, the requeued message or the forwarded copy can
run. A replacement sent by ``Task.replace`` runs unguarded (its tick was
claimed by the task it replaces). A worker that dies in the
body records nothing: its lease expires and a redelivery (``acks_late`` with
``task_reject_on_worker_lost``) or a duplicate runs it again.

Eager and direct calls run unguarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from celery import Task
from celery._state import get_current_task
from celery.exceptions import Ignore, Reject, Retry
from celery.utils.log import get_task_logger

from celery_nats_leader.config.settings import LeaderSettings, settings_of_app
from celery_nats_leader.core.backend import Bucket
from celery_nats_leader.core.backoff import retry_transient
from celery_nats_leader.core.errors import BackendTimeoutError, ElectionError, is_transient
from celery_nats_leader.nats.process_client import ProcessClient
from celery_nats_leader.recipes.once_guard import Claim, ClaimLostError, OnceGuard, Verdict
from celery_nats_leader.worker.celery_compat import replaced_task_nesting
from celery_nats_leader.worker.recheck import recheck_later
from celery_nats_leader.worker.refused import NotRun

__all__ = ["OnceService", "OnceTask", "guards_its_runs", "run_once", "run_task_once"]

logger = logging.getLogger(__name__)
task_logger = get_task_logger(__name__)

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

_MARK = "__nats_leader_once__"
#: Seconds :meth:`OnceService.check` waits: 2 buckets × (look up, create,
#: settings), each bounded by the connection's JetStream timeout (5 s).
OPEN_BOUND_SECONDS = 35.0
#: Request attribute: this request's id is claimed by the running guard.
_CLAIMED = "_nats_leader_once_claimed"


class OnceService:
    """The once-guard of one worker process, on the process's NATS client.

    One per process and settings (:meth:`for_settings`), kept by the
    process's :class:`~celery_nats_leader.nats.process_client.ProcessClient`,
    whose loop thread and connection it uses (opened at first use, after the
    fork of a prefork child).

    Args:
        settings: The ``nats_leader_*`` settings (servers, ``once_*``).

    """

    def __init__(self, settings: LeaderSettings) -> None:
        self.settings = settings
        self.lease = float(settings.once_lease)
        self.timeout = min(
            max(settings.election_config(settings.beat_role).request_timeout, 1.0), 5.0
        )
        self.claimant = f"{socket.gethostname()}:{os.getpid()}"

    @classmethod
    def for_settings(cls, settings: LeaderSettings) -> OnceService:
        """The service of this process for ``settings`` (created on first use)."""
        return ProcessClient.for_settings(settings).shared(
            ("once", settings.once_bucket), lambda _client: cls(settings)
        )

    @property
    def client(self) -> ProcessClient:
        """The process's client the guard runs on."""
        return ProcessClient.for_settings(self.settings)

    def run(
        self, coro: Callable[[OnceGuard], Coroutine[Any, Any, T]], *, timeout: float | None = None
    ) -> T:
        """Run ``coro(guard)`` on the client's loop and wait for it.

        Args:
            coro: What to run with the guard.
            timeout: Seconds to wait (default: a claim's bound, ``4 × timeout + 2``).

        Raises:
            ElectionError: NATS did not answer in time, or the buckets are unusable.

        """
        client = self.client

        async def call() -> T:
            return await coro(await self._open(client))

        return client.run(
            call(),
            4 * self.timeout + 2.0 if timeout is None else timeout,
            what="the once-guard got no answer from NATS",
        )

    def buckets(self) -> list[tuple[str, float]]:
        """The guard's two buckets and the ``max_age`` each must have: leases, done records."""
        settings = self.settings
        return [
            (f"{settings.once_bucket}_leases", settings.once_lease),
            (settings.once_bucket, settings.once_retention),
        ]

    def check(self) -> None:
        """Open the guard's two buckets as a claim does (creating them where allowed).

        On a connection of its own, closed after: a worker's main process
        keeps only its election's connection (a prefork child opens the
        guard's client when it runs a task).

        Raises:
            ElectionError: They cannot be used (missing and not creatable, a
                permission missing, other settings) or NATS did not answer.

        """
        from celery_nats_leader.nats import open_backend

        async def opened() -> None:
            backend = await open_backend(
                self.settings.connection,
                timeout=max(self.timeout, 2.0),
                name=f"celery-nats-leader once-guard check {self.claimant}",
            )
            try:
                for name, ttl in self.buckets():
                    await backend.open_bucket(
                        name,
                        ttl=ttl,
                        create=True,
                        replicas=self.settings.bucket_replicas,
                        timeout=max(self.timeout, 2.0),
                    )
            finally:
                await backend.close()

        async def bounded() -> None:
            # Long enough for each step of opening and creating both buckets
            # to time out by itself: a refused creation is then said as such
            # (a permission), not as NATS not answering.
            try:
                await asyncio.wait_for(opened(), OPEN_BOUND_SECONDS)
            except asyncio.TimeoutError as exc:
                raise BackendTimeoutError(
                    f"the once-guard's buckets: no answer from NATS in {OPEN_BOUND_SECONDS:g}s"
                ) from exc

        asyncio.run(bounded())

    async def _open(self, client: ProcessClient) -> OnceGuard:
        # The buckets are opened once per connection (the client keeps
        # them); a failure is tried again by the next call.
        settings = self.settings
        opened: list[Bucket] = []
        for name, ttl in self.buckets():
            opened.append(
                await client.bucket(
                    name,
                    ttl=ttl,
                    create=True,
                    replicas=settings.bucket_replicas,
                    timeout=max(self.timeout, 2.0),
                )
            )
        return OnceGuard(opened[0], opened[1], claimant=self.claimant, timeout=self.timeout)

    def close(self) -> None:
        """Close the process's client (its connection and loop thread; the next use reopens)."""
        self.client.close()

    @contextlib.contextmanager
    def renewing(self, claim: Claim) -> Any:
        """Keep ``claim``'s lease alive while the body runs (a task on the loop).

        Yields:
            A one-item list holding the claim at its latest revision.

        """
        current = [claim]
        stop = threading.Event()

        async def renew(guard: OnceGuard) -> None:
            while not stop.is_set():
                await asyncio.sleep(self.lease / 3)
                if stop.is_set():
                    return
                try:
                    current[0] = await guard.renew(current[0])
                except ClaimLostError as exc:
                    logger.error("%s: a duplicate may run beside this one", exc)
                    return
                except ElectionError as exc:
                    logger.warning("could not renew the claim on %r: %s", claim.key, exc)

        client = self.client
        future = client.submit(self._with_guard(client, renew))
        try:
            yield current
        finally:
            stop.set()
            future.cancel()

    async def _with_guard(
        self, client: ProcessClient, coro: Callable[[OnceGuard], Coroutine[Any, Any, None]]
    ) -> None:
        await coro(await self._open(client))


def _guarded(task: Any) -> bool:
    request = task.request
    if replaced_task_nesting(request):
        # Task.replace sent it under the id of the task it replaces, whose
        # run is recorded done: guarding it would drop it as "already ran".
        return False
    return bool(request.id) and not request.is_eager and not request.called_directly


def run_task_once(task: Any, call: Callable[[], T]) -> T:
    """Run ``call`` (the body of ``task``'s current request) once per task id.

    The building block of :class:`OnceTask` and :func:`run_once`.

    Args:
        task: The executing task (``task.request`` is the message).
        call: The body.

    Returns:
        What ``call`` returned.

    Raises:
        Ignore: A run of this id finished already.
        Retry: Another run holds the id, or NATS could not be asked.

    """
    if not _guarded(task) or getattr(task.request, _CLAIMED, False):
        # Already claimed for this request (a beat tick's guard around an
        # OnceTask or @run_once body): claiming again would find our own lease.
        return call()
    service = OnceService.for_settings(settings_of_app(task.app))
    task_id = str(task.request.id)
    retry_in = max(service.lease / 3, 0.1)
    try:
        claim = service.run(lambda guard: guard.claim(task_id))
    except ElectionError as exc:
        # Kept (retried), never run unguarded nor dropped; a problem that
        # needs an operator (bucket settings, permissions) is said at ERROR.
        task_logger.log(
            logging.WARNING if is_transient(exc) else logging.ERROR,
            "%s[%s]: cannot claim its id (%s); retrying in %gs",
            task.name,
            task_id,
            exc,
            retry_in,
        )
        raise recheck_later(task, retry_in, exc=exc) from exc
    if claim.verdict is Verdict.DONE:
        by = (claim.holder or {}).get("by", "?")
        task_logger.info(
            "%s[%s]: already ran (on %s); not running it again", task.name, task_id, by
        )
        raise Ignore()
    if claim.verdict is Verdict.BUSY:
        by = (claim.holder or {}).get("by", "?")
        task_logger.info(
            "%s[%s]: running on %s; checking again in %gs", task.name, task_id, by, retry_in
        )
        raise recheck_later(task, retry_in)
    # The renewal stops before the outcome is written (it must not move the
    # lease's revision under the final delete).
    setattr(task.request, _CLAIMED, True)
    renewal = service.renewing(claim)
    try:
        current = renewal.__enter__()
    except RuntimeError as exc:
        # The process's client was closed under us (at exit): the body did
        # not run; another copy or the retry may run it.
        _settle(service, lambda guard: guard.release(claim))
        raise recheck_later(task, retry_in, exc=exc) from exc
    try:
        try:
            result = call()
        finally:
            renewal.__exit__(None, None, None)
    except (Retry, Reject, NotRun):
        # Not a finished run: a retry, a requeue or a copy we forwarded
        # (same id) must be able to run it.
        _settle(service, lambda guard: guard.release(current[0]))
        raise
    except Ignore:
        # The body finished its own way (Task.replace sent the replacement,
        # update_state then Ignore): a copy of the message must not run it again.
        _settle(service, lambda guard: guard.complete(current[0], "ignored"))
        raise
    except Exception:
        _settle(service, lambda guard: guard.complete(current[0], "failure"))
        raise
    _settle(service, lambda guard: guard.complete(current[0], "success"))
    return result


def _settle(service: OnceService, step: Callable[[OnceGuard], Coroutine[Any, Any, Any]]) -> None:
    # Transient failures (JetStream out of storage for a moment, a cluster
    # between stream leaders) are retried while the lease still stands: until
    # it expires a duplicate is told "busy", so retrying for half of it is
    # safe, and a record written late still stops every later duplicate.
    try:
        retry_transient(
            lambda _remaining: service.run(step),
            timeout=service.lease / 2,
            what="recording a finished run in the once-guard",
        )
    except ElectionError as exc:
        # The body ran; the claim expires by itself. Until it does a duplicate
        # is retried; after it, a duplicate would run again: say so.
        logger.error(
            "could not record a finished run in the once-guard (%s): a duplicate arriving "
            "after the lease may run again",
            exc,
        )


def guards_its_runs(task: Any) -> bool:
    """Whether ``task`` claims each run in the once-guard (``OnceTask``, ``@run_once``)."""
    if isinstance(task, OnceTask):
        return True
    return getattr(getattr(task, "run", None), _MARK, None) is not None


class OnceTask(Task):  # type: ignore[misc]  # Celery is untyped
    """Task base whose body runs once per task id: ``@app.task(base=OnceTask)``.

    See the module documentation for what a duplicate, a failure and a
    worker crash do.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body under the once-guard (worker executions only)."""
        parent = super().__call__
        return run_task_once(self, lambda: parent(*args, **kwargs))


def run_once(fun: F) -> F:
    """Decorator form of :class:`OnceTask`, to put under ``@app.task``.

    Composes with :func:`~celery_nats_leader.tasks.leader_only`: put
    ``@leader_only`` above it, so that a follower requeues the message before
    anything is claimed.

    Args:
        fun: The task function.

    Returns:
        The wrapped function.

    Raises:
        TypeError: If applied over ``@app.task`` instead of under it.

    """
    if isinstance(fun, Task):
        raise TypeError("put @run_once under @app.task, not over it")

    @functools.wraps(fun)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        task = get_current_task()
        # Only when a worker executes the task this function is the body of.
        if task is None or getattr(getattr(task, "run", None), _MARK, None) is not fun:
            return fun(*args, **kwargs)
        return run_task_once(task, lambda: fun(*args, **kwargs))

    setattr(wrapper, _MARK, fun)
    return wrapper  # type: ignore[return-value]
