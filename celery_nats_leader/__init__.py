"""Leader election for Celery and Django on NATS JetStream Key-Value.

One leader per *role*, fenced by a monotonic token, handed over in
milliseconds on a clean stop and within the TTL after a crash.

The core (this package's top level) imports neither Celery nor Django. The
Celery integration lives in :mod:`celery_nats_leader.worker.bootstep`,
:mod:`celery_nats_leader.worker.tasks` and :mod:`celery_nats_leader.beat`; its main
names are importable from here too, lazily, so that importing the core never
imports Celery (type checkers and IDEs see them through the ``TYPE_CHECKING``
imports below).
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import TYPE_CHECKING, Any

from celery_nats_leader.config import ElectionConfig
from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.core.errors import (
    BackendError,
    BackendTimeoutError,
    BucketConfigError,
    BucketNotFoundError,
    ConfigError,
    ElectionError,
    ElectionStoppedError,
    JetStreamUnavailableError,
    LeadershipLostError,
    NatsUnavailableError,
    NotConnectedError,
    NotLeaderError,
    PermissionDeniedError,
)
from celery_nats_leader.election import DemoteReason, Election, ElectionState, KvElection
from celery_nats_leader.election.elector import Elector, RoleHandle
from celery_nats_leader.election.interface import LeaderElection, new_election
from celery_nats_leader.election.leader_services import LeaderContext, LeadingScope
from celery_nats_leader.election.observer import ElectionObserver
from celery_nats_leader.election.status import RoleStatus
from celery_nats_leader.term.record import LeaderRecord
from celery_nats_leader.term.token import FencingToken

if TYPE_CHECKING:
    # What ``__getattr__`` returns, for type checkers and IDEs (never run).
    from celery_nats_leader.beat import LeaderScheduler, LeaderSchedulerMixin
    from celery_nats_leader.worker.bootstep import NatsLeaderBootstep, install
    from celery_nats_leader.worker.leader_services import leader_service
    from celery_nats_leader.worker.once_tasks import OnceTask, run_once
    from celery_nats_leader.worker.signals import leader_demoted, leader_promoted
    from celery_nats_leader.worker.tasks import LeaderTask, leader_only

__version__ = "0.1.0"

#: Celery-side names, imported on first use (they import Celery).
_LAZY = {
    "install": "celery_nats_leader.worker.bootstep",
    "NatsLeaderBootstep": "celery_nats_leader.worker.bootstep",
    "leader_only": "celery_nats_leader.worker.tasks",
    "leader_service": "celery_nats_leader.worker.leader_services",
    "LeaderTask": "celery_nats_leader.worker.tasks",
    "OnceTask": "celery_nats_leader.worker.once_tasks",
    "run_once": "celery_nats_leader.worker.once_tasks",
    "leader_promoted": "celery_nats_leader.worker.signals",
    "leader_demoted": "celery_nats_leader.worker.signals",
    "LeaderScheduler": "celery_nats_leader.beat",
    "LeaderSchedulerMixin": "celery_nats_leader.beat",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'celery_nats_leader' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "BackendError",
    "BackendTimeoutError",
    "BucketConfigError",
    "BucketNotFoundError",
    "ConfigError",
    "ConnectOptions",
    "DemoteReason",
    "Election",
    "ElectionConfig",
    "ElectionError",
    "ElectionObserver",
    "ElectionState",
    "ElectionStoppedError",
    "Elector",
    "FencingToken",
    "JetStreamUnavailableError",
    "KvElection",
    "LeaderContext",
    "LeaderElection",
    "LeaderRecord",
    "LeadershipLostError",
    "LeadingScope",
    "NatsUnavailableError",
    "NotConnectedError",
    "NotLeaderError",
    "PermissionDeniedError",
    "RoleHandle",
    "RoleStatus",
    "__version__",
    "new_election",
]

if find_spec("celery") is not None:
    # Listed only where Celery is installed: ``from celery_nats_leader import *``
    # imports these (and with them Celery), and without Celery it must still
    # bring the core's names instead of failing.
    __all__ += [
        "LeaderScheduler",
        "LeaderSchedulerMixin",
        "LeaderTask",
        "NatsLeaderBootstep",
        "OnceTask",
        "install",
        "leader_demoted",
        "leader_only",
        "leader_promoted",
        "leader_service",
        "run_once",
    ]
