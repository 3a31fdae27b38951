"""Fencing a leader (``nats-leader fence``) against a real nats-server.

The fence first asks the leader to hand over and waits ``handover_wait``; a
live leader steps down before anyone else leads (no overlap). A leader that
does not answer (a child process frozen with SIGSTOP: it cannot renew,
answer or step down) is fenced: a conditional update at the revision
observed ends its term; a live candidate must lead within milliseconds of
the fence write (not after the TTL), and the frozen leader's fenced check
must fail when it runs again. Times are ``time.monotonic()`` of this host
(the children's events use the same clock).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from datetime import datetime, timezone

import nats
import pytest
from nats.aio.client import Client
from nats.js.api import KeyValueConfig

from celery_nats_leader import DemoteReason, ElectionConfig, Elector
from celery_nats_leader.beat.dispatch_fence import DispatchFence
from celery_nats_leader.beat.schedule_store import EntryState, encode_state, state_key
from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.core.constants import RESIGN_VERB
from celery_nats_leader.core.errors import NotLeaderError
from celery_nats_leader.election.base import control_subject
from celery_nats_leader.election.control import ResignAnswer
from celery_nats_leader.nats.jetstream import JetStreamBackend
from celery_nats_leader.ops.fence_leader import DEFAULT_HANDOVER_WAIT, fence_leader
from celery_nats_leader.term.record import decode_record, encode_record
from celery_nats_leader.testing import NatsServer
from tests.harness.candidate_control import CandidateGroup
from tests.integration.helpers import ROLE, SLACK, KeyHistory, create_bucket, in_thread

pytestmark = pytest.mark.integration

#: A long TTL: whatever the fence achieves, the key's expiry cannot explain it.
FENCE_TTL = 30.0
FENCE_BUCKET = "fenced"
#: The promise of the command: a live candidate leads this soon after it.
PROMOTION_BOUND = 0.1


@pytest.fixture
async def fence_bucket(nats_server: NatsServer) -> str:
    """A bucket whose TTL is far longer than anything the tests wait for."""
    await create_bucket(nats_server.url, FENCE_BUCKET, ttl=FENCE_TTL)
    return FENCE_BUCKET


@pytest.fixture
def slow_group(nats_server: NatsServer, fence_bucket: str) -> Iterator[CandidateGroup]:
    """Candidates with the long TTL."""
    with CandidateGroup(
        nats_server.url, role=ROLE, bucket=fence_bucket, ttl=FENCE_TTL, reconnect_wait=0.1
    ) as made:
        yield made


@pytest.fixture
async def operator(nats_server: NatsServer) -> AsyncIterator[Client]:
    """The operator's own connection."""
    client = await nats.connect(nats_server.url)
    yield client
    await client.close()


async def test_fencing_a_paused_leader_promotes_a_successor_at_once(
    slow_group: CandidateGroup, fence_bucket: str, operator: Client
) -> None:
    group = slow_group
    for name in ("a", "b"):
        group.spawn(name)
    await in_thread(group.wait_for_all, "ready", ["a", "b"], timeout=30)
    first = await in_thread(group.wait_for, "promoted", timeout=FENCE_TTL + SLACK)
    (other,) = {"a", "b"} - {first.name}
    await in_thread(group[first.name].pause)

    async with KeyHistory(operator, fence_bucket) as history:
        called_at = time.monotonic()
        outcome = await fence_leader(
            JetStreamBackend(operator),
            fence_bucket,
            ROLE,
            requester="test",
            wait=FENCE_TTL,
        )
        second = await in_thread(group.wait_for, "promoted", {other}, timeout=5)
        entries = await history.until_revision(second["epoch"])
    # The command returned after the successor's record arrived: measure from
    # the successor's own event, against the moment the fence was sent.
    assert outcome.successor is not None
    assert outcome.promoted_after is not None
    assert outcome.promoted_after < PROMOTION_BOUND, f"{outcome.promoted_after * 1000:.1f} ms"
    assert (outcome.fenced.id, outcome.fenced.epoch) == (first.name, first["epoch"])
    assert (outcome.successor.id, outcome.successor.epoch) == (other, second["epoch"])
    # It was asked first: the fence cost the hand-over wait, no more.
    assert (outcome.action, outcome.handed_over) == ("fenced", False)
    assert outcome.reason == "it did not answer a request to hand over within 1s"
    took = second.at - called_at
    assert DEFAULT_HANDOVER_WAIT <= took < DEFAULT_HANDOVER_WAIT + PROMOTION_BOUND, took
    # The term ended at the marker, and the next term is newer still.
    assert first["epoch"] < outcome.revision < second["epoch"]
    ops = [(e.op, e.leader) for e in entries]
    assert ops[-2:] == [("PUT", "fenced"), ("PUT", other)], entries

    # The frozen leader runs again: its fenced check fails, and it steps down.
    await in_thread(group[first.name].resume)
    assert not await in_thread(group.validate, first.name)
    demoted = await in_thread(group.wait_for, "demoted", {first.name}, timeout=5)
    assert demoted["reason"] == "fenced"
    assert await in_thread(group.validate, other)
    status = await in_thread(group.status, first.name)
    assert (status["is_leader"], status["leader_id"]) == (False, other)


