"""Django system checks for the ``NATS_LEADER`` settings and, with ``--deploy``, the server.

``manage.py check`` validates the settings without touching the network:

=====================  =========================================================
``nats_leader.E001``   ``NATS_LEADER`` is not a dict
``nats_leader.E002``   an unknown key (with the closest known one as the hint)
``nats_leader.E003``   an invalid role name (``ROLES``, ``BEAT_ROLE``, ``ROLE_OPTIONS``)
``nats_leader.E004``   ``TTL`` shorter than 3 heartbeats
``nats_leader.E005``   any other invalid value (the message names it)
``nats_leader.E006``   roles of one bucket with different TTLs
=====================  =========================================================

``manage.py check --deploy`` also connects (a few seconds at most):

=====================  =========================================================
``nats_leader.W010``   no NATS server reachable (``E010`` when ``REQUIRED`` is set)
``nats_leader.E011``   a bucket does not exist (and ``CREATE_BUCKET`` is off)
``nats_leader.E012``   a bucket's ``max_age`` is wrong (not the TTL; any on the beat state)
``nats_leader.E013``   the server has no JetStream
``nats_leader.W014``   the bucket keeps more than one value per key
``nats_leader.W015``   a once-guard bucket does not exist (ticks run once under a
                       leader scheduler; least-privilege workers cannot create it)
``nats_leader.E016``   a once-guard bucket has other settings than the guard's
=====================  =========================================================
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django.core import checks

from celery_nats_leader.config import validate_key
from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.constants import DEFAULT_TTL_SECONDS, MIN_HEARTBEATS_PER_TTL
from celery_nats_leader.core.errors import ConfigError
from django_nats_leader import conf

if TYPE_CHECKING:
    from celery_nats_leader.core.backend import BucketInfo
    from celery_nats_leader.ops.bucket import BucketTarget

#: The tag of these checks: ``manage.py check --tag nats_leader``.
TAG = "nats_leader"

#: Seconds the deploy checks wait for NATS.
DEPLOY_CHECK_TIMEOUT = 3.0

_HINT_ROLE = (
    "Use letters, digits and - / _ = . (not starting or ending with a dot), "
    "e.g. 'beat' or 'reports.nightly'."
)


def register_checks() -> None:
    """Register the checks with Django (idempotent; called by the AppConfig)."""
    checks.register(check_settings, TAG)
    checks.register(check_server, TAG, deploy=True)


def _merged() -> dict[str, Any]:
    values = conf.raw_settings()
    values.update(conf.celery_overrides())
    return values


def _as_list(value: Any) -> list[Any]:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(value)
    return [value]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def _unknown_keys(values: dict[str, Any]) -> list[checks.CheckMessage]:
    known = sorted(conf.known_keys())
    found: list[checks.CheckMessage] = []
    for key in sorted(set(values) - set(known)):
        close = difflib.get_close_matches(key, known, n=1)
        hint = f"Did you mean {close[0].upper()!r}? " if close else ""
        found.append(
            checks.Error(
                f"{conf.SETTING_NAME} has an unknown key {key.upper()!r}.",
                hint=f"{hint}Known keys: {', '.join(k.upper() for k in known)}.",
                id="nats_leader.E002",
            )
        )
    return found


def _bad_roles(values: dict[str, Any]) -> list[checks.CheckMessage]:
    named: list[tuple[str, Any]] = [("ROLES", role) for role in _as_list(values.get("roles", []))]
    if "beat_role" in values:
        named.append(("BEAT_ROLE", values["beat_role"]))
    options = values.get("role_options")
    if isinstance(options, dict):
        named += [("ROLE_OPTIONS", role) for role in options]
    found: list[checks.CheckMessage] = []
    for where, role in named:
        try:
            validate_key(role, where)
        except ConfigError:
            found.append(
                checks.Error(
                    f"{conf.SETTING_NAME}[{where!r}] names an invalid role {role!r}.",
                    hint=_HINT_ROLE,
                    id="nats_leader.E003",
                )
            )
    return found


def _heartbeat_ratio(values: dict[str, Any]) -> list[checks.CheckMessage]:
    base_ttl = values.get("ttl", DEFAULT_TTL_SECONDS)
    base_heartbeat = values.get("heartbeat_interval", 0)
    options = values.get("role_options")
    per_role: dict[str, Any] = options if isinstance(options, dict) else {}
    roles = [r for r in _as_list(values.get("roles", ["default"])) if isinstance(r, str)]
    roles += [values.get("beat_role", "beat")]
    found: list[checks.CheckMessage] = []
    seen: set[tuple[float, float]] = set()
    for role in dict.fromkeys(roles):
        overrides = per_role.get(role) if isinstance(per_role.get(role), dict) else {}
        ttl = _number((overrides or {}).get("ttl", base_ttl))
        heartbeat = _number((overrides or {}).get("heartbeat_interval", base_heartbeat))
        if ttl is None or heartbeat is None or heartbeat <= 0 or (ttl, heartbeat) in seen:
            continue
        seen.add((ttl, heartbeat))
        if ttl < MIN_HEARTBEATS_PER_TTL * heartbeat:
            where = "" if not overrides else f" (ROLE_OPTIONS[{role!r}])"
            found.append(
                checks.Error(
                    f"{conf.SETTING_NAME}: TTL={ttl:g}s is shorter than {MIN_HEARTBEATS_PER_TTL} "
                    f"heartbeats of HEARTBEAT_INTERVAL={heartbeat:g}s{where}; one lost renewal "
                    "would cost the leader its role.",
                    hint=(
                        f"Set HEARTBEAT_INTERVAL to at most {ttl / MIN_HEARTBEATS_PER_TTL:.3g} "
                        f"(or 0 for TTL/4), or raise TTL to at least "
                        f"{MIN_HEARTBEATS_PER_TTL * heartbeat:g}."
                    ),
                    id="nats_leader.E004",
                )
            )
    return found


def _mixed_ttls(settings: LeaderSettings) -> list[checks.CheckMessage]:
    from celery_nats_leader.ops.bucket import bucket_ttls

    found: list[checks.CheckMessage] = []
    for bucket, ttls in sorted(bucket_ttls(settings).items()):
        if len(ttls) > 1:
            found.append(
                checks.Error(
                    f"{conf.SETTING_NAME}: roles of bucket {bucket!r} use different TTLs "
                    f"({', '.join(f'{t:g}s' for t in sorted(ttls))}), "
                    "but a bucket has one max_age.",
                    hint="Give the roles with another TTL their own BUCKET in ROLE_OPTIONS.",
                    id="nats_leader.E006",
                )
            )
    return found


def check_settings(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Validate ``NATS_LEADER`` (and ``CELERY_NATS_LEADER_*``) without the network."""
    try:
        values = _merged()
    except ConfigError as exc:
        return [
            checks.Error(
                str(exc),
                hint="Set NATS_LEADER = {'SERVERS': [...], 'ROLES': [...], 'TTL': 10}.",
                id="nats_leader.E001",
            )
        ]
    found = _unknown_keys(values) + _bad_roles(values) + _heartbeat_ratio(values)
    if found:
        return found
    try:
        settings = conf.leader_settings()
    except ConfigError as exc:
        return [
            checks.Error(
                f"{conf.SETTING_NAME} is invalid: {exc}",
                hint="Fix the value named above; docs/configuration.md lists every key.",
                id="nats_leader.E005",
            )
        ]
    return _mixed_ttls(settings)


