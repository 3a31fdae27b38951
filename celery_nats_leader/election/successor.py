"""The designated successor: failover in about a second, authority still in KV.

Pure arithmetic on each process's own monotonic clock, no I/O and no asyncio
(the election does the messaging): :class:`PromiseLedger` is the successor's
side, :class:`SuccessorBounds` the leader's. The argument is in
docs/design.md ("Fast failover: the designated successor"); in short:

* The leader's record names one follower, the *successor*, with a random
  ``nonce`` new with each designation.
* Every ``PROMISE_INTERVAL_SECONDS`` the leader asks it, over core NATS, for
  a promise. The successor, on receipt at ``r`` (its clock), promises not to
  take over before ``r + G`` and answers. The leader, which sent the request
  at ``s`` (its clock, ``s`` before ``r`` in real time), counts on the
  promise until ``s + G x (1 - 2 rho) - margin``: before the successor's
  ``r + G`` as long as the clocks' rates differ by less than ``rho``.
* A successor also takes over no sooner than ``G`` after it first saw its
  designation's nonce, which it cannot see before the leader sent the write
  that carries it: the leader counts that write's send time as a promise.
* The successor takes over with a compare-and-set on the revision it saw,
  which names it: a renewal or a new designation makes the write fail.
* The leader's validity is the earliest of its KV lease and the bounds of
  every successor named in a revision that may be the current one; one
  whose promises run short writes a record with no successor first (then
  only the lease counts, as without fast failover).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

__all__ = ["PromiseLedger", "RateCheck", "SuccessorBounds", "candidate_digest"]

#: A successor's answers are checked against a baseline at most twice this
#: old (seconds): a rate off by more than the bound over that long is seen.
RATE_WINDOW_SECONDS = 60.0


def candidate_digest(instance_id: str) -> str:
    """The subject token of a candidate's promise subject.

    Instance ids may hold dots (host names), which NATS reads as token
    separators: a digest is one token whatever the id.
    """
    return hashlib.sha256(instance_id.encode()).hexdigest()[:20]


@dataclass
class PromiseLedger:
    """The successor's side: what it promised, and when it may take over.

    Args:
        grace: ``G``, seconds a promise holds from its receipt.

    Attributes:
        promised_until: No fast takeover before this (own clock): the
            latest promise's receipt plus ``grace``.
        nonce: The designation this candidate last saw naming it.
        designated_at: When it first saw ``nonce``.
        attempt_revision: The revision of a takeover write whose outcome is
            not known yet: no promise is given until a later revision is seen.
        quiet_until: No fast takeover before this either: set after this
            process's own reconnect or event-loop stall, when requests it
            did not read may be waiting.

    """

    grace: float
    promised_until: float = 0.0
    nonce: str | None = None
    designated_at: float = 0.0
    attempt_revision: int | None = None
    quiet_until: float = 0.0

    def promise(self, now: float, *, epoch: int, known_epoch: int) -> bool:
        """A leader asks for a promise; return whether it is given.

        Args:
            now: This candidate's clock, on receipt.
            epoch: The asking leader's epoch.
            known_epoch: The newest epoch this candidate has seen.

        Returns:
            ``False`` while a takeover of ours may still land (a promise
            then would be a lie), or to a leader of an older term than one
            seen (a stale leader's requests must not delay taking over from
            a newer one). Otherwise the promise holds until ``now + grace``.

        """
        if self.attempt_revision is not None or epoch < known_epoch:
            return False
        self.promised_until = max(self.promised_until, now + self.grace)
        return True

    def saw(
        self, revision: int, successor: str | None, nonce: str | None, own_id: str, now: float
    ) -> None:
        """The key's record at ``revision`` was seen (watch, read or write).

        Args:
            revision: Its revision.
            successor: The successor it names, if any.
            nonce: That designation's nonce.
            own_id: This candidate's id.
            now: This candidate's clock.

        """
        if self.attempt_revision is not None and revision > self.attempt_revision:
            # Our takeover write either landed (this is it) or never will
            # (the key moved past the revision it named).
            self.attempt_revision = None
        if successor == own_id and nonce is not None:
            if nonce != self.nonce:
                self.nonce = nonce
                self.designated_at = now
        else:
            self.nonce = None

    def takeover_at(self, nonce: str | None, revision: int | None = None) -> float:
        """When this candidate may take over from the record carrying ``nonce``.

        Args:
            nonce: The successor nonce of the record it would replace
                (``None`` when that record does not name this candidate).
            revision: That record's revision. While a takeover write on it
                has no known outcome, the same write may be sent again (no
                promise was given since, so its conditions still hold; if
                the first landed, the key has moved on and the retry fails);
                a write on any other revision may not.

        Returns:
            The earliest time on this candidate's clock, or ``inf``.

        """
        if nonce is None or nonce != self.nonce:
            return math.inf
        if self.attempt_revision is not None and self.attempt_revision != revision:
            return math.inf
        return max(self.promised_until, self.designated_at + self.grace, self.quiet_until)

    def attempting(self, revision: int) -> None:
        """A takeover write at ``revision`` is about to be sent: no promise until it resolves."""
        self.attempt_revision = revision

    def stay_quiet(self, until: float) -> None:
        """No fast takeover before ``until`` (after a reconnect or a stall of our own)."""
        self.quiet_until = max(self.quiet_until, until)


@dataclass
class SuccessorBounds:
    """The leader's side: until when no designated successor can take over.

    Args:
        grace: ``G``, seconds a promise holds from its receipt.
        rate_bound: ``rho``, the largest difference of clock rates assumed.
        margin: Seconds before a promise runs out that it stops counting.

    Every time is the leader's own monotonic clock.
    """

    grace: float
    rate_bound: float
    margin: float
    #: Per candidate: before this, it cannot take over fast (already reduced).
    _bounds: dict[str, float] = field(default_factory=dict)
    #: Candidates named in a revision that may be the key's current one.
    _possible: set[str] = field(default_factory=set)

    def usable_until(self, sent: float) -> float:
        """Until when a promise asked for at ``sent`` may be counted on."""
        return sent + self.grace * (1.0 - 2.0 * self.rate_bound) - self.margin

    def promised(self, candidate: str, sent: float) -> None:
        """``candidate`` promised, on a request sent at ``sent``."""
        bound = self.usable_until(sent)
        if bound > self._bounds.get(candidate, -math.inf):
            self._bounds[candidate] = bound

    def writing(self, candidate: str | None, *, new_designation: bool, sent: float) -> None:
        """A write naming ``candidate`` is being sent at ``sent``.

        Until a later write is confirmed, it may be the key's current
        revision. A new designation counts as a promise from its send time:
        the candidate counts ``G`` from its first sighting of the nonce,
        which is after the send.
        """
        if candidate is None:
            return
        if new_designation:
            self.promised(candidate, sent)
        self._possible.add(candidate)

    def confirmed(self, candidate: str | None) -> None:
        """A write naming ``candidate`` is stored: earlier revisions can no longer be CASed on."""
        self._possible = {candidate} if candidate is not None else set()
        for other in list(self._bounds):
            if other != candidate:
                del self._bounds[other]

    def deadline(self) -> float:
        """The leader's validity by the promises (``inf`` when no successor is named)."""
        if not self._possible:
            return math.inf
        return min(self._bounds.get(candidate, -math.inf) for candidate in self._possible)

    @property
    def promise_worth(self) -> float:
        """How long after its request's send time a promise is counted on."""
        return self.usable_until(0.0)

    @property
    def candidates(self) -> frozenset[str]:
        """The successors a revision that may be the key's current one names."""
        return frozenset(self._possible)

    @property
    def named(self) -> bool:
        """Whether a revision that may be current names a successor."""
        return bool(self._possible)

    def reset(self) -> None:
        """A new term: nobody is named yet."""
        self._bounds.clear()
        self._possible.clear()


