"""Fast failover (``fast_failover=True``) against a real nats-server, TTL 10 s.

Every candidate is a process; its event times are this host's monotonic
clock, as the test's are, so "the old leader stopped before the successor
started" is a comparison of two numbers. Without fast failover each of these
failovers takes about the TTL (9 s and more); with it, about a second. The
safety side: a leader that can no longer reach its successor (paused,
partitioned) stops counting on its promises before the successor's run out.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from celery_nats_leader.testing import NatsServer, ThreadedFaultProxy
from tests.harness.candidate_control import CandidateEvent, CandidateGroup
from tests.integration.helpers import BUCKET, ROLE, create_bucket

pytestmark = pytest.mark.integration

#: Long enough that a failover by the lease is unmistakable.
FAST_TTL = 10.0
#: The successor's wait (PROMISE_GRACE_SECONDS) plus a write and a busy host.
CRASH_BOUND = 2.0
#: A frozen or cut-off leader: the same, plus the fault's own detection.
FAULT_BOUND = 3.0


@pytest.fixture
async def fast_group(nats_server: NatsServer) -> Iterator[CandidateGroup]:
    await create_bucket(nats_server.url, ttl=FAST_TTL)
    with CandidateGroup(
        nats_server.url,
        role=ROLE,
        bucket=BUCKET,
        ttl=FAST_TTL,
        log_level="INFO",
        # The users' reconnect wait (0.5 s), not the other tests' 0.1 s: the
        # outage test measures what a restart costs as deployed.
        reconnect_wait=None,
    ) as made:
        yield made


def designated(group: CandidateGroup, leader: str, timeout: float = 10.0) -> str:
    """Wait until ``leader``'s record names a successor; return it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        successor = group.status(leader).get("successor")
        if successor:
            return str(successor)
        group.wait_for("renewed", {leader}, timeout=timeout, after=time.monotonic())
    raise AssertionError(f"{leader} named no successor within {timeout}s")


def leader_with_followers(
    group: CandidateGroup, *, leader_url: str | None = None, fast: bool = True
) -> CandidateEvent:
    """``a`` leads (through ``leader_url``, if given), ``b`` and ``c`` follow."""
    flags = ["--fast-failover"] if fast else []
    group.spawn("a", url=leader_url, extra_args=flags)
    first = group.wait_for("promoted", {"a"}, timeout=FAST_TTL)
    for name in ("b", "c"):
        group.spawn(name, extra_args=flags)
    group.wait_for_all("ready", ["b", "c"])
    return first


def leader_with_successor(
    group: CandidateGroup, *, leader_url: str | None = None
) -> tuple[CandidateEvent, str]:
    """As :func:`leader_with_followers`, with fast failover; ``a`` names a successor."""
    first = leader_with_followers(group, leader_url=leader_url)
    return first, designated(group, "a")


def test_a_killed_leader_is_replaced_by_its_successor_in_about_a_second(
    fast_group: CandidateGroup,
) -> None:
    first, successor = leader_with_successor(fast_group)

    killed_at = fast_group["a"].kill()
    second = fast_group.wait_for("promoted", {"b", "c"}, timeout=FAST_TTL + 2)

    failover = second.at - killed_at
    assert second.name == successor
    assert failover < CRASH_BOUND, f"failover took {failover:.3f}s at TTL {FAST_TTL}"
    assert second["epoch"] > first["epoch"]
    assert fast_group.validate(second.name)
    assert fast_group.overlap({"a": killed_at}) == 0.0
    # The new leader names a successor of its own: the next crash is fast too.
    assert designated(fast_group, second.name) == ({"b", "c"} - {second.name}).pop()


