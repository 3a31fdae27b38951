"""Election configuration: one frozen, validated dataclass per role.

Durations are in seconds (``float``). A duration left at ``0`` is derived from
``ttl`` when the config is built, so ``ElectionConfig(ttl=5)`` is a complete,
consistent configuration; the derived values are visible on the instance.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from celery_nats_leader.core import constants as c
from celery_nats_leader.core.errors import ConfigError

#: A health check: returns ``True`` when this process is fit to lead.
HealthCheck = Callable[[], "bool | Awaitable[bool]"]

Strategy = Literal["kv", "allcall"]


def resolve_health_check(value: object, setting: str = "health_check") -> HealthCheck | None:
    """Turn a ``health_check`` setting into a callable.

    Args:
        value: ``None``, a callable, or a dotted path to one
            (``"proj.health:db_ok"`` or ``"proj.health.db_ok"``).
        setting: The setting's name, for the error message.

    Returns:
        The callable, or ``None``.

    Raises:
        ConfigError: The path cannot be imported or does not name a callable.

    """
    if value is None or callable(value):
        return value
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{setting}={value!r} must be a callable or a dotted path to one")
    path = value.strip()
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{setting}={value!r}: cannot import it ({exc})") from exc
    if not callable(target):
        raise ConfigError(f"{setting}={value!r} is not callable")
    return target  # type: ignore[no-any-return]


def default_instance_id() -> str:
    """Build an instance id unique to this process: ``host:pid:random``.

    Returns:
        For example ``"web-3:4121:9f2c"``.

    """
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:4]}"


def _default_meta() -> dict[str, Any]:
    return {"hostname": socket.gethostname(), "pid": os.getpid()}


def validate_key(name: str, what: str) -> str:
    """Check that ``name`` is usable as a NATS KV key (a role name).

    Args:
        name: The candidate name.
        what: The field name, for the error message.

    Returns:
        ``name``.

    Raises:
        ConfigError: If the name is empty, has a character outside
            ``A-Z a-z 0-9 - / _ = .`` or starts or ends with a dot.

    """
    if (
        not isinstance(name, str)
        or not c.KEY_PATTERN.match(name)
        or name[0] == "."
        or name[-1] == "."
    ):
        raise ConfigError(
            f"{what}={name!r} is not a valid role name: use letters, digits and - / _ = . "
            "(not starting or ending with a dot), e.g. 'beat' or 'reports.nightly'"
        )
    return name


def validate_bucket(name: str) -> str:
    """Check that ``name`` is usable as a NATS KV bucket name.

    Args:
        name: The candidate bucket name.

    Returns:
        ``name``.

    Raises:
        ConfigError: If the name has a character outside ``A-Z a-z 0-9 _ -``.

    """
    if not isinstance(name, str) or not c.BUCKET_PATTERN.match(name):
        raise ConfigError(
            f"bucket={name!r} is not a valid KV bucket name: use only letters, digits, _ and -"
        )
    return name


@dataclass(frozen=True)
class ElectionConfig:
    """Configuration of one role's election. Validated at construction.

    Raises:
        ConfigError: On any invalid value; the message names the field, the
            value and what to change.

    """

    role: str = c.DEFAULT_ROLE
    """The role (the KV key) to lead, e.g. ``"beat"`` or ``"reports.nightly"``."""

    bucket: str = c.DEFAULT_BUCKET
    """The KV bucket holding one key per role."""

    instance_id: str = field(default_factory=default_instance_id)
    """This candidate's id, unique per process; default ``host:pid:random``."""

    ttl: float = c.DEFAULT_TTL_SECONDS
    """Seconds a term lasts without renewal; must equal the bucket's ``max_age``.
    With ``strategy="allcall"`` this is the seed's leaseTime (no bucket involved)."""

    heartbeat_interval: float = 0.0
    """Seconds between renewals by the leader; ``0`` means ``ttl / 4``. With
    ``strategy="allcall"``: seconds between allcalls; ``0`` means 1 s (the
    seed's heartBeat), or ``ttl / 4`` when that is shorter."""

    request_timeout: float = 0.0
    """Seconds to wait for one store operation; ``0`` means ``min(2, heartbeat / 2)``."""

    lease_margin: float = 0.0
    """Seconds before the key can expire at which the leader steps down on its
    own clock; ``0`` means ``ttl / 10``. Covers event-loop lag."""

    priority: int = 0
    """Higher is preferred: higher-priority candidates campaign first."""

    allow_takeover: bool = False
    """Politely ask a lower-priority leader to resign (never overwrites its key)."""

    disconnect_grace: float = 0.0
    """Seconds a leader stays leader while disconnected from NATS; ``0`` means
    ``2 x heartbeat``, the least allowed (and at most ``ttl - lease_margin``)."""

    health_check: HealthCheck | None = None
    """Optional callable (sync or async) returning ``True`` when fit to lead."""

    health_check_interval: float = 0.0
    """Seconds between health checks while leading; ``0`` means the heartbeat."""

    health_check_failures: int = c.DEFAULT_HEALTH_CHECK_FAILURES
    """Consecutive failed health checks that make the leader resign."""

    validation_interval: float = 0.0
    """Seconds between background token validations while leading; ``0`` = off."""

    demote_timeout: float = c.DEFAULT_DEMOTE_TIMEOUT_SECONDS
    """Seconds a stop or a release (resign, failed health check, takeover)
    waits for the demote callbacks. When they take longer it is logged, and the
    term is not released but left to expire: a successor then waits for the
    TTL, never starts while leader work may still be stopping. Also the
    longest a callback may run while later callbacks wait behind it: it is
    then abandoned (logged at ERROR) and they run, so that a hung
    ``on_promote`` cannot keep ``on_demote`` from running."""

    resync_interval: float = 0.0
    """Seconds between reads that back up the key watch; ``0`` means the heartbeat."""

    campaign_jitter: float = c.DEFAULT_CAMPAIGN_JITTER_SECONDS
    """Largest random delay added for candidates behind the first in line when the role falls free.

    The first in line (by priority, then id) campaigns at once; the k-th waits
    ``k`` successor steps (2 ms) plus a random delay up to this, capped at one step."""

    priority_step: float = c.DEFAULT_PRIORITY_STEP_SECONDS
    """Campaign delay per priority point below the best known candidate."""

    create_bucket: bool = False
    """Create the bucket when missing (development convenience)."""

    bucket_replicas: int = 1
    """Replicas when creating the bucket (3 for an R3 bucket in a cluster)."""

    release_on_stop: bool = True
    """Delete the key on stop so a successor takes over in milliseconds."""

    meta: Mapping[str, Any] = field(default_factory=_default_meta)
    """JSON-serializable metadata published in the leader record."""

    strategy: Strategy = "kv"
    """Election strategy: ``"kv"`` (JetStream KV, default, CP) or ``"allcall"``."""

    max_clock_skew: float = c.ALLCALL_DEFAULT_MAX_CLOCK_SKEW_SECONDS
    """``strategy="allcall"`` only (ignored by KV): the largest difference, in
    seconds, between the wall clocks of any two candidate hosts. ALLCALL
    compares lease expiry times across hosts; it is only safe while clocks
    agree to within this bound (``0`` is right when all candidates share one
    host). At most ``ttl / 2``."""

    fast_failover: bool = False
    """``strategy="kv"`` only: the leader designates a successor in its record
    and asks it for a promise every 150 ms over core NATS; when the leader
    dies or freezes, the successor takes the role over by a compare-and-set
    about a second later, whatever the TTL (docs/design.md, "Fast
    failover"). The cost: a leader that cannot reach its successor for about
    half a second (a NATS server restart, a partition, a stall of its event
    loop) steps down, where without it the lease would carry it over the
    blip, so terms change more often on a flaky network. Off by default."""

    def __post_init__(self) -> None:
        validate_key(self.role, "role")
        validate_bucket(self.bucket)
        if not isinstance(self.instance_id, str) or not self.instance_id.strip():
            raise ConfigError("instance_id must be a non-empty string")
        if self.strategy not in ("kv", "allcall"):
            raise ConfigError(f"strategy={self.strategy!r} is unknown: use 'kv' or 'allcall'")
        ttl = _seconds("ttl", self.ttl)
        if not c.MIN_TTL_SECONDS <= ttl <= c.MAX_TTL_SECONDS:
            raise ConfigError(
                f"ttl={ttl} is out of range: it must be between {c.MIN_TTL_SECONDS} and "
                f"{c.MAX_TTL_SECONDS:.0f} seconds"
            )
        allcall = self.strategy == "allcall"
        default_heartbeat = ttl / c.HEARTBEATS_PER_TTL
        if allcall:
            default_heartbeat = min(c.ALLCALL_DEFAULT_HEARTBEAT_SECONDS, default_heartbeat)
        heartbeat = _seconds("heartbeat_interval", self.heartbeat_interval) or default_heartbeat
        if ttl < c.MIN_HEARTBEATS_PER_TTL * heartbeat - 1e-9:
            raise ConfigError(
                f"heartbeat_interval={heartbeat} is too long for ttl={ttl}: ttl must be at least "
                f"{c.MIN_HEARTBEATS_PER_TTL} x heartbeat_interval; set heartbeat_interval <= "
                f"{ttl / c.MIN_HEARTBEATS_PER_TTL:.3g} or raise ttl"
            )
        timeout = _seconds("request_timeout", self.request_timeout) or min(2.0, heartbeat / 2)
        if timeout >= heartbeat:
            raise ConfigError(
                f"request_timeout={timeout} must be shorter than heartbeat_interval={heartbeat}"
            )
        margin = _seconds("lease_margin", self.lease_margin) or ttl * c.LEASE_MARGIN_FRACTION
        if margin + heartbeat + timeout >= ttl:
            raise ConfigError(
                f"lease_margin={margin} leaves no room for a renewal: lease_margin + "
                f"heartbeat_interval + request_timeout must be below ttl={ttl}"
            )
        # A leader must survive one reconnect that costs it a renewal: the
        # grace covers at least two heartbeats, and fits in the lease.
        min_grace = c.MIN_DISCONNECT_GRACE_HEARTBEATS * heartbeat
        grace = _seconds("disconnect_grace", self.disconnect_grace) or min_grace
        if grace > ttl - margin:
            raise ConfigError(
                f"disconnect_grace={grace:g} is longer than the lease (ttl - lease_margin = "
                f"{ttl - margin:.3g}); it would never apply. Lower it, or lower "
                "heartbeat_interval or lease_margin when it is the default "
                f"({c.MIN_DISCONNECT_GRACE_HEARTBEATS} x heartbeat_interval)."
            )
        if grace < min_grace - 1e-9:
            raise ConfigError(
                f"disconnect_grace={grace:g} is shorter than {c.MIN_DISCONNECT_GRACE_HEARTBEATS} "
                f"x heartbeat_interval ({min_grace:.3g}): a leader would step down on a "
                f"reconnect that costs one renewal; set disconnect_grace >= {min_grace:.3g} "
                "(0 means that default) or lower heartbeat_interval"
            )
        health_interval = _seconds("health_check_interval", self.health_check_interval) or heartbeat
        if self.health_check is not None and not callable(self.health_check):
            raise ConfigError("health_check must be a callable returning bool (or None)")
        if not isinstance(self.health_check_failures, int) or self.health_check_failures < 1:
            raise ConfigError(
                f"health_check_failures={self.health_check_failures!r} must be an integer >= 1"
            )
        validation = _seconds("validation_interval", self.validation_interval)
        if 0 < validation < heartbeat:
            raise ConfigError(
                f"validation_interval={validation} is shorter than heartbeat_interval={heartbeat}: "
                "use 0 (off) or a value >= the heartbeat (each validation is a KV read)"
            )
        resync = _seconds("resync_interval", self.resync_interval) or heartbeat
        demote_timeout = _seconds("demote_timeout", self.demote_timeout)
        if demote_timeout <= 0:
            raise ConfigError(
                f"demote_timeout={demote_timeout} must be positive: the seconds a stop or a "
                "release waits for the demote callbacks"
            )
        jitter = _seconds("campaign_jitter", self.campaign_jitter)
        step = _seconds("priority_step", self.priority_step)
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ConfigError(f"priority={self.priority!r} must be an integer")
        if not isinstance(self.bucket_replicas, int) or not 1 <= self.bucket_replicas <= 5:
            raise ConfigError(f"bucket_replicas={self.bucket_replicas!r} must be between 1 and 5")
        if not isinstance(self.meta, Mapping):
            raise ConfigError("meta must be a mapping of JSON-serializable values")
        if not isinstance(self.fast_failover, bool):
            raise ConfigError(f"fast_failover={self.fast_failover!r} must be True or False")
        if allcall and self.fast_failover:
            raise ConfigError(
                "fast_failover is for the KV strategy: ALLCALL detects a dead leader by its "
                "heartbeats already; set fast_failover=False or strategy='kv'"
            )
        skew = _seconds("max_clock_skew", self.max_clock_skew)
        if allcall and skew > ttl * c.ALLCALL_MAX_CLOCK_SKEW_FRACTION_OF_TTL:
            limit = ttl * c.ALLCALL_MAX_CLOCK_SKEW_FRACTION_OF_TTL
            raise ConfigError(
                f"max_clock_skew={skew} is out of range: it must be between 0 and "
                f"ttl * {c.ALLCALL_MAX_CLOCK_SKEW_FRACTION_OF_TTL} = {limit:g} seconds; "
                "synchronize the hosts' clocks (NTP) or raise ttl"
            )
        resolved = {
            "ttl": ttl,
            "heartbeat_interval": heartbeat,
            "request_timeout": timeout,
            "lease_margin": margin,
            "disconnect_grace": grace,
            "health_check_interval": health_interval,
            "validation_interval": validation,
            "resync_interval": resync,
            "demote_timeout": demote_timeout,
            "campaign_jitter": jitter,
            "priority_step": step,
            "max_clock_skew": skew,
        }
        for name, value in resolved.items():
            object.__setattr__(self, name, value)

    @property
    def lease_seconds(self) -> float:
        """How long after a confirmed renewal's send time the leader keeps leading."""
        return self.ttl - self.lease_margin

    def for_role(self, role: str) -> ElectionConfig:
        """Return a copy of this config for another role (same instance id).

        Args:
            role: The other role's name.

        Returns:
            The new config.

        """
        return dataclasses.replace(self, role=role)

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> ElectionConfig:
        """Build a config from a plain mapping (settings files, environment).

        Args:
            values: Field names to values. Unknown names are an error.

        Returns:
            The validated config.

        Raises:
            ConfigError: On an unknown name or an invalid value.

        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(
                f"unknown election setting(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(known))}"
            )
        return cls(**dict(values))


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}={value!r} must be a number of seconds")
    if value < 0 or math.isnan(value):
        raise ConfigError(f"{name}={value!r} must be a non-negative number of seconds")
    return float(value)