def check_server(
    app_configs: Sequence[Any] | None = None, **kwargs: Any
) -> list[checks.CheckMessage]:
    """Under ``check --deploy``: the server is reachable and the bucket is right."""
    try:
        settings = conf.leader_settings()
    except ConfigError:
        return []  # check_settings reports it
    from celery_nats_leader.ops.bucket import bucket_targets, bucket_ttls, probe

    wanted = bucket_ttls(settings)
    state_bucket = settings.beat_state_bucket if conf.beat_is_elected() else None
    guard = (
        bucket_targets(settings, once=True) if settings.beat_once and conf.beat_is_elected() else []
    )
    names = [*wanted, *([state_bucket] if state_bucket else []), *(t.name for t in guard)]
    result = probe(settings, names, timeout=DEPLOY_CHECK_TIMEOUT)
    servers = ", ".join(settings.servers)
    if not result.reachable:
        level = checks.Error if settings.required else checks.Warning
        return [
            level(
                f"No NATS server reachable at {servers} ({(result.error or '').rstrip(': ')}).",
                hint=(
                    "Start nats-server with JetStream (nats-server -js), or fix "
                    "NATS_LEADER['SERVERS'] and the credentials in CONNECT_OPTIONS."
                ),
                id="nats_leader.E010" if settings.required else "nats_leader.W010",
            )
        ]
    if result.error:
        return [
            checks.Error(
                f"NATS at {servers}: {result.error}",
                hint="Enable JetStream: nats-server -js, or jetstream {} in its configuration.",
                id="nats_leader.E013",
            )
        ]
    found: list[checks.CheckMessage] = []
    if state_bucket is not None:
        found += _state_bucket(state_bucket, result.buckets.get(state_bucket), settings, servers)
    for target in guard:
        found += _once_bucket(target, result.buckets.get(target.name), servers)
    for bucket, info in sorted(result.buckets.items()):
        if bucket not in wanted:
            continue
        ttls = wanted[bucket]
        ttl = next(iter(ttls)) if len(ttls) == 1 else None
        if info is None:
            create_ttl = ttl if ttl is not None else settings.ttl
            if not settings.create_bucket:
                found.append(
                    checks.Error(
                        f"KV bucket {bucket!r} does not exist on {servers}.",
                        hint=(
                            "Create it once with `manage.py election_bucket --create` (or "
                            f"`nats kv add {bucket} --ttl {create_ttl:g}s "
                            "--history 1`), or set NATS_LEADER['CREATE_BUCKET'] = True."
                        ),
                        id="nats_leader.E011",
                    )
                )
            continue
        if ttl is not None and abs(info.ttl - ttl) > 0.001:
            found.append(
                checks.Error(
                    f"KV bucket {bucket!r} has max_age={info.ttl:g}s but the election TTL is "
                    f"{ttl:g}s; elections refuse to start on it.",
                    hint=(
                        f"Set NATS_LEADER['TTL'] = {info.ttl:g}, or delete the bucket and "
                        f"recreate it with `manage.py election_bucket --create --ttl {ttl:g}`."
                    ),
                    id="nats_leader.E012",
                )
            )
        if info.history != 1:
            found.append(
                checks.Warning(
                    f"KV bucket {bucket!r} keeps {info.history} values per key; 1 is enough.",
                    hint="Recreate it with `manage.py election_bucket --create` (history=1).",
                    id="nats_leader.W014",
                )
            )
    return found


