"""The beat role's election, as a scheduler sees it: start, follow, stop.

:class:`BeatElection` hosts the beat role on one :class:`Elector` (one loop
thread, one NATS connection), opens the schedule's state store, wakes the
scheduler on a promotion or a demotion, and makes a scheduler that can never
lead say so. It imports neither Celery nor Django.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from celery_nats_leader.beat.schedule_store import ScheduleStateStore
from celery_nats_leader.config import ElectionConfig
from celery_nats_leader.config.settings import LeaderSettings
from celery_nats_leader.core.backoff import retry_transient
from celery_nats_leader.core.errors import ConfigError, ElectionError
from celery_nats_leader.election import DemoteReason, ElectionState
from celery_nats_leader.election.elector import Elector, RoleHandle
from celery_nats_leader.term.record import LeaderRecord
from celery_nats_leader.term.token import FencingToken

__all__ = ["SCHEDULER_META_KEY", "BeatElection", "describe_leader", "is_scheduler"]

logger = logging.getLogger(__name__)

#: How often a scheduler that cannot lead says why, in seconds.
WARNING_INTERVAL = 30.0


#: The key of a leader record's ``meta`` that only beat schedulers write.
SCHEDULER_META_KEY = "scheduler"


def is_scheduler(record: LeaderRecord) -> bool:
    """Whether the holder of a beat role's record is a beat scheduler (by its meta)."""
    return SCHEDULER_META_KEY in record.meta


def describe_leader(record: LeaderRecord | None) -> str:
    """A leader record for a log line: its id, host and pid."""
    if record is None:
        return "nobody"
    meta = record.meta
    return f"{record.id} (host {meta.get('hostname', '?')}, pid {meta.get('pid', '?')})"


