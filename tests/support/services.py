"""Helpers for tests that use the machine's services (brokers, databases).

A test that needs Redis, RabbitMQ or PostgreSQL calls :func:`require_service`:
under ``CI=true`` an unreachable service fails the test (CI machines must have
it), elsewhere the test is skipped with the reason.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

#: Whether this run is CI's (``CI=true``): missing services are failures there.
IN_CI = os.environ.get("CI", "").lower() == "true"


def reachable(url: str, timeout: float = 1.0) -> bool:
    """Whether something accepts TCP connections at ``url``'s host and port.

    Args:
        url: A URL with a host and a port (``redis://127.0.0.1:6379/0``).
        timeout: Seconds to wait for the connection.

    Returns:
        ``True`` if the connection was accepted.
    """
    parsed = urlparse(url)
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 0), timeout):
            return True
    except OSError:
        return False


def require_service(kind: str, url: str, hint: str = "start it to run these cases") -> None:
    """Fail under CI, skip elsewhere, when the service at ``url`` is not reachable.

    Args:
        kind: What the service is, for the message (``"redis broker"``).
        url: Where it should be.
        hint: What a developer can do about it.
    """
    import pytest  # only tests call this; the package does not depend on pytest

    if reachable(url):
        return
    message = f"{kind} not reachable at {url}"
    if IN_CI:
        pytest.fail(f"{message} (CI=true: the CI services must be up)")
    pytest.skip(f"{message}; {hint}")


def wait_for(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    diagnostics: Callable[[], str] | None = None,
) -> Any:
    """Poll ``predicate`` until it returns something truthy, and return that.

    For state that lives in other processes, where there is no event to wait on.

    Args:
        predicate: The condition.
        timeout: Seconds before giving up.
        what: Described in the failure message.
        diagnostics: Called on failure; its text is added to the message.

    Returns:
        The predicate's first truthy value.

    Raises:
        AssertionError: If ``timeout`` passed first.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = diagnostics() if diagnostics else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{extra}")
        time.sleep(0.02)
