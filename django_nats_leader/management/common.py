"""Helpers shared by the management commands (not a command itself)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from django.core.management.base import CommandError

from celery_nats_leader.config import validate_key
from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.errors import ConfigError, ElectionError, NotLeaderError
from celery_nats_leader.ops.output import EXIT_ERROR, EXIT_NO_LEADER
from django_nats_leader import conf


def load_settings() -> LeaderSettings:
    """The election settings, or a :class:`CommandError` naming the bad value."""
    try:
        return conf.leader_settings()
    except ConfigError as exc:
        raise CommandError(
            f"invalid {conf.SETTING_NAME} settings: {exc} (manage.py check lists every problem)",
            returncode=EXIT_ERROR,
        ) from exc


def checked_role(role: str, what: str = "ROLE") -> str:
    """``role`` if it is a valid key, else a :class:`CommandError` (exit 2) naming it.

    Args:
        role: The role given on the command line.
        what: How the message names the argument (``ROLE``, ``--role``).

    Returns:
        ``role`` unchanged.

    """
    try:
        validate_key(role, what)
    except ConfigError as exc:
        raise CommandError(str(exc), returncode=EXIT_ERROR) from exc
    return role


@contextmanager
def election_errors(
    no_leader: tuple[type[ElectionError], ...] = (NotLeaderError,),
) -> Iterator[None]:
    """Turn a request's election errors into :class:`CommandError` with the exit status.

    Args:
        no_leader: Errors that mean "nobody (able to answer) leads the role":
            exit 1 with the error's message. Any other :class:`ElectionError`
            exits 2 as "cannot reach the election".

    """
    try:
        yield
    except no_leader as exc:
        raise CommandError(str(exc), returncode=EXIT_NO_LEADER) from exc
    except ElectionError as exc:
        raise CommandError(f"cannot reach the election: {exc}", returncode=EXIT_ERROR) from exc


__all__ = ["EXIT_ERROR", "EXIT_NO_LEADER", "checked_role", "election_errors", "load_settings"]
