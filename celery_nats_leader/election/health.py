"""Health-check demotion, shared by every election strategy.

While a process leads, its health check runs every ``health_check_interval``;
after ``health_check_failures`` failures in a row the leader resigns, so that a
healthier candidate takes the role. The check runs on its own task (sync
checks on a worker thread), never on the renewal path.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable

from celery_nats_leader.config import ElectionConfig
from celery_nats_leader.election.callbacks import DaemonExecutor

logger = logging.getLogger(__name__)


async def watch_health(
    config: ElectionConfig, still_leading: Callable[[], bool], resign: Callable[[], None]
) -> None:
    """Run the health check while ``still_leading()``; call ``resign()`` on too many failures.

    Args:
        config: The role's configuration (``health_check`` must be set).
        still_leading: Whether the term this watch belongs to is still current.
        resign: Asks the election to step down; called at most once.
    """
    check = config.health_check
    assert check is not None
    loop = asyncio.get_running_loop()
    # A daemon thread: a check that hangs must not keep the process from exiting
    # (it times out here, counts as a failure, and is left behind).
    executor = DaemonExecutor(f"health-{config.role}")
    try:
        await _watch(config, check, still_leading, resign, loop=loop, executor=executor)
    finally:
        executor.shutdown(wait=False)


async def _watch(
    config: ElectionConfig,
    check: Callable[[], object],
    still_leading: Callable[[], bool],
    resign: Callable[[], None],
    *,
    loop: asyncio.AbstractEventLoop,
    executor: DaemonExecutor,
) -> None:
    failures = 0
    while still_leading():
        await asyncio.sleep(config.health_check_interval)
        try:
            if inspect.iscoroutinefunction(check):
                healthy = await asyncio.wait_for(check(), config.heartbeat_interval)
            else:
                result = await asyncio.wait_for(
                    loop.run_in_executor(executor, check), config.heartbeat_interval
                )
                healthy = await result if inspect.isawaitable(result) else result
        except Exception:
            logger.exception("%s: health check raised", config.role)
            healthy = False
        failures = 0 if healthy else failures + 1
        if failures:
            logger.warning(
                "%s: health check failed (%d/%d)",
                config.role,
                failures,
                config.health_check_failures,
            )
        if failures >= config.health_check_failures and still_leading():
            resign()
            return
