"""Run every tick our beat schedulers send once, on workers with the bootstep.

The leader schedulers (``LeaderScheduler``, django's
``LeaderDatabaseScheduler``) send each tick under a task id derived from the
tick (:func:`~celery_nats_leader.beat.ticks.tick_task_id`) and mark it with the
``nats_leader_once`` header unless the entry or the settings opted out. The
outbox may send a tick twice (a scheduler killed between its publish and its
record, a paused one waking up): a worker with the bootstep runs the body of
such a message under the once-guard (:func:`~celery_nats_leader.worker.once_tasks.run_task_once`),
keyed by that id, whatever the task's base class. So a plain ``@app.task``
runs each tick once, as ``OnceTask`` does.

Nothing else changes: messages without the header (every message not sent by
our schedulers, direct and eager calls) run as before, and a task that
guards itself (``OnceTask``, ``@run_once``) is claimed once, not twice.

How: the bootstep gives every registered task's class a ``__call__`` that
checks the header first (Celery's documented way to wrap a task's execution;
Celery's tracer then calls it instead of ``run``). A ``task_prerun`` receiver
could not do it: Celery logs and drops its exceptions, so it cannot refuse a
duplicate.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from celery_nats_leader.core.constants import ONCE_HEADER, TICK_HEADER
from celery_nats_leader.worker.once_tasks import run_task_once

__all__ = ["guard_beat_ticks", "is_once_tick"]

logger = logging.getLogger(__name__)

_WRAPPED = "__nats_leader_tick_once__"


def is_once_tick(request: Any) -> bool:
    """Whether ``request`` is a tick our scheduler asked to run once.

    Args:
        request: A task's request (``task.request``).

    Returns:
        ``True`` for a worker execution of a message carrying the tick and
        ``nats_leader_once`` headers (``True``, or its text after a transport
        that turns header values into strings).

    """
    if not getattr(request, "id", None) or request.is_eager or request.called_directly:
        return False
    headers = getattr(request, "headers", None)
    found: Mapping[str, Any] = headers if isinstance(headers, Mapping) else {}
    once = found.get(ONCE_HEADER, getattr(request, ONCE_HEADER, None))
    tick = found.get(TICK_HEADER, getattr(request, TICK_HEADER, None))
    return tick is not None and (once is True or str(once).lower() in ("true", "1"))


def _guard_class(cls: type) -> bool:
    """Give ``cls`` a ``__call__`` that runs our ticks once (idempotent)."""
    inner = cls.__call__
    if getattr(inner, _WRAPPED, False):
        return False

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if is_once_tick(self.request):
            return run_task_once(self, lambda: inner(self, *args, **kwargs))
        return inner(self, *args, **kwargs)

    setattr(__call__, _WRAPPED, True)
    __call__.__doc__ = inner.__doc__
    setattr(cls, "__call__", __call__)  # noqa: B010 - the class attribute, on purpose
    return True


def guard_beat_ticks(app: Any) -> int:
    """Make every task of ``app`` run our schedulers' ticks once (idempotent).

    Called by the worker's bootstep before the pool forks, after the app's
    tasks are imported. A task registered later (imported lazily by another
    task) is not covered: give it ``base=OnceTask`` if its ticks must run once.

    Args:
        app: The Celery app.

    Returns:
        How many task classes were given the check.

    """
    count = sum(_guard_class(type(task)) for task in list(app.tasks.values()))
    logger.debug("nats-leader: beat ticks run once on %d task classes", count)
    return count