class BeatElection:
    """The beat role of one scheduler, and the store of the schedule's state.

    Args:
        settings: The scheduler's settings.
        config: The beat role's election config (with the scheduler's meta).
        make_elector: Builds the elector (tests pass an in-memory one).
        watch: Called with the elector once the beat role is added, before it
            starts (the scheduler's Prometheus observer watches it there).

    """

    def __init__(
        self,
        settings: LeaderSettings,
        config: ElectionConfig,
        make_elector: Callable[[], Elector],
        watch: Callable[[Elector], None] | None = None,
    ) -> None:
        if config.strategy != "kv":
            # Workers check each beat message's epoch against the role's KV
            # key (the dispatch fence); an ALLCALL election writes no key, so that
            # check would pass every message of an ended term.
            raise ConfigError(
                f"the beat role {config.role!r} is elected with the {config.strategy!r} "
                "strategy; beat needs 'kv' (workers fence its messages by the role's KV key, "
                "which an ALLCALL election does not write). Set "
                f"nats_leader_role_options={{{config.role!r}: {{'strategy': 'kv'}}}}, "
                "or nats_leader_strategy='kv'"
            )
        self.settings = settings
        self.config = config
        self._make_elector = make_elector
        self._watch = watch
        self.elector: Elector | None = None
        self.handle: RoleHandle | None = None
        self.store: ScheduleStateStore | None = None
        self._wake = threading.Event()
        self._started_at = 0.0
        self._next_warning = 0.0
        self._next_leader_warning = 0.0
        self._connected_since: float | None = None

    @property
    def is_leader(self) -> bool:
        """Whether this scheduler leads the beat role right now."""
        return self.handle is not None and self.handle.is_leader

    def start(self) -> None:
        """Join the election and open the state store (idempotent).

        Raises:
            ElectionError: With ``nats_leader_required``, when NATS cannot be
                reached; always, on a permanent problem (bucket missing,
                permission denied).

        """
        if self.elector is not None:
            return
        settings, config = self.settings, self.config
        elector = self._make_elector()
        handle = elector.add_role(config)
        handle.on_promote(self._promoted)
        handle.on_demote(self._demoted)
        self.elector, self.handle = elector, handle
        if self._watch is not None:
            self._watch(elector)
        # State operations get a little more room than election reads: a
        # commit whose answer is late is reconciled, never retried blindly.
        self.store = ScheduleStateStore(
            elector,
            settings.beat_state_bucket,
            config.role,
            create=settings.create_bucket,
            replicas=settings.bucket_replicas,
            timeout=max(2 * config.request_timeout, 0.5),
        )
        logger.info(
            "nats-leader beat: instance %s campaigns for role %r in bucket %r on %s "
            "(state in bucket %r)",
            config.instance_id,
            config.role,
            config.bucket,
            ", ".join(settings.servers),
            settings.beat_state_bucket,
        )
        deadline = time.monotonic() + settings.start_timeout
        try:
            elector.start(timeout=settings.start_timeout, require_connection=settings.required)
            if elector.connected:
                # Fail now, not at the first promotion, on a missing or
                # misconfigured state bucket (within the same start timeout).
                store = self.store
                retry_transient(
                    lambda _remaining: store.open(),
                    timeout=max(deadline - time.monotonic(), 0.1),
                    what="opening the schedule state store",
                )
        except ElectionError as exc:
            logger.critical("nats-leader beat: cannot start: %s", exc)
            elector.stop()
            raise
        # Without ``required`` the connection completes in the background:
        # the elector warns about every attempt that actually fails, and
        # :meth:`follow` once the connection is overdue (start_timeout).
        self._started_at = time.monotonic()

    def stop(self) -> None:
        """Leave the election; a leader releases the role (its successor wins at once)."""
        elector = self.elector
        if elector is None:
            return
        was_leader = self.is_leader
        elector.stop(timeout=self.settings.release_bound([self.config.role]))
        if was_leader:
            logger.info("nats-leader beat: stopped; role %r released", self.config.role)

    def retry_delay(self, max_interval: float) -> float:
        """How soon to try again after a transient failure, in seconds."""
        return min(max_interval, max(0.05, self.config.heartbeat_interval / 2))

    def follow(self, max_interval: float) -> None:
        """A follower's pass: check the election's health, then wait a bounded time.

        A promotion or a demotion ends the wait at once.

        Raises:
            ElectionError: The election stopped for good or never started.

        """
        assert self.handle is not None
        self._check_health(self.handle)
        bound = min(max_interval, self.settings.beat_follower_interval)
        if self._wake.wait(bound):
            self._wake.clear()

    def _check_health(self, handle: RoleHandle) -> None:
        """Make a scheduler that can never lead say so (or stop, on a permanent error)."""
        elector = self.elector
        assert elector is not None
        if handle.error is not None:
            logger.critical(
                "nats-leader beat: the election for role %r stopped: %s",
                handle.role,
                handle.error,
            )
            raise handle.error
        now = time.monotonic()
        if elector.connected and handle.state is ElectionState.INIT:
            # Connected, but the role never started: the elector logged a
            # permanent error (missing bucket, ...). Give it start_timeout.
            if self._connected_since is None:
                self._connected_since = now
            elif now - self._connected_since > self.settings.start_timeout:
                raise ElectionError(
                    f"the election for role {handle.role!r} could not start (see the error "
                    "logged above); this scheduler would never dispatch"
                )
        if not elector.connected:
            overdue = now - self._started_at > self.settings.start_timeout
            if overdue and now >= self._next_warning:
                self._next_warning = now + WARNING_INTERVAL
                logger.warning(
                    "nats-leader beat: still not connected to NATS (%s) after %gs; "
                    "dispatching nothing",
                    ", ".join(self.settings.servers),
                    now - self._started_at,
                )
            return
        leader = handle.leader
        if leader is not None and not is_scheduler(leader):
            if now >= self._next_leader_warning:
                self._next_leader_warning = now + WARNING_INTERVAL
                logger.error(
                    "nats-leader beat: role %r is held by %s, which is not a beat scheduler "
                    "(meta %s); no beat replica dispatches while it holds the role. Remove %r "
                    "from that process's nats_leader_roles, or give beat another "
                    "nats_leader_beat_role",
                    handle.role,
                    describe_leader(leader),
                    dict(leader.meta),
                    handle.role,
                )
            return
        logger.debug(
            "nats-leader beat: following; the active scheduler is %s", describe_leader(leader)
        )

    def _promoted(self, token: FencingToken) -> None:
        logger.info(
            "nats-leader beat: this replica is now the active scheduler (role %r, epoch %d)",
            self.config.role,
            token.epoch,
        )
        self._wake.set()

    def _demoted(self, reason: DemoteReason) -> None:
        logger.info(
            "nats-leader beat: no longer the active scheduler (role %r, %s)",
            self.config.role,
            reason.value,
        )
        self._wake.set()
