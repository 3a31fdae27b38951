"""Where and how to connect to NATS: :class:`ConnectOptions`.

Plain configuration, validated at construction; :mod:`celery_nats_leader.nats`
turns it into a connection.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery_nats_leader.core.constants import DEFAULT_SERVERS
from celery_nats_leader.core.errors import ConfigError

__all__ = ["PASSTHROUGH_OPTIONS", "ConnectOptions"]

#: Options of :func:`nats.connect` a user may pass through.
PASSTHROUGH_OPTIONS = frozenset(
    {
        "name",
        "user",
        "password",
        "token",
        "user_credentials",
        "nkeys_seed",
        "nkeys_seed_str",
        "signature_cb",
        "user_jwt_cb",
        "tls",
        "tls_hostname",
        "tls_handshake_first",
        "connect_timeout",
        "ping_interval",
        "max_outstanding_pings",
        "reconnect_time_wait",
        "inbox_prefix",
        "drain_timeout",
        "verbose",
        "no_echo",
    }
)


@dataclass(frozen=True)
class ConnectOptions:
    """Where and how to connect.

    Attributes:
        servers: NATS URLs, e.g. ``("nats://n1:4222", "nats://n2:4222")``.
        options: Extra :func:`nats.connect` keyword arguments (credentials,
            TLS, token, nkeys, ...). ``tls`` may be an :class:`ssl.SSLContext`
            or a mapping with ``ca_file``, ``cert_file``, ``key_file``.

    """

    servers: tuple[str, ...] = DEFAULT_SERVERS
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        servers: Any = self.servers
        if isinstance(servers, str):
            servers = tuple(s.strip() for s in servers.split(",") if s.strip())
        servers = tuple(servers)
        if not servers or not all(isinstance(s, str) and s for s in servers):
            raise ConfigError("servers must name at least one NATS URL, e.g. nats://127.0.0.1:4222")
        object.__setattr__(self, "servers", servers)
        unknown = sorted(set(self.options) - PASSTHROUGH_OPTIONS)
        if unknown:
            raise ConfigError(
                f"unknown NATS connect option(s) {', '.join(unknown)}; "
                f"known: {', '.join(sorted(PASSTHROUGH_OPTIONS))}"
            )

    @classmethod
    def build(
        cls, servers: str | Sequence[str] | None = None, options: Mapping[str, Any] | None = None
    ) -> ConnectOptions:
        """Build from loosely typed settings (a comma-separated string or a list).

        Args:
            servers: One URL, comma-separated URLs or a sequence; default localhost.
            options: Extra connect options.

        Returns:
            The options.

        """
        if servers is None:
            servers = DEFAULT_SERVERS
        if isinstance(servers, str):
            servers = [s.strip() for s in servers.split(",") if s.strip()]
        return cls(servers=tuple(servers), options=dict(options or {}))
