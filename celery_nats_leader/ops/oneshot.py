"""Running one operator operation from synchronous code.

The Celery CLI, the Django management commands, the system checks and the
admin page each do one short piece of work on a connection of their own:
:func:`with_backend` opens a backend from the settings, runs the operation
on it and closes it, on :func:`run_sync` (``asyncio.run``, right for a
one-shot command); long-lived processes use the
:class:`~celery_nats_leader.election.elector.Elector` or the
:class:`~celery_nats_leader.nats.process_client.ProcessClient` instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import socket
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from celery_nats_leader.nats import open_backend

if TYPE_CHECKING:
    from celery_nats_leader.config.settings import LeaderSettings
    from celery_nats_leader.core.backend import Backend

T = TypeVar("T")


def run_sync(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run one coroutine to completion from synchronous code.

    Uses ``asyncio.run``; when the calling thread already runs an event loop
    (an ASGI server calling a sync view, a notebook), a short-lived helper
    thread runs it instead.

    Args:
        factory: Builds the coroutine (called in the thread that runs it).

    Returns:
        The coroutine's result.

    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_interruptible(factory))
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nats-leader-op") as pool:
        return pool.submit(lambda: asyncio.run(_interruptible(factory))).result()


async def _interruptible(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """``factory()``, ending cancelled whenever a cancel was asked for (Ctrl-C).

    In the main thread, ``asyncio.run`` answers Ctrl-C by cancelling its task,
    and raises ``KeyboardInterrupt`` only if the task then ends cancelled. A
    coroutine that answers the cancel with an error of its own (a connection
    attempt cut short says "could not connect") would turn Ctrl-C into that
    error, which callers polling for a state catch and retry: the interrupt
    would be lost. (Python 3.10's ``asyncio.run`` lets ``KeyboardInterrupt``
    through as raised.)
    """
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python 3.11+
    try:
        result = await factory()
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        if cancelling is not None and cancelling():
            raise asyncio.CancelledError() from exc
        raise
    if cancelling is not None and cancelling():
        raise asyncio.CancelledError()
    return result


def with_backend(
    settings: LeaderSettings,
    operation: Callable[[Backend], Awaitable[T]],
    *,
    timeout: float,
    name: str,
) -> T:
    """Open, run, close: one operator operation on a connection of its own, from sync code.

    Every operator path (``celery nats-leader``, the ``manage.py election_*``
    commands, the system checks, the admin page) goes through here.

    Args:
        settings: Where to connect (servers, credentials).
        operation: The work; it gets the connected backend.
        timeout: Seconds to wait for the connection.
        name: The connection's name in NATS monitoring
            (usually :func:`operator_name`).

    Returns:
        What ``operation`` returned.

    Raises:
        NatsUnavailableError: No server answered within ``timeout``.

    """

    async def run() -> T:
        async with await open_backend(settings.connection, timeout=timeout, name=name) as backend:
            return await operation(backend)

    return run_sync(run)


def operator_name(tool: str) -> str:
    """How an operator tool identifies itself to leaders and in NATS monitoring."""
    return f"{tool} ({socket.gethostname()}:{os.getpid()})"


__all__ = ["operator_name", "run_sync", "with_backend"]
