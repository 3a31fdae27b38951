"""Helpers shared by the management commands (not a command itself)."""

from __future__ import annotations

from django.core.management.base import CommandError

from celery_nats_leader.errors import ConfigError
from celery_nats_leader.settings import LeaderSettings
from django_nats_leader import conf

#: Exit code when a role has no leader (or no leader accepted a request).
EXIT_NO_LEADER = 1

#: Exit code when NATS cannot be used: unreachable, bucket missing, bad settings.
EXIT_ERROR = 2


def load_settings() -> LeaderSettings:
    """The election settings, or a :class:`CommandError` naming the bad value."""
    try:
        return conf.leader_settings()
    except ConfigError as exc:
        raise CommandError(
            f"invalid {conf.SETTING_NAME} settings: {exc} (manage.py check lists every problem)",
            returncode=EXIT_ERROR,
        ) from exc


__all__ = ["EXIT_ERROR", "EXIT_NO_LEADER", "load_settings"]
