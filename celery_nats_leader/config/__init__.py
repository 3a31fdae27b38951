"""Configuration: the election's settings, the process's settings and their defaults.

* :mod:`.election`: :class:`ElectionConfig`, one frozen, validated dataclass
  per role (re-exported here: ``from celery_nats_leader.config import
  ElectionConfig`` is the import path);
* :mod:`.settings`: :class:`~.settings.LeaderSettings`, a process's
  connection and roles, read from Celery's or Django's configuration;
* :mod:`.connection`: :class:`~.connection.ConnectOptions`, how to reach NATS.

Defaults, limits and naming conventions are in :mod:`celery_nats_leader.core.constants`.
"""

from __future__ import annotations

from celery_nats_leader.config.election import (
    ElectionConfig,
    HealthCheck,
    Strategy,
    default_instance_id,
    resolve_health_check,
    validate_bucket,
    validate_key,
)

__all__ = [
    "ElectionConfig",
    "HealthCheck",
    "Strategy",
    "default_instance_id",
    "resolve_health_check",
    "validate_bucket",
    "validate_key",
]