async def test_fencing_measured_from_the_command_to_the_successors_event(
    slow_group: CandidateGroup, fence_bucket: str, operator: Client
) -> None:
    """Fenced at once (``handover_wait=0``): the successor leads within 100 ms of the call."""
    group = slow_group
    for name in ("a", "b", "c"):
        group.spawn(name)
    await in_thread(group.wait_for_all, "ready", ["a", "b", "c"], timeout=30)
    first = await in_thread(group.wait_for, "promoted", timeout=FENCE_TTL + SLACK)
    await in_thread(group[first.name].pause)

    backend = JetStreamBackend(operator)
    called_at = time.monotonic()
    outcome = await fence_leader(
        backend, fence_bucket, ROLE, requester="test", wait=0, handover_wait=0
    )
    second = await in_thread(group.wait_for, "promoted", {"a", "b", "c"} - {first.name}, timeout=5)
    took = second.at - called_at
    assert took < PROMOTION_BOUND, f"successor promoted {took * 1000:.1f} ms after the fence"
    assert second["epoch"] > outcome.revision > first["epoch"]
    # Exactly one successor.
    await in_thread(group[first.name].resume)
    await in_thread(group.wait_for, "demoted", {first.name}, timeout=5)
    assert [e.name for e in group.events("promoted")] == [first.name, second.name]


async def test_fence_refuses_when_nobody_leads_or_the_epoch_is_not_current(
    slow_group: CandidateGroup, fence_bucket: str, operator: Client
) -> None:
    backend = JetStreamBackend(operator)
    with pytest.raises(NotLeaderError, match="nobody leads"):
        await fence_leader(backend, fence_bucket, ROLE, requester="test")
    slow_group.spawn("a")
    first = await in_thread(slow_group.wait_for, "promoted", timeout=FENCE_TTL + SLACK)
    stale = first["epoch"] + 1
    with pytest.raises(NotLeaderError, match=f"epoch {first['epoch']}, not {stale}"):
        await fence_leader(backend, fence_bucket, ROLE, requester="test", epoch=stale)
    # Nothing was written: the leader keeps its term.
    assert await in_thread(slow_group.validate, "a")


