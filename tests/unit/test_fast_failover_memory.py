"""Fast failover between elections in one process, on the in-memory server.

The message bus and the KV store can fail separately here: a successor cut
off from the leader's requests while both still reach KV, a leader that
loses everything at once. Times are this process's monotonic clock, the
promotions and demotions are the callbacks' own; real servers, processes and
signals are in tests/integration/test_fast_failover.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from celery_nats_leader import DemoteReason, ElectionConfig, KvElection
from celery_nats_leader.core import constants as c
from celery_nats_leader.core.backend import KVEntry
from celery_nats_leader.core.clock import Clock
from celery_nats_leader.core.errors import BackendTimeoutError
from celery_nats_leader.nats.memory import MemoryBackend, MemoryServer
from celery_nats_leader.term.record import decode_record
from celery_nats_leader.term.token import FencingToken

TTL = 10.0


class Node:
    """One candidate: its election, its connection, and when it led."""

    def __init__(
        self, server: MemoryServer, name: str, clock: Clock | None = None, priority: int = 0
    ) -> None:
        self.backend = MemoryBackend(server)
        config = ElectionConfig(
            role="beat",
            ttl=TTL,
            instance_id=name,
            create_bucket=True,
            fast_failover=True,
            priority=priority,
        )
        self.election = KvElection(config, backend=self.backend, clock=clock)
        self.name = name
        self.terms: list[tuple[str, float]] = []

        @self.election.on_promote
        def promoted(token: FencingToken) -> None:
            self.terms.append(("promoted", time.monotonic()))

        @self.election.on_demote
        def demoted(reason: DemoteReason) -> None:
            self.terms.append((reason.value, time.monotonic()))


async def until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Wait for ``condition``, looking every few milliseconds; return when it held."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout}s: {what}")
        await asyncio.sleep(0.005)
    return time.monotonic()


def successor_of(node: Node) -> Callable[[], str | None]:
    return lambda: node.election.describe()["successor"]


def refused_for_its_clock(caplog: pytest.LogCaptureFixture, candidate: str) -> bool:
    """Whether the leader has logged (at ERROR) that ``candidate``'s clock rate is off."""
    return any(
        "runs at a rate more than" in r.getMessage() and f"candidate {candidate}" in r.getMessage()
        for r in caplog.records
        if r.levelname == "ERROR"
    )


async def successors_named(leader: Node, seconds: float) -> set[str | None]:
    """Every successor ``leader`` names while it is watched for ``seconds`` (a few rounds)."""
    named: set[str | None] = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        named.add(successor_of(leader)())
        await asyncio.sleep(c.PROMISE_INTERVAL_SECONDS / 3)
    return named


@pytest.fixture
async def nodes() -> AsyncIterator[Callable[..., Awaitable[list[Node]]]]:
    server = MemoryServer()
    made: list[Node] = []

    async def start(
        *names: str,
        clocks: dict[str, Clock] | None = None,
        priorities: dict[str, int] | None = None,
    ) -> list[Node]:
        for name in names:
            node = Node(server, name, (clocks or {}).get(name), (priorities or {}).get(name, 0))
            made.append(node)
            await node.election.start()
        return made

    yield start
    for node in made:
        node.backend.connected = True
        node.backend.blackholed = False
        node.backend.partition = ""
        await node.election.stop()


def overlap(a: Node, b: Node) -> float:
    """Seconds during which both believed they led (their callbacks' times)."""

    def spans(node: Node) -> list[tuple[float, float]]:
        out, start = [], None
        for kind, at in node.terms:
            if kind == "promoted":
                start = at
            elif start is not None:
                out.append((start, at))
                start = None
        if start is not None:
            out.append((start, float("inf")))
        return out

    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in spans(a) for s2, e2 in spans(b))


