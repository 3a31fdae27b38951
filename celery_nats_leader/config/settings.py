"""Process-wide settings shared by the Celery and Django integrations.

One :class:`LeaderSettings` describes a process's connection and the roles it
campaigns for. It is built from Celery's configuration (lower-case
``nats_leader_*`` keys, so ``CELERY_NATS_LEADER_*`` under Django's CELERY
namespace) or from a plain mapping (Django's ``NATS_LEADER`` dict), validated
once, and turned into one :class:`~celery_nats_leader.config.ElectionConfig`
per role. This module imports neither Celery nor Django.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import re
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery_nats_leader.config import (
    ElectionConfig,
    Strategy,
    default_instance_id,
    resolve_health_check,
    validate_bucket,
    validate_key,
)
from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.config.environment import from_environment
from celery_nats_leader.core.constants import (
    BEAT_CATCH_UP_EXTRA_SECONDS,
    DEFAULT_METRICS_NAMESPACE,
    DEFAULT_SERVERS,
)
from celery_nats_leader.core.errors import ConfigError

logger = logging.getLogger(__name__)

#: Prefix of the settings in Celery's configuration.
CELERY_PREFIX = "nats_leader_"

#: Marks a :class:`LeaderSettings` field that is also an :class:`ElectionConfig` field.
_ELECTION = "election_config"

_ELECTION_FIELDS = {f.name: f for f in dataclasses.fields(ElectionConfig)}


def election_field(name: str) -> Any:
    """A :class:`LeaderSettings` field that is :class:`ElectionConfig`'s field ``name``.

    It has that field's default (or default factory) and is passed to every
    role's config by :meth:`LeaderSettings.election_config`, so a process-wide
    election setting is one line: ``ttl: float = election_field("ttl")``.

    Raises:
        KeyError: If ``ElectionConfig`` has no such field.

    """
    source = _ELECTION_FIELDS[name]
    metadata = {_ELECTION: name}
    if source.default_factory is not dataclasses.MISSING:
        return field(default_factory=source.default_factory, metadata=metadata)
    return field(default=source.default, metadata=metadata)


#: A metric name prefix (Prometheus names, without the colons kept for rules).
_METRIC_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


@dataclass(frozen=True)
class LeaderSettings:
    """A process's election settings.

    Every field maps to the Celery setting ``nats_leader_<field>`` and to the
    key ``<FIELD>`` (upper-case) of Django's ``NATS_LEADER`` dict. The fields
    declared with :func:`election_field` are :class:`ElectionConfig`'s (same
    name, same default), passed to every role's config.
    """

    servers: tuple[str, ...] = DEFAULT_SERVERS
    """NATS URLs (a comma-separated string is accepted)."""

    connect_options: Mapping[str, Any] = field(default_factory=dict)
    """Extra connect options: TLS, user_credentials, token, nkeys_seed, ..."""

    bucket: str = election_field("bucket")
    """KV bucket of the elections."""

    roles: tuple[str, ...] = ("default",)
    """Roles this process campaigns for."""

    ttl: float = election_field("ttl")
    """Election TTL in seconds (the bucket's max_age)."""

    heartbeat_interval: float = election_field("heartbeat_interval")
    """Seconds between renewals; 0 = ttl / 4."""

    request_timeout: float = election_field("request_timeout")
    """Seconds per store operation; 0 = derived from the heartbeat."""

    disconnect_grace: float = election_field("disconnect_grace")
    """Seconds a disconnected leader keeps leading; 0 = 2 heartbeats."""

    validation_interval: float = election_field("validation_interval")
    """Seconds between background token validations while leading; 0 = off."""

    demote_timeout: float = election_field("demote_timeout")
    """Seconds a stop or a release waits for the demote callbacks (and a callback
    may run while later ones wait behind it: past it, it is abandoned)."""

    priority: int = election_field("priority")
    """Higher is preferred."""

    allow_takeover: bool = election_field("allow_takeover")
    """Ask a lower-priority leader to hand over."""

    fast_failover: bool = election_field("fast_failover")
    """A designated successor takes over about a second after the leader dies,
    whatever the TTL (KV strategy; off by default)."""

    instance_id: str = election_field("instance_id")
    """This process's id; empty = host:pid:random."""

    create_bucket: bool = election_field("create_bucket")
    """Create the bucket when missing."""

    bucket_replicas: int = election_field("bucket_replicas")
    """Replicas when creating the bucket."""

    required: bool = False
    """Refuse to start when NATS cannot be reached (else keep trying, loudly)."""

    metrics_port: int | None = None
    """Serve Prometheus metrics on this port (extra ``metrics``)."""

    beat_metrics_port: int | None = None
    """Serve a beat scheduler's ``/healthz``, ``/readyz`` and ``/metrics`` on this
    port: required for the embedded beat of ``celery worker -B`` (a child
    process; the worker holds ``metrics_port``), and used instead of
    ``metrics_port`` by a standalone beat when set."""

    metrics_address: str = "0.0.0.0"
    """Address the metrics endpoint listens on (``127.0.0.1`` to keep it local)."""

    metrics_namespace: str = DEFAULT_METRICS_NAMESPACE
    """Prefix of the metric names (``<namespace>_is_leader``, ...)."""

    start_timeout: float = 10.0
    """Seconds a starting worker waits for NATS and its first campaign when
    ``required`` is set (otherwise it goes on at once and keeps trying)."""

    queue_prefix: str = "nats_leader."
    """Leader queues are named ``<queue_prefix><role>``."""

    beat_role: str = "beat"
    """Role whose leader runs the beat scheduler."""

    beat_state_bucket: str = ""
    """KV bucket holding the beat schedule's state (each entry's last tick and
    run count); empty = ``<bucket>_beat``. It has no ``max_age``: the state
    must outlive every scheduler."""

    beat_max_catch_up: int = 100
    """Most missed ticks of one entry that a scheduler dispatches one by one
    after a gap inside ``beat_catch_up_window``, besides the latest overdue
    one (so at most ``beat_max_catch_up + 1`` back to back). When more are
    overdue, all but the latest are skipped (logged and counted in the
    state), as Celery's own scheduler does after downtime. ``0`` = always
    coalesce."""

    beat_catch_up_window: float | None = None
    """Seconds: overdue ticks of an entry are dispatched one by one only while
    the oldest of them is at most this old (the ticks a failover missed);
    after a longer gap (every replica down, a migration) they coalesce into
    one run, as with Celery's own scheduler. ``None`` = ``2 x ttl + 5`` of
    the beat role (see :meth:`catch_up_window`); raise it to catch up longer
    outages tick by tick (still at most ``beat_max_catch_up``)."""

    beat_follower_interval: float = 1.0
    """Longest a follower's beat tick sleeps before it looks again, in seconds
    (a promotion wakes it at once). Capped by ``beat_max_loop_interval``."""

    beat_once: bool = True
    """Run each tick our beat schedulers send once on workers with the
    bootstep (the once-guard keyed by the tick's task id). ``False`` on the
    schedulers stops asking for it; ``False`` on a worker stops applying it.
    An entry opts out with ``nats_leader_once = False`` in its options (or,
    for database entries, its headers)."""

    once_bucket: str = ""
    """KV bucket of the once-guard's done records (``OnceTask``, ``@run_once``);
    empty = ``<bucket>_once``. Its leases live in ``<once_bucket>_leases``."""

    once_lease: float = 30.0
    """Seconds a guarded run's claim lives without renewal (renewed every third
    of it while the body runs). A run whose worker died runs again after it;
    a worker paused longer than it may see a duplicate run beside its own."""

    once_retention: float = 86400.0
    """Seconds a finished run is remembered (the done bucket's ``max_age``):
    duplicates arriving later than this run again."""

    strategy: Strategy = election_field("strategy")
    """Election strategy: ``kv`` (default) or ``allcall``."""

    max_clock_skew: float = election_field("max_clock_skew")
    """ALLCALL only: the bound on clock differences between hosts, seconds."""

    role_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Per-role overrides of any ElectionConfig field, e.g. ``{"beat": {"ttl": 5}}``."""

    health_check: Any = election_field("health_check")
    """Fit to lead? A callable (sync or async, returns bool) or its dotted path
    (``"proj.health:db_ok"``), run while leading; per role in ``role_options``.
    Built in: ``celery_nats_leader.worker.health.broker_reachable``,
    ``django_nats_leader.health.database_reachable``."""

    health_check_interval: float = election_field("health_check_interval")
    """Seconds between health checks while leading; 0 = the heartbeat."""

    health_check_failures: int = election_field("health_check_failures")
    """Consecutive failed health checks after which the leader resigns."""

    services: Mapping[str, Any] = field(default_factory=dict)
    """Leader services of a worker: role -> list of ``"module:function"`` run on the
    role's leader while it leads (see :func:`celery_nats_leader.leader_service`)."""

    def __post_init__(self) -> None:
        servers: Any = self.servers
        object.__setattr__(self, "servers", ConnectOptions.build(servers).servers)
        roles: Any = self.roles
        if isinstance(roles, str):
            roles = [r.strip() for r in roles.split(",") if r.strip()]
        roles = tuple(roles)
        for role in roles:
            validate_key(role, "roles")
        object.__setattr__(self, "roles", roles)
        validate_key(self.beat_role, "beat_role")
        if not self.beat_state_bucket:
            object.__setattr__(self, "beat_state_bucket", f"{self.bucket}_beat")
        validate_bucket(self.beat_state_bucket)
        if not self.once_bucket:
            object.__setattr__(self, "once_bucket", f"{self.bucket}_once")
        validate_bucket(self.once_bucket)
        for name in ("once_lease", "once_retention"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name}={value!r} must be a positive number of seconds")
        if self.once_retention < 2 * self.once_lease:
            raise ConfigError(
                f"once_retention={self.once_retention!r} must be at least twice "
                f"once_lease={self.once_lease!r} (a duplicate waits out a lease)"
            )
        if (
            isinstance(self.beat_max_catch_up, bool)
            or not isinstance(self.beat_max_catch_up, int)
            or self.beat_max_catch_up < 0
        ):
            raise ConfigError(
                f"beat_max_catch_up={self.beat_max_catch_up!r} must be an integer >= 0 "
                "(overdue ticks dispatched one by one after a gap)"
            )
        window: Any = self.beat_catch_up_window
        if window is not None and (
            isinstance(window, bool) or not isinstance(window, (int, float)) or not window >= 0
        ):
            raise ConfigError(
                f"beat_catch_up_window={window!r} must be a number of seconds >= 0 "
                "(or None: 2 x ttl + 5)"
            )
        if (
            isinstance(self.beat_follower_interval, bool)
            or not isinstance(self.beat_follower_interval, (int, float))
            or not self.beat_follower_interval > 0
        ):
            raise ConfigError(
                f"beat_follower_interval={self.beat_follower_interval!r} must be a positive "
                "number of seconds"
            )
        if not isinstance(self.beat_once, bool):
            raise ConfigError(f"beat_once={self.beat_once!r} must be True or False")
        if not self.instance_id:
            object.__setattr__(self, "instance_id", default_instance_id())
        if not isinstance(self.metrics_namespace, str) or not _METRIC_NAME.fullmatch(
            self.metrics_namespace
        ):
            raise ConfigError(
                f"metrics_namespace={self.metrics_namespace!r} must be a Prometheus metric "
                "name prefix: a letter or '_', then letters, digits or '_'"
            )
        if self.metrics_port is not None and not (0 <= int(self.metrics_port) <= 65535):
            raise ConfigError(f"metrics_port={self.metrics_port!r} must be a TCP port (0-65535)")
        if self.beat_metrics_port is not None and not (0 <= int(self.beat_metrics_port) <= 65535):
            raise ConfigError(
                f"beat_metrics_port={self.beat_metrics_port!r} must be a TCP port (0-65535)"
            )
        if self.beat_metrics_port and self.beat_metrics_port == self.metrics_port:
            # With ``worker -B`` both run in one host: the second bind would fail.
            raise ConfigError(
                f"beat_metrics_port={self.beat_metrics_port!r} is metrics_port too; give beat "
                "a port of its own (with `celery worker -B` the worker holds metrics_port)"
            )
        if (
            isinstance(self.start_timeout, bool)
            or not isinstance(self.start_timeout, (int, float))
            or not self.start_timeout > 0
        ):
            raise ConfigError(
                f"start_timeout={self.start_timeout!r} must be a positive number of seconds"
            )
        unknown_roles = sorted(set(self.role_options) - set(self.roles) - {self.beat_role})
        if unknown_roles:
            raise ConfigError(
                f"role_options names role(s) {', '.join(unknown_roles)} that are not in roles "
                f"{list(self.roles)}; add them to roles or remove the options"
            )
        # Build every role's config now, so that bad values fail at start-up.
        for role in dict.fromkeys((*self.roles, self.beat_role)):
            self.election_config(role)

    @property
    def connection(self) -> ConnectOptions:
        """Where and how to connect."""
        return ConnectOptions(servers=self.servers, options=dict(self.connect_options))

    def election_config(self, role: str) -> ElectionConfig:
        """The :class:`ElectionConfig` of ``role`` (with its ``role_options``).

        Raises:
            ConfigError: If a value is invalid; the message names the setting.

        """
        base: dict[str, Any] = {
            f.metadata[_ELECTION]: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if _ELECTION in f.metadata
        }
        base["role"] = role
        base.update(self.role_options.get(role, {}))
        try:
            base["health_check"] = resolve_health_check(base["health_check"], "health_check")
            return ElectionConfig.from_mapping(base)
        except ConfigError as exc:
            raise ConfigError(f"nats_leader settings for role {role!r}: {exc}") from exc

    def release_bound(self, roles: Sequence[str]) -> float:
        """Seconds a process's stop may take: demote callbacks, then each key's release.

        The longest ``demote_timeout + request_timeout`` of ``roles`` (they
        stop side by side), plus a second for the connection to close. A
        demote receiver that never returns is cut off by its own
        ``demote_timeout``, so this bounds the shutdown all the same; a
        shorter bound would cancel the release behind a slow callback and
        make the successor wait out the TTL.
        """
        configs = [self.election_config(role) for role in roles]
        if not configs:
            return 1.0
        return max(cfg.demote_timeout + cfg.request_timeout for cfg in configs) + 1.0

    def catch_up_window(self) -> float:
        """Seconds within which a beat scheduler catches missed ticks up one by one.

        ``beat_catch_up_window`` when set, else ``2 x ttl + 5`` of the beat
        role. Why that bounds a failover: a successor takes over at most
        ``ttl`` (plus a few milliseconds) after the old leader's last
        renewal, and the first tick the old leader missed is no older
        than that; the second ``ttl`` and the 5 s cover the campaign, loading
        the schedule's state, a busy host and clock skew between replicas.

        Raises:
            ConfigError: If the beat role's election settings are invalid.

        """
        if self.beat_catch_up_window is not None:
            return float(self.beat_catch_up_window)
        ttl = self.election_config(self.beat_role).ttl
        return 2.0 * ttl + BEAT_CATCH_UP_EXTRA_SECONDS

    def queue_for(self, role: str) -> str:
        """Name of the leader queue of ``role``."""
        return f"{self.queue_prefix}{role}"

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> LeaderSettings:
        """Build from a mapping of field names (any case), e.g. Django's ``NATS_LEADER``.

        Raises:
            ConfigError: On an unknown key or an invalid value.

        """
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        written: dict[str, str] = {}
        for key, value in values.items():
            name = key.lower()
            if name not in known:
                raise ConfigError(
                    f"unknown nats_leader setting {key!r}; known: {', '.join(sorted(known))}"
                )
            kwargs[name] = value
            written[name] = key
        found, sources = from_environment(
            dataclasses.fields(cls), kwargs, written_as=lambda name: written.get(name, name)
        )
        try:
            return cls(**found, **kwargs)
        except ConfigError as exc:
            raise ConfigError(_setting_names(str(exc), sources, "", celery=False)) from None

    @classmethod
    def from_celery(cls, conf: Any) -> LeaderSettings:
        """Build from a Celery app's configuration (``app.conf``).

        Reads ``nats_leader_<field>`` keys; under Django's CELERY namespace
        these are written ``CELERY_NATS_LEADER_<FIELD>``. Unknown
        ``nats_leader_*`` keys (a typo) are logged once per process with the
        closest known name.

        Raises:
            ConfigError: On an invalid value; the message names the setting
                as the configuration spells it (``nats_leader_roles``).

        """
        values: dict[str, Any] = {}
        found: dict[str, str] = {}
        for f in dataclasses.fields(cls):
            for key in (CELERY_PREFIX + f.name, (CELERY_PREFIX + f.name).upper()):
                try:
                    value = conf.get(key)
                except Exception:
                    value = None
                if value is not None:
                    values[f.name] = value
                    found[f.name] = key
                    break
        # Known only once a key was read (Celery loads its configuration lazily).
        prefix = _celery_namespace(conf)
        names = {name: (prefix + key).upper() if prefix else key for name, key in found.items()}
        for message in unknown_celery_settings(conf):
            if message not in _reported:
                _reported.add(message)
                logger.warning("nats-leader: %s", message)
        from_env, sources = from_environment(
            dataclasses.fields(cls),
            values,
            written_as=lambda name: names.get(name, CELERY_PREFIX + name),
        )
        names.update(sources)
        try:
            return cls(**from_env, **values)
        except ConfigError as exc:
            raise ConfigError(_setting_names(str(exc), names, prefix)) from None


#: Unknown-setting messages already logged by this process.
_reported: set[str] = set()


def _celery_namespace(conf: Any) -> str:
    """The namespace prefix of a Celery configuration (``CELERY_`` under Django), or ""."""
    prefix = conf.__dict__.get("prefix") if hasattr(conf, "__dict__") else None
    return prefix if isinstance(prefix, str) else ""


def _setting_names(
    message: str, names: Mapping[str, str], prefix: str, *, celery: bool = True
) -> str:
    """Rewrite ``field=`` in a validation message as the setting's name where it was set.

    ``names`` maps fields to how they were written (a Celery key, an
    environment variable); other fields are named as Celery settings, or
    left as they are without ``celery`` (Django's ``NATS_LEADER`` keys).
    """
    for name in sorted((f.name for f in dataclasses.fields(LeaderSettings)), key=len, reverse=True):
        if name not in names and not celery:
            continue
        written = names.get(name) or (
            (prefix + CELERY_PREFIX + name).upper() if prefix else CELERY_PREFIX + name
        )
        # "ttl=5 ..." anywhere, and "role_options names ..." opening a sentence.
        message = re.sub(rf"(?<![\w.]){re.escape(name)}=", f"{written}=", message)
        message = re.sub(rf"(^|: ){re.escape(name)} ", rf"\g<1>{written} ", message)
    return message


def unknown_celery_settings(conf: Any) -> list[str]:
    """Messages for the ``nats_leader_*`` keys of ``conf`` that no setting has.

    Args:
        conf: A Celery app's configuration.

    Returns:
        One message per unknown key, naming it as written, with the closest
        known setting ("did you mean").

    """
    known = sorted(CELERY_PREFIX + f.name for f in dataclasses.fields(LeaderSettings))
    try:
        # Reading a key finalizes Celery's lazy configuration; iterating does not.
        conf.get(CELERY_PREFIX + "roles")
        keys = [str(key) for key in conf]
    except Exception:  # pragma: no cover - not a Celery Settings object
        return []
    prefix = _celery_namespace(conf).upper()
    messages = []
    for key in sorted(keys):
        name = key
        if prefix:
            if not key.upper().startswith(prefix):
                continue  # outside the namespace: not a Celery setting (e.g. NATS_LEADER)
            name = key[len(prefix) :]
        lowered = name.lower()
        if not lowered.startswith(CELERY_PREFIX) or lowered in known:
            continue
        close = difflib.get_close_matches(lowered, known, n=1, cutoff=0.6)
        # Suggest in the user's own spelling: namespaced and upper-case, or not.
        suggestion = (prefix + close[0]).upper() if close and (prefix or name.isupper()) else ""
        hint = f"; did you mean {suggestion or close[0]!r}?" if close else ""
        messages.append(f"unknown setting {key!r} is ignored{hint}")
    return messages


_app_settings: weakref.WeakKeyDictionary[Any, LeaderSettings] = weakref.WeakKeyDictionary()


def is_leader_scheduler(scheduler: Any) -> bool:
    """Whether a ``beat_scheduler`` value names one of this package's schedulers.

    Then beat campaigns for the beat role: the role needs a leader, beat needs
    its state bucket, and the ticks it sends run under the once-guard.

    Args:
        scheduler: The setting's value: a dotted path or alias, or a class.

    """
    if scheduler is None:
        return False
    text = scheduler if isinstance(scheduler, str) else getattr(scheduler, "__module__", "")
    return "nats_leader" in str(text)


def settings_of_app(app: Any) -> LeaderSettings:
    """A Celery app's :meth:`LeaderSettings.from_celery`, read once per app (not once per task).

    Args:
        app: The Celery app (weakly referenced: the cache does not keep it alive).

    Raises:
        ConfigError: On an invalid value (nothing is cached then).

    """
    try:
        return _app_settings[app]
    except KeyError:
        settings = _app_settings[app] = LeaderSettings.from_celery(app.conf)
        return settings
