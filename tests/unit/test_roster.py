"""Roster: a candidate's place in line when the role falls free."""

from __future__ import annotations

from celery_nats_leader.core.clock import ManualClock
from celery_nats_leader.election.roster import Roster


def test_equals_queue_by_id_and_the_leaving_holder_is_not_in_line() -> None:
    clock = ManualClock()
    roster = Roster(own_id="c", own_priority=0, expiry=1.5)
    for name in ("a", "b", "d"):
        roster.heard(name, 0, clock.monotonic())
    assert roster.place(clock.monotonic()) == (0, 2)
    assert roster.place(clock.monotonic(), leaving="a") == (0, 1)
    roster.forget("b")
    assert roster.place(clock.monotonic(), leaving="a") == (0, 0)


def test_preferred_candidates_come_first_by_priority_points() -> None:
    clock = ManualClock()
    roster = Roster(own_id="low", own_priority=2, expiry=1.5)
    roster.heard("high", 5, clock.monotonic())
    roster.heard("same", 2, clock.monotonic())
    assert roster.place(clock.monotonic()) == (3, 0)
    # The preferred one was the leader whose term ends: it is not in line.
    assert roster.place(clock.monotonic(), leaving="high") == (0, 0)


def test_candidates_not_heard_of_for_the_expiry_drop_out_of_line() -> None:
    clock = ManualClock()
    roster = Roster(own_id="z", own_priority=0, expiry=1.5)
    roster.heard("crashed", 9, clock.monotonic())
    roster.heard("alive", 0, clock.monotonic())
    clock.advance(1.0)
    roster.heard("alive", 0, clock.monotonic())  # it announced itself again
    assert roster.place(clock.monotonic()) == (9, 1)
    clock.advance(0.6)
    assert roster.place(clock.monotonic()) == (0, 1)
    assert roster.live(clock.monotonic()) == {"alive": 0, "z": 0}
    clock.advance(1.0)
    assert roster.place(clock.monotonic()) == (0, 0)
    assert roster.knows("z") and not roster.knows("crashed")


def test_a_reset_keeps_only_the_candidate_itself_until_others_announce_again() -> None:
    clock = ManualClock()
    roster = Roster(own_id="c", own_priority=0, expiry=1.5)
    roster.heard("gone", 9, clock.monotonic())
    roster.heard("alive", 0, clock.monotonic())
    roster.reset()  # the connection came back
    assert roster.place(clock.monotonic()) == (0, 0)
    roster.heard("alive", 0, clock.monotonic())  # its hello after its own reconnect
    assert roster.live(clock.monotonic()) == {"alive": 0, "c": 0}
    assert roster.place(clock.monotonic()) == (0, 1)