def _state_bucket(
    name: str, info: BucketInfo | None, settings: LeaderSettings, servers: str
) -> list[checks.CheckMessage]:
    if info is None:
        if settings.create_bucket:
            return []
        return [
            checks.Error(
                f"KV bucket {name!r} (the beat schedule's state) does not exist on {servers}.",
                hint=(
                    "Create it once with `manage.py election_bucket --create` (or "
                    f"`nats kv add {name} --history 1`, no TTL), or set "
                    "NATS_LEADER['CREATE_BUCKET'] = True."
                ),
                id="nats_leader.E011",
            )
        ]
    if info.ttl:
        return [
            checks.Error(
                f"KV bucket {name!r} (the beat schedule's state) has max_age={info.ttl:g}s: "
                "the schedule's state would expire and ticks would run again.",
                hint=f"Delete it and recreate it without a TTL (`nats kv add {name} --history 1`).",
                id="nats_leader.E012",
            )
        ]
    return []


def _once_bucket(
    target: BucketTarget, info: BucketInfo | None, servers: str
) -> list[checks.CheckMessage]:
    if info is None:
        # Workers create it on first use if their NATS user may; a
        # least-privilege `worker` user may not, and then runs no tick.
        return [
            checks.Warning(
                f"KV bucket {target.name!r} (the once-guard's, which ticks are claimed in) "
                f"does not exist on {servers}; workers create it at start-up only if their "
                "NATS user may create buckets.",
                hint=(
                    "Create it once as an operator: `manage.py election_bucket --create` "
                    "(the least-privilege `worker` user of deploy/nats/permissions.conf may "
                    "not), or set NATS_LEADER['BEAT_ONCE'] = False if ticks need not run once."
                ),
                id="nats_leader.W015",
            )
        ]
    return [
        checks.Error(
            f"KV bucket {target.name!r} (the once-guard's): {problem}",
            hint="Workers refuse a once-guard bucket made with other settings.",
            id="nats_leader.E016",
        )
        for problem in target.problems(info)
    ]


__all__ = ["DEPLOY_CHECK_TIMEOUT", "TAG", "check_server", "check_settings", "register_checks"]
