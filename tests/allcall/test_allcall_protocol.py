"""The ALLCALL wire format, ranks, claim ordering and epochs (pure functions)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from celery_nats_leader.election.allcall_protocol import (
    Claim,
    Member,
    Message,
    MessageFormatError,
    claim_better,
    claim_valid,
    decode_message,
    encode_message,
    new_epoch,
    rank_of,
)
from celery_nats_leader.term.token import ALLCALL_EPOCH_FLOOR

SKEW = 1.0


def claim(
    name: str, expires: float, *, priority: int = 0, tiebreak: int = 1, epoch: int = 7
) -> Claim:
    return Claim(
        id=name,
        priority=priority,
        tiebreak=tiebreak,
        epoch=epoch,
        token=f"t-{name}-{epoch}",
        expires=expires,
        meta={"hostname": "h"},
    )


def test_messages_round_trip() -> None:
    message = Message(
        kind="reply",
        seq=42,
        sender=Member(id="a:1:ff", priority=-3, tiebreak=2**127 + 5, eligible=True),
        claim=claim("b", 1700000010.25, tiebreak=2**100),
        max_epoch=1700000000123,
        to="c",
    )
    assert decode_message(encode_message(message)) == message
    bare = Message(kind="allcall", seq=1, sender=Member("a", 0, 0), claim=None, max_epoch=0)
    assert decode_message(encode_message(bare)) == bare
    body = json.loads(encode_message(message))
    assert body["v"] == 1 and body["from"]["tiebreak"] == f"{2**127 + 5:032x}"


def _valid() -> dict[str, object]:
    return json.loads(
        encode_message(
            Message(
                kind="allcall",
                seq=1,
                sender=Member("a", 0, 1),
                claim=claim("a", 10.0),
                max_epoch=7,
            )
        )
    )


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda b: b.update(v=2), "wire version"),
        (lambda b: b.update(kind="vote"), "unknown kind"),
        (lambda b: b.update(seq="1"), "seq"),
        (lambda b: b.update({"from": None}), "from"),
        (lambda b: b["from"].update(id=""), "from.id"),
        (lambda b: b["from"].update(tiebreak="xyz"), "from.tiebreak"),
        (lambda b: b["from"].update(tiebreak="-1"), "from.tiebreak"),
        (lambda b: b["from"].update(tiebreak="f" * 33), "from.tiebreak"),
        (lambda b: b["claim"].update(expires="soon"), "claim.expires"),
        (lambda b: b["claim"].update(expires=float("inf")), "claim.expires"),
        (lambda b: b["claim"].update(epoch=0), "claim.epoch"),
        (lambda b: b["claim"].update(epoch=True), "claim.epoch"),
        (lambda b: b["claim"].update(token=5), "claim.token"),
        (lambda b: b.update(claim=[]), "claim"),
        (lambda b: b.update(to=3), "to"),
    ],
)
def test_malformed_messages_are_rejected(change: object, fragment: str) -> None:
    body = _valid()
    change(body)  # type: ignore[operator]
    with pytest.raises(MessageFormatError, match=fragment):
        decode_message(json.dumps(body).encode())


@pytest.mark.parametrize("data", [b"", b"\xff", b"[]", b"null", b"{}"])
def test_non_messages_are_rejected(data: bytes) -> None:
    with pytest.raises(MessageFormatError):
        decode_message(data)


def test_higher_priority_means_lower_rank() -> None:
    assert rank_of(10, 2**127, "z") < rank_of(0, 0, "a")
    assert rank_of(0, 1, "z") < rank_of(0, 2, "a")  # then the tie-breaker
    assert rank_of(0, 1, "a") < rank_of(0, 1, "b")  # then the id: a strict order
    assert Member("a", 3, 9).rank == rank_of(3, 9, "a")


def test_a_lease_is_honoured_until_expiry_plus_skew() -> None:
    c = claim("a", 100.0)
    assert claim_valid(c, 100.5, SKEW)
    assert not claim_valid(c, 101.0, SKEW)
    assert not claim_valid(c, 100.0, 0.0)


def test_later_expiry_wins_beyond_the_skew() -> None:
    preferred = claim("a", 100.0, priority=10)
    later = claim("b", 101.5, priority=0)
    assert claim_better(later, preferred, SKEW)
    assert not claim_better(preferred, later, SKEW)


def test_expiries_within_the_skew_are_equal_and_rank_decides() -> None:
    preferred = claim("a", 100.0, priority=10)
    later = claim("b", 100.9, priority=0)
    assert claim_better(preferred, later, SKEW)
    assert not claim_better(later, preferred, SKEW)


def test_same_leader_newer_term_or_later_expiry_wins() -> None:
    old = claim("a", 100.0, epoch=7)
    assert claim_better(claim("a", 99.0, epoch=8), old, SKEW)  # a newer term
    assert claim_better(claim("a", 100.5, epoch=7), old, SKEW)  # a renewal
    assert not claim_better(claim("a", 99.0, epoch=7), old, SKEW)


names = st.sampled_from(["a", "b", "c"])
claims = st.builds(
    claim,
    names,
    st.floats(min_value=0, max_value=50, allow_nan=False),
    priority=st.integers(-2, 2),
    tiebreak=st.integers(0, 3),
    epoch=st.integers(1, 4),
)


@given(claims, claims, st.floats(min_value=0, max_value=5, allow_nan=False))
def test_two_claims_never_both_beat_each_other(a: Claim, b: Claim, skew: float) -> None:
    """Why two leaders always resolve: at most one of them yields."""
    assert not (claim_better(a, b, skew) and claim_better(b, a, skew))


@given(claims, claims, st.floats(min_value=0, max_value=5), st.floats(min_value=0, max_value=5))
def test_a_renewed_incumbent_is_never_weaker(a: Claim, b: Claim, skew: float, bump: float) -> None:
    """A leader's own expiry only grows, and that never makes a challenger win."""
    if claim_better(a, b.renewed(b.expires + bump), skew):
        assert claim_better(a, b, skew)


def test_new_epochs_exceed_everything_heard_and_follow_the_wall_clock() -> None:
    assert new_epoch(1700000000.1234, 0) == 1700000000123
    assert new_epoch(1700000000.1234, 1700000005000) == 1700000005001
    # Never below the floor that tells ALLCALL epochs from KV revisions, whatever the clock.
    assert new_epoch(0.0, 0) == ALLCALL_EPOCH_FLOOR == 10**12
