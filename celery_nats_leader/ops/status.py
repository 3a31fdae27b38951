"""The status commands' reads, from synchronous code on a connection of their own.

The read model itself (:class:`~celery_nats_leader.election.status.RoleStatus`,
:func:`~celery_nats_leader.election.status.read_report`) lives with the
election; this module opens the connection, reads once or every few seconds,
and closes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core import constants as c
from celery_nats_leader.core.backend import Backend
from celery_nats_leader.core.errors import ElectionError
from celery_nats_leader.election.status import StatusReport, read_report
from celery_nats_leader.ops.oneshot import operator_name, with_backend

__all__ = ["fetch_report", "watch_reports"]


def fetch_report(
    settings: LeaderSettings,
    *,
    configured_roles: Sequence[str],
    only: Sequence[str] = (),
    timeout: float = 5.0,
    roster_window: float = c.DEFAULT_ROSTER_WINDOW_SECONDS,
    name: str | None = None,
) -> StatusReport:
    """Synchronous :func:`read_report` of the settings' bucket, on a connection of its own.

    Args:
        settings: Where to connect; the bucket, strategy and servers.
        configured_roles: Roles that must have a leader (listed even when unheld).
        only: If given, report just these roles (and require a leader for each).
        timeout: Seconds for the connection and the KV reads.
        roster_window: Seconds to collect the live candidates' answers.
        name: The connection's name in NATS monitoring.

    Returns:
        The report.

    Raises:
        ElectionError: NATS unreachable, bucket missing, ...

    """
    return with_backend(
        settings,
        lambda backend: _settings_report(
            backend,
            settings,
            configured_roles=configured_roles,
            only=only,
            timeout=timeout,
            roster_window=roster_window,
        ),
        timeout=timeout,
        name=name or operator_name("status"),
    )


def watch_reports(
    settings: LeaderSettings,
    *,
    configured_roles: Sequence[str],
    only: Sequence[str] = (),
    timeout: float = 5.0,
    interval: float = 2.0,
    count: int = 0,
    show: Callable[[StatusReport, int], None],
    failed: Callable[[ElectionError], None],
    name: str | None = None,
) -> StatusReport | None:
    """Read the report every ``interval`` seconds on one connection (``--watch``).

    Args:
        settings: Where to connect; the bucket, strategy and servers.
        configured_roles: Roles that must have a leader (listed even when unheld).
        only: If given, report just these roles.
        timeout: Seconds for the connection and each read.
        interval: Seconds between reads (at least 0.1).
        count: Stop after this many reads (``0``: until interrupted).
        show: Called with each report and its refresh number (1, 2, ...).
        failed: Called with the error of a read that failed (the watch goes on).
        name: The connection's name in NATS monitoring.

    Returns:
        The last report read, or ``None`` when no read succeeded.

    Raises:
        ElectionError: The connection could not be opened.

    """
    pause = max(0.1, float(interval))

    async def loop(backend: Backend) -> StatusReport | None:
        last: StatusReport | None = None
        done = 0
        while True:
            try:
                report = await _settings_report(
                    backend,
                    settings,
                    configured_roles=configured_roles,
                    only=only,
                    timeout=timeout,
                )
            except ElectionError as exc:
                failed(exc)
            else:
                last = report
                show(report, done + 1)
            done += 1
            if count and done >= count:
                return last
            await asyncio.sleep(pause)

    return with_backend(
        settings, loop, timeout=timeout, name=name or operator_name("status --watch")
    )


def _settings_report(
    backend: Backend,
    settings: LeaderSettings,
    *,
    configured_roles: Sequence[str],
    only: Sequence[str],
    timeout: float,
    roster_window: float = c.DEFAULT_ROSTER_WINDOW_SECONDS,
) -> Awaitable[StatusReport]:
    """:func:`read_report` of the settings' bucket, with their strategy and servers."""
    return read_report(
        backend,
        settings.bucket,
        configured_roles=configured_roles,
        only=only,
        strategy=settings.strategy,
        servers=settings.servers,
        timeout=timeout,
        roster_window=roster_window,
    )
