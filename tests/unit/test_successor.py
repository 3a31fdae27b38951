"""The designated successor's arithmetic (election/successor.py), case by case.

Each case of the fast-failover argument (docs/design.md) that the pure
bookkeeping decides: what a successor promises, when it may take over, and
until when the leader may count on it. Times are plain numbers: the
successor's clock and the leader's clock are separate arguments.
"""

from __future__ import annotations

import math

import pytest

from celery_nats_leader.core import constants as c
from celery_nats_leader.election.roster import Roster
from celery_nats_leader.election.successor import (
    PromiseLedger,
    RateCheck,
    SuccessorBounds,
    candidate_digest,
)
from celery_nats_leader.term.record import decode_record, encode_record

G = c.PROMISE_GRACE_SECONDS
RHO = c.CLOCK_RATE_BOUND
MARGIN = c.PROMISE_MARGIN_SECONDS


def ledger() -> PromiseLedger:
    return PromiseLedger(grace=G)


def bounds() -> SuccessorBounds:
    return SuccessorBounds(grace=G, rate_bound=RHO, margin=MARGIN)


# ------------------------------------------------------------ the successor


def test_a_successor_waits_a_grace_after_first_seeing_its_designation() -> None:
    book = ledger()
    book.saw(10, "s", "n1", "s", now=100.0)
    assert book.takeover_at("n1") == 100.0 + G
    # Renewals carry the same nonce: the first sighting's time stands.
    book.saw(11, "s", "n1", "s", now=105.0)
    assert book.takeover_at("n1") == 100.0 + G


def test_a_new_designation_restarts_the_wait_even_for_the_same_successor() -> None:
    """A -> B -> A, with the watch skipping B: the new nonce restarts the wait.

    Keyed on the successor's id alone, the second designation would inherit
    the first sighting's time, and the successor could take over at once,
    while the leader counts the wait from the second designation's send.
    """
    book = ledger()
    book.saw(10, "s", "n1", "s", now=100.0)
    book.saw(14, "s", "n2", "s", now=200.0)
    assert book.takeover_at("n2") == 200.0 + G
    assert book.takeover_at("n1") == math.inf  # the old designation is over


def test_a_successor_not_named_never_takes_over_fast() -> None:
    book = ledger()
    book.saw(10, "other", "n1", "s", now=100.0)
    assert book.takeover_at("n1") == math.inf
    assert book.takeover_at(None) == math.inf


def test_every_promise_postpones_the_takeover_by_the_grace_from_its_receipt() -> None:
    book = ledger()
    book.saw(10, "s", "n1", "s", now=100.0)
    assert book.promise(100.5, epoch=10, known_epoch=10)
    assert book.takeover_at("n1") == 100.5 + G
    # A promise that arrives late (an older request) never shortens one given.
    assert book.promise(100.2, epoch=10, known_epoch=10)
    assert book.takeover_at("n1") == 100.5 + G


def test_no_promise_while_a_takeover_write_may_still_land() -> None:
    """A timed-out takeover is final until a later revision says how it ended."""
    book = ledger()
    book.saw(10, "s", "n1", "s", now=100.0)
    book.attempting(10)
    assert not book.promise(101.0, epoch=10, known_epoch=10)
    assert book.takeover_at("n1", 11) == math.inf
    # The same write on the same revision may be sent again (no promise
    # was given since; if the first landed, the retry fails on the revision).
    assert book.takeover_at("n1", 10) == 100.0 + G
    book.saw(10, "s", "n1", "s", now=101.5)  # the same revision again: still unknown
    assert not book.promise(101.6, epoch=10, known_epoch=10)
    book.saw(12, "s", "n1", "s", now=102.0)  # a newer revision: resolved
    assert book.promise(102.1, epoch=12, known_epoch=12)


def test_no_promise_to_a_leader_of_an_older_term() -> None:
    book = ledger()
    assert not book.promise(100.0, epoch=7, known_epoch=9)
    assert book.promised_until == 0.0
    assert book.promise(100.0, epoch=10, known_epoch=9)  # newer than seen: fine


def test_after_a_reconnect_the_successor_stays_quiet_for_a_grace() -> None:
    book = ledger()
    book.saw(10, "s", "n1", "s", now=100.0)
    book.stay_quiet(150.0 + G)
    assert book.takeover_at("n1") == 150.0 + G


# --------------------------------------------------------------- the leader


def test_a_promise_counts_from_the_leaders_send_time_less_drift_and_margin() -> None:
    book = bounds()
    book.writing("s", new_designation=True, sent=50.0)
    book.confirmed("s")
    book.promised("s", sent=60.0)
    assert book.deadline() == pytest.approx(60.0 + G * (1 - 2 * RHO) - MARGIN)


def test_the_leader_stops_before_the_successor_may_take_over() -> None:
    """The whole fast path on two clocks: the successor's clock runs fast by RHO.

    The leader sends at its time s; the successor receives d later (real
    time) and promises until receipt + G on its own clock. The leader must
    stop, in real time, before the successor's promise ends in real time.
    """
    for delay in (0.0, 0.001, 0.3):
        leader = bounds()
        leader.writing("s", new_designation=True, sent=0.0)
        leader.confirmed("s")
        leader.promised("s", sent=10.0)
        # Real time of the leader's stop: its clock runs slow by RHO.
        stop_real = leader.deadline() / (1 - RHO)
        # The successor's clock runs fast by RHO: G of it is G / (1 + RHO) real.
        takeover_real = 10.0 + delay + G / (1 + RHO)
        assert stop_real < takeover_real - MARGIN / 2


def test_no_successor_named_leaves_the_lease_alone() -> None:
    book = bounds()
    assert book.deadline() == math.inf
    assert not book.named


