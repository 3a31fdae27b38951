"""Connecting to NATS the way the election needs it.

The connection reconnects forever, and never buffers writes while
reconnecting (``pending_size=0``): an election write that sat in a buffer
could land long after the lease it belongs to ended. Connection state changes
are forwarded to listeners so elections can apply their disconnect grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Mapping, Sequence
from typing import Any

import nats
from nats.aio.client import Client

from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.core.backend import ConnectionListener
from celery_nats_leader.core.errors import ConfigError, NatsUnavailableError
from celery_nats_leader.nats.jetstream import JetStreamBackend
from celery_nats_leader.nats.refusals import note_refusal

logger = logging.getLogger(__name__)

#: Seconds between two warnings about connection errors (the others go to DEBUG).
_ERROR_REPEAT = 30.0


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

    # nats-py reports every failed reconnect attempt (one per
    # reconnect_time_wait): say it once, then at most every _ERROR_REPEAT s.
    errors = {"count": 0, "next_warning": 0.0}

    async def on_reconnected() -> None:
        suppressed = errors["count"]
        errors["count"], errors["next_warning"] = 0, 0.0
        if suppressed:
            logger.info("reconnected to NATS (after %d connection errors)", int(suppressed))
        else:
            logger.info("reconnected to NATS")
        for listener in listeners:
            listener.reconnected()

    async def on_error(exc: Exception) -> None:
        errors["count"] += 1
        now = time.monotonic()
        level = logging.DEBUG
        if now >= errors["next_warning"]:
            errors["next_warning"] = now + _ERROR_REPEAT
            level = logging.WARNING
        logger.log(
            level,
            "NATS connection error (%d since the last connection): %s: %s",
            int(errors["count"]),
            type(exc).__name__,
            str(exc) or "no details",
        )
        if client:
            # A refused publish or subscription: the operation waiting for it
            # only sees a timeout; remember why (nats/refusals.py).
            note_refusal(client[0], exc)

    connect_timeout = float(kwargs.pop("connect_timeout", min(2.0, timeout)))
    # (A float: nats-py's annotation says int, its wait_for takes either.)
    kwargs["connect_timeout"] = connect_timeout
    kwargs.setdefault("reconnect_time_wait", 0.5)
    # Notice a dead TCP connection (no RST, no bytes) in seconds, not minutes.
    kwargs.setdefault("ping_interval", 5)
    kwargs.setdefault("max_outstanding_pings", 2)
    # Our own client object rather than nats.connect()'s: when the first
    # connection fails (a timeout, or a server that accepts TCP and never says
    # hello), nats-py drops its half-open socket without closing it; closing the
    # client gives it back now instead of at the next garbage collection.
    nc = Client()
    client.append(nc)  # so that closing it after a failure is not an outage
    try:
        await asyncio.wait_for(
            nc.connect(
                servers=list(options.servers),
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
        await _close_quietly(nc)
        # A timeout's message is empty: never leave "within 10s: " dangling.
        reason = str(exc) or ("no answer" if isinstance(exc, asyncio.TimeoutError) else repr(exc))
        raise NatsUnavailableError(
            f"could not connect to NATS at {', '.join(options.servers)} within {timeout:g}s: "
            f"{reason}"
        ) from exc
    except BaseException:
        # The caller gave up (a stop during start-up), or a user callback of
        # the handshake raised (credentials, signature): the socket goes too.
        await _close_quietly(nc)
        raise
    return nc


async def _close_quietly(nc: Client) -> None:
    """Close a client whose first connection failed (its socket, its tasks)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), 1.0)


async def open_backend(
    options: ConnectOptions | None = None,
    *,
    listeners: Sequence[ConnectionListener] = (),
    timeout: float = 5.0,
    name: str | None = None,
) -> JetStreamBackend:
    """Connect to NATS and return the election backend on that connection.

    The one door from the package to NATS: the elector, a standalone
    election, prefork children, the CLI and the Django commands all open
    their connection here. The backend owns the connection:
    :meth:`~JetStreamBackend.close` (or ``async with``) closes it.

    Args:
        options: Servers and extra options; default ``nats://127.0.0.1:4222``.
        listeners: Told about disconnects and reconnects.
        timeout: Seconds to wait for the first connection.
        name: Connection name shown by the server's monitoring.

    Returns:
        The backend, connected.

    Raises:
        NatsUnavailableError: No server answered within ``timeout``.

    """
    relay = _BackendRelay()
    nc = await connect(
        options or ConnectOptions(), listeners=[*listeners, relay], timeout=timeout, name=name
    )
    relay.backend = JetStreamBackend(nc, owns_connection=True)
    return relay.backend


class _BackendRelay(ConnectionListener):
    """Tells the backend of its own connection's reconnects (it restarts its watches)."""

    def __init__(self) -> None:
        self.backend: JetStreamBackend | None = None

    def reconnected(self) -> None:
        if self.backend is not None:
            self.backend.reconnected()


__all__ = [
    "ConnectOptions",
    "ConnectionListener",
    "connect",
    "open_backend",
]
