"""Settings of the Django app: one ``NATS_LEADER = {...}`` dict, read when used.

Every value is read from :data:`django.conf.settings` at the moment it is
needed, never copied into a module global at import time, so
``override_settings`` and settings changed by tests behave as expected.

The keys are the fields of :class:`~celery_nats_leader.config.settings.LeaderSettings`,
in any case (``"TTL"`` or ``"ttl"``)::

    NATS_LEADER = {
        "SERVERS": ["nats://nats-1:4222", "nats://nats-2:4222"],
        "CONNECT_OPTIONS": {"user_credentials": "/etc/nats/app.creds"},
        "BUCKET": "leaders",
        "ROLES": ["default", "reports"],
        "TTL": 10,
        "PRIORITY": 0,
    }

A Celery app configured from Django settings (``namespace="CELERY"``) may also
carry ``CELERY_NATS_LEADER_<FIELD>`` settings; they override the matching
``NATS_LEADER`` key, so the dict is the project-wide base and the Celery keys
are Celery-specific refinements. :func:`leader_settings` applies that merge and
:func:`configure_celery` makes a Celery app see it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

from celery_nats_leader.config.settings import CELERY_PREFIX, LeaderSettings, is_leader_scheduler
from celery_nats_leader.core.errors import ConfigError

logger = logging.getLogger(__name__)

#: Name of the Django setting holding the dict.
SETTING_NAME = "NATS_LEADER"

#: Prefix of the Celery settings in Django's settings (``namespace="CELERY"``).
DJANGO_CELERY_PREFIX = "CELERY_NATS_LEADER_"


def known_keys() -> frozenset[str]:
    """The accepted keys of ``NATS_LEADER``, lower-case."""
    return frozenset(f.name for f in dataclasses.fields(LeaderSettings))


def raw_settings() -> dict[str, Any]:
    """The ``NATS_LEADER`` dict with lower-case keys (empty when unset).

    Returns:
        A new dict; mutating it does not touch the settings.

    Raises:
        ConfigError: If ``NATS_LEADER`` is not a dict, or names one key twice
            in different cases.

    """
    from django.conf import settings

    value = getattr(settings, SETTING_NAME, None)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{SETTING_NAME} must be a dict such as {{'SERVERS': ['nats://127.0.0.1:4222'], "
            f"'ROLES': ['default']}}, not {type(value).__name__}"
        )
    values: dict[str, Any] = {}
    for key, item in value.items():
        name = str(key).lower()
        if name in values:
            raise ConfigError(f"{SETTING_NAME} names {name!r} twice (keys are case-insensitive)")
        values[name] = item
    return values


def celery_overrides(celery_conf: Any = None) -> dict[str, Any]:
    """The ``nats_leader_*`` values set on the Celery side.

    Args:
        celery_conf: A Celery app's ``conf``; by default the
            ``CELERY_NATS_LEADER_<FIELD>`` settings of Django are read instead.

    Returns:
        Field names (lower-case) to values, only for the keys that are set.

    """
    values: dict[str, Any] = {}
    if celery_conf is None:
        from django.conf import settings

        for name in sorted(known_keys()):
            value = getattr(settings, DJANGO_CELERY_PREFIX + name.upper(), None)
            if value is not None:
                values[name] = value
        return values
    for name in sorted(known_keys()):
        for key in (CELERY_PREFIX + name, (CELERY_PREFIX + name).upper()):
            try:
                value = celery_conf.get(key)
            except Exception:  # Celery's conf raises odd errors for unknown keys
                value = None
            if value is not None:
                values[name] = value
                break
    return values


def leader_settings(celery_conf: Any = None) -> LeaderSettings:
    """The process's election settings: ``NATS_LEADER`` under the Celery overrides.

    This is what the management commands, the checks and the admin page use;
    the Celery integration reads the same values when the app is set up with
    :func:`configure_celery`.

    Args:
        celery_conf: A Celery app's ``conf`` whose ``nats_leader_*`` keys
            override ``NATS_LEADER``; by default Django's
            ``CELERY_NATS_LEADER_*`` settings do.

    Returns:
        Validated settings.

    Raises:
        ConfigError: On an unknown key or an invalid value; the message names it.

    """
    values = raw_settings()
    values.update(celery_overrides(celery_conf))
    return LeaderSettings.from_mapping(values)


def beat_is_elected() -> bool:
    """Whether this project runs celery beat under the leader scheduler.

    True when ``CELERY_BEAT_SCHEDULER`` (Django setting) names one of this
    package's schedulers; then the beat role must have a leader too.
    """
    from django.conf import settings

    return is_leader_scheduler(getattr(settings, "CELERY_BEAT_SCHEDULER", None))


def expected_roles(settings: LeaderSettings) -> tuple[str, ...]:
    """The roles that must have a leader: ``ROLES``, plus ``BEAT_ROLE`` when beat is elected."""
    roles = list(settings.roles)
    if beat_is_elected():
        roles.append(settings.beat_role)
    return tuple(dict.fromkeys(roles))


def celery_defaults() -> dict[str, Any]:
    """``NATS_LEADER`` as Celery ``nats_leader_*`` keys (for ``app.add_defaults``).

    Returns an empty dict when Django settings are not available at all, so
    a Celery app can use this whether or not it runs inside a Django project.
    """
    from django.conf import settings

    if not settings.configured and not os.environ.get("DJANGO_SETTINGS_MODULE"):
        return {}
    # Celery looks defaults added this way up *before* the Django settings
    # object, so leave out what CELERY_NATS_LEADER_* sets: it must win.
    refined = celery_overrides()
    return {
        CELERY_PREFIX + name: value for name, value in raw_settings().items() if name not in refined
    }


def configure_celery(app: Any) -> None:
    """Make a Celery app read ``NATS_LEADER`` as its ``nats_leader_*`` defaults.

    Call it where the app is created, after ``config_from_object``::

        app = Celery("proj")
        app.config_from_object("django.conf:settings", namespace="CELERY")
        configure_celery(app)
        install(app)

    The values are read lazily, when Celery first reads its configuration,
    and rank below every ``CELERY_NATS_LEADER_*`` setting and anything set on
    ``app.conf`` directly, exactly like :func:`leader_settings`.

    Args:
        app: The Celery app.

    """
    if getattr(app, _CONFIGURED, False):
        return
    setattr(app, _CONFIGURED, True)
    app.add_defaults(celery_defaults)


#: Marks a Celery app :func:`configure_celery` was called on.
_CONFIGURED = "_nats_leader_django_configured"


def configure_forgotten(app: Any) -> bool:
    """Call :func:`configure_celery` on ``app`` if the project forgot to; say so.

    Connected to Celery's ``worker_init`` and ``beat_init`` by the Django app
    (:mod:`django_nats_leader.apps`): without it a worker of a project that
    sets ``NATS_LEADER`` would run with the defaults while ``manage.py`` uses
    the real values.

    Returns:
        Whether it had to.

    """
    if getattr(app, _CONFIGURED, False) or not raw_settings():
        return False
    logger.warning(
        "nats-leader: the Celery app %r was not given NATS_LEADER (configure_celery(app) "
        "is not called where it is created): applying it now. Add the call after "
        "config_from_object() so that every process reads the same settings",
        getattr(app, "main", None) or app,
    )
    configure_celery(app)
    return True


__all__ = [
    "DJANGO_CELERY_PREFIX",
    "SETTING_NAME",
    "beat_is_elected",
    "celery_defaults",
    "celery_overrides",
    "configure_celery",
    "configure_forgotten",
    "expected_roles",
    "known_keys",
    "leader_settings",
    "raw_settings",
]
