"""Running one operator operation from synchronous code.

The Celery CLI, the Django management commands, the system checks and the
admin page each do one short piece of work on a connection of their own, so
``asyncio.run`` (:func:`run_once`) is right for them; long-lived processes use
the :class:`~celery_nats_leader.elector.Elector` instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import socket
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_once(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
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
        return asyncio.run(factory())
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nats-leader-op") as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()


def operator_name(tool: str) -> str:
    """How an operator tool identifies itself to leaders and in NATS monitoring."""
    return f"{tool} ({socket.gethostname()}:{os.getpid()})"


__all__ = ["operator_name", "run_once"]
