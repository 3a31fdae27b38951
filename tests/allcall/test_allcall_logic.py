"""The ALLCALL state machine on the in-memory bus, in logical time.

Every test drives the candidates with one manual clock (see helpers.py), so
the seed's timings (init = lease + skew, election one heartbeat after the
replies, failover at expiry + skew) are asserted exactly. Behaviour that
matters to users is also tested against a real nats-server in
test_allcall_nats.py.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from celery_nats_leader import DemoteReason, ElectionConfig, ElectionState
from celery_nats_leader.core.errors import ConfigError
from celery_nats_leader.election import KvElection, control_subject
from celery_nats_leader.election.allcall import AllcallElection, Phase
from celery_nats_leader.election.allcall_protocol import (
    ALLCALL_VERB,
    REPLY_VERB,
    Claim,
    Member,
    Message,
    decode_message,
    encode_message,
)
from celery_nats_leader.election.interface import new_election
from celery_nats_leader.nats.memory import MemoryBackend
from tests.allcall.helpers import HB, SKEW, STEP, T0, TTL, MemoryCluster, Node

INIT = TTL + SKEW
MARGIN = TTL / 10  # the default lease_margin
ALLCALLS = control_subject("leaders", "beat", ALLCALL_VERB)
REPLIES = control_subject("leaders", "beat", REPLY_VERB)


class Spy:
    """A bare connection to the bus that records, and can forge, ALLCALL messages."""

    def __init__(self, cluster: MemoryCluster) -> None:
        self.cluster = cluster
        self.backend = MemoryBackend(cluster.server)
        self.seen: list[tuple[float, str, Message]] = []

    async def start(self) -> None:
        for subject in (ALLCALLS, REPLIES):
            await self.backend.subscribe(subject, self._record(subject))

    def _record(self, subject: str) -> Any:
        async def handler(data: bytes, reply: str | None) -> None:
            self.seen.append((self.cluster.now, subject, decode_message(data)))

        return handler

    def allcalls_from(self, name: str) -> list[tuple[float, Message]]:
        return [
            (at, m)
            for at, subject, m in self.seen
            if subject == ALLCALLS and m.sender.id == name and m.kind == "allcall"
        ]

    async def send(self, message: Message) -> None:
        await self.backend.publish(ALLCALLS, encode_message(message))
        await self.cluster.settle()


def forged_claim(name: str, *, expires: float, epoch: int = 5, priority: int = 0) -> Claim:
    return Claim(
        id=name, priority=priority, tiebreak=1, epoch=epoch, token=f"tok-{name}", expires=expires
    )


def member(name: str, *, priority: int = 0, eligible: bool = True) -> Member:
    return Member(id=name, priority=priority, tiebreak=1, eligible=eligible)


async def elect(cluster: MemoryCluster, *nodes: Node) -> Node:
    """Start ``nodes`` together and run until one of them leads."""
    await cluster.start(*nodes)
    await cluster.run_until(lambda: bool(cluster.leaders()), INIT + 3 * HB)
    (leader,) = cluster.leaders()
    return leader


# ------------------------------------------------------------------ phases


async def test_lone_node_is_silent_during_init_then_elects_itself_a_heartbeat_later(
    cluster: MemoryCluster,
) -> None:
    spy = Spy(cluster)
    await spy.start()
    node = cluster.add("a")
    await cluster.start(node)
    assert node.election.phase == Phase.INIT
    assert node.election.state is ElectionState.FOLLOWER

    await cluster.run_until(lambda: node.election.is_leader, INIT + 2 * HB)

    allcalls = spy.allcalls_from("a")
    # Init: no allcall for lease + skew, the first one exactly then.
    assert allcalls[0][0] == T0 + INIT
    # The election runs one heartbeat after that allcall's replies were due.
    assert [e.at for e in node.promotions] == [T0 + INIT + HB]
    assert allcalls[1][0] == T0 + INIT + HB
    assert allcalls[0][1].claim is None
    claim = allcalls[1][1].claim
    assert claim is not None and claim.id == "a"
    token = node.election.token
    assert token is not None and claim.epoch == token.epoch and claim.token == token.value
    assert claim.expires == T0 + INIT + HB + TTL  # wall clock = manual clock here
    assert node.election.phase == Phase.PING
    assert node.election.leader_id == "a"


async def test_allcalls_are_answered_during_init(cluster: MemoryCluster) -> None:
    spy = Spy(cluster)
    await spy.start()
    node = cluster.add("a")
    await cluster.start(node)
    await spy.send(Message("allcall", seq=7, sender=member("spy"), claim=None, max_epoch=0))

    replies = [m for _, subject, m in spy.seen if subject == REPLIES]
    assert len(replies) == 1
    assert replies[0].sender.id == "a" and replies[0].to == "spy" and replies[0].seq == 7
    assert replies[0].sender.eligible is False  # still in init
    assert node.election.phase == Phase.INIT


async def test_init_adopts_a_valid_claim_heard_in_an_allcall(cluster: MemoryCluster) -> None:
    spy = Spy(cluster)
    await spy.start()
    node = cluster.add("a", priority=100)
    await cluster.start(node)
    claim = forged_claim("old", expires=T0 + 1.0)
    await spy.send(Message("allcall", seq=1, sender=member("old"), claim=claim, max_epoch=5))
    assert node.election.leader_id == "old"
    assert node.changes[-1] is not None and node.changes[-1].id == "old"

    # The adopted lease (+ skew) runs out long before init ends; still no
    # election before init is over, however preferred this node is.
    await cluster.advance(INIT - STEP)
    assert node.election.leader_id is None
    assert node.changes[-1] is None
    assert not node.promotions
    await cluster.run_until(lambda: node.election.is_leader, 2 * HB)
    token = node.election.token
    assert token is not None and token.epoch > 5  # above every epoch heard of


async def test_start_does_not_open_a_kv_bucket(cluster: MemoryCluster) -> None:
    node = cluster.add("a")
    await cluster.start(node)
    assert cluster.server.buckets == {}


# ---------------------------------------------------------------- election


async def test_three_nodes_converge_to_the_lowest_rank(cluster: MemoryCluster) -> None:
    nodes = [cluster.add("low", priority=1), cluster.add("top", priority=7)]
    nodes.append(cluster.add("mid", priority=3))
    leader = await elect(cluster, *nodes)
    assert leader.name == "top"  # highest priority = lowest rank
    await cluster.advance(5 * TTL)
    assert [n.name for n in cluster.leaders()] == ["top"]
    assert {n.election.leader_id for n in nodes} == {"top"}
    assert {n.election.state for n in nodes} == {ElectionState.LEADER, ElectionState.FOLLOWER}
    # Renewals kept the term: one promotion in all, no demotion.
    assert sum(len(n.promotions) for n in nodes) == 1
    assert not any(n.demotions for n in nodes)
    assert cluster.max_leaders == 1


async def test_equal_priorities_are_ordered_by_the_random_tiebreaker(
    cluster: MemoryCluster,
) -> None:
    nodes = [cluster.add(f"n{i}", seed=i) for i in range(4)]
    leader = await elect(cluster, *nodes)
    best = min(nodes, key=lambda n: n.election.rank)
    assert leader is best
    ranks = [n.election.rank for n in nodes]
    assert len({r[1] for r in ranks}) == 4  # tie-breakers are distinct
    assert all(r[1].bit_length() > 64 for r in ranks)  # and long (128-bit draws)


async def test_one_and_two_node_clusters(cluster: MemoryCluster) -> None:
    a = cluster.add("a", priority=1)
    await elect(cluster, a)
    b = cluster.add("b", priority=5)
    await cluster.start(b)
    await cluster.advance(3 * TTL)
    assert [n.name for n in cluster.leaders()] == ["a"]  # b joined, a kept the role
    await a.election.stop()
    await cluster.settle()
    assert b.election.is_leader  # two nodes: the survivor took over at once
    assert cluster.max_leaders == 1


async def test_joining_node_does_not_disturb_a_leader_with_a_valid_lease(
    cluster: MemoryCluster,
) -> None:
    a = cluster.add("a", priority=0)
    await elect(cluster, a)
    joiner = cluster.add("joiner", priority=100)
    await cluster.start(joiner)
    await cluster.advance(HB)
    assert joiner.election.leader_id == "a"  # heard the leader's claim within a heartbeat
    await cluster.advance(4 * (TTL + SKEW))
    assert a.election.is_leader and not a.demotions
    assert not joiner.promotions and joiner.election.leader_id == "a"
    assert joiner.election.phase == Phase.PING


# ----------------------------------------------------------------- failure


async def test_silent_leader_is_replaced_after_lease_plus_skew(cluster: MemoryCluster) -> None:
    nodes = [cluster.add("a", priority=9), cluster.add("b", priority=5), cluster.add("c")]
    a = await elect(cluster, *nodes)
    await cluster.advance(HB / 2)  # off the heartbeat grid
    last_renewal = cluster.now - HB / 2
    a.backend.connected = False  # from the others' side, a crash: a goes silent
    crashed_at = cluster.now
    b = nodes[1]
    took = await cluster.run_until(lambda: b.election.is_leader, TTL + SKEW + 2 * HB)

    # Not before the lease (+ skew) of a's last renewal ran out, and within a
    # heartbeat after that.
    assert crashed_at + took >= last_renewal + TTL + SKEW
    assert crashed_at + took <= last_renewal + TTL + SKEW + HB
    # a itself stepped down once the disconnect grace was over, long before.
    assert a.demotions == [DemoteReason.DISCONNECTED]
    assert cluster.max_leaders == 1
    token = b.election.token
    a_token = a.promotions[0].detail
    assert token is not None and token.epoch > a_token.epoch


async def test_leader_whose_allcalls_are_lost_steps_down_before_a_successor(
    cluster: MemoryCluster,
) -> None:
    """No echo, no renewal: the lease runs out on the leader's own clock first."""
    a, b = cluster.add("a", priority=9), cluster.add("b")
    await elect(cluster, a, b)
    a.backend.blackholed = True  # looks connected, but nothing gets through
    await cluster.run_until(lambda: b.election.is_leader, TTL + SKEW + 2 * HB)
    assert a.demotions == [DemoteReason.LEASE_EXPIRED]
    demoted_at = next(e.at for e in a.events if e.kind == "demote")
    assert demoted_at <= b.promotions[0].at - SKEW
    assert cluster.max_leaders == 1


