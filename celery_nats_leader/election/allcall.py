"""ALLCALL: leased, rank-ordered leader election over plain NATS (no JetStream).

The second election strategy (``ElectionConfig(strategy="allcall")``), after
Jason E. Aten's ALLCALL algorithm. It needs only core NATS publish/subscribe,
works with any number of candidates (one and two included) and never waits
for a quorum. It is **AP, not CP**: during a network partition each side can
elect its own leader, and after the partition heals two leaders can coexist
until they hear each other (at most one lease).

.. warning:: **Clock assumption.** ALLCALL compares lease expiry times
   computed on one host's *wall clock* with another host's wall clock. This
   is the one place where this package compares wall clocks across hosts
   (the KV strategy never does). It is safe only while the wall clocks of any
   two candidate hosts differ by at most ``max_clock_skew`` (default 1 s):
   run NTP/chrony everywhere. If clocks drift further apart, two processes
   can lead at once. Decisions about this process's *own* lease still use
   its monotonic clock.

Phases (per role, per process):

* **Init** (``ttl + max_clock_skew`` after joining, and again after every
  reconnect): answer allcalls, adopt claims heard, issue no allcall and never
  start a term.
* **Ping**: every heartbeat, complete the current round, run the local
  election on the candidates that answered in the last two rounds, then
  broadcast an allcall carrying this process's view of the current claim.
  Every recipient broadcasts a reply carrying its own view, so claims spread
  to everyone within a heartbeat.
* **Election**: a valid claim (``wall_now < expires + max_clock_skew``) is
  honoured. When none is, the eligible candidate of lowest rank (highest
  priority, then a 128-bit random tie-breaker) starts a term: it mints the
  fencing token, sets ``expires = wall_now + ttl`` and broadcasts the claim.
  Its term begins (``CANDIDATE`` → ``LEADER``) once the server echoes that
  allcall back (or a peer answers it): proof that it went out.
* **Renewal**: the leader re-broadcasts its claim with a new expiry every
  heartbeat. Its local lease runs, on its monotonic clock, from the send time
  of the last *echoed* renewal (``+ ttl - lease_margin``); peers honour the
  claim until ``expires + max_clock_skew`` on their wall clocks. A leader
  whose renewals stop coming back (a partition between it and its server)
  therefore steps down before any peer on the other side can elect anyone.
* **Conflicts**: claims are merged in the seed's order (later expiry first,
  rank second, expiries closer than ``max_clock_skew`` counting as equal). A
  leader that hears a better claim steps down at once.
* **Release**: on stop and resign the leader runs its demote callbacks, then
  broadcasts a release; peers drop the claim and elect at once.

Fencing token: ``epoch = max(wall milliseconds, highest epoch heard + 1)``
when a term begins, carried in every message. Within a connected cluster
every new term's epoch exceeds every earlier term's; a leader that hears of
an epoch above its own (a concurrent term, after a partition healed) ends
its term and starts a new one above it. Across a partition epochs are not
ordered by causality: see docs/allcall.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from celery_nats_leader.core import constants as c
from celery_nats_leader.core.clock import SYSTEM_CLOCK, Clock
from celery_nats_leader.core.errors import ConfigError, ElectionError
from celery_nats_leader.election.allcall_protocol import (
    ALLCALL_VERB,
    REMEMBERED_RELEASES,
    REPLY_VERB,
    TIEBREAK_BITS,
    Claim,
    Kind,
    Member,
    Message,
    MessageFormatError,
    claim_better,
    claim_valid,
    decode_message,
    encode_message,
    new_epoch,
)
from celery_nats_leader.election.base import BaseElection
from celery_nats_leader.election.vocabulary import DemoteReason, ElectionState, control_subject
from celery_nats_leader.term.record import LeaderRecord
from celery_nats_leader.term.token import FencingToken

logger = logging.getLogger(__name__)

#: Returns the wall-clock time in Unix seconds (``time.time`` by default).
WallClock = Callable[[], float]

#: Renewals awaiting their echo, kept at most this many (older ones are moot).
_MAX_PENDING = 8


class Phase:
    """The seed's phases, as shown by :meth:`AllcallElection.describe`."""

    INIT = "init"
    PING = "ping"


