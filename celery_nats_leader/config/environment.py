"""Settings from the process's environment: ``NATS_LEADER_<SETTING>`` and ``NATS_URL``.

What changes from one deployment to the next (where NATS is, its credentials
file, the metrics port, whether NATS is required to start) belongs in the
environment a manifest or a unit file gives the process, not in the code.
Every setting can come from there, under its upper-case name with the prefix
``NATS_LEADER_``: ``NATS_LEADER_SERVERS``, ``NATS_LEADER_METRICS_PORT``,
``NATS_LEADER_REQUIRED``, ``NATS_LEADER_TTL``, ... The variables the NATS
tools read fill in what those leave unset: ``NATS_URL`` the servers,
``NATS_USER`` and ``NATS_PASSWORD`` or ``NATS_CREDS`` (a credentials file)
the connect options.

Precedence, highest first: the app's configuration (Celery's
``nats_leader_*``, Django's ``NATS_LEADER`` and ``CELERY_NATS_LEADER_*``),
then ``NATS_LEADER_<SETTING>``, then the NATS tools' variables, then the
defaults. A
variable the configuration overrides with another value is said at WARNING
(once per process), so a manifest's value is never ignored in silence.

Values are text: booleans are ``true``/``false`` (``1``/``0``, ``yes``/``no``,
``on``/``off``), lists are comma-separated (``nats://a:4222,nats://b:4222``),
mappings are JSON objects (``NATS_LEADER_CONNECT_OPTIONS='{"user_credentials":
"/etc/nats/worker.creds"}'``), an empty value of an optional number is unset.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from celery_nats_leader.core.errors import ConfigError

__all__ = ["ENV_PREFIX", "NATS_TOOLS", "NATS_URL", "from_environment", "variable_for"]

logger = logging.getLogger(__name__)

#: Prefix of the settings' environment variables.
ENV_PREFIX = "NATS_LEADER_"
#: The NATS tools' own variable: the servers, when NATS_LEADER_SERVERS is unset.
NATS_URL = "NATS_URL"
#: The NATS tools' credential variables and the connect options they give,
#: when NATS_LEADER_CONNECT_OPTIONS is unset.
NATS_TOOLS = {"NATS_USER": "user", "NATS_PASSWORD": "password", "NATS_CREDS": "user_credentials"}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}

#: Messages already logged by this process.
_reported: set[str] = set()


def variable_for(name: str) -> str:
    """The environment variable of setting ``name`` (``ttl`` -> ``NATS_LEADER_TTL``)."""
    return ENV_PREFIX + name.upper()


def _say_once(message: str) -> None:
    if message not in _reported:
        _reported.add(message)
        logger.warning("nats-leader: %s", message)


def _parse(variable: str, text: str, kind: str) -> Any:
    """The value of a variable, for a field annotated ``kind``."""
    kind = kind.replace("typing.", "")
    raw = text.strip()
    optional = kind.endswith("| None")
    if optional and raw == "":
        return None
    base = kind.removesuffix("| None").strip()
    try:
        if base == "bool":
            if raw.lower() in _TRUE:
                return True
            if raw.lower() in _FALSE:
                return False
            raise ValueError("not true or false")
        if base == "int":
            return int(raw)
        if base == "float":
            return float(raw)
        if base.startswith("tuple"):
            return tuple(part.strip() for part in raw.split(",") if part.strip())
        if base.startswith("Mapping"):
            value = json.loads(raw) if raw else {}
            if not isinstance(value, dict):
                raise ValueError("not a JSON object")
            return value
    except ValueError as exc:
        raise ConfigError(
            f"{variable}={text!r} in the environment is not a valid {base} ({exc}); fix or unset it"
        ) from None
    return raw


def _same(configured: Any, value: Any) -> bool:
    """Whether a configured value equals one read from text (lists as tuples)."""
    if isinstance(value, tuple):
        if isinstance(configured, str):
            configured = [part.strip() for part in configured.split(",") if part.strip()]
        if isinstance(configured, (list, tuple)):
            return tuple(configured) == value
    return bool(configured == value)


def from_environment(
    fields: tuple[dataclasses.Field[Any], ...],
    configured: Mapping[str, Any],
    *,
    written_as: Callable[[str], str],
    environ: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, str]]:
    """The settings the environment gives and the configuration leaves unset.

    Args:
        fields: The settings' fields (:class:`~.settings.LeaderSettings`).
        configured: The values the configuration sets, by field name.
        written_as: How the configuration spells a setting, for messages.
        environ: The environment (default: the process's).

    Returns:
        The values taken from the environment, by field name, and the
        variable each came from (for messages about them).

    Raises:
        ConfigError: A variable's value cannot be read; the message names it.

    """
    env = os.environ if environ is None else environ
    types = {f.name: str(f.type) for f in fields}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, kind in types.items():
        variable = variable_for(name)
        if name == "servers" and variable not in env and NATS_URL in env:
            variable = NATS_URL
        if name == "connect_options" and variable not in env:
            tools = {option: env[v] for v, option in NATS_TOOLS.items() if env.get(v)}
            if tools and name not in configured:
                values[name] = tools
                sources[name] = "/".join(v for v in NATS_TOOLS if env.get(v))
            continue
        if variable not in env:
            continue
        value = _parse(variable, env[variable], kind)
        if name in configured:
            if not _same(configured[name], value):
                _say_once(
                    f"{variable}={env[variable]!r} in the environment is ignored: "
                    f"{written_as(name)} in the configuration sets it"
                )
            continue
        values[name] = value
        sources[name] = variable
    known = {variable_for(name) for name in types}
    for variable in env:
        if variable.startswith(ENV_PREFIX) and variable not in known:
            close = difflib.get_close_matches(variable, sorted(known), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            _say_once(f"{variable} in the environment is not a setting{hint}")
    return values, sources
