"""Hooks through which an election reports what it does, for metrics.

The core defines the hooks and a no-op default; the Prometheus exporter
(extra ``metrics``) implements them. Hooks are called on the event loop and
must return quickly.
"""

from __future__ import annotations

from typing import Protocol


class ElectionObserver(Protocol):
    """Receives an election's measurements."""

    def state_changed(self, role: str, instance_id: str, old: str, new: str) -> None:
        """The election moved from state ``old`` to ``new``."""
        ...

    def campaign(self, role: str, instance_id: str, won: bool) -> None:
        """A campaign (create) finished; ``won`` tells its outcome."""
        ...

    def heartbeat(self, role: str, instance_id: str, seconds: float, ok: bool) -> None:
        """A renewal finished after ``seconds``; ``ok`` is false when it failed."""
        ...

    def validation(self, role: str, instance_id: str, ok: bool) -> None:
        """A token validation finished; ``ok`` is false when the token was stale."""
        ...


class NullObserver:
    """An observer that ignores everything (the default)."""

    def state_changed(self, role: str, instance_id: str, old: str, new: str) -> None:
        """Ignore."""

    def campaign(self, role: str, instance_id: str, won: bool) -> None:
        """Ignore."""

    def heartbeat(self, role: str, instance_id: str, seconds: float, ok: bool) -> None:
        """Ignore."""

    def validation(self, role: str, instance_id: str, ok: bool) -> None:
        """Ignore."""
