"""Candidates as separate processes against a real nats-server.

What a user sees: who leads, the term's epoch, how long a failover took.
Every candidate is a child process (``tests.harness.candidate``)
with its own connection; times are the children's ``time.monotonic()``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from celery_nats_leader.term.record import decode_record
from tests.harness.candidate_control import CandidateGroup
from tests.integration.helpers import (
    HEARTBEAT,
    ROLE,
    SLACK,
    TTL,
    KeyHistory,
    assert_increasing,
    in_thread,
    wait_follows,
)

pytestmark = pytest.mark.integration

#: A graceful hand-over (release, watch event, create) takes a few
#: milliseconds; this bound leaves room for a loaded machine.
HANDOFF_BOUND = 0.1


def start(group: CandidateGroup, *names: str, **options: Any) -> None:
    """Spawn candidates and wait until each has joined the election."""
    for name in names:
        group.spawn(name, **options)
    group.wait_for_all("ready", names, timeout=30)


async def test_exactly_one_of_three_leads(group: CandidateGroup, bucket: str, nc: Client) -> None:
    names = ["a", "b", "c"]
    await in_thread(start, group, *names)
    first = await in_thread(group.wait_for, "promoted", timeout=TTL + SLACK)

    views = {name: await in_thread(group.status, name) for name in names}
    assert [n for n, view in views.items() if view["is_leader"]] == [first.name]
    assert {view["leader_id"] for view in views.values()} == {first.name}
    assert views[first.name]["epoch"] == first["epoch"]
    # The store agrees: the key holds the leader's record of that term.
    entry = await (await nc.jetstream().key_value(bucket)).get(ROLE)
    assert entry.value is not None
    record = decode_record(entry.value, int(entry.revision or 0))
    assert (record.id, record.epoch) == (first.name, first["epoch"])
    # One promotion in all, and each candidate was told of the new leader once.
    assert [e.name for e in group.events("promoted")] == [first.name]
    for name in names:
        changes = [e["leader_id"] for e in group.events("leader", {name})]
        assert changes == [first.name], f"{name} saw leader changes {changes}"


def test_leader_crash_successor_within_ttl(group: CandidateGroup, bucket: str) -> None:
    start(group, "a", "b", "c")
    first = group.wait_for("promoted", timeout=TTL + SLACK)
    others = {"a", "b", "c"} - {first.name}

    killed_at = group[first.name].kill()
    second = group.wait_for("promoted", others, timeout=TTL + 2 * SLACK)
    failover = second.at - killed_at

    # Nothing released the key: the successor waited for it to expire, which
    # happens TTL after the last renewal (at most a heartbeat before the kill).
    assert TTL - HEARTBEAT - 0.5 < failover < TTL + SLACK, failover
    assert second["epoch"] > first["epoch"]
    (third,) = others - {second.name}
    wait_follows(group, third, second.name)
    assert group.status(third)["leader_id"] == second.name
    assert group.validate(second.name)
    assert group.overlap({first.name: killed_at}) == 0.0


async def test_graceful_stop_releases_the_key_and_hands_over_in_milliseconds(
    group: CandidateGroup, bucket: str, nc: Client
) -> None:
    await in_thread(start, group, "a", "b", "c")
    first = await in_thread(group.wait_for, "promoted", timeout=TTL + SLACK)
    async with KeyHistory(nc, bucket) as history:
        stop_at = group[first.name].terminate()
        second = await in_thread(
            group.wait_for, "promoted", {"a", "b", "c"} - {first.name}, timeout=TTL
        )
        demoted = await in_thread(group.wait_for, "demoted", {first.name}, timeout=5)
        await in_thread(group.wait_for, "stopped", {first.name}, timeout=5)
        assert await in_thread(group[first.name].wait, 5) == 0
        entries = await history.until_revision(second["epoch"])

    handoff = second.at - stop_at
    assert handoff < HANDOFF_BOUND, f"hand-over took {handoff * 1000:.1f} ms"
    assert demoted["reason"] == "stopped"
    assert demoted.at < second.at  # demote callbacks ran before the release
    # The old term's record, its deletion, the new term's record: never overwritten.
    ops = [(e.op, e.leader) for e in entries]
    assert ops[-3:] == [("PUT", first.name), ("DEL", None), ("PUT", second.name)], entries
    deleted_at_revision = entries[-2].revision
    assert first["epoch"] < deleted_at_revision < second["epoch"]
    assert group.overlap() == 0.0


def test_failing_health_check_resigns_and_a_healthy_follower_leads(
    group: CandidateGroup, bucket: str, tmp_path: Path
) -> None:
    files = {name: tmp_path / f"{name}.healthy" for name in ("a", "b", "c")}
    for name, path in files.items():
        path.touch()
        start(group, name, health_file=path)
    first = group.wait_for("promoted", timeout=TTL + SLACK)

    failing_at = time.monotonic()
    files[first.name].unlink()
    demoted = group.wait_for("demoted", {first.name}, timeout=4 * HEARTBEAT + SLACK)
    second = group.wait_for("promoted", {"a", "b", "c"} - {first.name}, timeout=TTL)

    assert demoted["reason"] == "health_check_failed"
    # Three failed checks in a row, one per heartbeat: at least two heartbeats
    # after the first failing one.
    assert 2 * HEARTBEAT <= demoted.at - failing_at < 3 * HEARTBEAT + SLACK
    # It resigned (released the key): no wait for the key to expire.
    assert second.at - demoted.at < TTL / 4
    assert second["epoch"] > first["epoch"]
    assert group.validate(second.name)
    assert not group.validate(first.name)
    wait_follows(group, first.name, second.name)
    assert group.overlap() == 0.0


def test_higher_priority_follower_wins_a_release(group: CandidateGroup, bucket: str) -> None:
    start(group, "incumbent")
    first = group.wait_for("promoted", {"incumbent"}, timeout=TTL + SLACK)
    start(group, "low", priority=0)
    start(group, "high", priority=50)

    group.resign("incumbent")
    winner = group.wait_for("promoted", {"low", "high"}, timeout=TTL)

    # 50 priority points below the best candidate: "low" waits 0.5 s before
    # campaigning; "high" campaigns at once and wins.
    assert winner.name == "high"
    assert winner["epoch"] > first["epoch"]
    wait_follows(group, "low", "high")
    wait_follows(group, "incumbent", "high")
    assert [e.name for e in group.events("promoted")] == ["incumbent", "high"]


async def test_polite_takeover_by_a_preferred_candidate(
    group: CandidateGroup, bucket: str, nc: Client
) -> None:
    await in_thread(start, group, "incumbent")
    first = await in_thread(group.wait_for, "promoted", {"incumbent"}, timeout=TTL + SLACK)
    async with KeyHistory(nc, bucket) as history:
        joined_at = time.monotonic()
        await in_thread(start, group, "preferred", priority=10, allow_takeover=True)
        demoted = await in_thread(group.wait_for, "demoted", {"incumbent"}, timeout=TTL)
        second = await in_thread(group.wait_for, "promoted", {"preferred"}, timeout=TTL)
        entries = await history.until_revision(second["epoch"])

    assert demoted["reason"] == "takeover"
    assert demoted.at < second.at
    # Asked at once on joining; no wait for an expiry.
    assert second.at - joined_at < HEARTBEAT + SLACK
    assert second["epoch"] > first["epoch"]
    # Polite: the incumbent deleted its own record; nobody overwrote it.
    ops = [(e.op, e.leader) for e in entries]
    assert ops[-2:] == [("DEL", None), ("PUT", "preferred")], entries
    assert all(leader == "incumbent" for op, leader in ops[:-2] if op == "PUT")
    assert await in_thread(group.validate, "preferred")
    assert group.overlap() == 0.0


def test_paused_leader_steps_down_on_resume_and_its_token_is_stale(
    group: CandidateGroup, bucket: str
) -> None:
    start(group, "a", "b", "c")
    first = group.wait_for("promoted", timeout=TTL + SLACK)
    others = {"a", "b", "c"} - {first.name}

    paused_at = group[first.name].pause()
    # While it is frozen its key expires and someone else takes over.
    second = group.wait_for("promoted", others, timeout=TTL + 2 * SLACK)
    assert second.at - paused_at > TTL - HEARTBEAT - 0.5
    resumed_at = group[first.name].resume()

    demoted = group.wait_for("demoted", {first.name}, timeout=SLACK)
    assert demoted["reason"] == "lease_expired"
    assert demoted.at - resumed_at < SLACK
    # Fenced: the ex-leader's token fails validation, the successor's passes.
    assert group.validate(first.name) is False
    assert group.validate(second.name) is True
    assert second["epoch"] > first["epoch"]
    wait_follows(group, first.name, second.name)
    view = group.status(first.name)
    assert (view["is_leader"], view["epoch"], view["leader_id"]) == (False, None, second.name)
    # Its renewals did not resume: the successor still holds the same term.
    assert group.status(second.name)["epoch"] == second["epoch"]
    assert_increasing([first["epoch"], second["epoch"]])
