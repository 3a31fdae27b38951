"""A follower's view of a role's key: what it saw, since when, and when to act.

Pure arithmetic on the follower's own monotonic clock, with no I/O and no
asyncio: the election feeds it what the watch, reads and writes report, and
asks it when to campaign and which revision may be deleted as expired.

Follower-driven expiry: a record at revision ``R`` that this follower first
saw at ``t`` (its own clock) and that nothing newer replaced by
``t + ttl + margin`` is over. The follower may then delete the key
*conditionally at R* and campaign, without waiting for the server's
``max_age`` timer (which fires up to ~250 ms late on nats-server 2.10+). The
safety argument (docs/design.md): ``R`` was stored before anyone could see it,
so ``t >= store(R) >= send(R)``; the leader of ``R`` stopped leading at
``send(R) + ttl - lease_margin`` on its own clock; and the delete names ``R``,
so a renewal (a newer revision) is never removed, however late the follower
learns of it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FollowerView"]


@dataclass
class FollowerView:
    """What one follower knows of one key.

    Args:
        ttl: The election TTL, seconds.
        expiry_margin: Seconds added to the TTL before a record seen unchanged
            counts as expired.

    Attributes:
        revision: Latest revision seen (``0``: none yet).
        present: Whether that revision holds a record (not a delete).
        seen_at: When ``revision`` was first seen, on the follower's clock.
        campaign_at: When to campaign next, on the follower's clock.
        free_revision: The revision of the delete the key was last seen to
            hold (a candidate may write right after it), or ``None``.

    """

    ttl: float
    expiry_margin: float
    revision: int = 0
    present: bool = False
    seen_at: float = 0.0
    campaign_at: float = 0.0
    free_revision: int | None = None

    def start(self, now: float) -> None:
        """Nothing is known yet: campaign as soon as the key is found empty."""
        self.revision = 0
        self.present = False
        self.seen_at = now
        self.campaign_at = now
        self.free_revision = None

    def observe(
        self,
        revision: int | None,
        present: bool,
        now: float,
        delay: float,
        *,
        authoritative: bool = False,
    ) -> bool:
        """Take note of the key's state as a watch event, a read or a write reported it.

        Args:
            revision: The entry's revision, ``None`` when a read found no entry.
            present: Whether the key holds a record (``False`` for a delete or nothing).
            now: The follower's clock.
            delay: This follower's campaign delay (priority order and jitter).
            authoritative: A fresh read: accept it even if its revision is
                older than one seen (a bucket recreated, a server restored).

        Returns:
            ``True`` if this is news (a new revision, or the key came or went);
            ``False`` for a repeat or a late, older event, which change nothing.

        """
        if revision is not None and revision < self.revision and not authoritative:
            return False  # an older event delivered late
        if revision is not None and revision == self.revision and self.present:
            return False  # seen already: the first sighting's time stands
        if revision is None and not self.present and self.revision == 0:
            return False  # still empty: keep the campaign time already chosen
        if revision is not None:
            self.revision = revision
        self.free_revision = revision if not present else None
        self.present = present
        self.seen_at = now
        # A record can only be over ttl after we first saw it; an empty key
        # is free now (after our place in the queue).
        self.campaign_at = (self.expires_at + delay) if present else (now + delay)
        return True

    @property
    def expires_at(self) -> float:
        """When the record seen counts as expired (meaningful while ``present``)."""
        return self.seen_at + self.ttl + self.expiry_margin

    def expired_revision(self, now: float) -> int | None:
        """The revision this follower may delete conditionally as expired, if any.

        Args:
            now: The follower's clock.

        Returns:
            ``revision`` once a present record has gone unrenewed past
            :attr:`expires_at`; otherwise ``None``.

        """
        if self.present and self.revision > 0 and now >= self.expires_at:
            return self.revision
        return None

    def forget(self, now: float) -> None:
        """Count the current record's age from ``now``, conservatively.

        For a record whose first sighting can no longer be trusted (a campaign
        that found the key held by a revision it had not seen before).
        """
        self.seen_at = now

    def due(self, now: float) -> bool:
        """Whether it is time to campaign."""
        return now >= self.campaign_at

    def retry_at(self, when: float) -> None:
        """Campaign again at ``when`` (after a failed or refused attempt)."""
        self.campaign_at = when
