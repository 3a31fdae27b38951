"""Configuration: the election's settings, the process's settings and their defaults.

* :mod:`.election`: :class:`ElectionConfig`, one frozen, validated dataclass
  per role (re-exported here: ``from celery_nats_leader.config import
  ElectionConfig`` is the import path);
* :mod:`.settings`: :class:`~.settings.LeaderSettings`, a process's
  connection and roles, read from Celery's or Django's configuration;
* :mod:`.constants`: every default, limit and naming convention.

``celery_nats_leader.settings`` and ``celery_nats_leader.constants``, their
old paths, keep working.
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
