"""ALLCALL: constants, wire format, ranks and the claim ordering (pure, no I/O).

This module holds everything of the ALLCALL strategy that two processes must
agree on, so that :mod:`celery_nats_leader.election.allcall` is only the state machine
and its I/O. See docs/allcall.md for the algorithm.

Subjects (``<prefix>`` is ``_NATS_LEADER``, shared with the KV strategy's side
channel)::

    <prefix>.<bucket>.<role>.allcall   allcalls, and releases of a term
    <prefix>.<bucket>.<role>.allreply  replies to allcalls (broadcast)
    <prefix>.<bucket>.<role>.roster    request/reply: every candidate's describe()
    <prefix>.<bucket>.<role>.resign    request/reply: ask the leader to step down

With the ALLCALL strategy the ``bucket`` setting names no KV bucket: it only
namespaces the subjects, so that two applications sharing a NATS account can
use the same role names.

Every message is one JSON object::

    {"v": 1, "kind": "allcall" | "reply" | "release", "seq": 12,
     "from": {"id": "web-3:4121:9f2c", "priority": 0, "tiebreak": "<32 hex>",
              "eligible": true},
     "to": "<id of the allcall's issuer, replies only>",
     "claim": {"id": ..., "priority": ..., "tiebreak": ..., "epoch": 1700000000123,
               "token": "<uuid4>", "expires": 1700000010.123, "meta": {...}} | null,
     "max_epoch": 1700000000123}

``claim`` is the sender's view of the current leader; ``expires`` is a
wall-clock time (seconds since the Unix epoch) *on the clock of the host that
computed it*. Comparing it on another host is the one place where this
package compares wall clocks across hosts; it is sound only while every two
hosts' clocks differ by at most ``max_clock_skew``.
"""

from __future__ import annotations

import json
import math
import string
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from celery_nats_leader.term.token import ALLCALL_EPOCH_FLOOR

#: Version of the message layout, written into every message.
WIRE_VERSION = 1

#: Verbs of the subjects above (the last token of each subject).
ALLCALL_VERB = "allcall"
REPLY_VERB = "allreply"

#: Bits of the random tie-breaker of a rank: with 128 bits, two candidates of
#: equal priority draw the same one with probability 2**-128.
TIEBREAK_BITS = 128

#: How many released terms a candidate remembers, so that a stale copy of a
#: released claim relayed by a slower peer is not adopted again.
REMEMBERED_RELEASES = 64

Kind = Literal["allcall", "reply", "release"]
_KINDS: frozenset[str] = frozenset({"allcall", "reply", "release"})


class MessageFormatError(ValueError):
    """Raised when a message on an ALLCALL subject is not a valid ALLCALL message."""


@dataclass(frozen=True)
class Member:
    """A candidate as it introduces itself in every message it sends.

    Attributes:
        id: The candidate's instance id.
        priority: Its configured priority (higher is preferred).
        tiebreak: Its random tie-breaker, drawn once per process.
        eligible: Whether it may start a term now (past its init phase,
            connected, not sitting out after a resignation, not stopping).

    """

    id: str
    priority: int
    tiebreak: int
    eligible: bool = True

    @property
    def rank(self) -> tuple[int, int, str]:
        """The seed's rank: lower is preferred. See :func:`rank_of`."""
        return rank_of(self.priority, self.tiebreak, self.id)


@dataclass(frozen=True)
class Claim:
    """One term's leadership claim: who leads, until when, under which token.

    Attributes:
        id: The leader's instance id.
        priority: The leader's priority.
        tiebreak: The leader's tie-breaker.
        epoch: The term's epoch (the fencing token's ordered part).
        token: The term's random token value (a UUID4 string).
        expires: Wall-clock time (Unix seconds, on the clock of the host that
            computed it) at which the lease ends unless renewed.
        meta: The leader's published metadata (hostname, pid, ...).

    """

    id: str
    priority: int
    tiebreak: int
    epoch: int
    token: str
    expires: float
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def rank(self) -> tuple[int, int, str]:
        """The leader's rank: lower is preferred."""
        return rank_of(self.priority, self.tiebreak, self.id)

    @property
    def term(self) -> tuple[str, int, str]:
        """What identifies the term: ``(leader id, epoch, token)``."""
        return (self.id, self.epoch, self.token)

    def renewed(self, expires: float) -> Claim:
        """The same term with a new lease expiry."""
        return replace(self, expires=expires)


