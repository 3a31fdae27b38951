"""Built-in health checks for Celery workers: is the broker reachable?

A health check decides whether this process is fit to lead (see the
``nats_leader_health_check`` setting): after ``health_check_failures``
failures in a row the leader resigns so that a healthier replica takes the
role. A leader that cannot reach the broker cannot run leader-only tasks nor
send beat's ticks, so this is the check most workers want::

    nats_leader_health_check = "celery_nats_leader.worker.health:broker_reachable"
    nats_leader_health_check_interval = 10

The check runs on a worker thread, never on the renewal path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

#: Seconds one broker check may take.
DEFAULT_BROKER_TIMEOUT_SECONDS = 2.0


def broker_check(
    app: Any = None, *, timeout: float = DEFAULT_BROKER_TIMEOUT_SECONDS
) -> Callable[[], bool]:
    """A health check that connects to ``app``'s broker.

    Args:
        app: The Celery app; default the current app (the worker's).
        timeout: Seconds the connection may take.

    Returns:
        A callable returning whether the broker accepted a connection.

    """

    def check() -> bool:
        from celery import current_app

        target = app if app is not None else current_app
        try:
            with target.connection_for_write() as connection:
                connection.ensure_connection(max_retries=1, interval_start=0, timeout=timeout)
        except Exception as exc:  # any failure to connect means "not fit to lead"
            logger.warning("health check: broker %s unreachable: %s", target.conf.broker_url, exc)
            return False
        return True

    return check


#: The worker's broker, for the dotted-path setting.
broker_reachable = broker_check()

__all__ = ["DEFAULT_BROKER_TIMEOUT_SECONDS", "broker_check", "broker_reachable"]
