"""Network faults between a leader and NATS, and a restart of NATS itself.

The leader connects through a fault-injecting TCP proxy; its followers
connect directly. Every candidate is a process; their event times are the
same host's monotonic clock as the test's, so "the old leader stepped down
before the new one was promoted" is a plain comparison of two numbers.
"""

from __future__ import annotations

import time

import pytest

from celery_nats_leader.testing import NatsServer
from celery_nats_leader.testing.fault_proxy import ThreadedFaultProxy
from tests.harness.candidate_control import CandidateEvent, CandidateGroup
from tests.integration.helpers import (
    GRACE,
    HEARTBEAT,
    LEASE,
    REQUEST_TIMEOUT,
    SLACK,
    TTL,
    wait_follows,
)

pytestmark = pytest.mark.integration

FOLLOWERS = {"f1", "f2"}


def leader_behind_proxy(group: CandidateGroup, proxy: ThreadedFaultProxy) -> CandidateEvent:
    """The candidate ``cut`` leads through the proxy; ``f1``, ``f2`` follow directly."""
    group.spawn("cut", url=proxy.url)
    first = group.wait_for("promoted", {"cut"}, timeout=TTL + SLACK)
    for name in sorted(FOLLOWERS):
        group.spawn(name)
    group.wait_for_all("ready", sorted(FOLLOWERS))
    return first


def assert_steps_down_before_successor(
    demoted: CandidateEvent, successor: CandidateEvent, first: CandidateEvent
) -> None:
    # Both times are this host's monotonic clock: the old leader's belief
    # ended before anyone else's began.
    assert demoted.at < successor.at, (demoted, successor)
    assert successor["epoch"] > first["epoch"]


def test_blackholed_leader_steps_down_before_its_key_expires(
    group: CandidateGroup, bucket: str, proxy: ThreadedFaultProxy
) -> None:
    first = leader_behind_proxy(group, proxy)

    cut_at = time.monotonic()
    proxy.blackhole()
    demoted = group.wait_for("demoted", {"cut"}, timeout=LEASE + SLACK)
    successor = group.wait_for("promoted", FOLLOWERS, timeout=TTL + SLACK)

    assert demoted["reason"] in {"lease_expired", "disconnected"}
    # It kept the role while its lease lasted (a partition shorter than the
    # lease costs nothing), and gave it up on its own clock when the lease
    # (TTL - margin after its last confirmed renewal) ran out.
    assert LEASE - HEARTBEAT - REQUEST_TIMEOUT < demoted.at - cut_at < LEASE + SLACK / 2
    assert_steps_down_before_successor(demoted, successor, first)
    # The successor had to wait for the key to expire (nothing deleted it).
    assert successor.at - cut_at > TTL - HEARTBEAT - REQUEST_TIMEOUT

    proxy.heal()
    # Back on the network, the ex-leader follows the new leader.
    wait_follows(group, "cut", successor.name, timeout=TTL + 5 * SLACK)
    assert group.validate(successor.name)
    assert not group.validate("cut")
    assert group.overlap() == 0.0


def test_reset_and_refused_leader_steps_down_before_its_key_expires(
    group: CandidateGroup, bucket: str, proxy: ThreadedFaultProxy
) -> None:
    first = leader_behind_proxy(group, proxy)

    proxy.refuse()  # reconnects fail too: the server is gone for this client
    reset_at = time.monotonic()
    proxy.reset()
    demoted = group.wait_for("demoted", {"cut"}, timeout=LEASE + SLACK)
    successor = group.wait_for("promoted", FOLLOWERS, timeout=TTL + SLACK)

    assert demoted["reason"] in {"disconnected", "lease_expired"}
    assert demoted.at - reset_at < LEASE + SLACK / 2
    assert_steps_down_before_successor(demoted, successor, first)

    proxy.accept()
    wait_follows(group, "cut", successor.name, timeout=TTL + 3 * SLACK)
    assert group.validate(successor.name)
    assert group.overlap() == 0.0


