"""The election's vocabulary: the words every part of an election shares.

States, demote reasons, the callback types, the subjects an election speaks
on, and :class:`ServiceHost`, what leader services need of an election.
Nothing here runs an election: :mod:`.base`, :mod:`.kv`, :mod:`.allcall`,
:mod:`.leader_services`, :mod:`.interface` and :mod:`celery_nats_leader.election.events`
import these names from here, so none of them has to import another's
implementation for a word.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from celery_nats_leader.core import constants as c

if TYPE_CHECKING:
    from celery_nats_leader.config import ElectionConfig
    from celery_nats_leader.core.errors import ElectionError
    from celery_nats_leader.term.record import LeaderRecord
    from celery_nats_leader.term.token import FencingToken


class ElectionState(str, enum.Enum):
    """Where an election is in its life."""

    INIT = "init"
    CANDIDATE = "candidate"
    LEADER = "leader"
    FOLLOWER = "follower"
    STOPPED = "stopped"


class DemoteReason(str, enum.Enum):
    """Why a leader stopped leading (passed to demote callbacks)."""

    STOPPED = "stopped"
    """:meth:`BaseElection.stop <celery_nats_leader.election.base.BaseElection.stop>`
    was called."""
    RESIGNED = "resigned"
    """:meth:`BaseElection.resign <celery_nats_leader.election.base.BaseElection.resign>`
    was called, or an operator asked."""
    TAKEOVER = "takeover"
    """A higher-priority candidate politely asked for the role."""
    LEASE_EXPIRED = "lease_expired"
    """No renewal was confirmed before the local lease deadline."""
    REVISION_CHANGED = "revision_changed"
    """Someone else wrote the key: the term is over."""
    KEY_DELETED = "key_deleted"
    """The key was deleted by someone else."""
    TOKEN_MISMATCH = "token_mismatch"
    """Validation found another term's token in the key."""
    DISCONNECTED = "disconnected"
    """The NATS connection was down longer than the disconnect grace."""
    HEALTH_CHECK_FAILED = "health_check_failed"
    """The health check failed too many times in a row."""
    FENCED = "fenced"
    """An operator fenced the term (``nats-leader fence``): it ended at once."""
    ERROR = "error"
    """A permanent error (bucket deleted, permission denied) ended the election."""


#: Demote reasons after which the leader deletes its key itself (a release).
RELEASING_REASONS = frozenset(
    {
        DemoteReason.STOPPED.value,
        DemoteReason.TAKEOVER.value,
        DemoteReason.HEALTH_CHECK_FAILED.value,
    }
)

PromoteCallback = Callable[["FencingToken"], "Awaitable[None] | None"]
"""``callback(token)``: this process became leader."""
DemoteCallback = Callable[[DemoteReason], "Awaitable[None] | None"]
"""``callback(reason)``: this process stopped leading."""
LeaderChangeCallback = Callable[["LeaderRecord | None"], "Awaitable[None] | None"]
"""``callback(record_or_None)``: the known leader changed."""
ErrorCallback = Callable[["ElectionError"], "Awaitable[None] | None"]
"""``callback(error)``: an error stopped the election."""
TransitionHook = Callable[[ElectionState, ElectionState], None]
"""``hook(old, new)``: called synchronously on the election's loop at every state change."""


def control_subject(bucket: str, role: str, verb: str) -> str:
    """Subject of the request/reply side channel of one role.

    Args:
        bucket: The KV bucket.
        role: The role.
        verb: ``roster`` or ``resign``.

    Returns:
        ``_NATS_LEADER.<bucket>.<role>.<verb>``.

    """
    return f"{c.CONTROL_SUBJECT_PREFIX}.{bucket}.{role}.{verb}"


def event_subject(bucket: str, role: str = ">") -> str:
    """The subject of ``role``'s transition events in ``bucket`` (default: every role's).

    Roles may contain dots, so the role comes last and ``>`` matches them all.
    """
    return f"{c.EVENTS_SUBJECT_PREFIX}.{bucket}.{role}"


def events_stream(bucket: str) -> str:
    """Name of the optional JetStream stream keeping ``bucket``'s events."""
    return f"{c.EVENTS_STREAM_PREFIX}{bucket}"


class ServiceHost(Protocol):
    """What leader services (:mod:`.leader_services`) need of an election.

    :class:`~celery_nats_leader.election.base.BaseElection` provides it; the
    services runner depends on this and nothing else of the election.
    """

    config: ElectionConfig

    @property
    def role(self) -> str:
        """The role."""
        ...

    @property
    def is_leader(self) -> bool:
        """Whether this process leads now (lease checked at every call)."""
        ...

    @property
    def token(self) -> FencingToken | None:
        """The current term's fencing token while leading."""
        ...

    @property
    def lease_remaining(self) -> float:
        """Seconds left on the local lease."""
        ...

    @property
    def recorded_state(self) -> ElectionState:
        """The state as the election last set it (no lease check, unlike ``state``)."""
        ...

    @property
    def ending_reason(self) -> DemoteReason | None:
        """Why the term is ending, while it ends; else ``None``.

        Set from just before the state leaves LEADER until the transition
        hooks have run.
        """
        ...

    async def wait_for_leadership(self, timeout: float | None = None) -> bool:
        """Wait until this process leads; ``False`` after ``timeout`` seconds."""
        ...

    def add_transition_hook(self, hook: TransitionHook) -> None:
        """Call ``hook(old, new)`` at every state change, on the election's loop."""
        ...

    def remove_transition_hook(self, hook: TransitionHook) -> None:
        """Stop calling ``hook`` (no error if it was not added)."""
        ...


__all__ = [
    "RELEASING_REASONS",
    "DemoteCallback",
    "DemoteReason",
    "ElectionState",
    "ErrorCallback",
    "LeaderChangeCallback",
    "PromoteCallback",
    "ServiceHost",
    "TransitionHook",
    "control_subject",
    "event_subject",
    "events_stream",
]
