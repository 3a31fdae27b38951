"""The candidates of a role as one candidate knows them, and its place in line.

Pure bookkeeping on the candidate's own monotonic clock, fed by the roster
messages (``hello``, ``here``, ``known``, ``bye``) and by the leader records
seen in the key. It answers one question: when the role falls free, how long
should this candidate wait before it campaigns?

* Preferred candidates first: every priority point below the best live
  candidate costs ``priority_step``.
* Among equals, a fixed order (by id) instead of a random one: the first in
  line campaigns at once, the k-th waits ``k`` steps plus a random jitter, so
  a hand-over costs one wake-up and one write while a herd is still spread
  out should the first in line be gone.
* Entries expire: followers re-announce themselves every heartbeat, and one
  not heard of for ``expiry`` seconds is dropped, so crashed candidates do not
  keep live ones waiting. The holder of the record that just ended is not in
  line either.
* A reconnect starts the roster afresh (:meth:`Roster.reset`): a ``bye`` sent
  while the connection or the server was down is lost, and a candidate that
  left then would otherwise keep its place for ``expiry`` seconds. Each
  candidate announces itself again after its reconnect, so only the live ones
  come back.

The roster only orders campaigns after a release: it never affects safety
(taking the key is still one atomic create, whoever campaigns first).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Roster"]


@dataclass
class Roster:
    """Who campaigns for a role, as far as this candidate has heard.

    Args:
        own_id: This candidate's id (always in line, never expires).
        own_priority: This candidate's priority.
        expiry: Seconds an entry lives without news of it.

    """

    own_id: str
    own_priority: int
    expiry: float
    _entries: dict[str, tuple[int, float]] = field(default_factory=dict)

    def heard(self, candidate_id: str, priority: int, now: float) -> None:
        """A candidate announced itself (or holds the key) at ``now``."""
        if candidate_id != self.own_id:
            self._entries[candidate_id] = (priority, now)

    def knows(self, candidate_id: str) -> bool:
        """Whether ``candidate_id`` has an entry (expired or not)."""
        return candidate_id == self.own_id or candidate_id in self._entries

    def forget(self, candidate_id: str) -> None:
        """Drop a candidate that said goodbye or whose term ended unrenewed."""
        self._entries.pop(candidate_id, None)

    def reset(self) -> None:
        """Forget every other candidate (after a reconnect: the live ones re-announce)."""
        self._entries.clear()

    def live(self, now: float) -> dict[str, int]:
        """Every candidate heard of within ``expiry`` (and this one): id -> priority."""
        for candidate_id, (_, heard_at) in list(self._entries.items()):
            if now - heard_at > self.expiry:
                del self._entries[candidate_id]
        out = {candidate_id: priority for candidate_id, (priority, _) in self._entries.items()}
        out[self.own_id] = self.own_priority
        return out

    def place(self, now: float, *, leaving: str | None = None) -> tuple[int, int]:
        """This candidate's place in line for the next term.

        Args:
            now: The candidate's clock.
            leaving: The holder of the term that is ending (not in line).

        Returns:
            ``(points, rank)``: priority points below the best live candidate,
            and how many live candidates of this priority come first (by id).

        """
        live = self.live(now)
        if leaving is not None and leaving != self.own_id:
            live.pop(leaving, None)
        best = max(live.values())
        rank = sum(
            1
            for candidate_id, priority in live.items()
            if priority == self.own_priority and candidate_id < self.own_id
        )
        return max(0, best - self.own_priority), rank

    def first_in_line(self, now: float, *, excluded: frozenset[str] = frozenset()) -> str | None:
        """The live candidate (not this one) that would campaign first for the next term.

        The leader's choice of a designated successor: the same order the
        followers keep among themselves (priority, then id).

        Args:
            now: The candidate's clock.
            excluded: Candidates not to choose.

        Returns:
            Its id, or ``None`` when no other live candidate is known.

        """
        live = self.live(now)
        live.pop(self.own_id, None)
        eligible = [(-priority, cid) for cid, priority in live.items() if cid not in excluded]
        return min(eligible)[1] if eligible else None