async def test_a_live_leader_asked_to_fence_hands_over_with_no_overlap(
    slow_group: CandidateGroup, fence_bucket: str, operator: Client
) -> None:
    """A leader that answers steps down before its successor is promoted; nothing is fenced."""
    group = slow_group
    group.spawn("a")
    first = await in_thread(group.wait_for, "promoted", {"a"}, timeout=FENCE_TTL + SLACK)
    group.spawn("b")
    await in_thread(group.wait_for, "ready", {"b"}, timeout=30)
    async with KeyHistory(operator, fence_bucket) as history:
        called_at = time.monotonic()
        outcome = await fence_leader(
            JetStreamBackend(operator), fence_bucket, ROLE, requester="test", wait=5
        )
        second = await in_thread(group.wait_for, "promoted", {"b"}, timeout=5)
        entries = await history.until_revision(second["epoch"])
    demoted = await in_thread(group.wait_for, "demoted", {"a"}, timeout=5)
    assert demoted["reason"] == "resigned"
    # No overlap, on this host's monotonic clock: "a" stopped leading (its
    # is_leader turns False before its demote callbacks run) before "b" led.
    assert called_at < demoted.at < second.at, (called_at, demoted.at, second.at)
    assert (outcome.action, outcome.handed_over) == ("handed_over", True)
    assert (outcome.fenced.id, outcome.fenced.epoch) == ("a", first["epoch"])
    assert outcome.successor is not None
    assert (outcome.successor.id, outcome.successor.epoch) == ("b", second["epoch"])
    assert outcome.promoted_after is not None and outcome.promoted_after < PROMOTION_BOUND
    # The key: released by the leader (at the outcome's revision), then taken; no marker.
    ops = [(e.op, e.leader) for e in entries]
    assert ops[-2:] == [("DEL", None), ("PUT", "b")], entries
    assert entries[-2].revision == outcome.revision
    assert ("PUT", "fenced") not in ops
    assert outcome.to_dict()["action"] == "handed_over"


async def test_a_live_leader_fenced_at_once_steps_down_and_sits_out(
    slow_group: CandidateGroup, fence_bucket: str, operator: Client
) -> None:
    """``handover_wait=0`` on a leader that is not stuck: it sees the marker and steps down.

    This is the overlap the hand-over avoids: the successor may lead before
    the fenced leader's watch delivers the marker.
    """
    group = slow_group
    group.spawn("a")
    await in_thread(group.wait_for, "promoted", {"a"}, timeout=FENCE_TTL + SLACK)
    group.spawn("b")
    await in_thread(group.wait_for, "ready", {"b"}, timeout=30)
    outcome = await fence_leader(
        JetStreamBackend(operator), fence_bucket, ROLE, requester="test", wait=5, handover_wait=0
    )
    assert (outcome.action, outcome.reason) == (
        "fenced",
        "fenced at once, without asking it to hand over",
    )
    demoted = await in_thread(group.wait_for, "demoted", {"a"}, timeout=5)
    assert demoted["reason"] == "fenced"
    second = await in_thread(group.wait_for, "promoted", timeout=5)
    # The fenced leader sits out one TTL: the other candidate leads.
    assert second.name == "b"
    assert outcome.successor is not None and outcome.successor.id == "b"
    kv = await operator.jetstream().key_value(fence_bucket)
    entry = await kv.get(ROLE)
    assert entry.value is not None
    assert decode_record(entry.value, int(entry.revision or 0)).id == "b"


async def test_a_leader_still_in_its_demote_callbacks_is_fenced_when_the_wait_runs_out(
    nats_server: NatsServer, fence_bucket: str, operator: Client
) -> None:
    """It agreed, but its demote callback outlasts ``handover_wait``: the fence ends the term.

    Its ``is_leader`` was already false when the callback began; only the
    callback overlaps the successor's term (docs/operating.md's table).
    """
    finish = threading.Event()
    seen: list[tuple[bool, DemoteReason]] = []
    electors = {name: Elector(nats_server.url, name=f"test-{name}") for name in ("a", "b")}
    handles = {
        name: elector.add_role(
            ElectionConfig(role=ROLE, bucket=fence_bucket, ttl=FENCE_TTL, instance_id=name)
        )
        for name, elector in electors.items()
    }

    @handles["a"].on_demote
    def slow(reason: DemoteReason) -> None:
        seen.append((handles["a"].is_leader, reason))
        finish.wait(10)

    try:
        await in_thread(electors["a"].start, timeout=10)
        assert await in_thread(handles["a"].wait_for_leadership, 10)
        await in_thread(electors["b"].start, timeout=10)
        outcome = await fence_leader(
            JetStreamBackend(operator),
            fence_bucket,
            ROLE,
            requester="test",
            wait=5,
            handover_wait=0.2,
        )
        assert (outcome.action, outcome.reason) == (
            "fenced",
            "it agreed to hand over but had not released the key within 0.2s",
        )
        assert outcome.successor is not None and outcome.successor.id == "b"
        assert await in_thread(handles["b"].wait_for_leadership, 5)
        # "a" stopped leading before its callback ran, so before "b" led;
        # the callback is still running now, in "b"'s term.
        assert seen == [(False, DemoteReason.RESIGNED)]
        assert not finish.is_set() and not handles["a"].is_leader
    finally:
        finish.set()
        for elector in electors.values():
            await in_thread(elector.stop)