def test_a_new_designation_counts_as_a_promise_from_its_send() -> None:
    """The successor counts its wait from its first sighting, after the send."""
    book = bounds()
    book.writing("s", new_designation=True, sent=100.0)
    assert book.deadline() == pytest.approx(100.0 + G * (1 - 2 * RHO) - MARGIN)


def test_a_resent_designation_does_not_extend_the_bound() -> None:
    """A retransmission of a nonce already sent may have been seen long before."""
    book = bounds()
    book.writing("s", new_designation=True, sent=100.0)
    first = book.deadline()
    book.writing("s", new_designation=False, sent=130.0)
    assert book.deadline() == first


def test_while_a_change_of_successor_is_unconfirmed_both_bind_the_leader() -> None:
    """Either revision may be the key's: the old successor may still CAS on its own."""
    book = bounds()
    book.writing("a", new_designation=True, sent=100.0)
    book.confirmed("a")
    book.promised("a", sent=105.0)
    book.writing("b", new_designation=True, sent=105.1)  # in flight, or timed out
    a_bound = 105.0 + G * (1 - 2 * RHO) - MARGIN
    assert book.deadline() == pytest.approx(a_bound)
    book.confirmed("b")  # a's revision can no longer be CASed on
    assert book.deadline() == pytest.approx(105.1 + G * (1 - 2 * RHO) - MARGIN)


def test_a_confirmed_record_without_successor_ends_the_promises_role() -> None:
    book = bounds()
    book.writing("a", new_designation=True, sent=100.0)
    book.confirmed("a")
    book.writing(None, new_designation=False, sent=100.4)
    assert book.deadline() < math.inf  # not confirmed yet: a may still CAS
    book.confirmed(None)
    assert book.deadline() == math.inf


# -------------------------------------------------------- the clock check


def test_answers_drifting_faster_than_the_rate_bound_are_refused() -> None:
    check = RateCheck(rate_bound=RHO)
    assert check.plausible("s/1", sent=0.0, received=1000.0, answered=0.002)
    # 100 s later on the leader's clock, 100.5 s later on the successor's:
    # 0.5 % drift, within 1 % (plus the round trips).
    assert check.plausible("s/1", sent=100.0, received=1100.5, answered=100.002)
    # 3 % fast: refused.
    assert not check.plausible("s/1", sent=200.0, received=1206.0, answered=200.002)
    # A restarted successor (a new run) starts afresh.
    assert check.plausible("s/2", sent=200.0, received=5.0, answered=200.002)


def test_a_clock_that_starts_drifting_late_is_still_caught() -> None:
    """The baseline moves on: a drift that starts after hours is measured from then."""
    check = RateCheck(rate_bound=RHO)
    assert check.plausible("s/1", sent=0.0, received=0.0, answered=0.001)
    for hour in range(1, 4):  # three good hours
        t = hour * 3600.0
        assert check.plausible("s/1", sent=t, received=t, answered=t + 0.001)
    start = 3 * 3600.0
    # Then 3 % fast: refused within minutes, not after hours of allowance.
    assert not check.plausible(
        "s/1", sent=start + 60, received=start + 61.8, answered=start + 60.001
    )


# ------------------------------------------------------- record and roster


def test_the_record_carries_the_designation_and_old_records_carry_none() -> None:
    value = encode_record(
        instance_id="l", token="t", epoch=4, priority=0, meta={}, successor="s", successor_nonce="n"
    )
    record = decode_record(value, 9)
    assert (record.successor, record.successor_nonce) == ("s", "n")
    plain = encode_record(instance_id="l", token="t", epoch=4, priority=0, meta={})
    assert b"successor" not in plain
    assert decode_record(plain, 9).successor is None
    # Malformed: no successor (nobody takes over fast; the lease still holds).
    broken = plain[:-1] + b',"successor":{"id":"s"}}'
    assert decode_record(broken, 9).successor is None


def test_the_leader_designates_the_first_in_line() -> None:
    roster = Roster(own_id="l", own_priority=0, expiry=10.0)
    assert roster.first_in_line(0.0) is None
    roster.heard("c", 0, 0.0)
    roster.heard("b", 0, 0.0)
    roster.heard("z", 5, 0.0)
    assert roster.first_in_line(1.0) == "z"
    assert roster.first_in_line(1.0, excluded=frozenset({"z"})) == "b"
    assert roster.first_in_line(20.0) is None  # all expired


def test_promise_subjects_are_one_token_whatever_the_id() -> None:
    digest = candidate_digest("web-3.example.com:4121:9f2c")
    assert "." not in digest and len(digest) == 20
    assert digest != candidate_digest("web-3.example.com:4121:9f2d")


def test_a_dropped_successor_is_asked_again_only_after_its_old_bound_ended() -> None:
    """Designation bounds are kept per candidate, not per nonce: sound only so.

    A candidate dropped (a write naming none) is named again no sooner than
    ``PROMISE_RETRY_SECONDS`` later; by then its bound from the earlier
    designation has ended the term, or the write naming none is confirmed
    and no revision naming its old nonce can be written on.
    """
    assert bounds().promise_worth < c.PROMISE_RETRY_SECONDS


def test_services_get_the_promise_margin_with_fast_failover() -> None:
    from celery_nats_leader import ElectionConfig
    from celery_nats_leader.election.leader_services import default_grace

    assert default_grace(ElectionConfig(ttl=10)) == pytest.approx(1.0)
    fast = ElectionConfig(ttl=10, fast_failover=True)
    assert default_grace(fast) == pytest.approx(c.PROMISE_MARGIN_SECONDS)