@dataclass
class RateCheck:
    """Checks one successor's answers against the clock-rate bound.

    Each answer carries the successor's receipt time ``r`` (its clock). With
    the leader's send time ``s`` and the answer's arrival ``a``, the offset
    ``r - s`` may move only by the rate difference times the elapsed time,
    plus the round trips (the one-way delays are unknown but below them).
    A larger move means the clocks' rates differ by more than assumed, and
    fast failover is not safe with that successor.

    Args:
        rate_bound: ``rho``.

    """

    rate_bound: float
    _first: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    def plausible(self, run: str, sent: float, received: float, answered: float) -> bool:
        """Whether the answer of the successor process ``run`` fits the bound.

        Args:
            run: Identifies one successor process (a restart starts afresh).
            sent: The request's send time (leader's clock).
            received: The successor's receipt time (its clock).
            answered: The answer's arrival (leader's clock).

        """
        first = self._first.get(run)
        if first is None:
            # Baselines of processes no longer asked go (one per successor
            # process of a long term would pile up); one still asked is
            # renewed at half this age.
            stale = [
                r for r, (s0, _, _) in self._first.items() if sent - s0 > 4 * RATE_WINDOW_SECONDS
            ]
            for old in stale:
                del self._first[old]
            self._first[run] = (sent, received, answered - sent)
            return True
        sent0, received0, round_trip0 = first
        drift = abs((received - sent) - (received0 - sent0))
        plausible = drift <= self.rate_bound * (sent - sent0) + round_trip0 + (answered - sent)
        if plausible and sent - sent0 >= 2 * RATE_WINDOW_SECONDS:
            # A fresh baseline now and then: against a first answer of long
            # ago the allowance would grow without end, and a clock that
            # started to drift late would go unnoticed for as long.
            self._first[run] = (sent, received, answered - sent)
        return plausible

    def forget(self) -> None:
        """Drop every baseline (a new successor, or a new term)."""
        self._first.clear()
