"""The interface every election strategy implements.

The Elector, the Celery bootstep, ``@leader_only`` and the beat scheduler
depend only on this, so they work unchanged on the KV strategy
(:class:`~celery_nats_leader.election.KvElection`, the default) and on ALLCALL.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from celery_nats_leader.config import ElectionConfig
from celery_nats_leader.core.backend import Backend
from celery_nats_leader.core.errors import ElectionError
from celery_nats_leader.election.leader_services import (
    LeaderServiceRunner,
    LeadingScope,
    ServiceFunction,
)
from celery_nats_leader.election.vocabulary import (
    DemoteCallback,
    ElectionState,
    ErrorCallback,
    LeaderChangeCallback,
    PromoteCallback,
)
from celery_nats_leader.term.record import LeaderRecord
from celery_nats_leader.term.token import FencingToken


class LeaderElection(Protocol):
    """One role's election, whatever the strategy."""

    config: ElectionConfig

    @property
    def role(self) -> str:
        """The role."""
        ...

    @property
    def instance_id(self) -> str:
        """This candidate's id."""
        ...

    @property
    def state(self) -> ElectionState:
        """The current state."""
        ...

    @property
    def is_leader(self) -> bool:
        """Whether this process leads now (thread-safe, checks the lease clock)."""
        ...

    @property
    def token(self) -> FencingToken | None:
        """The fencing token while leading."""
        ...

    @property
    def leader(self) -> LeaderRecord | None:
        """The last leader seen."""
        ...

    @property
    def leader_id(self) -> str | None:
        """The last leader's id."""
        ...

    @property
    def error(self) -> ElectionError | None:
        """The permanent error that stopped the election, if any."""
        ...

    @property
    def lease_remaining(self) -> float:
        """Seconds left on the local lease."""
        ...

    def bind(self, backend: Backend) -> None:
        """Use ``backend`` (a shared connection) instead of connecting on start."""
        ...

    def wake(self) -> None:
        """Re-evaluate now (the connection changed)."""
        ...

    def on_promote(self, callback: PromoteCallback) -> PromoteCallback:
        """Register a promote callback."""
        ...

    def on_demote(self, callback: DemoteCallback) -> DemoteCallback:
        """Register a demote callback."""
        ...

    def on_leader_change(self, callback: LeaderChangeCallback) -> LeaderChangeCallback:
        """Register a leader-change callback."""
        ...

    def on_error(self, callback: ErrorCallback) -> ErrorCallback:
        """Register an error callback."""
        ...

    def run_while_leading(
        self, service: ServiceFunction, *, name: str | None = None, grace: float | None = None
    ) -> LeaderServiceRunner:
        """Run ``service(ctx)`` while leading, every term (see :mod:`.leader_services`)."""
        ...

    def leading(self, timeout: float | None = None) -> LeadingScope:
        """An ``async with`` block run while leading, cancelled when the term ends."""
        ...

    def add_lease_listener(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` on the loop whenever the lease deadline moves."""
        ...

    async def start(self, *, wait: float | None = None) -> None:
        """Join the election."""
        ...

    async def stop(self) -> None:
        """Leave the election (releasing leadership)."""
        ...

    async def resign(self) -> None:
        """Step down if leading."""
        ...

    async def validate_token(self) -> bool:
        """Confirm the term against the shared state."""
        ...

    async def wait_for_leadership(self, timeout: float | None = None) -> bool:
        """Wait until leading."""
        ...

    def describe(self) -> dict[str, Any]:
        """This candidate's view, for the roster and status commands."""
        ...


def new_election(config: ElectionConfig, **kwargs: Any) -> LeaderElection:
    """Build the election of ``config.strategy``.

    Args:
        config: The role's configuration.
        **kwargs: Passed to the strategy's constructor (backend, clock, observer...).

    Returns:
        An election, not started.
    """
    if config.strategy == "allcall":
        from celery_nats_leader.election.allcall import AllcallElection

        election: LeaderElection = AllcallElection(config, **kwargs)
        return election
    from celery_nats_leader.election.kv import KvElection

    return KvElection(config, **kwargs)