async def test_a_leader_that_releases_while_its_answer_is_late_is_reported_as_handed_over(
    nats_server: NatsServer, fence_bucket: str, operator: Client
) -> None:
    """Its key is released after the request, but no answer came within ``handover_wait``.

    (A leader's check of its term before answering can take up to its
    request timeout.) The fence's conditional write then loses to the
    release: the term ended on request, and the outcome says so with the
    release's revision (a database fence is raised to it), not "ended
    meanwhile; nothing fenced".
    """
    backend = JetStreamBackend(operator)
    kv = await backend.open_bucket(fence_bucket, ttl=None, create=False, replicas=1, timeout=5)
    record = encode_record(instance_id="a", token="t-a", epoch=None, priority=0, meta={})
    revision = await kv.create(ROLE, record, timeout=5)
    released: list[int] = []

    async def release_then_answer_late(data: bytes, reply: str | None) -> None:
        released.append(await kv.delete(ROLE, last=revision, timeout=5))
        await asyncio.sleep(0.5)  # its answer comes after handover_wait (0.2 s)
        assert reply is not None
        await backend.publish(reply, ResignAnswer(id="a", accepted=True).encode())

    subscription = await backend.subscribe(
        control_subject(fence_bucket, ROLE, RESIGN_VERB), release_then_answer_late
    )
    try:
        outcome = await fence_leader(
            backend, fence_bucket, ROLE, requester="test", wait=0, handover_wait=0.2
        )
    finally:
        await subscription.unsubscribe()
    assert (outcome.action, outcome.fenced.id, outcome.fenced.epoch) == (
        "handed_over",
        "a",
        revision,
    )
    assert outcome.revision == released[0] > revision


async def test_a_key_deleted_by_a_follower_is_no_hand_over_of_a_leader_that_never_answered(
    nats_server: NatsServer, fence_bucket: str, operator: Client
) -> None:
    # The leader never answers (frozen, cut off); while the fence waits for
    # it, a follower deletes the expired key conditionally at its revision
    # (follower-driven expiry). The fence's write then loses: the term has
    # ended, but not by a hand-over, and the outcome must not say it was.
    backend = JetStreamBackend(operator)
    kv = await backend.open_bucket(fence_bucket, ttl=None, create=False, replicas=1, timeout=5)
    record = encode_record(instance_id="a", token="t-a", epoch=None, priority=0, meta={})
    revision = await kv.create(ROLE, record, timeout=5)
    asked = asyncio.Event()

    async def never_answer(data: bytes, reply: str | None) -> None:
        asked.set()

    async def follower_deletes_the_expired_key() -> None:
        await asked.wait()
        await kv.delete(ROLE, last=revision, timeout=5)

    subscription = await backend.subscribe(
        control_subject(fence_bucket, ROLE, RESIGN_VERB), never_answer
    )
    follower = asyncio.ensure_future(follower_deletes_the_expired_key())
    try:
        with pytest.raises(NotLeaderError, match="ended meanwhile; nothing fenced"):
            await fence_leader(
                backend, fence_bucket, ROLE, requester="test", wait=0, handover_wait=0.3, timeout=1
            )
    finally:
        follower.cancel()
        await subscription.unsubscribe()


