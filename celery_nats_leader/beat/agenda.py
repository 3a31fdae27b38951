"""When to ask each entry again: the leader scheduler's equivalent of Celery's heap.

Celery's scheduler asks an entry's ``is_due()`` only when the delay of its
last answer has passed. :class:`Agenda` keeps, per entry, that answer (the
entry is *held* until then) and the backoff of an entry whose send failed,
so that a leader's pass costs a few lookups per entry that is not due, and
one failing entry does not hold the others.

Times are timestamps on the entry's own clock (its schedule's ``now()``), as
Celery's heap; an answer is forgotten as soon as the entry is edited or its
KV state changes. This module imports neither Celery nor Django.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Agenda"]


@dataclass(frozen=True)
class _Hold:
    entry: Any
    revision: int
    until: float


class Agenda:
    """Per-entry holds (a "not due" answer) and backoffs (a failed send).

    Args:
        same_entry: Whether an entry is unedited since it was held.

    """

    def __init__(self, same_entry: Callable[[Any, Any], bool]) -> None:
        self.same_entry = same_entry
        self._holds: dict[str, _Hold] = {}
        self._backoffs: dict[str, tuple[int, float]] = {}

    def held_for(self, name: str, entry: Any, revision: int, now: float) -> float | None:
        """Seconds the entry is still held or backing off, else ``None`` (ask it now).

        Args:
            name: The entry's name.
            entry: The entry as the scheduler has it now.
            revision: The KV revision of its state now.
            now: The time on the entry's clock.

        """
        backoff = self._backoffs.get(name)
        if backoff is not None and backoff[1] > now:
            return backoff[1] - now
        hold = self._holds.get(name)
        if hold is None or hold.revision != revision or hold.until <= now:
            return None
        if not self.same_entry(hold.entry, entry):
            # Edited (in the database, in beat_schedule): its answer may differ.
            return None
        return hold.until - now

    def hold(self, name: str, entry: Any, revision: int, until: float) -> None:
        """Do not ask the entry again before ``until`` (while it and its state are unchanged)."""
        self._holds[name] = _Hold(entry, revision, until)

    def release(self, name: str) -> None:
        """Forget the entry's hold (it is due)."""
        self._holds.pop(name, None)

    def back_off(self, name: str, now: float, *, first: float, cap: float) -> float:
        """Hold a failing entry: ``first`` seconds, doubling per failure, at most ``cap``.

        Returns:
            The delay chosen.

        """
        failures = self._backoffs.get(name, (0, 0.0))[0] + 1
        delay: float = min(cap, first * 2.0 ** (failures - 1))
        self._backoffs[name] = (failures, now + delay)
        return delay

    def succeeded(self, name: str) -> None:
        """The entry's tick went out: end its backoff."""
        self._backoffs.pop(name, None)

    def clear(self) -> None:
        """Forget every hold (every entry is asked at the next pass)."""
        self._holds.clear()