@dataclass(frozen=True)
class Message:
    """One ALLCALL message.

    Attributes:
        kind: ``allcall`` (a ping carrying the sender's view), ``reply`` (an
            answer to an allcall, broadcast) or ``release`` (the sender gives
            up the term in ``claim``, or leaves when ``claim`` is ``None``).
        seq: The sender's message counter (replies carry the allcall's).
        sender: The sender.
        claim: The sender's view of the current leader's claim, if any.
        max_epoch: The highest epoch the sender has heard of.
        to: For replies, the id of the allcall's issuer.

    """

    kind: Kind
    seq: int
    sender: Member
    claim: Claim | None
    max_epoch: int
    to: str | None = None


def rank_of(priority: int, tiebreak: int, instance_id: str) -> tuple[int, int, str]:
    """Rank a candidate: lower ranks are preferred as leader.

    Higher priority means lower rank; among equal priorities the random
    tie-breaker decides, and the instance id makes the order strict even in
    the (2**-128) event of equal tie-breakers.

    Args:
        priority: The configured priority.
        tiebreak: The random tie-breaker.
        instance_id: The instance id.

    Returns:
        A tuple that sorts like the rank.

    """
    return (-priority, tiebreak, instance_id)


def claim_valid(claim: Claim, wall_now: float, max_clock_skew: float) -> bool:
    """Whether a claim must still be honoured by a node whose wall clock reads ``wall_now``.

    A lease is honoured until ``expires + max_clock_skew`` on the local wall
    clock: the host that computed ``expires`` may be up to ``max_clock_skew``
    behind us, and its leader stops leading at ``expires`` on its own clock.

    Args:
        claim: The claim.
        wall_now: Local wall-clock time, Unix seconds.
        max_clock_skew: The configured clock-skew bound, seconds.

    Returns:
        ``True`` while the lease (plus the skew) has not run out.

    """
    return wall_now < claim.expires + max_clock_skew


def claim_better(challenger: Claim, incumbent: Claim, max_clock_skew: float) -> bool:
    """The seed's order of two *valid* claims of different terms.

    Ordered by lease expiry first (the later expiry wins: continuity of the
    term that runs longer), then by the leader's rank (lower wins). Two expiry
    times less than ``max_clock_skew`` apart cannot be told apart on clocks
    that are only synchronized to within ``max_clock_skew``, so they count as
    equal and the rank decides. For two claims of the same leader, the newer
    term (higher epoch) wins.

    Whatever the timing, two leaders comparing each other's claims can never
    both find the other's better, so a pair of leaders always resolves to one.

    Args:
        challenger: The claim just heard.
        incumbent: The claim currently held.
        max_clock_skew: The configured clock-skew bound, seconds.

    Returns:
        ``True`` if ``challenger`` should replace ``incumbent``.

    """
    if challenger.id == incumbent.id:
        return (challenger.epoch, challenger.expires) > (incumbent.epoch, incumbent.expires)
    if abs(challenger.expires - incumbent.expires) > max_clock_skew:
        return challenger.expires > incumbent.expires
    return challenger.rank < incumbent.rank


def new_epoch(wall_now: float, max_epoch_seen: int) -> int:
    """The epoch of a new term: a hybrid of wall time and every epoch heard of.

    ``max(wall milliseconds, highest epoch heard + 1)``: greater than every
    epoch this node has heard of, and (clocks permitting) greater than epochs
    of terms it never heard of that began earlier. Never below
    :data:`~celery_nats_leader.term.token.ALLCALL_EPOCH_FLOOR`, even with a wall
    clock set before 2001, so that an epoch always says which strategy made
    it (KV epochs are revisions, far below).

    Args:
        wall_now: Local wall-clock time, Unix seconds.
        max_epoch_seen: The highest epoch heard of (0 if none).

    Returns:
        The new epoch.

    """
    return max(int(wall_now * 1000), max_epoch_seen + 1, ALLCALL_EPOCH_FLOOR)


