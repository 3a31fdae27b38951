"""Exponential backoff with jitter, and a circuit breaker, for transient errors."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import TypeVar

from celery_nats_leader.core.constants import (
    BACKOFF_INITIAL_SECONDS,
    BACKOFF_JITTER,
    BACKOFF_MAX_SECONDS,
    BACKOFF_MULTIPLIER,
    CIRCUIT_BREAKER_THRESHOLD,
)
from celery_nats_leader.core.errors import ElectionError, is_transient

T = TypeVar("T")

logger = logging.getLogger(__name__)


class Backoff:
    """Delays for consecutive failures: ``min(max, initial * multiplier**n) ± jitter``.

    After ``breaker_threshold`` consecutive failures the circuit opens and
    every further delay is ``breaker_cooldown`` until a success resets it, so
    a broken server is not hammered by a herd of candidates. The cooldown is
    never shorter than ``maximum``: opening the circuit must not make retries
    faster than the backoff already had them.

    Args:
        initial: First delay, seconds.
        maximum: Largest exponential delay, seconds.
        multiplier: Growth factor per failure.
        jitter: Relative jitter, e.g. ``0.1`` for ±10 %.
        breaker_threshold: Consecutive failures that open the circuit.
        breaker_cooldown: Delay while the circuit is open, seconds (raised
            to ``maximum`` when shorter).
        rng: Random source (injectable for tests).

    """

    def __init__(
        self,
        *,
        initial: float = BACKOFF_INITIAL_SECONDS,
        maximum: float = BACKOFF_MAX_SECONDS,
        multiplier: float = BACKOFF_MULTIPLIER,
        jitter: float = BACKOFF_JITTER,
        breaker_threshold: int = CIRCUIT_BREAKER_THRESHOLD,
        breaker_cooldown: float = BACKOFF_MAX_SECONDS,
        rng: random.Random | None = None,
    ) -> None:
        self._initial = initial
        self._maximum = maximum
        self._multiplier = multiplier
        self._jitter = jitter
        self._threshold = breaker_threshold
        self._cooldown = max(breaker_cooldown, maximum)
        self._rng = rng or random.Random()
        self.failures = 0

    @property
    def circuit_open(self) -> bool:
        """Whether enough consecutive failures happened to open the circuit."""
        return self.failures >= self._threshold

    def failure(self) -> float:
        """Record a failure.

        Returns:
            How long to wait before the next attempt, seconds.

        """
        self.failures += 1
        if self.circuit_open:
            return self._cooldown
        base = min(self._maximum, self._initial * self._multiplier ** (self.failures - 1))
        return max(0.0, base + base * self._jitter * self._rng.uniform(-1.0, 1.0))

    def success(self) -> None:
        """Record a success: the next failure starts from the initial delay."""
        self.failures = 0


def retry_transient(call: Callable[[float], T], *, timeout: float, what: str) -> T:
    """Call ``call(remaining_seconds)`` until it succeeds, retrying transient errors.

    Used where a process starts, and where a finished run is recorded: a
    JetStream that answers "temporarily unavailable" (a cluster electing a
    stream leader, a store that was full) or a request that timed out is no
    reason to give up while time remains.
    Permanent errors (see :func:`~celery_nats_leader.core.errors.is_transient`)
    are raised at once; a transient one is raised when the next attempt
    would start after ``timeout``.

    Args:
        call: The operation; it receives the seconds left before the deadline.
        timeout: Seconds from now after which no attempt starts.
        what: What is being done, for the log ("starting the leader election", ...).

    Returns:
        What ``call`` returned.

    """
    deadline = time.monotonic() + timeout
    backoff = Backoff(maximum=1.0, breaker_threshold=1_000_000)
    while True:
        try:
            return call(max(deadline - time.monotonic(), 0.1))
        except ElectionError as exc:
            delay = backoff.failure()
            if not is_transient(exc) or time.monotonic() + delay >= deadline:
                raise
            logger.warning(
                "%s failed (%s: %s); retrying in %.0f ms",
                what,
                type(exc).__name__,
                exc,
                delay * 1000,
            )
            time.sleep(delay)
