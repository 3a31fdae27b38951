"""Celery beat on every replica, dispatching from exactly one: the leader scheduler.

Run ``celery beat`` (or ``celery worker -B``) on every replica with::

    celery -A proj beat -S nats_leader            # Celery's default scheduler semantics
    celery -A proj beat -S django_nats_leader     # django-celery-beat's DatabaseScheduler

Every replica campaigns for the ``beat`` role (``nats_leader_beat_role``);
only its leader dispatches. A follower's tick reads and writes nothing: it
waits a short, bounded time (a promotion wakes it at once) and looks again.

Each dispatch, by the leader only, validates the fencing token against KV,
commits the tick (identified by its *slot*, the time the schedule says it is
due) with a compare-and-set, sends it with the term's epoch and the tick's identity
in its headers (``nats_leader_*``), and records the send (or reverts the
commit when it could not be sent). A tick committed by a scheduler that died
before recording its send is sent again by the next one, under the same task
id: delivery is **at least once per tick**, and execution exactly once on
workers with the bootstep (:func:`celery_nats_leader.install`), which run
every tick under the once-guard unless the entry or the settings opt out.

The package, one part per module:

* :mod:`~celery_nats_leader.beat.scheduler`: the Celery mixin (Celery's
  hooks and the subclasses' hooks, wiring the parts) and
  :class:`LeaderScheduler`;
* :mod:`~celery_nats_leader.beat.leader_pass`: the leader's pass (which due
  tick goes first, its dispatch, what came of it);
* :mod:`~celery_nats_leader.beat.send`: a committed tick's message (task id,
  headers) and Celery's ``apply_async``;
* :mod:`~celery_nats_leader.beat.introspection`: what is read from Celery's
  schedules;
* :mod:`~celery_nats_leader.beat.signals`: SIGTERM and SIGINT held back
  while a tick is dispatched;
* :mod:`~celery_nats_leader.beat.dispatcher`: validate, commit, send, record
  or revert, and re-send a pending tick (no Celery);
* :mod:`~celery_nats_leader.beat.election`: the beat role (no Celery);
* :mod:`~celery_nats_leader.beat.ticks`: tick identity and planning (no Celery);
* :mod:`~celery_nats_leader.beat.agenda`: when to ask each entry again (no Celery);
* :mod:`~celery_nats_leader.beat.metrics`: per-entry tick counters (no Celery);
* :mod:`~celery_nats_leader.beat.schedule_store`: the entries' state in KV (no Celery);
* :mod:`~celery_nats_leader.beat.dispatch_fence`: the worker-side check of the term.

The Celery names below are imported on first use, so the parts that import
no Celery can be imported without it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from celery_nats_leader.beat.ticks import tick_task_id
from celery_nats_leader.core.constants import (
    DISPATCHER_HEADER,
    ENTRY_HEADER,
    EPOCH_HEADER,
    ONCE_HEADER,
    ROLE_HEADER,
    RUN_HEADER,
    TICK_HEADER,
    TOKEN_HEADER,
)

if TYPE_CHECKING:
    from celery_nats_leader.beat.dispatch_fence import (
        DispatchCheck,
        DispatchFence,
        FencedBeatTask,
        check_dispatch_token,
        enforce_dispatch_token,
    )
    from celery_nats_leader.beat.scheduler import LeaderScheduler, LeaderSchedulerMixin

__all__ = [
    "DISPATCHER_HEADER",
    "ENTRY_HEADER",
    "EPOCH_HEADER",
    "ONCE_HEADER",
    "ROLE_HEADER",
    "RUN_HEADER",
    "TICK_HEADER",
    "TOKEN_HEADER",
    "DispatchCheck",
    "DispatchFence",
    "FencedBeatTask",
    "LeaderScheduler",
    "LeaderSchedulerMixin",
    "check_dispatch_token",
    "enforce_dispatch_token",
    "tick_task_id",
]

_SCHEDULER = "celery_nats_leader.beat.scheduler"
_FENCE = "celery_nats_leader.beat.dispatch_fence"

#: Names that import Celery, by the module that defines them.
_LAZY = {
    "LeaderScheduler": _SCHEDULER,
    "LeaderSchedulerMixin": _SCHEDULER,
    "DispatchCheck": _FENCE,
    "DispatchFence": _FENCE,
    "FencedBeatTask": _FENCE,
    "check_dispatch_token": _FENCE,
    "enforce_dispatch_token": _FENCE,
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