# ------------------------------------------------------------------ encoding


def encode_message(message: Message) -> bytes:
    """Serialize a message.

    Args:
        message: The message.

    Returns:
        Compact JSON bytes.

    """
    body: dict[str, Any] = {
        "v": WIRE_VERSION,
        "kind": message.kind,
        "seq": message.seq,
        "from": {
            "id": message.sender.id,
            "priority": message.sender.priority,
            "tiebreak": _hex(message.sender.tiebreak),
            "eligible": message.sender.eligible,
        },
        "claim": _claim_body(message.claim) if message.claim is not None else None,
        "max_epoch": message.max_epoch,
    }
    if message.to is not None:
        body["to"] = message.to
    return json.dumps(body, separators=(",", ":")).encode()


def decode_message(data: bytes) -> Message:
    """Parse a message received on an ALLCALL subject.

    Args:
        data: The message payload.

    Returns:
        The message.

    Raises:
        MessageFormatError: If ``data`` is not an ALLCALL message of this
            wire version.

    """
    try:
        body = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise MessageFormatError("not JSON") from exc
    if not isinstance(body, dict):
        raise MessageFormatError("not a JSON object")
    if body.get("v") != WIRE_VERSION:
        raise MessageFormatError(f"unknown wire version {body.get('v')!r}")
    kind = body.get("kind")
    if kind not in _KINDS:
        raise MessageFormatError(f"unknown kind {kind!r}")
    sender = body.get("from")
    if not isinstance(sender, dict):
        raise MessageFormatError("no 'from'")
    to = body.get("to")
    if to is not None and not isinstance(to, str):
        raise MessageFormatError("bad 'to'")
    claim_body = body.get("claim")
    return Message(
        kind=kind,
        seq=_int(body.get("seq"), "seq"),
        sender=Member(
            id=_str(sender.get("id"), "from.id"),
            priority=_int(sender.get("priority"), "from.priority"),
            tiebreak=_tiebreak(sender.get("tiebreak"), "from.tiebreak"),
            eligible=bool(sender.get("eligible", False)),
        ),
        claim=_decode_claim(claim_body) if claim_body is not None else None,
        max_epoch=_int(body.get("max_epoch", 0), "max_epoch"),
        to=to,
    )


def _claim_body(claim: Claim) -> dict[str, Any]:
    return {
        "id": claim.id,
        "priority": claim.priority,
        "tiebreak": _hex(claim.tiebreak),
        "epoch": claim.epoch,
        "token": claim.token,
        "expires": claim.expires,
        "meta": dict(claim.meta),
    }


def _decode_claim(body: object) -> Claim:
    if not isinstance(body, dict):
        raise MessageFormatError("bad 'claim'")
    expires = body.get("expires")
    if isinstance(expires, bool) or not isinstance(expires, (int, float)):
        raise MessageFormatError("bad 'claim.expires'")
    if not math.isfinite(expires):
        raise MessageFormatError("bad 'claim.expires'")
    meta = body.get("meta", {})
    epoch = _int(body.get("epoch"), "claim.epoch")
    if epoch <= 0:
        raise MessageFormatError("bad 'claim.epoch'")
    return Claim(
        id=_str(body.get("id"), "claim.id"),
        priority=_int(body.get("priority"), "claim.priority"),
        tiebreak=_tiebreak(body.get("tiebreak"), "claim.tiebreak"),
        epoch=epoch,
        token=_str(body.get("token"), "claim.token"),
        expires=float(expires),
        meta=meta if isinstance(meta, dict) else {},
    )


def _hex(value: int) -> str:
    return f"{value:032x}"


def _int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise MessageFormatError(f"bad {name!r}")
    return value


def _str(value: object, name: str) -> str:
    if not isinstance(value, str) or not value:
        raise MessageFormatError(f"bad {name!r}")
    return value


def _tiebreak(value: object, name: str) -> int:
    if (
        not isinstance(value, str)
        or not 0 < len(value) <= TIEBREAK_BITS // 4
        or value.strip(string.hexdigits)
    ):
        raise MessageFormatError(f"bad {name!r}")
    return int(value, 16)
