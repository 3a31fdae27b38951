"""A real network partition between two hosts of this machine (network namespaces).

The nats-server listens on the root namespace's end of a veth pair; the
candidate ``inside`` runs in a namespace behind it, ``o1`` and ``o2`` in the
root namespace. :meth:`NetnsHost.partition` takes the namespace's link down:
the kernel drops the packets, nothing resets the connection, so the leader
learns of the partition only from its own renewals going unanswered. All
event times are this host's monotonic clock (namespaces share it).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from celery_nats_leader.testing import NatsServer
from tests.chaos.netns import NetnsHost, cleanup_leftovers
from tests.harness.candidate_control import CandidateGroup
from tests.integration.helpers import (
    LEASE,
    SLACK,
    TTL,
    candidate_group,
    create_bucket,
    wait_follows,
)

pytestmark = pytest.mark.integration

OUTSIDE = {"o1", "o2"}

#: How late a ``demoted`` event may be printed after the lease timer fired:
#: an async callback's latency on a loaded 2-core machine.
CALLBACK_LATENCY = 0.2


@pytest.fixture
def hosts_group(root_server: NatsServer) -> Iterator[CandidateGroup]:
    """Candidate processes for ``ROLE`` on ``root_server``."""
    with candidate_group(root_server.url) as made:
        yield made


async def test_partitioned_leader_steps_down_by_its_lease_before_a_successor_leads(
    host: NetnsHost, root_server: NatsServer, hosts_group: CandidateGroup
) -> None:
    group = hosts_group
    await create_bucket(root_server.url)
    group.spawn("inside", wrapper=host.command([]))
    first = group.wait_for("promoted", {"inside"}, timeout=TTL + SLACK)
    for name in sorted(OUTSIDE):
        group.spawn(name)
    group.wait_for_all("ready", sorted(OUTSIDE))
    for name in sorted(OUTSIDE):
        wait_follows(group, name, "inside", timeout=SLACK)
    group.wait_for("renewed", {"inside"}, timeout=TTL, after=first.at)

    cut_at = time.monotonic()
    host.partition()
    demoted = group.wait_for("demoted", {"inside"}, timeout=LEASE + SLACK)
    successor = group.wait_for("promoted", OUTSIDE, timeout=TTL + SLACK)

    # Its lease ran until TTL - margin after the send of its last confirmed
    # renewal; it gave the role up by then, on its own clock, with no word
    # from the server (none could reach it).
    last_sent = max(e["sent"] for e in group.events("renewed", {"inside"}) if e.at < demoted.at)
    deadline = last_sent + LEASE
    assert demoted["reason"] == "lease_expired", demoted
    assert demoted.at <= deadline + CALLBACK_LATENCY, (demoted.at - deadline, demoted)
    # No overlap: the successor was promoted after the old leader stepped
    # down, and only once the key had expired (TTL after the last write).
    assert demoted.at < successor.at, (demoted, successor)
    assert successor.at >= last_sent + TTL - CALLBACK_LATENCY, successor.at - last_sent
    assert successor["epoch"] > first["epoch"]
    assert successor.at - cut_at < TTL + SLACK

    host.heal()
    # Back on the network, the ex-leader follows the successor and does not
    # lead again while the successor does.
    wait_follows(group, "inside", successor.name, timeout=TTL + 5 * SLACK)
    assert group.validate(successor.name)
    assert not group.validate("inside")
    assert group.status("inside")["state"] != "leader"
    assert [e.at for e in group.events("promoted", {"inside"})] == [first.at]
    assert group.overlap() == 0.0


#: A client inside the namespace: connects, says so, prints what it receives and when.
_CLIENT = """
import socket, sys, time
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
print("connected", flush=True)
data = conn.recv(16)
print(data.decode(), time.monotonic(), flush=True)
"""


def test_partition_drops_packets_without_resetting_connections(host: NetnsHost) -> None:
    with socket.create_server((host.root_address, 0)) as listener:
        port = listener.getsockname()[1]
        client = subprocess.Popen(
            host.command([sys.executable, "-c", _CLIENT, host.root_address, str(port)]),
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert client.stdout is not None
            listener.settimeout(SLACK * 10)
            conn, _ = listener.accept()
            with conn:
                assert client.stdout.readline().strip() == "connected"
                host.partition()
                # New connections from inside fail at once (no route) ...
                connect = (
                    f"import socket; socket.create_connection(('{host.root_address}', {port}))"
                )
                refused = subprocess.run(
                    host.command([sys.executable, "-c", connect]),
                    capture_output=True,
                    text=True,
                    check=False,
                )
                assert refused.returncode != 0 and "unreachable" in refused.stderr, refused
                # ... and bytes sent to it now wait (TCP retransmits) instead of failing.
                conn.sendall(b"hello")
                healed_at = time.monotonic()
                host.heal()
                word, at = client.stdout.readline().split()
                assert client.wait(SLACK * 10) == 0
        finally:
            if client.poll() is None:
                client.kill()
            client.wait()
            if client.stdout is not None:
                client.stdout.close()
    assert word == "hello"
    assert float(at) > healed_at  # delivered only once the link was back


def test_leftovers_of_exited_runs_are_removed_and_a_live_runs_are_kept() -> None:
    exited = subprocess.Popen(["true"])
    exited.wait()
    dead_name, live_name = f"cnl{exited.pid}n0", f"cnl{os.getpid()}n998"
    for name in (dead_name, live_name):
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        removed = cleanup_leftovers()
        listed = subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, check=True
        ).stdout.split()
        assert dead_name in removed and dead_name not in listed
        assert live_name not in removed and live_name in listed
    finally:
        for name in (dead_name, live_name):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, check=False)