def test_a_paused_leader_has_stopped_leading_when_it_resumes(
    fast_group: CandidateGroup,
) -> None:
    _, successor = leader_with_successor(fast_group)

    paused_at = fast_group["a"].pause()
    second = fast_group.wait_for("promoted", {"b", "c"}, timeout=FAST_TTL + 2)
    assert second.name == successor
    assert second.at - paused_at < FAULT_BOUND
    fast_group["a"].resume()

    # Its KV lease (TTL 10 s) still runs: the promises' bound, counted from
    # before the pause, has ended the term. On resume the deadline timer is
    # due before the watch's news of the successor is read, so the reason
    # says which ended it (with the KV lease alone: "revision_changed").
    demoted = fast_group.wait_for("demoted", {"a"}, timeout=5)
    assert demoted["reason"] == "lease_expired"
    assert fast_group.status("a")["is_leader"] is False
    assert fast_group.validate("a") is False
    assert fast_group.validate(second.name) is True


def test_a_leader_cut_off_from_nats_stops_before_its_successor_starts(
    fast_group: CandidateGroup, proxy: ThreadedFaultProxy
) -> None:
    _, successor = leader_with_successor(fast_group, leader_url=proxy.url)

    cut_at = time.monotonic()
    proxy.blackhole()
    second = fast_group.wait_for("promoted", {"b", "c"}, timeout=FAST_TTL + 2)
    demoted = fast_group.wait_for("demoted", {"a"}, timeout=5)

    assert second.name == successor
    assert second.at - cut_at < FAULT_BOUND, f"failover took {second.at - cut_at:.3f}s"
    # The leader's connection still looks up to it (packets vanish): only
    # the missing promises stop it, and before the successor starts.
    assert demoted["reason"] == "lease_expired"
    assert demoted.at < second.at, (demoted, second)
    proxy.heal()
    assert fast_group.validate(second.name)
    assert fast_group.overlap() == 0.0


@pytest.mark.parametrize("outage", [0.0, 2.0], ids=["restart", "2s-outage"])
@pytest.mark.parametrize("fast", [False, True], ids=["lease-only", "fast"])
def test_what_a_nats_outage_costs_the_term_with_and_without_fast_failover(
    nats_server: NatsServer, fast_group: CandidateGroup, fast: bool, outage: float
) -> None:
    """The trade-off fast failover makes, measured on a single server.

    A restart (down for a few hundred milliseconds) costs neither a term.
    A 2-s outage: the lease (TTL 10 s, disconnect grace 5 s) carries the
    leader over it; with fast failover its promises run out, it steps down,
    and the role gets a new term once NATS is back. Never two leaders.
    """
    first = leader_with_followers(fast_group, fast=fast)
    if fast:
        designated(fast_group, "a")

    down_at = time.monotonic()
    if outage:
        nats_server.stop()
        time.sleep(outage)  # the outage itself: nothing to wait for
        nats_server.start()
    else:
        nats_server.restart()
    for name in ("a", "b", "c"):
        fast_group.wait_for("reconnected", {name}, timeout=10, after=down_at)
    deadline = time.monotonic() + FAST_TTL
    while True:
        views = [fast_group.status(name) for name in ("a", "b", "c")]
        leaders = [view["id"] for view in views if view["is_leader"]]
        if len(leaders) == 1 and {view["leader_id"] for view in views} == set(leaders):
            break
        assert time.monotonic() < deadline, views
    if fast and outage:
        # A candidate answers `status` as leader as soon as its term began,
        # before its on_promote callback has printed the event: awaited.
        promoted = fast_group.wait_for("promoted", timeout=5, after=down_at)
        assert promoted.name == leaders[0]
        promotions = [e for e in fast_group.events("promoted") if e.at > down_at]
        assert promotions == [promoted], promotions
        assert fast_group.overlap() == 0.0
        demoted = fast_group.wait_for("demoted", {"a"}, timeout=1)
        assert demoted["reason"] == "lease_expired"
        # It stopped within its promises' worth of the outage's start.
        assert demoted.at - down_at < 1.0
    else:
        # The same term (a new one would have a new epoch) and no promotion.
        assert leaders == ["a"]
        assert fast_group.status("a")["epoch"] == first["epoch"]
        assert [e for e in fast_group.events("promoted") if e.at > down_at] == []
        assert fast_group.overlap() == 0.0
