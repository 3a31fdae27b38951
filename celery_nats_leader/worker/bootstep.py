"""Celery bootsteps: run the leader election inside every worker.

Add them with one line where the app is created::

    from celery_nats_leader import install

    app = Celery("proj")
    app.config_from_object("django.conf:settings", namespace="CELERY")
    install(app)

Two thin steps, in the style of Celery's ``consumer/heart.py``; the work is
done by :class:`~celery_nats_leader.worker.election.WorkerElection`:

* :class:`NatsLeaderBootstep` (worker blueprint) builds the service before the
  pool forks, starts it after, and stops it at the *start* of a shutdown, so
  that a leader hands its roles over before it waits for its running tasks;
* :class:`LeaderQueues` (consumer blueprint) hands each (re)started consumer
  to the service, which consumes a role's leader queue only while leading.
"""

from __future__ import annotations

import logging
import os
from typing import Any, NoReturn

from celery import bootsteps
from celery.concurrency.solo import TaskPool as SoloPool

from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.errors import ConfigError, ElectionError
from celery_nats_leader.worker.celery_compat import (
    hub_polls_at_once_when_ready,
    hub_wakes_on_call_soon,
    immediate_acks,
    pool_shutdown_tells_every_process,
)
from celery_nats_leader.worker.election import WorkerElection
from celery_nats_leader.worker.tasks import install_routing

__all__ = ["LeaderQueues", "NatsLeaderBootstep", "install"]

logger = logging.getLogger(__name__)


class NatsLeaderBootstep(bootsteps.StartStopStep):  # type: ignore[misc]  # Celery is untyped
    """Worker step: the worker campaigns for ``nats_leader_roles``.

    Reads the ``nats_leader_*`` settings when the worker is created (a bad
    value stops the worker with a message naming the setting), builds the
    service before the pool forks (children inherit the shared state), and
    starts campaigning once the pool runs.
    """

    label = "NATS leader"
    # Start after the pool has forked its children: no election threads exist
    # yet when they fork.
    requires = ("celery.worker.components:Pool",)

    def __init__(self, worker: Any, **kwargs: Any) -> None:
        super().__init__(worker, **kwargs)
        pool = getattr(worker, "pool_cls", None)
        if getattr(pool, "is_green", False):
            _refuse(
                os.EX_CONFIG,
                "cannot start the worker: %s",
                ConfigError(
                    f"the {_pool_name(pool)} pool is not supported: the leader election runs an "
                    "asyncio event loop on an OS thread of its own, which green-thread "
                    "monkey-patching turns into a greenlet that a blocking task would stall "
                    "(renewals late, leadership lost). Use -P prefork (the default), threads "
                    "or solo"
                ),
            )
        try:
            settings = LeaderSettings.from_celery(worker.app.conf)
        except ConfigError as exc:
            _refuse(os.EX_CONFIG, "cannot start the worker: %s", exc)
        self.service = WorkerElection(worker.app, settings, hostname=worker.hostname)
        self.service.prepare_worker()
        worker.nats_leader = self.service

    def start(self, worker: Any) -> None:
        """Connect and campaign (see :meth:`WorkerElection.start`)."""
        # A billiard race could otherwise keep the warm shutdown that hands
        # the roles over from ever ending (see the function).
        pool_shutdown_tells_every_process(getattr(worker, "pool", None))
        try:
            self.service.start()
        except ConfigError as exc:
            _refuse(os.EX_CONFIG, "cannot start leader election: %s", exc)
        except ElectionError as exc:
            _refuse(
                os.EX_UNAVAILABLE,
                "cannot start leader election (nats_leader_required=True): %s",
                exc,
            )

    def close(self, worker: Any) -> None:
        """First thing at shutdown: release leadership, before tasks are awaited."""
        self.service.stop()

    def stop(self, worker: Any) -> None:
        """Stop the service (idempotent)."""
        self.service.stop()

    def terminate(self, worker: Any) -> None:
        """Cold shutdown: still release leadership (it takes milliseconds)."""
        self.service.stop()

    def shutdown(self, worker: Any) -> None:
        """Stop the service (idempotent)."""
        self.service.stop()


def _pool_name(pool: Any) -> str:
    """``celery.concurrency.gevent.TaskPool`` -> ``gevent``."""
    module = str(getattr(pool, "__module__", ""))
    return module.rsplit(".", 1)[-1] or repr(pool)


def _refuse(exit_code: int, message: str, exc: Exception) -> NoReturn:
    """Stop the worker with one clear line instead of a chain of tracebacks.

    The error is the user's to fix (a setting, a missing bucket), not a bug:
    its NATS-level causes would only bury the message. Celery's worker stops
    cleanly on ``SystemExit`` (with this exit code) during start-up.
    """
    logger.critical("nats-leader: " + message, f"{type(exc).__name__}: {exc}")
    raise SystemExit(exit_code) from None


class LeaderQueues(bootsteps.StartStopStep):  # type: ignore[misc]  # Celery is untyped
    """Consumer step: consume leader queues only while leading their roles."""

    label = "NATS leader queues"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        """Hand the (re)started consumer to the service."""
        service = getattr(c.controller, "nats_leader", None)
        if service is not None:
            # Before Celery/kombu 5.7, acks and the leader-queue change wait
            # for the event loop's next timeout (seconds).
            immediate_acks(c)
            hub_wakes_on_call_soon(getattr(c, "hub", None))
            if isinstance(getattr(c, "pool", None), SoloPool):
                # A solo task runs in the event loop, and its ack can wait
                # for the loop's next poll (up to 10 s), holding back the
                # next prefetched task. Other pools ack from I/O callbacks or
                # other threads, which do not wait.
                hub_polls_at_once_when_ready(getattr(c, "hub", None))
            service.queues.attach(c)

    def stop(self, c: Any) -> None:
        """The consumer stops or reconnects: forget it."""
        service = getattr(c.controller, "nats_leader", None)
        if service is not None:
            service.queues.detach(c)

    shutdown = stop


def install(app: Any) -> None:
    """Add leader election to ``app``'s workers and route its leader-only tasks.

    Idempotent. Call it where the app is created, in every process that uses
    the app (workers and the processes that send tasks).

    Args:
        app: The Celery app.

    """
    app.steps["worker"].add(NatsLeaderBootstep)
    app.steps["consumer"].add(LeaderQueues)
    install_routing(app)