async def test_beat_messages_of_an_ended_term_are_refused_with_nobody_leading(
    slow_group: CandidateGroup, fence_bucket: str, operator: Client, nats_server: NatsServer
) -> None:
    """The workers' dispatch fence while the role is vacant (its key deleted or fenced).

    A term whose key was deleted since (its leader resigned, a successor
    released) has ended: the delete's revision is above its epoch. With no
    marker left (expired: nats-server before 2.11 leaves none), a newer term
    that began and ended since is known from the entry's schedule state (it
    dispatched the entry); a fenced term from the fence marker. Each even by
    a worker process that never saw those terms lead.
    """
    group = slow_group
    state_bucket = f"{fence_bucket}_beat"
    await operator.jetstream().create_key_value(KeyValueConfig(bucket=state_bucket, history=1))
    connection = ConnectOptions(servers=(nats_server.url,))

    def fresh_fence() -> DispatchFence:
        # A worker process that has seen none of the terms below lead.
        return DispatchFence(connection, fence_bucket, state_bucket=state_bucket)

    async def dispatched(entry: str, epoch: int) -> None:
        # What a leader's commit writes: the entry's state, with its epoch.
        state = EntryState(entry=entry, slot=datetime.now(timezone.utc), runs=1, epoch=epoch)
        kv = await operator.jetstream().key_value(state_bucket)
        await kv.put(state_key(ROLE, entry), encode_state(state))

    fence = fresh_fence()
    try:
        group.spawn("a")
        first = await in_thread(group.wait_for, "promoted", {"a"}, timeout=FENCE_TTL + SLACK)
        await dispatched("nightly", first["epoch"])
        assert (await in_thread(fence.check, ROLE, first["epoch"], "nightly")).ok

        # a resigned (its key deleted), nobody leads: its term has ended, and
        # a late message of it (a paused scheduler's) is refused.
        await in_thread(group.resign, "a")
        released = await in_thread(fresh_fence().reader.read_latest, ROLE, timeout=5)
        assert released is not None and released.revision > first["epoch"]
        vacant = await in_thread(fresh_fence().check, ROLE, first["epoch"], "nightly")
        assert (vacant.ok, vacant.certain, vacant.current_epoch) == (False, True, None)
        assert vacant.reason == (
            f"dispatched under epoch {first['epoch']}; that term has ended (the role was "
            f"released at revision {released.revision} and nobody leads it now)"
        )

        # b leads, dispatches the entry, resigns, and its delete marker goes
        # too (as expiry leaves the key on nats-server 2.9 and 2.10): a's
        # late message is refused by the entry's state.
        group.spawn("b")
        second = await in_thread(group.wait_for, "promoted", {"b"}, timeout=FENCE_TTL + SLACK)
        await dispatched("nightly", second["epoch"])
        await in_thread(group.resign, "b")
        await operator.jetstream().purge_stream(
            f"KV_{fence_bucket}", subject=f"$KV.{fence_bucket}.{ROLE}"
        )
        assert await in_thread(fresh_fence().reader.read_latest, ROLE, timeout=5) is None
        late = await in_thread(fresh_fence().check, ROLE, first["epoch"], "nightly")
        assert (late.ok, late.certain, late.current_epoch) == (False, True, second["epoch"])
        assert late.reason == (
            f"dispatched under epoch {first['epoch']}; a newer term ({second['epoch']}) has "
            "dispatched 'nightly' since"
        )
        assert (await in_thread(fresh_fence().check, ROLE, second["epoch"], "nightly")).ok

        # c's term is fenced while c is paused, with nobody to succeed it (a
        # and b, which would retake the role after a TTL, are gone): the
        # marker is a newer term, whatever the entry.
        for name in ("a", "b"):
            group[name].kill()
        group.spawn("c")
        third = await in_thread(group.wait_for, "promoted", {"c"}, timeout=FENCE_TTL + SLACK)
        await in_thread(group["c"].pause)
        outcome = await fence_leader(
            JetStreamBackend(operator), fence_bucket, ROLE, requester="test", handover_wait=0
        )
        assert outcome.successor is None  # nobody leads: the marker holds the key
        refused = await in_thread(fresh_fence().check, ROLE, third["epoch"], "weekly")
        assert (refused.ok, refused.certain) == (False, True)
        assert refused.current_epoch == outcome.revision > third["epoch"]
        assert refused.reason == (
            f"dispatched under epoch {third['epoch']}; the current term is {outcome.revision}"
        )
        await in_thread(group["c"].resume)
        await in_thread(group.wait_for, "demoted", {"c"}, timeout=5)
    finally:
        await in_thread(fence.reader.close)
