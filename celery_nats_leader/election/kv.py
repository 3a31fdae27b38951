"""The election state machine for one role (asyncio).

``INIT → CANDIDATE → LEADER | FOLLOWER → ... → STOPPED``

* Campaign: ``create`` the role's key; atomic, so exactly one candidate wins.
* Renew: the leader ``update``s the key at its last revision every heartbeat;
  a revision written by someone else is a definite loss.
* Lease: the leader keeps, on its own monotonic clock, the *send* time of its
  last confirmed write and stops leading at ``send + ttl - margin``. The
  server cannot expire the key before ``store + ttl >= send + ttl``, so a live
  leader always steps down before a successor can win, whatever the network
  does. :attr:`KvElection.is_leader` checks that deadline on every call, so it
  is right even when the event loop lags.
* Follow: watch the key; on a delete, campaign at once (with a little jitter,
  preferred candidates first); otherwise campaign when the key must have
  expired (``max_age`` expiry sends no watch event on nats-server 2.9/2.10),
  backing the watch up with a periodic read.
* Release: on stop or resign, run the demote callbacks, then delete the key
  at our revision (never a successor's record).
* A TTL change (a new bucket): a won create is checked against the bucket's
  "moved" mark before the term is used, and a replica on the new bucket waits
  for the old bucket's term of the role to end (:mod:`.moves`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import uuid
from collections import deque
from typing import Any

from celery_nats_leader.core import constants as c
from celery_nats_leader.core.backend import Backend, Bucket, KVEntry, Operation
from celery_nats_leader.core.backoff import Backoff
from celery_nats_leader.core.errors import (
    BackendError,
    BackendTimeoutError,
    BucketConfigError,
    BucketNotFoundError,
    ElectionError,
    JetStreamUnavailableError,
    KeyExistsError,
    NotConnectedError,
    PermissionDeniedError,
    RevisionMismatchError,
)
from celery_nats_leader.election.base import BaseElection
from celery_nats_leader.election.follower_view import FollowerView
from celery_nats_leader.election.moves import BucketMarks
from celery_nats_leader.election.roster import Roster
from celery_nats_leader.election.successor import (
    PromiseLedger,
    RateCheck,
    SuccessorBounds,
    candidate_digest,
)
from celery_nats_leader.election.vocabulary import DemoteReason, ElectionState, control_subject
from celery_nats_leader.term import read_term
from celery_nats_leader.term.current import term_of
from celery_nats_leader.term.record import LeaderRecord, encode_record
from celery_nats_leader.term.token import FencingToken

logger = logging.getLogger(__name__)

#: Errors after which retrying cannot help: the election stops and reports.
PERMANENT_ERRORS = (
    BucketNotFoundError,
    BucketConfigError,
    JetStreamUnavailableError,
    PermissionDeniedError,
)

#: How many of our own past tokens we remember, to recognize our leftovers.
_REMEMBERED_TOKENS = 16


class KvElection(BaseElection):
    """Leader election for one role on a NATS JetStream KV bucket.

    Constructed like every strategy: see
    :class:`~celery_nats_leader.election.base.BaseElection` for the arguments.

    """

    _logger = logger
    _name_prefix = "election"
    _permanent_errors = PERMANENT_ERRORS
    _strategy = "kv"

    def _init_state(self) -> None:
        self._bucket: Bucket | None = None

        # Leader side.
        self._revision = 0
        self._renewal_value = b""
        self._unconfirmed_send: float | None = None
        self._deadline_timer: asyncio.TimerHandle | None = None
        # The lease deadline and term the timer was armed for.
        self._deadline_timer_at = 0.0
        self._deadline_timer_token: FencingToken | None = None
        self._hand_over_task: asyncio.Task[None] | None = None

        # What we know of the key (both sides).
        self._leader: LeaderRecord | None = None
        # Revision seen, since when, when to campaign: arithmetic kept apart.
        self._view = FollowerView(
            ttl=self.config.ttl, expiry_margin=c.FOLLOWER_EXPIRY_MARGIN_SECONDS
        )
        self._last_read_at = 0.0
        self._bad_record_revision = 0
        self._issued_tokens: deque[str] = deque(maxlen=_REMEMBERED_TOKENS)
        self._roster = Roster(
            own_id=self.config.instance_id,
            own_priority=self.config.priority,
            expiry=c.ROSTER_EXPIRY_HEARTBEATS * self.config.heartbeat_interval,
        )
        self._next_announce_at = 0.0
        # A TTL change (election/moves.py): the bucket this one was moved to
        # (then we never start a term again), and the one it was migrated
        # from, whose term of the role we wait out before campaigning.
        self._moved_to: str | None = None
        self._migrated_from: str | None = None
        self._old_bucket: Bucket | None = None
        self._waiting_for_old_term = False
        # The old bucket we saw free of the role (then we never look again),
        # and when to say again that it cannot be read.
        self._old_bucket_seen_free: str | None = None
        self._old_unreadable_warning_at: float | None = None
        # Set while the connection is down; the roster starts afresh once it is back.
        self._connection_lost = False
        self._hello_due = False

        # Fast failover (election/successor.py, docs/design.md). As a
        # follower: the promises given, the designation seen. As the leader:
        # until when no successor can take over, the designation our record
        # carries (written, and first sent), and the one it should carry.
        self._ledger = PromiseLedger(grace=c.PROMISE_GRACE_SECONDS)
        self._known_epoch = 0
        self._bounds = SuccessorBounds(
            grace=c.PROMISE_GRACE_SECONDS,
            rate_bound=c.CLOCK_RATE_BOUND,
            margin=c.PROMISE_MARGIN_SECONDS,
        )
        self._rates = RateCheck(rate_bound=c.CLOCK_RATE_BOUND)
        self._kv_lease_deadline = 0.0
        self._successor: tuple[str, str] | None = None
        self._sent_successor: tuple[str, str] | None = None
        self._written_successor: tuple[str, str] | None = None
        self._designation_due = False
        self._next_probe_at = 0.0
        self._not_designated_until: dict[str, float] = {}
        self._promise_task: asyncio.Task[None] | None = None
        # Names this process in its promises (a restarted successor is a new run).
        self._run_id = uuid.uuid4().hex

        self._backoff = Backoff(
            breaker_cooldown=min(
                c.CIRCUIT_BREAKER_MAX_COOLDOWN_SECONDS,
                self.config.ttl * c.CIRCUIT_BREAKER_COOLDOWN_TTLS,
            ),
            rng=self._rng,
        )

    # ------------------------------------------------------------------ API

    @property
    def leader(self) -> LeaderRecord | None:
        """The last leader record seen (ours while leading), or ``None``."""
        return self._leader

    @property
    def leader_id(self) -> str | None:
        """The id of the last leader seen, or ``None`` when the role looked free."""
        return self._leader.id if self._leader is not None else None

    async def start(self, *, wait: float | None = None) -> None:
        """Join the election.

        Opens the bucket (failing fast on permanent problems), starts the
        watch and the state machine, and waits until the first campaign has
        decided whether this process leads or follows; when it leads, once
        its ``on_promote`` callbacks have returned too.

        Args:
            wait: Seconds to wait for that first decision and its callbacks;
                default the TTL.

        Raises:
            BucketNotFoundError: The bucket is missing and ``create_bucket`` is off.
            BucketConfigError: The bucket's ``max_age`` differs from ``ttl``.
            JetStreamUnavailableError: The server has no JetStream.
            NatsUnavailableError: No connection could be made.
            ElectionStoppedError: The election was stopped before.

        """
        backend = await self._prepare_start()
        try:
            await self._join(backend)
        except BaseException:
            # Fail fast *and clean*: a connection we opened must not stay
            # behind, reconnecting and logging forever, after start() raised.
            await self._abandon_start()
            raise
        await self._launch(self.config.ttl if wait is None else wait)

    async def _join(self, backend: Backend) -> None:
        """Open the bucket, subscribe, read and watch the key: everything but the loop."""
        cfg = self.config
        assert self._decided is not None
        self._bucket = await backend.open_bucket(
            cfg.bucket,
            ttl=cfg.ttl,
            create=cfg.create_bucket,
            replicas=cfg.bucket_replicas,
            timeout=max(cfg.request_timeout, 2.0),
        )
        # Read with the bucket's max_age when it was opened: no extra request.
        marks = BucketMarks.parse(self._bucket.description)
        self._migrated_from = marks.migrated_from
        if await self._move_is_live(marks):
            self._stop_campaigning(marks.moved_to)
        self._callbacks.start()
        self._subscriptions.append(
            await backend.subscribe(
                control_subject(cfg.bucket, cfg.role, c.ROSTER_VERB), self._on_roster
            )
        )
        self._subscriptions.append(
            await backend.subscribe(
                control_subject(cfg.bucket, cfg.role, c.RESIGN_VERB), self._on_resign_request
            )
        )
        if cfg.fast_failover:
            # Only candidates that take over fast answer: a leader must not
            # count on a promise from one that would wait out the TTL anyway.
            self._subscriptions.append(
                await backend.subscribe(self._promise_subject(cfg.instance_id), self._on_promise)
            )
        now = self._clock.monotonic()
        self._view.start(now)
        self._last_read_at = now
        # Read first, so that "someone else leads" is known before start() returns.
        self._observe(await self._bucket.get(cfg.role, timeout=max(cfg.request_timeout, 2.0)))
        if self._view.present:
            self._decided.set()
        self._subscriptions.append(await self._bucket.watch(cfg.role, self._on_watch))
        await self._announce({"hello": {"id": cfg.instance_id, "priority": cfg.priority}})
        # The first "here" at a random point of the first heartbeat: candidates
        # that started together then hear of those ahead of them first, and
        # most of them stay silent (see _follow).
        self._next_announce_at = self._clock.monotonic() + self._rng.uniform(
            0.0, cfg.heartbeat_interval
        )
        self._set_state(ElectionState.FOLLOWER)

    async def _abandon_start(self) -> None:
        self._bucket = None
        await super()._abandon_start()

    async def stop(self) -> None:
        """Leave the election.

        A leader first runs its demote callbacks, then (with
        ``release_on_stop``) deletes its key so a successor is promoted in
        milliseconds. Idempotent.
        """
        if self._state is ElectionState.STOPPED and self._main_task is None:
            return
        was_leader = self._state is ElectionState.LEADER
        token = self._token
        revision = self._revision
        hand_over = self._hand_over_task
        await self._cancel_main()
        if hand_over is not None and not hand_over.done():
            # A release (resign, failed health check, takeover) is under way:
            # let it delete the key, or the successor waits out the TTL.
            await asyncio.wait({hand_over})
        if was_leader and token is not None:
            keeper = self._keep_successors_waiting(token)
            self._drop_term(DemoteReason.STOPPED)
            self._set_state(ElectionState.STOPPED)
            try:
                if keeper is not None:
                    revision = await self._unname_successor(token, revision)
                returned = await self._demote_callbacks_done(
                    self._notify_demoted(DemoteReason.STOPPED)
                )
                if self.config.release_on_stop and returned:
                    # Conditional on our revision: never deletes a successor's record.
                    await self._delete_own_key(token, revision)
            finally:
                if keeper is not None:
                    keeper.cancel()
        self._set_state(ElectionState.STOPPED)
        await self._announce({"bye": {"id": self.config.instance_id}})
        await self._teardown()

    async def validate_token(self) -> bool:
        """Confirm against the store that this process still holds its term.

        Reads the key and compares id and token. A mismatch demotes at once.
        Fails closed: any error reading the key returns ``False``.

        Returns:
            ``True`` only if the key holds this process's current term and the
            local lease is still valid.

        """
        token = self._token
        if not self.is_leader or token is None or self._bucket is None:
            return False
        try:
            term = await read_term(self._bucket, self.role, timeout=self.config.request_timeout)
        except ElectionError as exc:
            logger.debug("%s: token validation could not read the key: %s", self.role, exc)
            return False
        ok = term is not None and term.holds(token, self.instance_id)
        self._observer.validation(self.role, self.instance_id, ok)
        if not ok:
            if self._token is token:
                logger.warning(
                    "%s: fencing token %s is no longer in the store; stepping down",
                    self.role,
                    token,
                )
                reason = (
                    DemoteReason.KEY_DELETED
                    if term is None
                    else DemoteReason.FENCED
                    if term.record is not None and term.record.is_fence
                    else DemoteReason.TOKEN_MISMATCH
                )
                self._demote(reason)
            return False
        return self.is_leader and self._token is token

    def describe(self) -> dict[str, Any]:
        """This candidate as the roster and status commands show it.

        Returns:
            A JSON-serializable dict: ``id``, ``role``, ``state``, ``priority``,
            ``is_leader``, ``epoch``, ``revision``, ``term_age``,
            ``lease_remaining``, ``lease_margin``, ``last_heartbeat_age``, ``leader_id``, ``meta``,
            and, while another process's record holds the key, ``observed_revision``
            and ``leader_expires_within``: the longest that record can last
            without renewal, from when this process first saw it (its own clock).

        """
        now = self._clock.monotonic()
        leading = self.is_leader
        token = self._token if leading else None
        # The record was stored before we saw it, so it expires by then + TTL.
        watching = not leading and self._view.present and self._leader is not None
        return {
            "id": self.instance_id,
            "role": self.role,
            "state": self.state.value,
            "priority": self.config.priority,
            "is_leader": leading,
            "epoch": token.epoch if token else None,
            "revision": self._revision if leading else None,
            "term_age": round(now - self._term_started_at, 3) if leading else None,
            "lease_remaining": round(self.lease_remaining, 3) if leading else None,
            "lease_margin": self.config.lease_margin,
            "last_heartbeat_age": round(now - self._last_confirmed_send, 3) if leading else None,
            "leader_id": self.leader_id,
            "successor": (
                self._written_successor[0] if leading and self._written_successor else None
            ),
            "meta": dict(self.config.meta),
            "observed_revision": self._view.revision if watching else None,
            "leader_expires_within": (
                round(max(0.0, self._view.seen_at + self.config.ttl - now), 3) if watching else None
            ),
        }

    # ------------------------------------------------------------ plumbing

    def _state_log_level(self, old: ElectionState, new: ElectionState) -> int:
        # Leading or not is news; a follower's campaigns (many while it waits
        # for an old key to expire) are detail.
        return (
            logging.INFO
            if ElectionState.LEADER in (old, new) or new is ElectionState.STOPPED
            else logging.DEBUG
        )

    def _decides(self, old: ElectionState, new: ElectionState) -> bool:
        # A lost campaign decides too: someone else leads.
        return new is ElectionState.LEADER or (
            new is ElectionState.FOLLOWER and old is ElectionState.CANDIDATE
        )

    def _decode(self, entry: KVEntry) -> LeaderRecord | None:
        term = term_of(entry)
        if term is None:
            return None  # a delete or purge marker: a released term
        if term.record is None and self._bad_record_revision != entry.revision:
            # Logged once per revision: someone else's data, treated as
            # someone else's leadership until it expires or is deleted.
            self._bad_record_revision = entry.revision
            logger.warning(
                "%s: key holds a value that is not a leader record (%s); treating it as "
                "held by someone else",
                self.role,
                term.problem,
            )
        return term.record

    def _record_bytes(
        self,
        token: FencingToken | str,
        epoch: int | None,
        successor: tuple[str, str] | None = None,
    ) -> bytes:
        value = token.value if isinstance(token, FencingToken) else token
        return encode_record(
            instance_id=self.instance_id,
            token=value,
            epoch=epoch,
            priority=self.config.priority,
            meta=self.config.meta,
            successor=successor[0] if successor is not None else None,
            successor_nonce=successor[1] if successor is not None else None,
        )

    def _campaign_delay(self, leaving: str | None = None) -> float:
        """How long to wait before campaigning once the role is free.

        A lag for every priority point below the best live candidate, then a
        fixed order among equals: the first in line goes at once, the k-th
        waits k successor steps plus a random jitter within one step (a herd
        stays spread out if the first in line is gone, and no one waits long
        for a candidate that is).

        Args:
            leaving: The holder of the term that ends (not in line).
        """
        points, rank = self._roster.place(self._clock.monotonic(), leaving=leaving)
        lag = min(c.MAX_PRIORITY_LAG_SECONDS, self.config.priority_step * points)
        if rank == 0:
            return lag
        jitter = min(self.config.campaign_jitter, c.SUCCESSOR_STEP_SECONDS)
        return lag + rank * c.SUCCESSOR_STEP_SECONDS + self._rng.uniform(0.0, jitter)

    def wake(self) -> None:
        """Re-evaluate now; called when the connection goes down or comes back."""
        # Noted here, not only in the loop: the loop may sit in a request for
        # the whole outage and see the connection up again afterwards.
        self._note_connection()
        super().wake()

    def _note_connection(self) -> None:
        """After a reconnect: start the roster afresh, and announce ourselves again.

        A ``bye`` sent while the connection or the server was down is lost: a
        candidate that left then would keep its place in line for
        ``ROSTER_EXPIRY_HEARTBEATS`` heartbeats, and the next hand-over would
        wait a successor step for it, or up to ``MAX_PRIORITY_LAG_SECONDS`` if
        it was preferred. Live candidates announce themselves again after
        their own reconnect (and preferred ones answer that ``hello`` with
        ``known``), so only the gone stay out. Called before every use of the
        roster after an event (wake-up, key change, follower step), so a
        release seen right after the reconnect is already ordered without
        them. The roster only orders campaigns after a release and never
        affects safety: taking the key is still one atomic create, whoever
        campaigns first.
        """
        if self._backend is None:
            return
        if not self._backend.is_connected:
            self._connection_lost = True
        elif self._connection_lost:
            self._connection_lost = False
            # Requests sent to us while we were away were lost, and the
            # leader may only now be reconnecting too: no fast takeover for a
            # promise's worth, as if it had promised (liveness, not safety).
            self._ledger.stay_quiet(self._clock.monotonic() + c.PROMISE_GRACE_SECONDS)
            self._roster.reset()
            if self._leader is not None:
                self._roster.heard(self._leader.id, self._leader.priority, self._clock.monotonic())
            self._hello_due = True

    # --------------------------------------------------------- observation

    def _observe(self, entry: KVEntry | None, *, authoritative: bool = False) -> None:
        """Take note of what the key holds (from the watch, a read or a write)."""
        self._note_connection()
        now = self._clock.monotonic()
        present = entry is not None and entry.operation is Operation.PUT
        previous_leader = self._leader
        record = self._decode(entry) if present and entry is not None else None
        # An operator's fence marker: the term is over and nobody leads. The
        # view counts the key as free at the marker's revision, so a campaign
        # takes it at once with one conditional write at that revision (only
        # one candidate can succeed), without waiting for the marker to expire.
        fence = record is not None and record.is_fence
        # Whoever held the term that ends (or may end next) is not in line.
        leaving = (
            str((record.fenced or {}).get("id"))
            if fence and record is not None
            else (record.id if present and record is not None else None)
        )
        if leaving is None and not present and previous_leader is not None:
            leaving = previous_leader.id
        if not self._view.observe(
            entry.revision if entry is not None else None,
            present and not fence,
            now,
            self._campaign_delay(leaving),
            authoritative=authoritative,
        ):
            return
        if record is not None:
            self._known_epoch = max(self._known_epoch, record.epoch)
        self._ledger.saw(
            entry.revision if entry is not None else 0,
            record.successor if present and record is not None and not fence else None,
            record.successor_nonce if present and record is not None and not fence else None,
            self.instance_id,
            now,
        )
        if present and not fence:
            self._leader = record
            if self._waiting_for_old_term and record is not None:
                # A term on this bucket: the old bucket's has ended (nobody
                # campaigns here before it has), and a replica that waited
                # for it may serve as a successor again.
                self._waiting_for_old_term = False
            # Someone else holds the role: we follow, and start() may return.
            # (Without this, a candidate that learned of the leader from the
            # watch before its first campaign waited a whole TTL in start().)
            # Not while campaigning: that may be our own create, and the
            # campaign's outcome decides.
            if self._decided is not None and self._state is not ElectionState.CANDIDATE:
                self._decided.set()
        else:
            self._leader = None
            if previous_leader is not None and previous_leader.id != self.instance_id:
                # Its term ended: if it is alive it will announce itself again.
                self._roster.forget(previous_leader.id)
        if (previous_leader is None) != (self._leader is None) or (
            previous_leader is not None
            and self._leader is not None
            and (previous_leader.id, previous_leader.epoch) != (self._leader.id, self._leader.epoch)
        ):
            self._callbacks.submit(self._change_callbacks, self._leader)
        if self._leader is not None:
            self._roster.heard(self._leader.id, self._leader.priority, now)

    def _on_watch(self, entry: KVEntry) -> None:
        if self._state is ElectionState.STOPPED:
            return
        if self._state is ElectionState.LEADER and self._token is not None:
            if entry.revision <= self._revision:
                return
            if entry.operation is Operation.PUT and entry.value == self._renewal_value:
                # Our own renewal, seen before its acknowledgement: the same
                # bytes carry our token. Comparing them spares decoding the
                # JSON on every renewal of every role this process leads.
                return
            record = self._decode(entry) if entry.operation is Operation.PUT else None
            if record is not None and record.token == self._token.value:
                return  # our own renewal, seen before its acknowledgement
            self._observe(entry)
            reason = (
                DemoteReason.KEY_DELETED
                if entry.operation is not Operation.PUT
                else DemoteReason.FENCED
                if record is not None and record.is_fence
                else DemoteReason.REVISION_CHANGED
            )
            logger.warning("%s: the key was written by someone else; stepping down", self.role)
            self._demote(reason)
            return
        self._observe(entry)
        self.wake()

    # ----------------------------------------------------------- main loop

    async def _loop(self) -> None:
        while self._state is not ElectionState.STOPPED:
            if self._state is ElectionState.LEADER:
                await self._lead()
            else:
                await self._follow()

    # ------------------------------------------------------------ follower

    async def _follow(self) -> None:
        assert self._bucket is not None
        cfg = self.config
        self._note_connection()
        if self._hello_due:
            self._hello_due = False
            # Not while sitting out: we will not campaign for the next term.
            if self._clock.monotonic() >= self._sit_out_until:
                await self._announce({"hello": {"id": cfg.instance_id, "priority": cfg.priority}})
        now = self._clock.monotonic()
        if (
            self._leader is not None
            and self._leader.token in self._issued_tokens
            and self._backend is not None
            and self._backend.is_connected
        ):
            await self._clear_leftover(self._leader)
            return
        if self._view.present and self._leader is not None and self._moved_to is None:
            await self._maybe_take_over(self._leader.id, self._leader.priority, now)
        fast_at = self._fast_takeover_at()
        if now > fast_at + c.PROMISE_INTERVAL_SECONDS:
            # Woken this late, our own loop stalled (a GC pause, a busy
            # host): promise requests may be waiting unread. Let them in
            # before counting the leader silent (liveness: a promise the
            # leader never got an answer to is not counted by it).
            self._ledger.stay_quiet(now + 2 * c.PROMISE_INTERVAL_SECONDS)
            fast_at = self._fast_takeover_at()
        campaign_at = max(min(self._view.campaign_at, fast_at), self._sit_out_until)
        if self._moved_to is not None:
            campaign_at = math.inf  # the role's terms are the new bucket's now
        resync_at = self._last_read_at + cfg.resync_interval
        if now >= campaign_at:
            if await self._old_bucket_holds_the_role():
                self._view.retry_at(now + min(c.MOVE_POLL_SECONDS, cfg.heartbeat_interval))
                return
            await self._campaign()
            return
        if now >= self._next_announce_at:
            self._next_announce_at = now + cfg.heartbeat_interval
            # Only the first few in line for the next term keep their roster
            # entries alive: the order matters only at the front (behind it,
            # candidates campaign a few steps late, still spread out), and N
            # candidates announcing to N would cost N² messages a heartbeat.
            # A leader never announces: it is not in line. Nor does a
            # candidate sitting out after a resign or a fence: it will not
            # campaign, and every follower that counted it in front of
            # itself would wait a step for it on the next hand-over.
            points, rank = self._roster.place(
                now, leaving=self._leader.id if self._leader is not None else None
            )
            if points == 0 and rank < c.ANNOUNCED_SUCCESSORS and now >= self._sit_out_until:
                await self._announce({"here": {"id": cfg.instance_id, "priority": cfg.priority}})
            return
        if now >= resync_at:
            await self._resync()
            return
        await self._sleep_until(min(campaign_at, resync_at, self._next_announce_at))

    async def _resync(self) -> None:
        """Read the key: backs up a watch that may miss expiries or go blind."""
        assert self._bucket is not None
        self._last_read_at = self._clock.monotonic()
        known = self._view.revision
        try:
            entry = await self._bucket.get(self.role, timeout=self.config.request_timeout)
        except PERMANENT_ERRORS:
            raise
        except ElectionError as exc:
            logger.debug("%s: resync read failed: %s", self.role, exc)
            return
        # A successful read says nothing about writes: with JetStream out of
        # storage reads succeed while every create fails. Only a write's
        # answer resets the backoff, or the breaker would never open.
        if self._view.revision != known:
            return  # the watch told us something newer while we read
        if entry is None and self._view.present:
            # Gone without an event: expired. Campaign now (after jitter).
            self._observe(None, authoritative=True)
        elif entry is not None and entry.revision != self._view.revision:
            self._observe(entry, authoritative=True)

    async def _campaign(self) -> None:
        attempt = self._ledger.attempt_revision
        await self._campaign_once()
        if self._ledger.attempt_revision is not None and self._state is not ElectionState.LEADER:
            # A fast takeover with no known outcome: it may be sent again (the
            # same write on the same revision), paced like any failed campaign.
            self._ledger.stay_quiet(self._view.campaign_at)
            if attempt is None:
                logger.info(
                    "%s: the fast takeover at revision %d got no answer; trying it again at "
                    "that revision (no promise is given meanwhile)",
                    self.role,
                    self._ledger.attempt_revision,
                )

    async def _campaign_once(self) -> None:
        assert self._bucket is not None
        cfg = self.config
        self._set_state(ElectionState.CANDIDATE)
        token_value = str(uuid.uuid4())
        self._issued_tokens.append(token_value)
        # What we knew when we decided to campaign. The watch may report the
        # winner's record while our create is in flight; that record must not
        # be mistaken for the one we expected to expire.
        expected = (self._view.revision, self._view.present)
        send = self._clock.monotonic()
        free_revision = self._view.free_revision
        expired = self._view.expired_revision(send)
        fast = expired is None and send >= self._fast_takeover_at()
        if expired is not None:
            free_revision = await self._delete_expired(expired)
            if free_revision is None:
                return
        elif fast:
            # The designated successor's takeover: one compare-and-set on the
            # revision that names us. Our promises have run out, so the
            # leader stopped counting on them before now (docs/design.md);
            # a renewal or a new designation meanwhile makes the write fail.
            free_revision = self._view.revision
            self._ledger.attempting(free_revision)
            logger.info(
                "%s: the leader %s asked for no promise for %.3fs; taking over (fast failover)",
                self.role,
                self._leader.id if self._leader is not None else "?",
                send - self._ledger.promised_until + c.PROMISE_GRACE_SECONDS,
            )
        try:
            revision = await self._claim(self._record_bytes(token_value, None), free_revision)
        except KeyExistsError:
            self._observer.campaign(self.role, self.instance_id, False)
            await self._after_lost_campaign(*expected)
            return
        except BackendTimeoutError:
            # The create may still have landed: a record carrying our token is ours.
            self._unconfirmed_send = send
            entry = await self._read_quietly()
            record = self._decode(entry) if entry is not None else None
            if entry is not None and record is not None and record.token == token_value:
                await self._win_unless_moved(
                    FencingToken(record.epoch, token_value), entry.revision, send
                )
                return
            # Not ours (yet): should it land later, it is a leftover under a
            # token we remember (see _clear_leftover), never a term of ours,
            # so its send time must not date back the lease of a later term.
            self._unconfirmed_send = None
            self._set_state(ElectionState.FOLLOWER)
            self._observe(entry, authoritative=True)
            if entry is None or entry.revision == expected[0]:
                self._retry_later()
            # else: someone else won meanwhile; follow it (the campaign is
            # scheduled for when its record can expire), do not retry now.
            return
        except PERMANENT_ERRORS:
            raise
        except NotConnectedError:
            # Nothing was sent, so nothing to back off from: look again soon.
            if fast:
                self._ledger.attempt_revision = None  # no write of ours can land
            self._set_state(ElectionState.FOLLOWER)
            self._view.retry_at(self._clock.monotonic() + min(0.25, cfg.heartbeat_interval / 4))
            return
        except BackendError as exc:
            logger.debug("%s: campaign failed: %s", self.role, exc)
            self._set_state(ElectionState.FOLLOWER)
            self._retry_later()
            return
        if self._view.revision > revision:
            # The key changed after our create, before its acknowledgement
            # reached us: our record is already overwritten. A clustered
            # nats-server before 2.9.21 can accept two concurrent creates
            # (nats-server#4320); the later one holds the key, so we lost.
            logger.warning(
                "%s: created the key at revision %d, but revision %d is already newer; "
                "following (a clustered nats-server < 2.9.21 accepts concurrent creates)",
                self.role,
                revision,
                self._view.revision,
            )
            self._observer.campaign(self.role, self.instance_id, False)
            self._set_state(ElectionState.FOLLOWER)
            if self._decided is not None:
                self._decided.set()
            return
        self._observer.campaign(self.role, self.instance_id, True)
        await self._win_unless_moved(FencingToken(revision, token_value), revision, send)

    # ------------------------------------------------------- a TTL change

    async def _marks(self, bucket: str) -> BucketMarks:
        """The marks a TTL change left on ``bucket`` (election/moves.py)."""
        assert self._backend is not None
        timeout = max(self.config.request_timeout, 2.0)
        info = await self._backend.bucket_info(bucket, timeout=timeout)
        return BucketMarks.parse(info.description)

    async def _move_is_live(self, marks: BucketMarks) -> bool:
        """Whether ``marks`` say our bucket was moved, to a bucket that says so too.

        Deleting the new bucket undoes a move (a roll given up). A new
        bucket we may not look at, or cannot now, counts as live: the mark
        alone must keep us from leading.
        """
        if marks.moved_to is None:
            return False
        try:
            target = await self._marks(marks.moved_to)
        except BucketNotFoundError:
            return False
        except ElectionError:
            return True
        return target.migrated_from == self.config.bucket

    def _stop_campaigning(self, moved_to: str | None) -> None:
        if self._decided is not None:
            self._decided.set()  # start() returns: we follow, for good
        if self._moved_to is not None:
            return
        self._moved_to = moved_to
        logger.warning(
            "%s: KV bucket %r was moved to %r (a TTL change): this replica will not lead %r "
            "again; restart it with the new bucket and TTL",
            self.role,
            self.config.bucket,
            moved_to,
            self.role,
        )

    async def _win_unless_moved(self, token: FencingToken, revision: int, send: float) -> None:
        """Lead with the term just created, unless our bucket was moved meanwhile.

        The one check a TTL change needs on the old bucket (election/moves.py):
        after our create, before anything acts on the term. A mark that
        cannot be read now counts as a move: the key is given back and the
        campaign tried again later.
        """
        try:
            marks = await self._marks(self.config.bucket)
            moved = await self._move_is_live(marks)
        except ElectionError as exc:
            # Any failure, a "permanent" one included (a timeout of the stream
            # API reads as JetStream unavailable): not knowing is not leading,
            # and it must not stop the election either.
            logger.warning(
                "%s: won a campaign but could not read the bucket's marks (%s); giving the "
                "key back and campaigning again",
                self.role,
                exc,
            )
            await self._give_back(token, revision)
            self._retry_later()
            return
        if moved:
            self._stop_campaigning(marks.moved_to)
            await self._give_back(token, revision)
            return
        if self._state is ElectionState.STOPPED:
            return
        if marks.migrated_from is not None and marks.migrated_from != self._old_bucket_seen_free:
            # Marked "migrated from" after we opened it (by hand, or by a tool
            # that marks an existing bucket): the old bucket may hold a term
            # of the role. Give the key back and wait that term out first, as
            # a replica that read the mark at start does (election/moves.py).
            logger.warning(
                "%s: KV bucket %r was marked migrated from %r after this replica opened it; "
                "giving the key back until the old bucket's term of %r ends",
                self.role,
                self.config.bucket,
                marks.migrated_from,
                self.role,
            )
            self._migrated_from = marks.migrated_from
            self._old_bucket = None
            await self._give_back(token, revision)
            self._view.retry_at(self._clock.monotonic())
            return
        if self._view.revision > revision:
            # The key changed while we read the marks (a concurrent create
            # accepted on nats-server < 2.9.21, a fence, a delete): the event
            # reached us as a candidate, so only this check can see it.
            logger.warning(
                "%s: the key changed (revision %d) after our create at revision %d; following",
                self.role,
                self._view.revision,
                revision,
            )
            self._set_state(ElectionState.FOLLOWER)
            if self._decided is not None:
                self._decided.set()
            return
        self._win(token, revision, send)

    async def _give_back(self, token: FencingToken, revision: int) -> None:
        """Delete a key we created but will not lead with (it would expire anyway)."""
        assert self._bucket is not None
        self._set_state(ElectionState.FOLLOWER)
        try:
            await self._bucket.delete(self.role, last=revision, timeout=self.config.request_timeout)
        except ElectionError as exc:
            logger.debug("%s: left the unused key to expire: %s", self.role, exc)

    async def _old_bucket_holds_the_role(self) -> bool:
        """On a migrated bucket: whether the old bucket still has a term of the role.

        Until it is seen without one, we do not campaign (election/moves.py);
        after that, never again. A missing old bucket (deleted after the
        roll) holds nothing.
        """
        if self._migrated_from is None:
            return False
        assert self._backend is not None
        cfg = self.config
        try:
            if self._old_bucket is None:
                self._old_bucket = await self._backend.open_bucket(
                    self._migrated_from,
                    ttl=None,
                    create=False,
                    replicas=1,
                    timeout=max(cfg.request_timeout, 2.0),
                )
            entry = await self._old_bucket.get(self.role, timeout=cfg.request_timeout)
        except BucketNotFoundError:
            # Deleted (the roll's last step): a bucket that does not exist
            # holds no term. Only "not found" says so; any other failure
            # below may hide a live term, and we wait.
            logger.info(
                "%s: the old bucket %r no longer exists (a finished TTL change); campaigning",
                self.role,
                self._migrated_from,
            )
            entry = None
        except ElectionError as exc:
            self._warn_old_bucket_unreadable(self._migrated_from, exc)
            return True
        if self._old_unreadable_warning_at is not None:
            self._old_unreadable_warning_at = None
            logger.info("%s: the old bucket %r can be read again", self.role, self._migrated_from)
        if entry is not None:
            if self._decided is not None:
                self._decided.set()  # start() returns: we follow until it ends
            if not self._waiting_for_old_term:
                self._waiting_for_old_term = True
                logger.info(
                    "%s: waiting for the term of %r on the old bucket %r to end (a TTL change)",
                    self.role,
                    self.role,
                    self._migrated_from,
                )
            return True
        if self._waiting_for_old_term:
            # The wait is over: the replica may serve as a successor again
            # (_on_promise refuses while it waits).
            self._waiting_for_old_term = False
            logger.info(
                "%s: the term on the old bucket %r has ended", self.role, self._migrated_from
            )
        self._old_bucket_seen_free = self._migrated_from
        self._migrated_from = None
        self._old_bucket = None
        return False

    def _warn_old_bucket_unreadable(self, old: str, exc: ElectionError) -> None:
        """Say that the old bucket cannot be read: at once, then every MOVE_WARNING_REPEAT_SECONDS.

        The replica waits for as long as it lasts, so it must not be a
        DEBUG line: nothing else shows why the role has no leader here.
        """
        now = self._clock.monotonic()
        if self._old_unreadable_warning_at is not None and now < self._old_unreadable_warning_at:
            logger.debug("%s: could not read the old bucket %r: %s", self.role, old, exc)
            return
        self._old_unreadable_warning_at = now + c.MOVE_WARNING_REPEAT_SECONDS
        if isinstance(exc, PermissionDeniedError):
            logger.warning(
                "%s: permission denied reading the old bucket %r (%s): this replica does not "
                "campaign for %r until it can (a TTL change: the old bucket's term of the role "
                "must end first). Let its NATS user read %r until the roll ends (the permission "
                "sets in docs/operating.md), or delete %r if no replica uses it any more",
                self.role,
                old,
                exc,
                self.role,
                old,
                old,
            )
            return
        logger.warning(
            "%s: cannot read the old bucket %r (%s): this replica does not campaign for %r "
            "until it can (a TTL change: the old bucket's term of the role must end first); "
            "trying again every %gs",
            self.role,
            old,
            exc,
            self.role,
            min(c.MOVE_POLL_SECONDS, self.config.heartbeat_interval),
        )

    def _retry_later(self) -> None:
        delay = self._backoff.failure()
        if self._backoff.circuit_open:
            logger.warning(
                "%s: %d failures in a row; waiting %.1fs before trying again",
                self.role,
                self._backoff.failures,
                delay,
            )
        self._view.retry_at(self._clock.monotonic() + delay)

    async def _claim(self, value: bytes, free_revision: int | None) -> int:
        """Create the role's key; return the new term's revision.

        Where the key is known to hold a delete (a release, or our own delete
        of an expired record), one conditional write right after it is the
        whole campaign; the general create needs up to three round trips.

        Raises:
            KeyExistsError: Someone else holds the role.
        """
        assert self._bucket is not None
        timeout = self.config.request_timeout
        if free_revision:
            try:
                return await self._bucket.update(
                    self.role, value, last=free_revision, timeout=timeout
                )
            except RevisionMismatchError:
                pass  # taken, or the delete itself is gone: create() tells which
        return await self._bucket.create(self.role, value, timeout=timeout)

    async def _delete_expired(self, revision: int) -> int | None:
        """Delete a record gone unrenewed past its TTL, conditionally at its revision.

        Follower-driven expiry: the server's ``max_age`` timer fires up to
        ~250 ms late on nats-server 2.10+ (and has been seen not to fire on a
        replica), so a follower that saw ``revision`` unchanged for TTL plus a
        margin ends it itself. The leader of that revision stepped down before
        (docs/design.md), and the delete names the revision, so a renewal that
        landed meanwhile makes it fail instead of removing a live term.

        Returns:
            The revision of our delete, to campaign right after it; ``None``
            when the key moved on (what it holds now has been observed) or the
            delete failed.
        """
        assert self._bucket is not None
        try:
            deleted = await self._bucket.delete(
                self.role, last=revision, timeout=self.config.request_timeout
            )
        except PERMANENT_ERRORS:
            raise
        except RevisionMismatchError:
            # Renewed, released or expired by the server meanwhile: learn which.
            entry = await self._read_quietly()
            self._set_state(ElectionState.FOLLOWER)
            if self._view.revision != revision:
                # The watch delivered something newer while we wrote or read:
                # it is newer than our read (which may predate it) too.
                return None
            if entry is not None and entry.revision == revision:
                self._retry_later()  # the store still shows it: never spin
            else:
                self._observe(entry, authoritative=True)
            return None
        except ElectionError as exc:
            # The delete may or may not have landed; the watch will tell.
            logger.debug("%s: could not delete the expired record: %s", self.role, exc)
            self._set_state(ElectionState.FOLLOWER)
            self._retry_later()
            return None
        logger.info(
            "%s: record at revision %d went unrenewed for the TTL; deleted it", self.role, revision
        )
        return deleted

    async def _after_lost_campaign(self, expected_revision: int, expected_present: bool) -> None:
        """The key is held: learn by whom, or come back when its record may be deleted as expired.

        Args:
            expected_revision: The key's revision we knew of when we decided to campaign.
            expected_present: Whether it held a record then (that we expected to expire).
        """
        entry = await self._read_quietly()
        self._set_state(ElectionState.FOLLOWER)
        now = self._clock.monotonic()
        if entry is None:
            # Freed between our create and our read: try again right away.
            self._view.retry_at(now + self._campaign_delay())
            return
        if entry.revision == expected_revision and expected_present:
            # The record we campaigned against is not over yet by our count:
            # come back when we may delete it ourselves.
            self._view.retry_at(max(now, self._view.expires_at) + self._campaign_delay())
            return
        self._observe(entry, authoritative=True)
        self._backoff.success()

    async def _read_quietly(self) -> KVEntry | None:
        assert self._bucket is not None
        try:
            entry = await self._bucket.get(self.role, timeout=self.config.request_timeout)
        except PERMANENT_ERRORS:
            raise
        except ElectionError:
            return None
        self._last_read_at = self._clock.monotonic()
        return entry

    async def _clear_leftover(self, record: LeaderRecord) -> None:
        """Delete a record of ours from a term we no longer hold.

        After a lost lease or connection, or when a write of ours that timed
        out landed after we stepped down, the key still names us; left alone it
        would keep the role empty until it expired.

        Like a release, this waits for the demote callbacks first: while the
        record stands no successor can start, so deleting it must not cut
        short the time the callbacks have to stop leader work. A callback
        that never returns only delays the successor until the record
        expires, as if nothing were cleared.
        """
        assert self._bucket is not None
        # Forget the tokens first: whatever happens below, this runs once.
        self._issued_tokens.clear()
        if not await self._demote_callbacks_done(self._callbacks.barrier()):
            return
        logger.info("%s: clearing a leftover record of ours (epoch %d)", self.role, record.epoch)
        timeout = self.config.request_timeout
        try:
            entry = await self._bucket.get(self.role, timeout=timeout)
            current = self._decode(entry) if entry is not None else None
            if entry is not None and current is not None and current.token == record.token:
                await self._bucket.delete(self.role, last=entry.revision, timeout=timeout)
        except PERMANENT_ERRORS:
            raise
        except ElectionError as exc:
            logger.debug("%s: could not clear the leftover record: %s", self.role, exc)
        await self._resync()

    # -------------------------------------------------------------- leader

    def _win(self, token: FencingToken, revision: int, send: float) -> None:
        cfg = self.config
        now = self._clock.monotonic()
        self._token = token
        self._revision = revision
        self._term_started_at = now
        self._known_epoch = max(self._known_epoch, token.epoch)
        self._ledger.saw(revision, None, None, cfg.instance_id, now)
        if self._leader is not None and self._leader.id != cfg.instance_id:
            # The holder of the term we replace is not a successor: if it
            # is alive it will announce itself again.
            self._roster.forget(self._leader.id)
        self._bounds.reset()
        self._rates.forget()
        self._successor = self._sent_successor = self._written_successor = None
        self._designation_due = False
        self._next_probe_at = now
        # Every renewal of the term writes the same bytes: encode them once.
        self._renewal_value = self._record_bytes(token, token.epoch)
        self._confirm(send)
        # The watch may have delivered our own create before its acknowledgement
        # (we were still a candidate): the change was reported then already.
        previous = self._leader
        already_reported = previous is not None and previous.holds(token)
        self._leader = LeaderRecord(
            id=cfg.instance_id,
            token=token.value,
            epoch=token.epoch,
            revision=revision,
            priority=cfg.priority,
            meta=dict(cfg.meta),
        )
        self._view.observe(revision, True, now, 0.0, authoritative=True)
        self._release_reason = None
        self._disconnected_since = None
        self._backoff.success()
        self._set_state(ElectionState.LEADER)
        logger.info("%s: promoted, epoch %d", self.role, token.epoch)
        if not already_reported:
            self._callbacks.submit(self._change_callbacks, self._leader)
        self._notify_promoted(token)
        self._watch_health(token)
        if cfg.fast_failover:
            # A task of its own: a promise must not wait behind a renewal.
            self._promise_task = asyncio.get_running_loop().create_task(
                self._promise_loop(token), name=f"promises-{self.role}"
            )

    def _confirm(self, send: float) -> None:
        """A write of ours is known stored: the lease runs from its send time.

        If an earlier write's outcome was unknown, the stored revision may be
        that one: count from the oldest unconfirmed send to stay safe.
        """
        if self._unconfirmed_send is not None:
            send = min(send, self._unconfirmed_send)
            self._unconfirmed_send = None
        self._last_confirmed_send = max(self._last_confirmed_send, send)
        self._kv_lease_deadline = send + self.config.lease_seconds
        self._refresh_deadline()

    def _refresh_deadline(self) -> None:
        """The lease deadline: the KV lease, or sooner a designated successor's promises."""
        deadline = min(self._kv_lease_deadline, self._bounds.deadline())
        moved = deadline != self._lease_deadline
        self._lease_deadline = deadline
        self._arm_deadline_timer()
        if moved:
            self._lease_moved()

    def _arm_deadline_timer(self) -> None:
        """Demote exactly at the lease deadline, whatever the lead loop is awaiting.

        The loop may be inside a renewal or a read when the lease runs out;
        the demotion (and the demote callbacks that stop leader work) must
        not wait for that call to time out.
        """
        if self._deadline_timer is not None:
            if (
                self._deadline_timer_token is self._token
                and self._deadline_timer_at <= self._lease_deadline
            ):
                # A renewal moved the deadline later: the timer fires first,
                # finds the lease valid and arms itself for the new deadline
                # (_on_deadline). It never fires after the deadline; and a
                # leader no longer cancels and schedules a timer on every
                # renewal (one per lease instead of one per heartbeat).
                return
            self._deadline_timer.cancel()
        loop = asyncio.get_running_loop()
        delay = max(0.0, self._lease_deadline - self._clock.monotonic())
        self._deadline_timer = loop.call_later(delay, self._on_deadline, self._token)
        self._deadline_timer_at = self._lease_deadline
        self._deadline_timer_token = self._token

    def _on_deadline(self, token: FencingToken | None) -> None:
        self._deadline_timer = None
        if self._state is not ElectionState.LEADER or self._token is not token:
            return
        if self._lease_valid():
            self._arm_deadline_timer()  # renewed meanwhile (or an injected clock)
            return
        if self._lease_deadline < self._kv_lease_deadline:
            logger.warning(
                "%s: the designated successor's promises ran out (none answered for %.3fs); "
                "stepping down so that it may take over",
                self.role,
                self._clock.monotonic() - self._lease_deadline + self._bounds.promise_worth,
            )
            self._demote(DemoteReason.LEASE_EXPIRED)
            return
        logger.warning(
            "%s: no renewal confirmed for %.3fs; lease over, stepping down",
            self.role,
            self._clock.monotonic() - self._last_confirmed_send,
        )
        self._demote(DemoteReason.LEASE_EXPIRED)

    def _cancel_deadline_timer(self) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None

    def _drop_term(self, reason: DemoteReason) -> None:
        """Forget our term's token and lease (the caller changes the state).

        The reason is set before the token is dropped: a thread that sees the
        term over (``LeaderContext.reason``) finds why.
        """
        self._ending_reason = reason
        self._token = None
        self._lease_deadline = 0.0
        self._kv_lease_deadline = 0.0
        self._bounds.reset()
        if self._promise_task is not None:
            self._promise_task.cancel()
            self._promise_task = None
        # A renewal of this term whose outcome is unknown says nothing about
        # the next term's record: left set, it would date that lease back.
        self._unconfirmed_send = None
        self._cancel_deadline_timer()

    def _demote(self, reason: DemoteReason) -> None:
        """Stop leading at once (state first, callbacks after)."""
        if self._state is not ElectionState.LEADER:
            return
        self._drop_term(reason)
        if reason is DemoteReason.FENCED:
            # The operator fenced this process because it was stuck: let a
            # live candidate take the role rather than campaign again at once.
            self._sit_out_until = self._clock.monotonic() + self.config.ttl
        elif reason is DemoteReason.KEY_DELETED:
            # Someone deleted our key (an operator, by hand): a follower takes
            # the role. We come back a heartbeat later if nobody did: a lag
            # in campaign order alone loses the race on a busy host.
            self._sit_out_until = self._clock.monotonic() + self.config.heartbeat_interval
        self._set_state(ElectionState.FOLLOWER)
        logger.info("%s: demoted (%s)", self.role, reason.value)
        self._stop_health_watch()
        self._notify_demoted(reason)
        self.wake()

    async def _lead(self) -> None:
        cfg = self.config
        next_renew = self._last_confirmed_send + cfg.heartbeat_interval
        next_validation = (
            self._clock.monotonic() + cfg.validation_interval if cfg.validation_interval else None
        )
        # While disconnected, look often enough to honour the grace period.
        disconnected_poll = cfg.disconnect_grace / 8
        while self._state is ElectionState.LEADER:
            now = self._clock.monotonic()
            if now >= self._lease_deadline:
                self._on_deadline(self._token)
                return
            if self._release_reason is not None:
                await self._release(self._release_reason)
                return
            if self._check_disconnected(now):
                return
            if self._disconnected_since is not None:
                # A write now would be refused anyway; wait for the connection.
                await self._sleep_until(
                    min(
                        self._lease_deadline,
                        self._disconnected_since + cfg.disconnect_grace,
                        now + disconnected_poll,
                    )
                )
                continue
            if now >= next_renew or self._designation_due:
                next_renew = await self._renew()
                continue
            if next_validation is not None and now >= next_validation:
                await self.validate_token()
                next_validation = now + cfg.validation_interval
                continue
            wake_at = min(next_renew, self._lease_deadline)
            if next_validation is not None:
                wake_at = min(wake_at, next_validation)
            await self._sleep_until(wake_at)

    def _check_disconnected(self, now: float) -> bool:
        assert self._backend is not None
        if self._backend.is_connected:
            self._disconnected_since = None
            return False
        self._connection_lost = True
        if self._disconnected_since is None:
            self._disconnected_since = now
            logger.warning("%s: leader lost its NATS connection", self.role)
        if now - self._disconnected_since >= self.config.disconnect_grace:
            logger.warning(
                "%s: disconnected for %.3fs (grace %.3fs); stepping down",
                self.role,
                now - self._disconnected_since,
                self.config.disconnect_grace,
            )
            self._demote(DemoteReason.DISCONNECTED)
            return True
        return False

    async def _renew(self) -> float:
        """One renewal. Returns when the next one is due."""
        assert self._bucket is not None and self._token is not None
        cfg = self.config
        token = self._token
        send = self._clock.monotonic()
        timeout = max(0.001, min(cfg.request_timeout, self._lease_deadline - send))
        designation = self._successor
        self._designation_due = False
        value = self._renewal_value
        if designation != self._written_successor:
            value = self._record_bytes(token, token.epoch, designation)
        # Until a later write is confirmed, this one may be the key's
        # revision: its successor's bound counts from now on.
        self._bounds.writing(
            designation[0] if designation is not None else None,
            new_designation=designation is not None and designation != self._sent_successor,
            sent=send,
        )
        self._sent_successor = designation
        self._refresh_deadline()
        try:
            revision = await self._bucket.update(
                cfg.role,
                value,
                last=self._revision,
                timeout=timeout,
            )
        except (RevisionMismatchError, BackendTimeoutError) as exc:
            self._observer.heartbeat(
                self.role, self.instance_id, self._clock.monotonic() - send, False
            )
            if isinstance(exc, BackendTimeoutError) and self._token is token:
                # (A term that ended while the write was in flight has no
                # lease left to date back: see _drop_term.)
                self._unconfirmed_send = (
                    send if self._unconfirmed_send is None else self._unconfirmed_send
                )
            return await self._reconcile_renewal(token, send)
        except PERMANENT_ERRORS:
            raise
        except BackendError as exc:
            self._observer.heartbeat(
                self.role, self.instance_id, self._clock.monotonic() - send, False
            )
            delay = min(self._backoff.failure(), cfg.heartbeat_interval / 2)
            logger.debug("%s: renewal failed (%s); retrying in %.3fs", self.role, exc, delay)
            return self._clock.monotonic() + delay
        if self._token is not token:
            return send  # demoted while the write was in flight
        self._observer.heartbeat(self.role, self.instance_id, self._clock.monotonic() - send, True)
        self._revision = revision
        self._view.observe(revision, True, self._clock.monotonic(), 0.0)
        if value is not self._renewal_value:
            self._renewal_value = value
            self._written_successor = designation
            logger.debug("%s: designated successor: %s", self.role, designation)
        self._bounds.confirmed(designation[0] if designation is not None else None)
        self._confirm(send)
        self._backoff.success()
        logger.debug("%s: renewed at revision %d", self.role, revision)
        return send + cfg.heartbeat_interval

    async def _reconcile_renewal(self, token: FencingToken, send: float) -> float:
        """A renewal failed or timed out: read the key to learn what happened."""
        assert self._bucket is not None
        cfg = self.config
        timeout = max(
            0.001, min(cfg.request_timeout, self._lease_deadline - self._clock.monotonic())
        )
        try:
            entry = await self._bucket.get(cfg.role, timeout=timeout)
        except PERMANENT_ERRORS:
            raise
        except ElectionError:
            # Still unknown: try again soon; the lease deadline bounds this.
            return self._clock.monotonic() + min(
                self._backoff.failure(), cfg.heartbeat_interval / 2
            )
        if self._token is not token:
            return send
        record = self._decode(entry) if entry is not None else None
        if entry is not None and record is not None and record.token == token.value:
            if entry.revision != self._revision:
                # Our write landed after all. It is the key's revision now: no
                # earlier one can be written on, so only its successor counts.
                self._revision = entry.revision
                landed = (
                    (record.successor, record.successor_nonce)
                    if record.successor is not None and record.successor_nonce is not None
                    else None
                )
                self._bounds.confirmed(record.successor)
                self._renewal_value = entry.value or b""
                self._written_successor = landed
                if landed != self._successor:
                    # It names a successor since dropped (or another than
                    # the one now chosen): write the record again, or the
                    # dropped one's bound would end the term.
                    self._designation_due = True
                self._confirm(send)
                return send + cfg.heartbeat_interval
            return self._clock.monotonic() + min(
                self._backoff.failure(), cfg.heartbeat_interval / 2
            )
        self._observe(entry, authoritative=True)
        reason = (
            DemoteReason.KEY_DELETED
            if entry is None
            else DemoteReason.FENCED
            if record is not None and record.is_fence
            else DemoteReason.REVISION_CHANGED
        )
        logger.warning("%s: the key no longer holds our term; stepping down", self.role)
        self._demote(reason)
        return send

    async def _release(self, reason: DemoteReason) -> None:
        """Graceful hand-over: demote callbacks first, then delete our key."""
        token, revision = self._token, self._revision
        if self._state is not ElectionState.LEADER or token is None:
            return
        self._release_reason = None
        keeper = self._keep_successors_waiting(token)
        self._drop_term(reason)
        # Sit out one TTL so that someone else takes the role.
        self._sit_out_until = self._clock.monotonic() + self.config.ttl
        self._set_state(ElectionState.FOLLOWER)
        logger.info("%s: stepping down (%s)", self.role, reason.value)
        self._stop_health_watch()
        # In a task of its own, which stop() lets finish: stop() cancels the
        # main loop, and a release cancelled there left the key in place, so
        # the successor waited a whole TTL instead of milliseconds.
        hand_over = asyncio.get_running_loop().create_task(
            self._hand_over(reason, token, revision, keeper), name=f"release-{self.role}"
        )
        self._hand_over_task = hand_over
        await asyncio.shield(hand_over)
        self.wake()

    async def _hand_over(
        self,
        reason: DemoteReason,
        token: FencingToken,
        revision: int,
        keeper: asyncio.Task[None] | None = None,
    ) -> None:
        """The release proper: demote callbacks, then the key goes."""
        try:
            if keeper is not None:
                revision = await self._unname_successor(token, revision)
            if await self._demote_callbacks_done(self._notify_demoted(reason)):
                await self._delete_own_key(token, revision)
        finally:
            if keeper is not None:
                keeper.cancel()

    def _keep_successors_waiting(self, token: FencingToken) -> asyncio.Task[None] | None:
        """A release with a successor named: keep it from taking over until the key goes.

        The term's promise task ends with the term, before the demote
        callbacks (and the services' grace) have run; a successor whose last
        promise then ran out would take over while they still run. So until
        the release is done, the successors a current revision may name are
        still asked for promises (an answer only delays them: nothing counts
        on it), and the record is rewritten without a successor first
        (:meth:`_unname_successor`).
        """
        candidates = self._bounds.candidates
        if not candidates or self._backend is None:
            return None
        backend = self._backend
        subjects = [self._promise_subject(candidate) for candidate in sorted(candidates)]
        body = self._promise_request(token)

        async def keep_asking() -> None:
            while True:
                started = self._clock.monotonic()
                for subject in subjects:
                    with contextlib.suppress(ElectionError):
                        await backend.request(
                            subject, body, timeout=c.PROMISE_INTERVAL_SECONDS / len(subjects)
                        )
                delay = started + c.PROMISE_INTERVAL_SECONDS - self._clock.monotonic()
                await asyncio.sleep(max(0.0, delay))

        return asyncio.get_running_loop().create_task(
            keep_asking(), name=f"promises-release-{self.role}"
        )

    async def _unname_successor(self, token: FencingToken, revision: int) -> int:
        """Rewrite our record without a successor; return the revision to delete at.

        After it is stored no takeover on an earlier revision can succeed,
        whether or not the successor still hears from us. If it fails, the
        record is deleted at its old revision (or, that failing, if it still
        carries our token: :meth:`_delete_own_key`).
        """
        assert self._bucket is not None
        timeout = self.config.request_timeout
        value = self._record_bytes(token, token.epoch)
        try:
            return await self._bucket.update(self.role, value, last=revision, timeout=timeout)
        except RevisionMismatchError:
            pass
        except ElectionError as exc:
            logger.debug("%s: could not name no successor before the release: %s", self.role, exc)
            return revision
        # Our revision is stale (a renewal in flight, cancelled or timed out,
        # landed): rewrite at the key's revision if it still carries our token.
        try:
            current = await self._own_revision(token)
            if current is None:
                return revision
            return await self._bucket.update(self.role, value, last=current, timeout=timeout)
        except ElectionError as exc:
            logger.debug("%s: could not name no successor before the release: %s", self.role, exc)
            return revision

    async def _own_revision(self, token: FencingToken) -> int | None:
        """The key's revision if it still carries ``token`` (read now), else ``None``."""
        assert self._bucket is not None
        entry = await self._bucket.get(self.role, timeout=self.config.request_timeout)
        record = self._decode(entry) if entry is not None else None
        if entry is None or record is None or record.token != token.value:
            return None
        return entry.revision

    async def _delete_own_key(self, token: FencingToken, revision: int) -> None:
        """Delete the key only at our revision: never a successor's record."""
        assert self._bucket is not None
        timeout = self.config.request_timeout
        await self._trail.handed_out()
        try:
            await self._bucket.delete(self.role, last=revision, timeout=timeout)
            logger.info("%s: released the key (epoch %d)", self.role, token.epoch)
            return
        except RevisionMismatchError:
            pass
        except ElectionError as exc:
            logger.warning("%s: could not release the key (%s); it will expire", self.role, exc)
            return
        # Our revision is stale (a renewal in flight may have landed): delete
        # only if the key still carries our token.
        try:
            current = await self._own_revision(token)
            if current is not None:
                await self._bucket.delete(self.role, last=current, timeout=timeout)
                logger.info("%s: released the key (epoch %d)", self.role, token.epoch)
        except ElectionError as exc:
            logger.warning("%s: could not release the key (%s); it will expire", self.role, exc)

    # ------------------------------------------------------- fast failover

    def _promise_subject(self, candidate: str) -> str:
        cfg = self.config
        verb = f"{c.PROMISE_VERB}.{candidate_digest(candidate)}"
        return control_subject(cfg.bucket, cfg.role, verb)

    def _promise_request(self, token: FencingToken) -> bytes:
        """The body of a promise request: who asks, for which term (see ``_on_promise``)."""
        return json.dumps({"leader": self.instance_id, "epoch": token.epoch}).encode()

    def _fast_takeover_at(self) -> float:
        """When this follower, as the designated successor, may take over (else ``inf``)."""
        leader = self._leader
        if (
            not self.config.fast_failover
            or not self._view.present
            or leader is None
            or leader.successor != self.instance_id
            or leader.revision != self._view.revision
            or self._moved_to is not None
            or self._backend is None
            or not self._backend.is_connected
        ):
            return math.inf
        return self._ledger.takeover_at(leader.successor_nonce, self._view.revision)

    async def _on_promise(self, data: bytes, reply: str | None) -> None:
        """A leader asks us, its designated successor, not to take over for a while."""
        if reply is None or self._backend is None:
            return
        now = self._clock.monotonic()
        try:
            body = json.loads(data)
            epoch = int(body["epoch"])
        except (ValueError, TypeError, KeyError):
            return
        # A candidate that would not take over anyway (sitting out after a
        # resign, moved to a new bucket, waiting for an old bucket's term)
        # refuses: the leader names another instead of counting on it.
        eligible = (
            self._state in (ElectionState.FOLLOWER, ElectionState.CANDIDATE)
            and now >= self._sit_out_until
            and self._moved_to is None
            and not self._waiting_for_old_term
        )
        given = eligible and self._ledger.promise(now, epoch=epoch, known_epoch=self._known_epoch)
        with contextlib.suppress(ElectionError):
            await self._respond(reply, {"ok": given, "at": now, "run": self._run_id})

    async def _promise_loop(self, token: FencingToken) -> None:
        """As the leader: keep a successor designated, and its promises coming.

        Every ``PROMISE_INTERVAL_SECONDS``: ask the designated successor for
        a promise; with none designated, ask the first candidate in line and
        designate it once it has answered. A successor whose promises would
        run out within ``PROMISE_REVOKE_LEAD_SECONDS`` is dropped (a renewal
        naming none): the leader then goes on under its KV lease alone.
        """
        while self._token is token and self._state is ElectionState.LEADER:
            started = self._clock.monotonic()
            try:
                await self._promise_round(token, started)
            except Exception:
                # Not silently: a leader whose promises stop steps down.
                logger.exception("%s: asking the successor for a promise failed", self.role)
            delay = started + c.PROMISE_INTERVAL_SECONDS - self._clock.monotonic()
            await asyncio.sleep(max(0.0, delay))

    async def _promise_round(self, token: FencingToken, started: float) -> None:
        """One round of :meth:`_promise_loop`."""
        successor = self._successor
        if successor is not None:
            await self._ask_promise(successor[0], token)
            now = self._clock.monotonic()
            if (
                self._token is token
                and self._successor is successor
                and self._bounds.deadline() - now < c.PROMISE_REVOKE_LEAD_SECONDS
            ):
                logger.warning(
                    "%s: the designated successor %s has not answered for %.3fs; naming "
                    "none (until one answers, the role fails over by the TTL)",
                    self.role,
                    successor[0],
                    now - self._bounds.deadline() + self._bounds.promise_worth,
                )
                self._drop_successor(now)
            return
        if started < self._next_probe_at:
            return
        asked_roster = False
        # Down the line within the round: after a failover the roster still
        # lists the dead leader's process for a few heartbeats, and a
        # candidate gone from the server refuses at once (no responders).
        while (
            self._token is token and self._clock.monotonic() - started < c.PROMISE_INTERVAL_SECONDS
        ):
            now = self._clock.monotonic()
            # Expired exclusions go (ids of candidates long gone would pile up).
            self._not_designated_until = {
                cid: until for cid, until in self._not_designated_until.items() if until > now
            }
            excluded = frozenset(self._not_designated_until)
            candidate = self._roster.first_in_line(now, excluded=excluded)
            if candidate is None and not asked_roster:
                # Candidates announce themselves once at start and
                # then only every heartbeat (a hello that reached
                # nobody yet, a roster reset by a reconnect): ask.
                asked_roster = True
                await self._ask_roster()
                candidate = self._roster.first_in_line(self._clock.monotonic(), excluded=excluded)
            if candidate is None:
                self._next_probe_at = started + c.PROMISE_RETRY_SECONDS
                return
            if await self._ask_promise(candidate, token):
                if self._token is token and self._successor is None:
                    self._successor = (candidate, uuid.uuid4().hex)
                    self._designation_due = True
                    self.wake()
                return
            # Gone, or a candidate without fast failover: the next in
            # line now, this one again later (not sooner than a refusal
            # of its clock's rate, which _ask_promise has set).
            self._not_designated_until[candidate] = max(
                self._not_designated_until.get(candidate, 0.0), now + c.PROMISE_RETRY_SECONDS
            )

    async def _ask_roster(self) -> None:
        """Ask the role's candidates to describe themselves; note the live ones in the roster."""
        if self._backend is None:
            return
        cfg = self.config
        try:
            answers = await self._backend.request_many(
                control_subject(cfg.bucket, cfg.role, c.ROSTER_VERB),
                b"{}",
                window=c.PROMISE_INTERVAL_SECONDS,
            )
        except ElectionError:
            return
        now = self._clock.monotonic()
        for data in answers:
            try:
                answer = json.loads(data)
            except ValueError:
                continue
            if (
                isinstance(answer, dict)
                and isinstance(answer.get("id"), str)
                and answer["id"] != cfg.instance_id
                and answer.get("state")
                in (ElectionState.FOLLOWER.value, ElectionState.CANDIDATE.value)
            ):
                self._roster.heard(answer["id"], _priority(answer), now)

    def _drop_successor(self, now: float) -> None:
        self._successor = None
        self._designation_due = True
        self._next_probe_at = now + c.PROMISE_RETRY_SECONDS
        self.wake()

    async def _ask_promise(self, candidate: str, token: FencingToken) -> bool:
        """Ask ``candidate`` for a promise; count it if it comes. Returns whether it did."""
        if self._backend is None:
            return False
        body = self._promise_request(token)
        sent = self._clock.monotonic()
        try:
            data = await self._backend.request(
                self._promise_subject(candidate), body, timeout=c.PROMISE_INTERVAL_SECONDS
            )
        except ElectionError:
            return False
        answered = self._clock.monotonic()
        try:
            answer = json.loads(data)
            given = answer["ok"] is True
            received = float(answer["at"])
            run = str(answer["run"])
        except (ValueError, TypeError, KeyError):
            return False
        if not given or self._token is not token:
            return False
        if not self._rates.plausible(f"{candidate}/{run}", sent, received, answered):
            logger.error(
                "%s: the clock of candidate %s runs at a rate more than %g%% off this "
                "process's (its answers drift against the elapsed time); fast failover is not "
                "safe with it, and it is not designated for %gs. Check the hosts' clocks",
                self.role,
                candidate,
                c.CLOCK_RATE_BOUND * 100,
                c.RATE_REFUSAL_SECONDS,
            )
            self._not_designated_until[candidate] = answered + c.RATE_REFUSAL_SECONDS
            self._rates.forget()
            if self._successor is not None and self._successor[0] == candidate:
                self._drop_successor(answered)
            return False
        self._bounds.promised(candidate, sent)
        self._refresh_deadline()
        return True

    async def _announce(self, body: dict[str, Any]) -> None:
        if self._backend is None:
            return
        cfg = self.config
        with contextlib.suppress(ElectionError):
            await self._backend.publish(
                control_subject(cfg.bucket, cfg.role, c.ROSTER_VERB), json.dumps(body).encode()
            )

    async def _on_roster(self, data: bytes, reply: str | None) -> None:
        try:
            body = json.loads(data) if data else {}
        except ValueError:
            return
        if isinstance(body, dict):
            hello = body.get("hello")
            if isinstance(hello, dict) and isinstance(hello.get("id"), str):
                priority = _priority(hello)
                self._roster.heard(hello["id"], priority, self._clock.monotonic())
                # Introduce ourselves back only if we are preferred over the
                # newcomer (a broadcast from every member to every newcomer
                # cost N² messages when N candidates started together).
                # Not while sitting out: it would put us back in everyone's
                # line for a term we will not campaign for.
                if (
                    hello["id"] != self.instance_id
                    and reply is None
                    and self.config.priority > priority
                    and self._clock.monotonic() >= self._sit_out_until
                ):
                    await self._announce(
                        {"known": {"id": self.instance_id, "priority": self.config.priority}}
                    )
            for kind in ("known", "here"):
                entry = body.get(kind)
                if isinstance(entry, dict) and isinstance(entry.get("id"), str):
                    self._roster.heard(entry["id"], _priority(entry), self._clock.monotonic())
            bye = body.get("bye")
            if isinstance(bye, dict) and bye.get("id") != self.instance_id:
                self._roster.forget(str(bye.get("id")))
        if reply and self._backend is not None:
            await self._respond(reply, self.describe())


def _priority(entry: dict[str, Any]) -> int:
    priority = entry.get("priority", 0)
    return priority if isinstance(priority, int) else 0


#: The former name of :class:`KvElection`, kept as an alias.
Election = KvElection

__all__ = ["PERMANENT_ERRORS", "Election", "KvElection"]
