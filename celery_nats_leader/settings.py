"""Moved to :mod:`celery_nats_leader.config.settings`; this import path keeps working."""

from __future__ import annotations

from celery_nats_leader.config.settings import (
    CELERY_PREFIX,
    LeaderSettings,
    election_field,
    settings_of_app,
    unknown_celery_settings,
)

__all__ = [
    "CELERY_PREFIX",
    "LeaderSettings",
    "election_field",
    "settings_of_app",
    "unknown_celery_settings",
]
