"""The event trail against a real nats-server: every transition, kept and live.

Candidates are processes; the test resigns, fences and stops them and checks
the events each published (kind, reason, epoch, its own counters), both as
kept by the optional stream and as seen live by a follower of the subject.
"""

from __future__ import annotations

import asyncio
import itertools

import nats
import pytest
from nats.aio.client import Client

from celery_nats_leader.core.errors import JetStreamUnavailableError
from celery_nats_leader.election.events import TransitionEvent, events_stream
from celery_nats_leader.nats.jetstream import JetStreamBackend
from celery_nats_leader.ops.events import (
    ensure_events_stream,
    read_events,
    show_events,
    stream_info,
)
from celery_nats_leader.ops.fence_leader import fence_leader
from celery_nats_leader.testing import NatsServer
from tests.harness.candidate_control import CandidateGroup
from tests.integration.helpers import BUCKET, ROLE, SLACK, TTL, in_thread

pytestmark = pytest.mark.integration


STREAM = events_stream(BUCKET)


def summary(events: list[TransitionEvent]) -> list[tuple[str, str, str | None]]:
    return [(e.id, e.event.value, e.reason) for e in events]


async def test_every_transition_is_published_and_kept(
    group: CandidateGroup, bucket: str, nc: Client
) -> None:
    backend = JetStreamBackend(nc)
    stream = await ensure_events_stream(backend, BUCKET, max_age=3600)
    assert stream.created and stream.max_age == 3600
    live: list[TransitionEvent] = []
    follower = asyncio.create_task(
        show_events(backend, BUCKET, live.append, role=ROLE, follow=True, count=7)
    )

    group.spawn("a")
    first = await in_thread(group.wait_for, "promoted", {"a"}, timeout=TTL + SLACK)
    group.spawn("b")
    await in_thread(group.wait_for, "ready", {"b"}, timeout=30)
    await in_thread(group.resign, "a")
    second = await in_thread(group.wait_for, "promoted", {"b"}, timeout=5)

    # Frozen briefly (well within its lease): it learns of the fence when it runs again.
    await in_thread(group["b"].pause)
    fenced = await fence_leader(backend, BUCKET, ROLE, requester="test")
    await in_thread(group["b"].resume)
    demoted = await in_thread(group.wait_for, "demoted", {"b"}, timeout=5)
    assert demoted["reason"] == "fenced"
    # "a" sat out one TTL after resigning; then it takes the fenced key.
    third = await in_thread(group.wait_for, "promoted", {"a"}, timeout=TTL + SLACK)

    group["a"].terminate()
    await in_thread(group.wait_for, "stopped", {"a"}, timeout=5)
    fourth = await in_thread(group.wait_for, "promoted", {"b"}, timeout=TTL + SLACK)
    await asyncio.wait_for(follower, 10)

    expected = [
        ("a", "promoted", None),
        ("a", "resigned", "resigned"),
        ("b", "promoted", None),
        ("b", "fenced", "fenced"),
        ("a", "promoted", None),
        ("a", "released", "stopped"),
        ("b", "promoted", None),
    ]
    kept = await read_events(backend, BUCKET, role=ROLE)
    assert kept is not None
    assert summary(kept) == expected
    assert summary(live) == expected
    epochs = [e.epoch for e in kept]
    assert epochs == [
        first["epoch"],
        first["epoch"],
        second["epoch"],
        second["epoch"],
        third["epoch"],
        third["epoch"],
        fourth["epoch"],
    ]
    assert fenced.revision < third["epoch"]
    # Each publisher's own counters: its sequence and its monotonic offsets grow.
    for name in ("a", "b"):
        mine = [e for e in kept if e.id == name]
        assert [e.seq for e in mine] == list(range(1, len(mine) + 1))
        assert all(x.uptime <= y.uptime for x, y in itertools.pairwise(mine))
    ended = [e for e in kept if e.event.value != "promoted"]
    assert all(e.term_age is not None and e.term_age > 0 for e in ended)
    assert all(e.stored_at for e in kept) and all(e.stored_at is None for e in live)
    # The newest N, and one role's events only.
    assert summary((await read_events(backend, BUCKET, limit=2)) or []) == expected[-2:]
    assert await read_events(backend, BUCKET, role="other") == []


async def test_without_a_stream_nothing_is_kept_and_elections_do_not_care(
    group: CandidateGroup, bucket: str, nc: Client
) -> None:
    backend = JetStreamBackend(nc)
    live: list[TransitionEvent] = []
    follower = asyncio.create_task(show_events(backend, BUCKET, live.append, follow=True, count=2))
    group.spawn("a")
    await in_thread(group.wait_for, "promoted", {"a"}, timeout=TTL + SLACK)
    group["a"].terminate()
    await in_thread(group.wait_for, "stopped", {"a"}, timeout=5)
    await asyncio.wait_for(follower, 10)
    assert summary(live) == [("a", "promoted", None), ("a", "released", "stopped")]
    assert await read_events(backend, BUCKET) is None


async def test_on_a_server_without_jetstream_no_history_is_kept() -> None:
    with NatsServer(jetstream=False) as server:
        client = await nats.connect(server.url)
        try:
            backend = JetStreamBackend(client)
            with pytest.raises(JetStreamUnavailableError) as info:
                await stream_info(backend, BUCKET, timeout=2)
            assert str(info.value) == (
                f"JetStream did not answer (nobody answers on $JS.API.STREAM.INFO.{STREAM})"
            )
            with pytest.raises(JetStreamUnavailableError) as made:
                await ensure_events_stream(backend, BUCKET, max_age=60, timeout=2)
            assert str(made.value) == str(info.value)
            with pytest.raises(JetStreamUnavailableError) as read:
                await read_events(backend, BUCKET, timeout=2)
            assert str(read.value) == (
                f"JetStream did not answer (nobody answers on $JS.API.STREAM.MSG.GET.{STREAM})"
            )
            # The events command: no history to show (it says so), no error.
            shown: list[TransitionEvent] = []
            assert await show_events(backend, BUCKET, shown.append, timeout=2) is False
            assert shown == []
        finally:
            await client.close()