def test_connection_loss_demotes_after_the_disconnect_grace_not_before(
    group: CandidateGroup, bucket: str, proxy: ThreadedFaultProxy
) -> None:
    first = leader_behind_proxy(group, proxy)

    # A blip (the client reconnects at once) is shorter than the grace: no change.
    blip_at = time.monotonic()
    proxy.reset()
    group.wait_for("disconnected", {"cut"}, timeout=SLACK, after=blip_at)
    back = group.wait_for("reconnected", {"cut"}, timeout=GRACE, after=blip_at)
    assert back.at - blip_at < GRACE
    assert group.validate("cut")
    assert group.status("cut")["epoch"] == first["epoch"]
    assert not group.events("demoted")

    proxy.refuse()
    lost_at = time.monotonic()
    proxy.reset()
    noticed = group.wait_for("disconnected", {"cut"}, timeout=SLACK, after=lost_at)
    demoted = group.wait_for("demoted", {"cut"}, timeout=GRACE + SLACK)
    assert demoted["reason"] == "disconnected"
    # Not before the grace (the connection was up until the RST), and not
    # much after it either, counted from when the client noticed.
    assert demoted.at - lost_at >= GRACE
    assert demoted.at - noticed.at < GRACE + SLACK / 2
    successor = group.wait_for("promoted", FOLLOWERS, timeout=TTL + SLACK)
    assert_steps_down_before_successor(demoted, successor, first)
    proxy.accept()
    wait_follows(group, "cut", successor.name, timeout=TTL + 3 * SLACK)
    assert [e.name for e in group.events("promoted")] == ["cut", successor.name]
    assert group.overlap() == 0.0


def test_slow_updates_past_the_lease_demote_the_leader(
    group: CandidateGroup, bucket: str, proxy: ThreadedFaultProxy
) -> None:
    first = leader_behind_proxy(group, proxy)

    # One way takes a whole lease: no renewal can be confirmed in time.
    slow_at = time.monotonic()
    proxy.delay(LEASE)
    demoted = group.wait_for("demoted", {"cut"}, timeout=LEASE + SLACK)
    # A renewal sent before the deadline can still land after it and extend
    # the key once; the successor then waits for that to expire (or for the
    # ex-leader to delete its leftover).
    successor = group.wait_for("promoted", FOLLOWERS, timeout=2 * LEASE + TTL + SLACK)

    assert demoted["reason"] == "lease_expired"
    assert demoted.at - slow_at < LEASE + SLACK / 2
    assert_steps_down_before_successor(demoted, successor, first)
    proxy.delay(0)
    assert group.validate(successor.name)
    assert group.overlap() == 0.0


def test_nats_restart_clients_reconnect_and_one_leads(
    group: CandidateGroup, bucket: str, nats_server: NatsServer
) -> None:
    names = ["a", "b", "c"]
    for name in names:
        group.spawn(name)
    group.wait_for_all("ready", names)
    group.wait_for("promoted", timeout=TTL + SLACK)

    nats_server.restart()  # same port, same store: the bucket survives

    deadline = time.monotonic() + 2 * TTL + 3 * SLACK
    while True:
        views = [group.status(name) for name in names]
        leaders = [view["id"] for view in views if view["is_leader"]]
        agreed = {view["leader_id"] for view in views}
        connections = nats_server.monitor("connz")["num_connections"]
        if len(leaders) == 1 and agreed == set(leaders) and connections == len(names):
            break
        assert time.monotonic() < deadline, (views, connections)
        time.sleep(0.05)
    (leader,) = leaders
    assert group.validate(leader)
    assert group.overlap() == 0.0

    # Watches work after the restart: a crash is noticed as usual.
    epoch = group.status(leader)["epoch"]
    killed_at = group[leader].kill()
    successor = group.wait_for(
        "promoted", set(names) - {leader}, timeout=TTL + 2 * SLACK, after=killed_at
    )
    assert successor.at - killed_at < TTL + SLACK
    assert successor["epoch"] > epoch