async def test_a_leader_gone_silent_stops_before_its_successor_takes_over(
    nodes: Callable[..., Awaitable[list[Node]]],
) -> None:
    leader, successor = await nodes("a", "b")
    assert leader.election.is_leader
    await until(lambda: successor_of(leader)() == "b", 5, "a names b")

    cut_at = time.monotonic()
    leader.backend.connected = False  # no requests, no renewals, no reads
    await until(lambda: bool(successor.terms), 3, "b's promote callback")
    promoted_at = successor.terms[0][1]

    # About a second, at a TTL of ten (the lease alone: about nine).
    assert promoted_at - cut_at < c.PROMISE_GRACE_SECONDS + 0.3
    # Its KV lease had seconds left; the promises' bound ended it first.
    assert [kind for kind, _ in leader.terms] == ["promoted", "lease_expired"]
    assert leader.terms[-1][1] < successor.terms[0][1]
    assert overlap(leader, successor) == 0.0


async def test_a_leader_cut_off_from_its_successor_names_none_and_keeps_the_role(
    nodes: Callable[..., Awaitable[list[Node]]],
) -> None:
    """Both reach KV; only the requests are lost: no takeover, no term change."""
    leader, successor = await nodes("a", "b")
    await until(lambda: successor_of(leader)() == "b", 5, "a names b")
    epoch = leader.election.describe()["epoch"]

    cut_at = time.monotonic()
    successor.backend.partition = "cut"
    dropped_at = await until(lambda: successor_of(leader)() is None, 2, "a names no one")
    # Within what a's last promise was worth to it (then it would have stopped).
    assert dropped_at - cut_at < c.PROMISE_GRACE_SECONDS - c.PROMISE_MARGIN_SECONDS
    # Past every promise b gave: b would have taken over by now, had a not
    # written its record without a successor first. (A window in which a
    # takeover would happen: nothing to await, the point is that it does not.)
    await asyncio.sleep(c.PROMISE_GRACE_SECONDS + 0.2)
    assert leader.election.is_leader and successor.terms == []
    assert leader.election.describe()["epoch"] == epoch

    successor.backend.partition = ""
    await until(lambda: successor_of(leader)() == "b", c.PROMISE_RETRY_SECONDS + 2, "b again")
    assert overlap(leader, successor) == 0.0


async def test_a_successor_that_leaves_is_replaced_and_the_next_one_takes_over(
    nodes: Callable[..., Awaitable[list[Node]]],
) -> None:
    leader, first, second = await nodes("a", "b", "c")
    await until(lambda: successor_of(leader)() == "b", 5, "a names b (first in line)")

    await first.election.stop()
    await until(lambda: successor_of(leader)() == "c", 3, "a names c")

    cut_at = time.monotonic()
    leader.backend.connected = False
    await until(lambda: bool(second.terms), 3, "c's promote callback")
    promoted_at = second.terms[0][1]
    assert promoted_at - cut_at < c.PROMISE_GRACE_SECONDS + 0.3
    assert leader.terms[-1][1] < second.terms[0][1]
    assert overlap(leader, second) == 0.0