@dataclass
class _Pending:
    """A sent allcall whose echo would confirm a lease.

    ``base`` is the monotonic time at which the claim's ``expires`` was
    computed (``expires = wall(base) + ttl``), so a confirmation extends the
    local lease to ``base + ttl - lease_margin``.
    """

    base: float
    sent: float
    token: FencingToken


@dataclass
class _Probe:
    """A token validation waiting for its echo and its peers' replies."""

    expected: set[str]
    echoed: bool = False
    replied: set[str] = field(default_factory=set)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def update(self) -> None:
        if self.echoed and self.expected <= self.replied:
            self.done.set()


class AllcallElection(BaseElection):
    """Leader election for one role with the ALLCALL algorithm (core NATS only).

    Implements :class:`~celery_nats_leader.election.interface.LeaderElection` with the
    same semantics as :class:`~celery_nats_leader.election.KvElection` where
    they apply; see the module docstring for the algorithm and the clock
    assumption, and docs/allcall.md for the guarantees.

    Constructed like every strategy (see
    :class:`~celery_nats_leader.election.base.BaseElection` for the
    arguments); ``config.strategy`` must be ``"allcall"``. Only the backend's
    core messaging is used (``subscribe``, ``publish``, ``request``), never
    JetStream.

    Attributes:
        wall_clock: Wall clock for lease expiry times shared with other hosts.
            Default :func:`time.time`; when a ``clock`` is injected, a wall
            clock that advances with it (for deterministic tests). Tests may
            replace it before :meth:`start` to simulate clock skew.

    Demote reasons used by ALLCALL: ``STOPPED``, ``RESIGNED``, ``TAKEOVER``,
    ``HEALTH_CHECK_FAILED``, ``LEASE_EXPIRED`` (renewals not echoed in time),
    ``DISCONNECTED`` (longer than ``disconnect_grace``), ``REVISION_CHANGED``
    (a better claim of another leader was heard) and ``TOKEN_MISMATCH`` (a
    concurrent term with a higher epoch was heard: this process starts a new
    term at once, with a new token).

    Raises:
        ConfigError: If ``config.strategy`` is not ``"allcall"``.

    """

    _logger = logger
    _name_prefix = "allcall"

    def _init_state(self) -> None:
        config = self.config
        if config.strategy != "allcall":
            raise ConfigError(
                f"AllcallElection needs ElectionConfig(strategy='allcall'), got "
                f"strategy={config.strategy!r}; use new_election() to pick the class"
            )
        self.wall_clock: WallClock = _default_wall_clock(self._clock)
        self._tiebreak = self._rng.getrandbits(TIEBREAK_BITS)
        self._subjects = {
            verb: control_subject(config.bucket, config.role, verb)
            for verb in (ALLCALL_VERB, REPLY_VERB, c.ROSTER_VERB, c.RESIGN_VERB)
        }

        # Phase and eligibility.
        self._phase = Phase.INIT
        self._init_until = 0.0

        # What this process believes about the role.
        self._claim: Claim | None = None
        self._announced: tuple[str, int] | None = None
        self._max_epoch = 0
        self._released: deque[tuple[str, int]] = deque(maxlen=REMEMBERED_RELEASES)
        self._hand_over_task: asyncio.Task[None] | None = None

        # Leader side.
        self._candidate_until = 0.0
        self._pending: dict[int, _Pending] = {}
        self._reterm = False
        self._echo_seen = False

        # Rounds: who answered our allcalls in the current and the last round.
        self._seq = 0
        self._round_open = False
        self._round: set[str] = set()
        self._last_round: set[str] = set()
        self._members: dict[str, Member] = {}
        self._probes: dict[int, _Probe] = {}
        self._evaluate_now = False
        self._warned_mixed = False

    # ------------------------------------------------------------------ API

    @property
    def rank(self) -> tuple[int, int, str]:
        """The rank of this candidate (lower is preferred): ``(-priority, tie-breaker, id)``."""
        return self._me().rank

    @property
    def phase(self) -> str:
        """``"init"`` or ``"ping"`` (see :class:`Phase`)."""
        return self._phase

    @property
    def leader(self) -> LeaderRecord | None:
        """The leader of the claim currently honoured (ours while leading), or ``None``."""
        claim = self._claim
        if claim is None:
            return None
        return _record(claim)

    @property
    def leader_id(self) -> str | None:
        """The id of the leader currently honoured, or ``None`` when the role looks free."""
        claim = self._claim
        return claim.id if claim is not None else None

    async def start(self, *, wait: float | None = None) -> None:
        """Join the election.

        Subscribes to the role's subjects (no KV bucket is opened: JetStream
        is not needed) and enters the init phase, in which this process
        answers allcalls and adopts the claims it hears but starts no term
        for ``ttl + max_clock_skew``. Returns once the current leader is
        known (when it is this process, once its ``on_promote`` callbacks have
        returned), which takes about one heartbeat when somebody leads; when nobody does, it
        returns after ``wait`` and the election goes on in the background
        (use :meth:`wait_for_leadership`).

        Args:
            wait: Seconds to wait for a leader to be known; default two
                heartbeats plus the request timeout.

        Raises:
            NatsUnavailableError: No connection could be made.
            ElectionStoppedError: The election was started before.

        """
        cfg = self.config
        backend = await self._prepare_start()
        self._callbacks.start()
        handlers = {
            ALLCALL_VERB: self._on_allcall,
            REPLY_VERB: self._on_reply,
            c.ROSTER_VERB: self._on_roster,
            c.RESIGN_VERB: self._on_resign_request,
        }
        try:
            for verb, handler in handlers.items():
                self._subscriptions.append(await backend.subscribe(self._subjects[verb], handler))
        except BaseException:
            # Restartable: no handler may be left subscribed twice on a retry.
            await self._abandon_start()
            raise
        now = self._clock.monotonic()
        self._enter_init(now)
        self._set_state(ElectionState.FOLLOWER)
        logger.info(
            "%s: joined (allcall, rank priority=%d tiebreak=%08x…); init phase for %.3gs",
            self.role,
            cfg.priority,
            self._tiebreak >> (TIEBREAK_BITS - 32),
            cfg.ttl + cfg.max_clock_skew,
        )
        await self._launch(
            2 * cfg.heartbeat_interval + cfg.request_timeout if wait is None else wait
        )

    async def stop(self) -> None:
        """Leave the election.

        A leader first runs its demote callbacks, then (with
        ``release_on_stop``) broadcasts the release of its term so that a
        successor is elected at once. Every candidate announces that it
        leaves, so that it is no longer considered. Idempotent.
        """
        if self._state is ElectionState.STOPPED and self._main_task is None:
            return
        was_leader = self._state is ElectionState.LEADER
        claim = self._own_claim()
        hand_over = self._hand_over_task
        await self._cancel_main()
        if hand_over is not None and not hand_over.done():
            # A release (resign, failed health check, takeover) is under way:
            # let it broadcast, or the successor waits out the lease.
            await asyncio.wait({hand_over})
        # The reason before the token: a thread that sees the term over
        # finds why (LeaderContext.reason).
        self._ending_reason = DemoteReason.STOPPED
        self._token = None
        self._lease_deadline = 0.0
        self._set_state(ElectionState.STOPPED)
        returned = True
        if was_leader:
            returned = await self._demote_callbacks_done(self._notify_demoted(DemoteReason.STOPPED))
        released = claim if self.config.release_on_stop and returned else None
        if released is not None:
            self._forget_claim(released)
        # Even without a claim to release, tell the others we are gone so
        # that they no longer count us as a candidate.
        await self._publish(ALLCALL_VERB, self._message("release", claim=released))
        if released is not None:
            logger.info("%s: released the term (epoch %d)", self.role, released.epoch)
        await self._teardown()

    async def validate_token(self) -> bool:
        """Check, as far as ALLCALL can, that this process still holds its term.

        Broadcasts an allcall and waits (up to ``request_timeout``) for the
        server's echo and for the replies of the candidates of the last
        rounds; every reply carries its sender's view, and a better claim in
        any of them demotes this process at once.

        This is **not** a linearizable check, and cannot be one without a
        quorum: a candidate on the far side of a partition (or one that did
        not answer in time) may lead concurrently without this process
        knowing. It proves that the server relayed our claim just now and
        that no candidate that answered knows a better one.

        Returns:
            ``True`` only if the echo came back, no better claim was heard,
            and the local lease is still valid. ``False`` on any doubt.

        """
        token = self._token
        if not self.is_leader or token is None or self._backend is None:
            return False
        seq = self._next_seq()
        probe = _Probe(expected=(self._round | self._last_round) - {self.instance_id})
        self._probes[seq] = probe
        try:
            await self._publish(
                ALLCALL_VERB, self._message("allcall", seq=seq, claim=self._own_claim())
            )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(probe.done.wait(), self.config.request_timeout)
        finally:
            self._probes.pop(seq, None)
        ok = probe.echoed and self.is_leader and self._token is token
        self._observer.validation(self.role, self.instance_id, ok)
        if not ok:
            logger.debug(
                "%s: token validation failed (echo %s, leading %s)",
                self.role,
                probe.echoed,
                self.is_leader,
            )
        return ok

    def describe(self) -> dict[str, Any]:
        """Describe this candidate as the roster and status commands show it.

        Returns:
            A JSON-serializable dict with the keys of
            :meth:`KvElection.describe <celery_nats_leader.election.KvElection.describe>`
            (``revision`` is always ``None``: there is no KV) plus
            ``strategy``, ``phase``, ``eligible``, ``max_clock_skew``,
            ``lease_expires`` (the honoured claim's expiry, wall clock of the
            host that computed it) and ``candidates`` (ids heard in the last
            rounds).

        """
        now = self._clock.monotonic()
        leading = self.is_leader
        token = self._token if leading else None
        claim = self._claim
        return {
            "id": self.instance_id,
            "role": self.role,
            "strategy": "allcall",
            "state": self.state.value,
            "phase": self._phase,
            "eligible": self._eligible(now),
            "priority": self.config.priority,
            "is_leader": leading,
            "epoch": token.epoch if token else None,
            "revision": None,
            "term_age": round(now - self._term_started_at, 3) if leading else None,
            "lease_remaining": round(self.lease_remaining, 3) if leading else None,
            "lease_margin": self.config.lease_margin,
            "max_clock_skew": self.config.max_clock_skew,
            "last_heartbeat_age": round(now - self._last_confirmed_send, 3) if leading else None,
            "leader_id": claim.id if claim is not None else None,
            "lease_expires": claim.expires if claim is not None else None,
            "candidates": sorted((self._round | self._last_round) - {self.instance_id}),
            "meta": dict(self.config.meta),
        }

    # ------------------------------------------------------------ plumbing

    async def _respond(self, reply: str, body: Any) -> None:
        # Unlike the KV strategy, a failed answer is dropped without a log.
        with contextlib.suppress(ElectionError):
            await super()._respond(reply, body)

    def _may_take_over(self, leader_id: str, now: float) -> bool:
        return leader_id != self.instance_id and self._eligible(now)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _enter_init(self, now: float) -> None:
        """(Re)start the init phase: no term may begin before it ends.

        Also after a reconnect: claims sent while we were away were not
        heard, so we wait a full lease (plus the skew) before trusting that
        the role is free, exactly as a newcomer does.
        """
        cfg = self.config
        self._phase = Phase.INIT
        self._init_until = max(self._init_until, now + cfg.ttl + cfg.max_clock_skew)
        # Rounds from before are stale: the first round after init starts afresh.
        self._round_open = False
        self._round.clear()
        self._last_round.clear()

    def _me(self) -> Member:
        return Member(
            id=self.instance_id,
            priority=self.config.priority,
            tiebreak=self._tiebreak,
            eligible=self._eligible(self._clock.monotonic()),
        )

    def _eligible(self, now: float) -> bool:
        """Whether this process may start a term now."""
        return (
            self._state in (ElectionState.FOLLOWER, ElectionState.CANDIDATE, ElectionState.LEADER)
            and self._phase == Phase.PING
            and now >= self._sit_out_until
            and self._disconnected_since is None
            and self._backend is not None
            and self._backend.is_connected
        )

    def _own_claim(self) -> Claim | None:
        """Our claim, if the honoured claim is our current term."""
        claim, token = self._claim, self._token
        if claim is None or token is None:
            return None
        if claim.id != self.instance_id or claim.token != token.value:
            return None
        return claim

    def _message(
        self,
        kind: Kind,
        *,
        seq: int | None = None,
        claim: Claim | None = None,
        to: str | None = None,
    ) -> Message:
        return Message(
            kind=kind,
            seq=self._seq if seq is None else seq,
            sender=self._me(),
            claim=claim,
            max_epoch=self._max_epoch,
            to=to,
        )

    async def _publish(self, verb: str, message: Message) -> None:
        if self._backend is None:
            return
        with contextlib.suppress(ElectionError):
            await self._backend.publish(self._subjects[verb], encode_message(message))

    # --------------------------------------------------------- claim state

    def _adopt(self, claim: Claim | None) -> None:
        """Honour ``claim`` from now on (``None``: the role looks free)."""
        self._claim = claim
        key = (claim.id, claim.epoch) if claim is not None else None
        if key != self._announced:
            self._announced = key
            self._callbacks.submit(
                self._change_callbacks, _record(claim) if claim is not None else None
            )
        if claim is not None and self._decided is not None:
            self._decided.set()

    def _forget_claim(self, claim: Claim) -> None:
        """A term was released: never honour a relayed copy of it again."""
        self._released.append((claim.id, claim.epoch))
        if self._claim is not None and self._claim.term == claim.term:
            self._adopt(None)

    def _merge(self, incoming: Claim | None, max_epoch: int) -> None:
        """Take note of a claim heard from a peer, in the seed's order."""
        if max_epoch > self._max_epoch or (incoming and incoming.epoch > self._max_epoch):
            self._max_epoch = max(max_epoch, incoming.epoch if incoming else 0)
            own = self._own_claim()
            if own is not None and self._max_epoch > own.epoch:
                # A term we never heard of got a higher epoch than ours: a
                # fenced resource may have accepted it. Start a new term above.
                self._reterm = True
                self.wake()
        if incoming is None or (incoming.id, incoming.epoch) in self._released:
            return
        skew = self.config.max_clock_skew
        wall = self.wall_clock()
        if not claim_valid(incoming, wall, skew):
            return
        own = self._own_claim()
        current = self._claim
        if own is not None:
            if incoming.term == own.term or incoming.id == self.instance_id:
                return  # a relay of our own claim: we are its only authority
            if claim_better(incoming, own, skew):
                self._superseded(incoming)
            return
        if current is not None and claim_valid(current, wall, skew):
            if incoming.term == current.term:
                if incoming.expires > current.expires:
                    self._claim = incoming  # a renewal: same term, later expiry
                return
            if not claim_better(incoming, current, skew):
                return
        self._adopt(incoming)

    def _superseded(self, better: Claim) -> None:
        """A better claim of another leader was heard: step down at once."""
        was_leader = self._state is ElectionState.LEADER
        logger.warning(
            "%s: heard a better claim (leader %s, epoch %d); stepping down",
            self.role,
            better.id,
            better.epoch,
        )
        if was_leader:
            self._ending_reason = DemoteReason.REVISION_CHANGED
        self._end_term()
        self._adopt(better)
        if was_leader:
            self._notify_demoted(DemoteReason.REVISION_CHANGED)
        else:
            self._observer.campaign(self.role, self.instance_id, False)
        self.wake()

    def _end_term(self) -> None:
        """Forget our term (state first, callbacks are the caller's)."""
        self._token = None
        self._lease_deadline = 0.0
        self._pending.clear()
        self._reterm = False
        self._stop_health_watch()
        if self._state in (ElectionState.LEADER, ElectionState.CANDIDATE):
            self._set_state(ElectionState.FOLLOWER)

    def _demote(self, reason: DemoteReason) -> None:
        """Stop leading at once (state first, callbacks after)."""
        if self._state is not ElectionState.LEADER:
            return
        self._ending_reason = reason
        self._end_term()
        logger.info("%s: demoted (%s)", self.role, reason.value)
        self._notify_demoted(reason)
        self.wake()

    # ------------------------------------------------------------ handlers

    async def _on_allcall(self, data: bytes, reply: str | None) -> None:
        message = self._decode(data)
        if message is None or self._state is ElectionState.STOPPED:
            return
        if message.sender.id == self.instance_id:
            self._echoed(message.seq)
            return
        self._members[message.sender.id] = message.sender
        if message.kind == "release":
            self._on_release(message)
            return
        self._merge(message.claim, message.max_epoch)
        answer = self._message("reply", seq=message.seq, claim=self._claim, to=message.sender.id)
        await self._publish(REPLY_VERB, answer)

    async def _on_reply(self, data: bytes, reply: str | None) -> None:
        message = self._decode(data)
        if message is None or self._state is ElectionState.STOPPED:
            return
        if message.sender.id == self.instance_id:
            return
        self._members[message.sender.id] = message.sender
        self._merge(message.claim, message.max_epoch)
        if message.to == self.instance_id:
            if self._round_open:
                self._round.add(message.sender.id)
            # The peer got our allcall: the server relayed it, as an echo proves.
            self._confirm(message.seq)
            probe = self._probes.get(message.seq)
            if probe is not None:
                probe.replied.add(message.sender.id)
                probe.update()

    def _on_release(self, message: Message) -> None:
        if message.claim is not None:
            self._max_epoch = max(self._max_epoch, message.claim.epoch)
            self._forget_claim(message.claim)
            logger.info(
                "%s: %s released its term (epoch %d)",
                self.role,
                message.sender.id,
                message.claim.epoch,
            )
        else:
            # Leaving without a term: drop it from the candidates at once.
            self._round.discard(message.sender.id)
            self._last_round.discard(message.sender.id)
        if self._claim is None:
            # The role is free: elect now rather than at the next heartbeat.
            self._evaluate_now = True
            self.wake()

    def _echoed(self, seq: int) -> None:
        """The server relayed one of our own allcalls back to us."""
        self._echo_seen = True
        self._confirm(seq)
        probe = self._probes.get(seq)
        if probe is not None:
            probe.echoed = True
            probe.update()

    def _confirm(self, seq: int) -> None:
        """Allcall ``seq`` went out: extend the lease its claim carried."""
        pending = self._pending.get(seq)
        if pending is None:
            return
        # Older renewals are moot once a newer one is confirmed.
        for old in [s for s in self._pending if s <= seq]:
            del self._pending[old]
        if pending.token is not self._token:
            return
        now = self._clock.monotonic()
        cfg = self.config
        deadline = pending.base + cfg.ttl - cfg.lease_margin
        if now >= deadline:
            return  # confirmed too late to be of use
        self._lease_deadline = max(self._lease_deadline, deadline)
        self._last_confirmed_send = max(self._last_confirmed_send, pending.sent)
        self._observer.heartbeat(self.role, self.instance_id, now - pending.sent, True)
        if self._state is ElectionState.CANDIDATE:
            self._win(pending.token)
        else:
            logger.debug("%s: lease renewed (epoch %d)", self.role, pending.token.epoch)

    def _decode(self, data: bytes) -> Message | None:
        try:
            return decode_message(data)
        except MessageFormatError as exc:
            logger.debug("%s: ignored a malformed allcall message: %s", self.role, exc)
            return None

    async def _on_roster(self, data: bytes, reply: str | None) -> None:
        try:
            body = json.loads(data) if data else {}
        except ValueError:
            body = {}
        if isinstance(body, dict) and "hello" in body and not self._warned_mixed:
            # Only the KV strategy announces itself with "hello".
            self._warned_mixed = True
            logger.error(
                "%s: a candidate using the KV strategy joined this role (%r); mixing "
                "strategies elects one leader per strategy. Configure every process alike.",
                self.role,
                body.get("hello"),
            )
        if reply and self._backend is not None:
            await self._respond(reply, self.describe())

    # ----------------------------------------------------------- main loop

    async def _loop(self) -> None:
        cfg = self.config
        next_tick = self._clock.monotonic()
        while self._state is not ElectionState.STOPPED:
            now = self._clock.monotonic()
            self._track_connection(now)
            if self._state is ElectionState.LEADER:
                if now >= self._lease_deadline:
                    logger.warning(
                        "%s: no renewal echoed for %.3fs; lease over, stepping down",
                        self.role,
                        now - self._last_confirmed_send,
                    )
                    self._demote(DemoteReason.LEASE_EXPIRED)
                    continue
                if self._release_reason is not None:
                    await self._release(self._release_reason)
                    continue
                if (
                    self._disconnected_since is not None
                    and now - self._disconnected_since >= cfg.disconnect_grace
                ):
                    logger.warning(
                        "%s: disconnected for %.3fs (grace %.3fs); stepping down",
                        self.role,
                        now - self._disconnected_since,
                        cfg.disconnect_grace,
                    )
                    self._demote(DemoteReason.DISCONNECTED)
                    continue
            if self._state is ElectionState.CANDIDATE and now >= self._candidate_until:
                self._give_up_candidacy()
                continue
            if self._phase == Phase.INIT and now >= self._init_until:
                self._phase = Phase.PING
                logger.info("%s: init phase over, issuing allcalls", self.role)
                next_tick = now
            on_grid = now >= next_tick
            if on_grid or self._evaluate_now or self._reterm:
                # Out-of-grid ticks (a release was heard, a concurrent term
                # must be superseded) do not move the heartbeat grid.
                self._evaluate_now = False
                await self._tick(now)
                if on_grid:
                    next_tick += cfg.heartbeat_interval
                    if next_tick <= now:
                        next_tick = now + cfg.heartbeat_interval  # we were late
                continue
            wake_at = next_tick
            if self._phase == Phase.INIT:
                wake_at = min(wake_at, self._init_until)
            if self._state is ElectionState.LEADER:
                wake_at = min(wake_at, self._lease_deadline)
                if self._disconnected_since is not None:
                    wake_at = min(wake_at, self._disconnected_since + cfg.disconnect_grace)
            if self._state is ElectionState.CANDIDATE:
                wake_at = min(wake_at, self._candidate_until)
            await self._sleep_until(wake_at)

    def _track_connection(self, now: float) -> None:
        assert self._backend is not None
        if not self._backend.is_connected:
            if self._disconnected_since is None:
                self._disconnected_since = now
                logger.warning("%s: lost the NATS connection", self.role)
            return
        if self._disconnected_since is not None:
            self._disconnected_since = None
            logger.info("%s: reconnected; init phase again before any new term", self.role)
            self._enter_init(now)

    async def _tick(self, now: float) -> None:
        """One heartbeat: expire, complete the round, elect or renew, then allcall."""
        wall = self.wall_clock()
        claim = self._claim
        if (
            claim is not None
            and self._own_claim() is None
            and not claim_valid(claim, wall, self.config.max_clock_skew)
        ):
            logger.info("%s: the lease of %s ran out", self.role, claim.id)
            self._adopt(None)
        leading = self._state in (ElectionState.LEADER, ElectionState.CANDIDATE)
        if self._phase == Phase.INIT and not leading:
            return  # the seed: no allcalls during init
        if self._state is ElectionState.LEADER:
            self._count_unconfirmed(now)
        candidates: set[str] | None = None
        if self._round_open:
            # The seed's round: the replies to our allcalls over the last
            # heartbeat, plus the one before, so that a late reply does not
            # drop a live candidate.
            candidates = self._round | self._last_round
            self._last_round, self._round = self._round, set()
        self._round_open = True
        seq = self._next_seq()
        reterm, self._reterm = self._reterm, False
        if reterm and self._state in (ElectionState.LEADER, ElectionState.CANDIDATE):
            logger.warning(
                "%s: a concurrent term with epoch %d exists; starting a new term above it",
                self.role,
                self._max_epoch,
            )
            self._demote(DemoteReason.TOKEN_MISMATCH)  # no-op for a candidate
            self._begin_term(now, wall, seq)
        elif self._state is ElectionState.LEADER:
            self._renew(now, wall, seq)
        elif self._state is ElectionState.CANDIDATE:
            self._retransmit(now, seq)
        elif candidates is not None and self._claim is None:
            self._elect(now, wall, seq, candidates)
        await self._publish(ALLCALL_VERB, self._message("allcall", seq=seq, claim=self._claim))
        claim = self._claim
        if self._state is ElectionState.FOLLOWER and claim is not None:
            # After the allcall: a takeover request may wait request_timeout.
            await self._maybe_take_over(claim.id, claim.priority, now)

    def _elect(self, now: float, wall: float, seq: int, candidates: set[str]) -> None:
        """The role is free: the eligible candidate of lowest rank starts a term."""
        if not self._eligible(now):
            return
        ranked = [self._me()]
        ranked += [
            self._members[i]
            for i in candidates
            if i in self._members and i != self.instance_id and self._members[i].eligible
        ]
        best = min(ranked, key=lambda member: member.rank)
        if best.id != self.instance_id:
            logger.debug("%s: role free; %s has the lowest rank", self.role, best.id)
            return
        self._begin_term(now, wall, seq)

    def _begin_term(self, now: float, wall: float, seq: int) -> None:
        """Mint a term and claim it; it begins when the claim is echoed."""
        cfg = self.config
        epoch = new_epoch(wall, self._max_epoch)
        self._max_epoch = epoch
        token = FencingToken(epoch=epoch, value=str(uuid.uuid4()))
        self._token = token
        self._pending.clear()
        claim = Claim(
            id=self.instance_id,
            priority=cfg.priority,
            tiebreak=self._tiebreak,
            epoch=epoch,
            token=token.value,
            expires=wall + cfg.ttl,
            meta=dict(cfg.meta),
        )
        self._adopt(claim)
        self._candidate_until = now + cfg.ttl - cfg.lease_margin
        self._pending[seq] = _Pending(base=now, sent=now, token=token)
        self._set_state(ElectionState.CANDIDATE)
        logger.info("%s: no valid lease and lowest rank: claiming epoch %d", self.role, epoch)

    def _renew(self, now: float, wall: float, seq: int) -> None:
        own = self._own_claim()
        assert own is not None and self._token is not None
        if self._disconnected_since is not None:
            # Nobody would hear it (and no echo would confirm it): keep our
            # view of our claim equal to what the others last saw.
            return
        self._claim = own.renewed(wall + self.config.ttl)
        self._pending[seq] = _Pending(base=now, sent=now, token=self._token)
        while len(self._pending) > _MAX_PENDING:
            del self._pending[min(self._pending)]

    def _retransmit(self, now: float, seq: int) -> None:
        """Send our unconfirmed claim again, unchanged: its lease still runs from its base."""
        assert self._token is not None
        first = min(self._pending.values(), key=lambda p: p.base, default=None)
        base = first.base if first is not None else now
        self._pending[seq] = _Pending(base=base, sent=now, token=self._token)

    def _count_unconfirmed(self, now: float) -> None:
        stale = [p for p in self._pending.values() if p.sent < now]
        if stale:
            latest = max(stale, key=lambda p: p.sent)
            self._observer.heartbeat(self.role, self.instance_id, now - latest.sent, False)

    def _give_up_candidacy(self) -> None:
        logger.warning(
            "%s: our claim was never echoed back; giving up the candidacy%s",
            self.role,
            "" if self._echo_seen else " (no_echo set on the connection? ALLCALL needs echo)",
        )
        self._observer.campaign(self.role, self.instance_id, False)
        self._end_term()
        self._sit_out_until = self._clock.monotonic() + self.config.ttl

    def _win(self, token: FencingToken) -> None:
        now = self._clock.monotonic()
        self._term_started_at = now
        self._release_reason = None
        self._set_state(ElectionState.LEADER)
        self._observer.campaign(self.role, self.instance_id, True)
        logger.info("%s: promoted, epoch %d", self.role, token.epoch)
        self._notify_promoted(token)
        self._watch_health(token)

    async def _release(self, reason: DemoteReason) -> None:
        """Graceful hand-over: demote callbacks first, then broadcast the release."""
        claim = self._own_claim()
        if self._state is not ElectionState.LEADER or claim is None:
            return
        self._release_reason = None
        self._ending_reason = reason
        self._end_term()
        # Sit out one TTL so that someone else takes the role.
        self._sit_out_until = self._clock.monotonic() + self.config.ttl
        logger.info("%s: stepping down (%s)", self.role, reason.value)
        # In a task of its own, which stop() lets finish: stop() cancels the
        # main loop, and a release cancelled there was never broadcast, so
        # the successor waited out the lease (as for the KV strategy).
        hand_over = asyncio.get_running_loop().create_task(
            self._hand_over(reason, claim), name=f"release-{self.role}"
        )
        self._hand_over_task = hand_over
        await asyncio.shield(hand_over)
        self.wake()

    async def _hand_over(self, reason: DemoteReason, claim: Claim) -> None:
        """The release proper: demote callbacks, then the release is broadcast."""
        if not await self._demote_callbacks_done(self._notify_demoted(reason)):
            return  # the claim is left to lapse, as if this process had died
        self._forget_claim(claim)
        await self._publish(ALLCALL_VERB, self._message("release", claim=claim))
        logger.info("%s: released the term (epoch %d)", self.role, claim.epoch)


def _record(claim: Claim) -> LeaderRecord:
    return LeaderRecord(
        id=claim.id,
        token=claim.token,
        epoch=claim.epoch,
        revision=0,
        priority=claim.priority,
        meta=dict(claim.meta),
    )


def _default_wall_clock(clock: Clock) -> WallClock:
    """``time.time``, or a wall clock that moves with an injected monotonic clock."""
    if clock is SYSTEM_CLOCK:
        return time.time
    offset = time.time() - clock.monotonic()
    return lambda: clock.monotonic() + offset


__all__ = ["AllcallElection", "Phase", "WallClock"]