async def test_a_claim_that_never_comes_back_makes_no_leader(
    cluster: MemoryCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """A term begins only once the server echoed the claim: proof that it went out."""
    a = cluster.add("a")
    await cluster.start(a)
    a.backend.blackholed = True
    await cluster.run_until(lambda: a.election.state is ElectionState.CANDIDATE, INIT + 2 * HB)
    with caplog.at_level(logging.WARNING, logger="celery_nats_leader.election.allcall"):
        await cluster.run_until(lambda: a.election.state is ElectionState.FOLLOWER, TTL)
    assert "never echoed" in caplog.text
    assert not a.promotions
    # It sits out a TTL, then, heard again, is elected for real.
    a.backend.blackholed = False
    took = await cluster.run_until(lambda: a.election.is_leader, 2 * TTL + SKEW + 2 * HB)
    assert took > TTL


@pytest.mark.parametrize("offset", [-SKEW, SKEW])
async def test_clock_offsets_within_the_skew_bound_never_give_two_leaders(
    cluster: MemoryCluster, offset: float
) -> None:
    a = cluster.add("a", priority=9)
    b = cluster.add("b", offset=offset)
    await elect(cluster, a, b)
    a.backend.blackholed = True
    await cluster.run_until(lambda: b.election.is_leader, TTL + 2 * SKEW + 2 * HB)
    assert cluster.max_leaders == 1


async def test_clock_offsets_beyond_the_skew_bound_can_give_two_leaders(
    cluster: MemoryCluster,
) -> None:
    """The clock assumption matters: this is what max_clock_skew protects against."""
    a = cluster.add("a", priority=9)
    b = cluster.add("b", offset=SKEW + MARGIN + 0.25)  # b's wall clock runs far ahead
    await elect(cluster, a, b)
    a.backend.blackholed = True
    await cluster.run_until(lambda: b.election.is_leader, TTL + SKEW + 2 * HB)
    assert cluster.max_leaders == 2


async def test_partition_gives_two_leaders_and_healing_one(cluster: MemoryCluster) -> None:
    a, b = cluster.add("a", priority=9), cluster.add("b", priority=5)
    c = cluster.add("c", priority=1)
    await elect(cluster, a, b, c)
    c.backend.partition = "far side"
    await cluster.run_until(lambda: c.election.is_leader, TTL + SKEW + 2 * HB)
    assert a.election.is_leader  # AP: each side has its leader
    assert b.election.leader_id == "a"
    c_token = c.election.token
    a_token = a.election.token
    assert c_token is not None and a_token is not None and c_token.epoch > a_token.epoch

    c.backend.partition = ""
    took = await cluster.run_until(lambda: len(cluster.leaders()) == 1, TTL)
    assert took <= HB  # one heartbeat's allcalls suffice
    # Expiries of two renewing leaders are closer than the skew: rank decides.
    await cluster.advance(2 * HB)
    assert [n.name for n in cluster.leaders()] == ["a"]
    assert c.demotions == [DemoteReason.REVISION_CHANGED]
    # a had the lower epoch: it started a new term above c's, so a fenced
    # resource that saw c's token accepts a's.
    assert a.demotions == [DemoteReason.TOKEN_MISMATCH]
    new_token = a.election.token
    assert new_token is not None and new_token.epoch > c_token.epoch
    assert {n.election.leader_id for n in (a, b, c)} == {"a"}
    await cluster.advance(3 * TTL)
    assert [n.name for n in cluster.leaders()] == ["a"]


async def test_a_better_claim_demotes_the_leader_at_once(cluster: MemoryCluster) -> None:
    spy = Spy(cluster)
    await spy.start()
    a = cluster.add("a")
    await elect(cluster, a)
    claim = forged_claim("other", expires=cluster.now + TTL + 2 * SKEW, epoch=1)
    await spy.send(Message("allcall", seq=1, sender=member("other"), claim=claim, max_epoch=1))
    assert not a.election.is_leader
    assert a.demotions == [DemoteReason.REVISION_CHANGED]
    assert a.election.leader_id == "other"


async def test_a_worse_claim_is_ignored_by_leader_and_followers(cluster: MemoryCluster) -> None:
    spy = Spy(cluster)
    await spy.start()
    a, b = cluster.add("a", priority=5), cluster.add("b")
    await elect(cluster, a, b)
    # Expires within the skew of a's claim and ranks worse (lower priority).
    claim = forged_claim("worse", expires=cluster.now + TTL, epoch=1, priority=-1)
    await spy.send(Message("allcall", seq=1, sender=member("worse"), claim=claim, max_epoch=1))
    assert a.election.is_leader and not a.demotions
    assert b.election.leader_id == "a"


# ------------------------------------------------------------- hand-overs


async def test_stop_releases_and_the_successor_is_elected_at_once(
    cluster: MemoryCluster,
) -> None:
    a = cluster.add("a", priority=9)
    # b's wall clock is behind by the whole skew: epochs must still grow.
    b = cluster.add("b", priority=5, offset=-SKEW)
    c = cluster.add("c", priority=1)
    await elect(cluster, a, b, c)
    first = a.election.token
    assert first is not None
    await a.election.stop()
    await cluster.settle()  # no logical time passes
    assert [n.name for n in cluster.leaders()] == ["b"]
    assert a.demotions == [DemoteReason.STOPPED]
    second = b.election.token
    assert second is not None and second.epoch > first.epoch
    assert c.election.leader_id == "b"
    assert a.election.state is ElectionState.STOPPED


async def test_resign_hands_over_and_sits_out(cluster: MemoryCluster) -> None:
    a, b = cluster.add("a", priority=9), cluster.add("b")
    await elect(cluster, a, b)
    await a.election.resign()
    await cluster.settle()
    assert b.election.is_leader
    assert a.demotions == [DemoteReason.RESIGNED]
    assert a.election.leader_id == "b"


async def test_lonely_resigner_takes_the_role_back_after_sitting_out(
    cluster: MemoryCluster,
) -> None:
    a = cluster.add("a")
    await elect(cluster, a)
    await a.election.resign()
    await cluster.settle()
    assert not a.election.is_leader
    took = await cluster.run_until(lambda: a.election.is_leader, TTL + 2 * HB)
    assert took >= TTL
    assert len(a.promotions) == 2


async def test_stale_relay_of_a_released_claim_is_not_adopted(cluster: MemoryCluster) -> None:
    spy = Spy(cluster)
    await spy.start()
    a, b = cluster.add("a", priority=9), cluster.add("b")
    await elect(cluster, a, b)
    released = a.election._claim
    assert released is not None
    await a.election.stop()
    await cluster.settle()
    assert b.election.is_leader
    # A slow peer relays its old view: a's released claim, still "valid".
    await spy.send(Message("allcall", seq=1, sender=member("slow"), claim=released, max_epoch=0))
    assert b.election.is_leader and b.election.leader_id == "b"


async def test_a_stop_during_a_release_still_broadcasts_it(cluster: MemoryCluster) -> None:
    # The failed health check's release runs its demote callbacks; a stop
    # arrives meanwhile. The release ran inside the main task, which stop()
    # cancels: it was never broadcast, and the successor waited out the lease.
    healthy = {"a": True}
    a = cluster.add("a", priority=9, health_check=lambda: healthy["a"], health_check_interval=0.01)
    b = cluster.add("b")
    await elect(cluster, a, b)
    released = a.election._claim
    assert released is not None
    in_callback, finish = asyncio.Event(), asyncio.Event()

    @a.election.on_demote
    async def slow(reason: DemoteReason) -> None:
        in_callback.set()
        await finish.wait()

    healthy["a"] = False
    await in_callback.wait()  # the release is under way, in its demote callbacks
    stopping = asyncio.ensure_future(a.election.stop())
    await cluster.settle()
    assert not stopping.done()  # stop() waits for the release
    finish.set()
    await stopping
    await cluster.settle()  # no logical time passes: the release, not the lease
    assert [n.name for n in cluster.leaders()] == ["b"]
    assert a.demotions == [DemoteReason.HEALTH_CHECK_FAILED]


async def test_polite_takeover_by_a_preferred_candidate(cluster: MemoryCluster) -> None:
    a = cluster.add("a", priority=1)
    await elect(cluster, a)
    b = cluster.add("b", priority=5, allow_takeover=True)
    await cluster.start(b)
    await cluster.run_until(lambda: b.election.is_leader, INIT + 3 * HB)
    assert a.demotions == [DemoteReason.TAKEOVER]
    assert cluster.max_leaders == 1


async def test_failing_health_check_resigns(cluster: MemoryCluster) -> None:
    healthy = {"a": True}
    a = cluster.add("a", priority=9, health_check=lambda: healthy["a"], health_check_interval=0.01)
    b = cluster.add("b")
    await elect(cluster, a, b)
    healthy["a"] = False
    # The health loop runs on real time (0.01 s per check): wait for its verdict.
    await a.demoted.wait()
    await cluster.settle()
    assert a.demotions == [DemoteReason.HEALTH_CHECK_FAILED]
    assert b.election.is_leader


# ---------------------------------------------------------------- the API


async def test_validate_token(cluster: MemoryCluster) -> None:
    a, b = cluster.add("a", priority=9), cluster.add("b")
    await elect(cluster, a, b)
    assert await a.election.validate_token() is True
    assert await b.election.validate_token() is False
    a.backend.blackholed = True  # no echo: cannot vouch for the claim
    assert await a.election.validate_token() is False
    assert a.election.is_leader  # but not a reason to demote by itself


async def test_validate_token_fails_once_a_better_claim_was_heard(
    cluster: MemoryCluster,
) -> None:
    spy = Spy(cluster)
    await spy.start()
    a = cluster.add("a")
    await elect(cluster, a)
    claim = forged_claim("other", expires=cluster.now + TTL + 2 * SKEW)
    await spy.send(Message("allcall", seq=1, sender=member("other"), claim=claim, max_epoch=5))
    assert await a.election.validate_token() is False
    assert a.election.token is None


async def test_disconnected_leader_steps_down_after_the_grace(cluster: MemoryCluster) -> None:
    a = cluster.add("a")
    await elect(cluster, a)
    a.backend.connected = False
    grace = a.election.config.disconnect_grace
    took = await cluster.run_until(lambda: not a.election.is_leader, TTL)
    assert took == pytest.approx(grace, abs=STEP)
    assert a.demotions == [DemoteReason.DISCONNECTED]


async def test_reconnect_starts_a_new_init_phase(cluster: MemoryCluster) -> None:
    a, b = cluster.add("a", priority=9), cluster.add("b")
    await elect(cluster, a, b)
    b.backend.connected = False
    await cluster.advance(HB)
    b.backend.connected = True
    await cluster.advance(STEP)
    assert b.election.phase == Phase.INIT
    assert b.election.describe()["eligible"] is False
    await cluster.advance(INIT)
    assert b.election.phase == Phase.PING
    assert a.election.is_leader and not a.demotions


async def test_describe_and_roster(cluster: MemoryCluster) -> None:
    a, b = cluster.add("a", priority=9, meta={"host": "h1"}), cluster.add("b")
    await elect(cluster, a, b)
    await cluster.advance(2 * HB)
    view = a.election.describe()
    assert view["strategy"] == "allcall" and view["state"] == "leader"
    assert view["is_leader"] is True and view["leader_id"] == "a"
    assert view["phase"] == "ping" and view["candidates"] == ["b"]
    assert view["revision"] is None and view["epoch"] == a.election.token.epoch  # type: ignore[union-attr]
    assert 0 < view["lease_remaining"] <= TTL
    record = b.election.leader
    assert record is not None and record.id == "a" and record.meta == {"host": "h1"}

    asker = MemoryBackend(cluster.server)
    subject = control_subject("leaders", "beat", "roster")
    replies = await asker.request_many(subject, b"{}", window=0.05)
    import json

    views = sorted((json.loads(r) for r in replies), key=lambda v: v["id"])
    assert [(v["id"], v["is_leader"], v["strategy"]) for v in views] == [
        ("a", True, "allcall"),
        ("b", False, "allcall"),
    ]


async def test_operator_resign_request(cluster: MemoryCluster) -> None:
    a, b = cluster.add("a", priority=9), cluster.add("b")
    await elect(cluster, a, b)
    asker = MemoryBackend(cluster.server)
    reply = await asker.request(
        control_subject("leaders", "beat", "resign"), b'{"requester": "ops"}', timeout=0.5
    )
    assert b'"accepted": true' in reply
    await cluster.advance(STEP)
    assert a.demotions == [DemoteReason.RESIGNED]
    assert b.election.is_leader


async def test_kv_candidate_on_the_same_role_is_reported(
    cluster: MemoryCluster, caplog: pytest.LogCaptureFixture
) -> None:
    a = cluster.add("a")
    await cluster.start(a)
    announcer = MemoryBackend(cluster.server)
    with caplog.at_level(logging.ERROR, logger="celery_nats_leader.election.allcall"):
        await announcer.publish(
            control_subject("leaders", "beat", "roster"), b'{"hello": {"id": "kv-1"}}'
        )
        await cluster.settle()
    assert "KV strategy" in caplog.text


async def test_garbage_on_the_subjects_is_ignored(cluster: MemoryCluster) -> None:
    a = cluster.add("a")
    await cluster.start(a)
    junk = MemoryBackend(cluster.server)
    for payload in (b"", b"not json", b"[]", b'{"v": 1, "kind": "allcall"}', b'{"v": 99}'):
        await junk.publish(ALLCALLS, payload)
        await junk.publish(REPLIES, payload)
    await cluster.settle()
    await cluster.run_until(lambda: a.election.is_leader, INIT + 2 * HB)


async def test_wait_for_leadership_and_stop(cluster: MemoryCluster) -> None:
    a = cluster.add("a")
    await cluster.start(a)
    assert await a.election.wait_for_leadership(timeout=0) is False
    await cluster.run_until(lambda: a.election.is_leader, INIT + 2 * HB)
    assert await a.election.wait_for_leadership(timeout=0) is True
    await a.election.stop()
    await a.election.stop()  # idempotent
    assert a.election.state is ElectionState.STOPPED
    with pytest.raises(Exception, match="not running"):
        await a.election.wait_for_leadership(timeout=0)


# ------------------------------------------------------------ construction


def test_new_election_picks_the_strategy() -> None:
    allcall = new_election(ElectionConfig(strategy="allcall"))
    assert isinstance(allcall, AllcallElection)
    assert isinstance(new_election(ElectionConfig()), KvElection)
    with pytest.raises(ConfigError, match="strategy='allcall'"):
        AllcallElection(ElectionConfig())
    # The KV class refuses a config asking for ALLCALL instead of running KV.
    with pytest.raises(ConfigError, match=r"strategy='allcall'.*new_election\(config\)"):
        KvElection(ElectionConfig(strategy="allcall"))
    from celery_nats_leader import new_election as exported

    assert exported is new_election


async def test_bind_after_start_is_refused(cluster: MemoryCluster) -> None:
    a = cluster.add("a")
    await cluster.start(a)
    with pytest.raises(Exception, match="before start"):
        a.election.bind(MemoryBackend(cluster.server))
    with pytest.raises(Exception, match="already started"):
        await a.election.start()


async def test_leader_services_follow_the_allcall_term(cluster: MemoryCluster) -> None:
    running: list[str] = []
    overlaps: list[list[str]] = []

    def service(name: str) -> Any:
        async def run(ctx: Any) -> None:
            running.append(name)
            if len(running) > 1:
                overlaps.append(list(running))
            try:
                await asyncio.Event().wait()  # until the term ends
            finally:
                running.remove(name)

        return run

    a, b = cluster.add("a", priority=2), cluster.add("b", priority=1)
    runners = {
        node.election.instance_id: node.election.run_while_leading(
            service(node.election.instance_id)
        )
        for node in (a, b)
    }
    await cluster.start(a, b)
    await cluster.run_until(lambda: len(cluster.leaders()) == 1, 10)
    await cluster.settle()
    first = cluster.leaders()[0].election.instance_id
    assert running == [first]

    await cluster.leaders()[0].election.resign()  # awaits the service's end first
    assert running == []
    await cluster.run_until(
        lambda: [n.election.instance_id for n in cluster.leaders()] not in ([], [first]), 10
    )
    await cluster.settle()
    second = cluster.leaders()[0].election.instance_id
    assert running == [second] and second != first
    assert overlaps == []
    assert (runners[first].runs, runners[second].runs) == (1, 1)
