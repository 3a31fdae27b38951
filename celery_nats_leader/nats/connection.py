"""Connecting to NATS the way the election needs it.

The connection reconnects forever, and never buffers writes while
reconnecting (``pending_size=0``): an election write that sat in a buffer
could land long after the lease it belongs to ended. Connection state changes
are forwarded to listeners so elections can apply their disconnect grace.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.aio.client import Client

from celery_nats_leader.constants import DEFAULT_SERVERS
from celery_nats_leader.errors import ConfigError, NatsUnavailableError

#: How nats-py words the server's refusal of a publish or a subscription.
_PERMISSION_VIOLATION = "permissions violation"

#: Recent refusals per connection: (monotonic time, the server's message).
_violations: weakref.WeakKeyDictionary[Client, deque[tuple[float, str]]] = (
    weakref.WeakKeyDictionary()
)

logger = logging.getLogger(__name__)

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


class ConnectionListener:
    """Receives connection state changes; override what you need."""

    def disconnected(self) -> None:
        """The connection went down (it will try to reconnect)."""

    def reconnected(self) -> None:
        """The connection is back."""


def _tls_context(value: Any) -> ssl.SSLContext:
    if isinstance(value, ssl.SSLContext):
        return value
    if isinstance(value, Mapping):
        context = ssl.create_default_context(cafile=value.get("ca_file"))
        if value.get("cert_file"):
            context.load_cert_chain(value["cert_file"], value.get("key_file"))
        return context
    raise ConfigError("tls must be an ssl.SSLContext or a mapping with ca_file/cert_file/key_file")


async def connect(
    options: ConnectOptions,
    *,
    listeners: Sequence[ConnectionListener] = (),
    timeout: float = 5.0,
    name: str | None = None,
) -> Client:
    """Open a NATS connection suitable for elections.

    Args:
        options: Servers and extra options.
        listeners: Told about disconnects and reconnects.
        timeout: Seconds to wait for the first connection.
        name: Connection name shown by the server's monitoring.

    Returns:
        The connected client.

    Raises:
        NatsUnavailableError: No server answered within ``timeout``.

    """
    kwargs: dict[str, Any] = dict(options.options)
    if "tls" in kwargs:
        kwargs["tls"] = _tls_context(kwargs["tls"])
    if name and "name" not in kwargs:
        kwargs["name"] = name

    client: list[Client] = []

    async def on_disconnected() -> None:
        if client and client[0].is_closed:
            return  # our own close(), not an outage
        logger.warning("disconnected from NATS")
        for listener in listeners:
            listener.disconnected()

    async def on_reconnected() -> None:
        logger.info("reconnected to NATS")
        for listener in listeners:
            listener.reconnected()

    async def on_error(exc: Exception) -> None:
        logger.warning("NATS connection error: %s", exc)
        if client and _PERMISSION_VIOLATION in str(exc).lower():
            # The server refused a publish or subscription: the operation
            # waiting for it only sees a timeout; remember why.
            _violations.setdefault(client[0], deque(maxlen=16)).append((time.monotonic(), str(exc)))

    connect_timeout = float(kwargs.pop("connect_timeout", min(2.0, timeout)))
    kwargs.setdefault("reconnect_time_wait", 0.5)
    # Notice a dead TCP connection (no RST, no bytes) in seconds, not minutes.
    kwargs.setdefault("ping_interval", 5)
    kwargs.setdefault("max_outstanding_pings", 2)
    try:
        nc = await asyncio.wait_for(
            nats.connect(
                servers=list(options.servers),
                connect_timeout=connect_timeout,
                max_reconnect_attempts=-1,
                allow_reconnect=True,
                pending_size=0,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
                error_cb=on_error,
                **kwargs,
            ),
            timeout,
        )
    except (asyncio.TimeoutError, OSError, nats.errors.Error) as exc:
        raise NatsUnavailableError(
            f"could not connect to NATS at {', '.join(options.servers)} within {timeout:g}s: {exc}"
        ) from exc
    client.append(nc)
    return nc


def permission_violation(nc: Client, since: float) -> str | None:
    """The server's latest permission refusal on ``nc`` at or after ``since``, if any.

    Args:
        nc: A client made by :func:`connect`.
        since: A :func:`time.monotonic` reading (when the operation began).

    Returns:
        The server's message (it names the subject), or ``None``.

    """
    for at, message in reversed(_violations.get(nc, ())):
        if at >= since:
            return message
    return None


__all__ = ["ConnectOptions", "ConnectionListener", "connect", "permission_violation"]
