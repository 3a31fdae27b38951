"""A TTL change's marks on the two buckets: one leader per role through the roll.

A bucket's ``max_age`` is its elections' TTL, so a new TTL means a new
bucket, and while the replicas roll over, some campaign on the old bucket and
some on the new one. Two buckets could each give the role a leader; the
marks make them one election:

* ``bucket --migrate-from OLD`` first marks ``OLD`` *moved to* ``NEW`` (its
  stream's description), then creates ``NEW`` marked *migrated from* ``OLD``
  (in the same create, so no replica ever sees ``NEW`` unmarked; it
  refuses a ``NEW`` it did not create, which a replica may have opened
  unmarked).
* A replica on ``OLD`` never starts a term once ``OLD`` is moved (while
  ``NEW`` exists and names ``OLD``; deleting ``NEW`` undoes the move). It
  reads the mark after each won create, before it acts as leader, and gives
  the key back if it finds it. The leader ``OLD`` had
  when it was moved stays leader until it stops (or its term ends).
* A replica on ``NEW`` does not campaign while ``OLD`` holds a term for the
  role: it reads ``OLD``'s key first, and waits for that term to end (a
  release deletes it, a crash lets it expire). Once it has seen ``OLD`` free
  of the role, it never looks again.

Why no two leaders: a replica on ``NEW`` campaigns only after it read
``OLD``'s key absent at some time ``t1``, after the move (it started after
the migration, which marked ``OLD`` before ``NEW`` existed). A term on ``OLD``
created before ``t1`` had ended by ``t1`` (its key was gone: released after
its leader's demote callbacks, or expired after its leader's validity ran
out, the expiry argument of docs/design.md). A term created on ``OLD`` after
``t1`` is created after the move, and its candidate reads the mark after its
create, so it sees it and never acts. On ``NEW`` itself the election is the
usual one.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MARK", "BucketMarks"]

#: The first word of a description that carries marks.
MARK = "celery-nats-leader"
_MOVED_TO, _MIGRATED_FROM = "moved-to=", "migrated-from="


@dataclass(frozen=True)
class BucketMarks:
    """What a bucket's description says about a TTL change.

    Attributes:
        moved_to: The bucket the replicas move to (this one is the old one).
        migrated_from: The bucket the replicas come from (this one is the new one).

    """

    moved_to: str | None = None
    migrated_from: str | None = None

    @classmethod
    def parse(cls, description: str) -> BucketMarks:
        """The marks in a stream description (none for any other description)."""
        words = description.split()
        if not words or words[0] != MARK:
            return cls()
        moved_to = migrated_from = None
        for word in words[1:]:
            if word.startswith(_MOVED_TO):
                moved_to = word[len(_MOVED_TO) :] or None
            elif word.startswith(_MIGRATED_FROM):
                migrated_from = word[len(_MIGRATED_FROM) :] or None
        return cls(moved_to=moved_to, migrated_from=migrated_from)

    def describe(self) -> str:
        """The description that carries these marks (empty when there are none)."""
        words = [MARK]
        if self.migrated_from:
            words.append(_MIGRATED_FROM + self.migrated_from)
        if self.moved_to:
            words.append(_MOVED_TO + self.moved_to)
        return " ".join(words) if len(words) > 1 else ""