async def test_a_landed_renewal_naming_a_dropped_successor_is_written_over(
    nodes: Callable[..., Awaitable[list[Node]]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A renewal naming ``b`` lands unacknowledged just as ``b`` falls silent.

    The leader drops ``b``, its "none" write meets the landed revision, and
    the read that follows finds its own record, naming ``b``: it must write
    the record again, or ``b``'s bound, which runs out within a promise's
    worth, ends a term whose KV lease is fine.
    """
    leader, successor = await nodes("a", "b")
    await until(lambda: successor_of(leader)() == "b", 5, "a names b")
    election = leader.election
    bucket = election._bucket
    assert bucket is not None
    update, get = bucket.update, bucket.get
    landed = asyncio.Event()

    async def lands_unacknowledged(key: str, value: bytes, *, last: int, timeout: float) -> int:
        revision = await update(key, value, last=last, timeout=timeout)
        if not landed.is_set():
            landed.set()
            successor.backend.partition = "away"  # b falls silent at that moment
            raise BackendTimeoutError("the acknowledgement was lost")
        return revision

    def dropped() -> bool:
        return any("has not answered" in r.getMessage() for r in caplog.records)

    async def unread_until_b_is_dropped(key: str, *, timeout: float) -> KVEntry | None:
        if landed.is_set() and not dropped():
            raise BackendTimeoutError("the read was lost too")
        return await get(key, timeout=timeout)

    monkeypatch.setattr(bucket, "update", lands_unacknowledged)
    monkeypatch.setattr(bucket, "get", unread_until_b_is_dropped)
    await asyncio.wait_for(landed.wait(), TTL)

    async def names_none() -> bool:
        entry = await get("beat", timeout=1)
        return entry is not None and decode_record(entry.value, entry.revision).successor is None

    deadline = time.monotonic() + 3.0
    while not await names_none():
        assert time.monotonic() < deadline, ("the record still names b", leader.terms)
        await asyncio.sleep(0.01)
    assert election.is_leader and [kind for kind, _ in leader.terms] == ["promoted"]


class RunningFast:
    """A monotonic clock whose rate is ``rate`` times the host's (a bad oscillator)."""

    def __init__(self, rate: float) -> None:
        self._rate = rate
        self._origin = time.monotonic()

    def monotonic(self) -> float:
        return self._origin + (time.monotonic() - self._origin) * self._rate


async def test_a_successor_whose_clock_runs_too_fast_is_not_designated(
    nodes: Callable[..., Awaitable[list[Node]]], caplog: pytest.LogCaptureFixture
) -> None:
    """The rate bound the argument assumes is checked, not trusted.

    ``b`` is first in line, but its clock runs 5 % fast: the grace it
    waits is less real time than the leader counts on. Its answers drift
    against the elapsed time; the leader refuses it and names ``c``. When
    ``c`` leaves, ``b`` stays refused (``RATE_REFUSAL_SECONDS``): the leader
    names nobody rather than a candidate whose clock it found wrong, though
    a first answer after the refusal has no drift to show.
    """
    leader, fast, normal = await nodes(
        "a", "b", "c", clocks={"b": RunningFast(1 + 5 * c.CLOCK_RATE_BOUND)}
    )
    await until(lambda: successor_of(leader)() == "c", 5, "a names c instead of b")
    assert refused_for_its_clock(caplog, "b")
    assert fast.terms == [] and normal.terms == []

    await normal.election.stop()
    await until(lambda: successor_of(leader)() is None, 3, "a names none once c has gone")
    # Several designation rounds, each asking again no sooner than
    # PROMISE_RETRY_SECONDS: b is not among the answers counted.
    named = await successors_named(leader, 3 * c.PROMISE_RETRY_SECONDS)
    assert named == {None}, named
    assert c.RATE_REFUSAL_SECONDS > 3 * c.PROMISE_RETRY_SECONDS


class Stepping:
    """A monotonic clock that can step ahead (a rate error, its effect accumulated at once)."""

    def __init__(self) -> None:
        self.ahead = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.ahead


async def test_a_candidate_refused_for_its_clock_when_asked_again_stays_refused(
    nodes: Callable[..., Awaitable[list[Node]]], caplog: pytest.LogCaptureFixture
) -> None:
    """A refusal on being asked to serve (not while serving) lasts as long as any.

    ``b`` serves, falls silent (cut off from the leader's requests: ``c``
    is named), and its clock moves 0.5 s against its earlier answers. When
    ``c`` leaves, ``b`` is asked again and refused for its clock; the round
    that asked it must not shorten that refusal to the retry of a candidate
    that did not answer, after which a first answer (no earlier one to
    drift against) would have it named.
    """
    clock = Stepping()
    leader, cut, normal = await nodes("a", "b", "c", clocks={"b": clock})
    await until(lambda: successor_of(leader)() == "b", 5, "a names b (first in line)")
    cut.backend.partition = "away"
    await until(lambda: successor_of(leader)() == "c", 5, "a names c while b is silent")
    clock.ahead = 0.5
    cut.backend.partition = ""

    await normal.election.stop()
    await until(lambda: refused_for_its_clock(caplog, "b"), 5, "a refuses b for its clock")
    named = await successors_named(leader, 3 * c.PROMISE_RETRY_SECONDS)
    assert named == {None}, named
    assert cut.terms == []


async def test_a_leader_that_never_heard_of_a_candidate_asks_and_names_it(
    nodes: Callable[..., Awaitable[list[Node]]],
) -> None:
    """A hello lost (or a roster reset by a reconnect): the leader asks who is there.

    Followers announce themselves again only every heartbeat (2.5 s at TTL
    10); a leader with nobody in its roster asks the candidates instead.
    """
    (leader,) = await nodes("a")
    server = leader.backend.server
    late = Node(server, "b")
    late.backend.partition = "away"  # its hello reaches nobody
    await late.election.start()
    late.backend.partition = ""
    joined_at = time.monotonic()
    try:
        named_at = await until(lambda: successor_of(leader)() == "b", 2, "a names b")
        # Within a probe's retry; b's own first announcement comes at a
        # random moment of its first heartbeat (2.5 s here).
        assert named_at - joined_at < c.PROMISE_RETRY_SECONDS + 0.5
    finally:
        await late.election.stop()


@pytest.mark.parametrize("leave", ["resign", "stop"])
async def test_a_successor_waits_for_the_old_leaders_demote_callbacks_on_a_hand_over(
    nodes: Callable[..., Awaitable[list[Node]]], leave: str
) -> None:
    """A graceful hand-over: the successor starts after the old leader's work stopped.

    The term's promises end with the term, but the demote callbacks (and
    the services' grace) run after that; the leader keeps its successor
    waiting, and names none, until the key is deleted.
    """
    leader, successor = await nodes("a", "b")
    await until(lambda: successor_of(leader)() == "b", 5, "a names b")
    returned: list[float] = []

    @leader.election.on_demote
    async def slow_stop(reason: DemoteReason) -> None:
        await asyncio.sleep(2 * c.PROMISE_GRACE_SECONDS)
        returned.append(time.monotonic())

    left_at = time.monotonic()
    if leave == "resign":
        await leader.election.resign()
    else:
        await leader.election.stop()
    await until(lambda: bool(successor.terms), 5, "b's promote callback")
    assert returned and returned[0] < successor.terms[0][1]
    assert successor.terms[0][1] - left_at > 2 * c.PROMISE_GRACE_SECONDS
    assert overlap(leader, successor) == 0.0


async def test_a_stop_during_a_renewal_that_lands_still_names_no_successor_first(
    nodes: Callable[..., Awaitable[list[Node]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``stop()`` cancels a renewal naming ``b`` whose write lands; ``b`` is out of reach.

    The release's "no successor" rewrite meets the landed revision. It must
    rewrite at that one (the record carries our token): with ``b`` beyond
    the keeper's requests, only the record keeps it from taking over on
    that revision while the old leader's demote callbacks still run.
    """
    leader, successor = await nodes("a", "b")
    await until(lambda: successor_of(leader)() == "b", 5, "a names b")
    bucket = leader.election._bucket
    assert bucket is not None
    update = bucket.update
    landed = asyncio.Event()

    async def lands_and_hangs(key: str, value: bytes, *, last: int, timeout: float) -> int:
        revision = await update(key, value, last=last, timeout=timeout)
        if landed.is_set():
            return revision
        landed.set()
        await asyncio.Event().wait()  # the answer never comes: stop() cancels
        return revision

    monkeypatch.setattr(bucket, "update", lands_and_hangs)
    returned: list[float] = []

    @leader.election.on_demote
    async def slow_stop(reason: DemoteReason) -> None:
        await asyncio.sleep(2 * c.PROMISE_GRACE_SECONDS)
        returned.append(time.monotonic())

    await asyncio.wait_for(landed.wait(), TTL)
    successor.backend.partition = "away"
    await leader.election.stop()
    await until(lambda: bool(successor.terms), TTL + 5, "b's promote callback")
    assert returned and returned[0] < successor.terms[0][1], (returned, successor.terms)
