"""FollowerView: when a follower may treat a record as expired, on its own clock."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from celery_nats_leader.core.clock import ManualClock
from celery_nats_leader.election.follower_view import FollowerView

TTL = 1.0
MARGIN = 0.01


def fresh(clock: ManualClock) -> FollowerView:
    view = FollowerView(ttl=TTL, expiry_margin=MARGIN)
    view.start(clock.monotonic())
    return view


def test_a_record_expires_ttl_plus_margin_after_it_was_first_seen() -> None:
    clock = ManualClock()
    view = fresh(clock)
    assert view.observe(7, True, clock.monotonic(), delay=0.002)
    clock.advance(0.5)
    # Seen again (a resync read): the first sighting's time stands.
    assert not view.observe(7, True, clock.monotonic(), delay=0.002)
    clock.advance(TTL + MARGIN - 0.5 - 0.001)
    assert view.expired_revision(clock.monotonic()) is None
    assert not view.due(clock.monotonic())
    clock.advance(0.001)
    assert view.expired_revision(clock.monotonic()) == 7
    assert not view.due(clock.monotonic())  # this follower's delay comes on top
    clock.advance(0.002)
    assert view.due(clock.monotonic())


def test_a_renewal_restarts_the_count_and_the_old_revision_is_never_offered() -> None:
    clock = ManualClock()
    view = fresh(clock)
    view.observe(7, True, clock.monotonic(), delay=0.0)
    clock.advance(TTL - 0.1)
    assert view.observe(8, True, clock.monotonic(), delay=0.0)  # the leader renewed
    clock.advance(0.2)  # past the first record's expiry
    assert view.expired_revision(clock.monotonic()) is None
    clock.advance(TTL + MARGIN - 0.2)
    assert view.expired_revision(clock.monotonic()) == 8


def test_late_older_events_change_nothing_but_an_authoritative_read_does() -> None:
    clock = ManualClock()
    view = fresh(clock)
    view.observe(9, True, clock.monotonic(), delay=0.0)
    clock.advance(0.3)
    assert not view.observe(8, True, clock.monotonic(), delay=0.0)
    assert (view.revision, view.seen_at) == (9, 1000.0)
    # A recreated bucket starts its revisions again: a fresh read is believed.
    assert view.observe(2, True, clock.monotonic(), delay=0.0, authoritative=True)
    assert (view.revision, view.seen_at) == (2, 1000.3)


def test_a_delete_makes_the_role_free_after_this_followers_delay() -> None:
    clock = ManualClock()
    view = fresh(clock)
    view.observe(7, True, clock.monotonic(), delay=0.0)
    clock.advance(0.1)
    assert view.observe(8, False, clock.monotonic(), delay=0.003)
    assert view.expired_revision(clock.monotonic()) is None  # nothing to delete
    assert view.campaign_at == clock.monotonic() + 0.003


def test_an_empty_key_keeps_the_campaign_time_already_chosen() -> None:
    clock = ManualClock()
    view = fresh(clock)
    clock.advance(0.2)
    assert not view.observe(None, False, clock.monotonic(), delay=0.5)
    assert view.campaign_at == 1000.0
    assert view.due(clock.monotonic())


@given(
    st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=2.0),
            st.integers(min_value=1, max_value=20),
            st.booleans(),
        ),
        max_size=30,
    ),
    st.floats(min_value=0.0, max_value=3.0),
)
def test_only_the_newest_revision_is_ever_offered_and_never_early(
    events: list[tuple[float, int, bool]], tail: float
) -> None:
    clock = ManualClock()
    view = fresh(clock)
    newest = 0
    newest_first_seen = 0.0
    for step, revision, present in events:
        clock.advance(step)
        if revision > newest or (revision == newest and not view.present and present):
            newest_first_seen = clock.monotonic()
        if view.observe(revision, present, clock.monotonic(), delay=0.0):
            newest = revision
        offered = view.expired_revision(clock.monotonic())
        assert offered in (None, newest)
    clock.advance(tail)
    offered = view.expired_revision(clock.monotonic())
    if offered is not None:
        assert offered == newest == view.revision
        assert clock.monotonic() >= newest_first_seen + TTL + MARGIN
