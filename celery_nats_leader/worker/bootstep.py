"""Celery bootsteps: run the leader election inside every worker.

Add them with one line where the app is created::

    from celery_nats_leader import install

    app = Celery("proj")
    app.config_from_object("django.conf:settings", namespace="CELERY")
    install(app)

Two thin steps, in the style of Celery's ``consumer/heart.py``; the work is
done by :class:`~celery_nats_leader.worker.service.LeaderService`:

* :class:`NatsLeaderBootstep` (worker blueprint) builds the service before the
  pool forks, starts it after, and stops it at the *start* of a shutdown, so
  that a leader hands its roles over before it waits for its running tasks;
* :class:`LeaderQueues` (consumer blueprint) hands each (re)started consumer
  to the service, which consumes a role's leader queue only while leading.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

from celery_nats_leader.errors import ConfigError, ElectionError
from celery_nats_leader.settings import LeaderSettings
from celery_nats_leader.worker.service import LeaderService
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
        settings = LeaderSettings.from_celery(worker.app.conf)
        self.service = LeaderService(worker.app, settings, hostname=worker.hostname)
        self.service.prepare_worker()
        worker.nats_leader = self.service

    def start(self, worker: Any) -> None:
        """Connect and campaign (see :meth:`LeaderService.start`)."""
        try:
            self.service.start()
        except ConfigError as exc:
            logger.critical("nats-leader: cannot start leader election: %s", exc)
            raise
        except ElectionError as exc:
            logger.critical(
                "nats-leader: cannot start leader election (nats_leader_required=True): %s",
                exc,
            )
            raise

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


class LeaderQueues(bootsteps.StartStopStep):  # type: ignore[misc]  # Celery is untyped
    """Consumer step: consume leader queues only while leading their roles."""

    label = "NATS leader queues"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c: Any) -> None:
        """Hand the (re)started consumer to the service."""
        service = getattr(c.controller, "nats_leader", None)
        if service is not None:
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
