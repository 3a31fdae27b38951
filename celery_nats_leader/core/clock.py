"""Monotonic clocks: the only notion of time the election uses.

The election never compares wall clocks, and never compares clocks of two
hosts: every deadline is computed and checked on the local monotonic clock.
The clock is injectable so that timing logic can be tested deterministically.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """A source of monotonic time in seconds."""

    def monotonic(self) -> float:
        """Return the current monotonic time, in seconds."""
        ...


class MonotonicClock:
    """The process's monotonic clock (:func:`time.monotonic`)."""

    def monotonic(self) -> float:
        """Return :func:`time.monotonic`."""
        return time.monotonic()


class ManualClock:
    """A clock that only moves when told to; for tests of timing logic.

    Args:
        start: The initial reading, in seconds.

    """

    def __init__(self, start: float = 1000.0) -> None:
        self._now = start

    def monotonic(self) -> float:
        """Return the current reading."""
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock forward.

        Args:
            seconds: How far to move, in seconds; must not be negative.

        Raises:
            ValueError: If ``seconds`` is negative (monotonic clocks never go back).

        """
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go backwards")
        self._now += seconds


SYSTEM_CLOCK: Clock = MonotonicClock()
