"""A TTL change's marks (election/moves.py) against the in-memory backend.

Fast logic tests; the same roll runs against a real nats-server with real
beat replicas in tests/beat/test_beat_ttl_change.py and with the database
fence in tests/django/test_ttl_change.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from celery_nats_leader import DemoteReason
from celery_nats_leader.core.errors import (
    BackendTimeoutError,
    ElectionError,
    PermissionDeniedError,
)
from celery_nats_leader.election.moves import BucketMarks
from celery_nats_leader.nats.memory import MemoryBackend, MemoryServer
from celery_nats_leader.term.record import encode_record
from tests.unit.test_election_logic import Candidate, make, server

__all__ = ["make", "server"]  # the fixtures, used by name

OLD, NEW = "leaders", "leaders_new"


async def move(server: MemoryServer, *, ttl: float = 0.6) -> None:
    """What ``bucket --migrate-from OLD`` leaves: OLD marked first, then NEW created marked."""
    admin = MemoryBackend(server)
    await admin.describe_bucket(OLD, BucketMarks(moved_to=NEW).describe(), timeout=1)
    description = BucketMarks(migrated_from=OLD).describe()
    await admin.open_bucket(
        NEW, ttl=ttl, create=True, replicas=1, timeout=1, description=description
    )


def test_marks_read_back_and_other_descriptions_carry_none() -> None:
    both = BucketMarks(moved_to="c", migrated_from="a")
    assert BucketMarks.parse(both.describe()) == both
    assert both.describe() == "celery-nats-leader migrated-from=a moved-to=c"
    assert BucketMarks.parse("") == BucketMarks()
    assert BucketMarks.parse("moved-to=x (someone else's stream)") == BucketMarks()
    assert BucketMarks().describe() == ""


async def test_a_follower_of_the_moved_bucket_never_starts_a_term_and_the_new_bucket_waits(
    make: Callable[..., Candidate], server: MemoryServer
) -> None:
    old_leader, old_follower = make("old-a", bucket=OLD), make("old-b", bucket=OLD)
    await old_leader.election.start()
    await old_follower.election.start()
    assert old_leader.election.is_leader
    await move(server)
    new = make("new-a", bucket=NEW)
    started = asyncio.get_running_loop().time()
    await new.election.start()
    # start() returns once it knows it follows (it does not wait a TTL).
    assert asyncio.get_running_loop().time() - started < 0.3
    # One leader of the role: the new bucket's replica waits for the old
    # term. (A wrong campaign would come within a heartbeat: two TTLs
    # without one show the wait.)
    await asyncio.sleep(0.6 * 2)
    assert not new.election.is_leader and new.promotions == []

    await old_leader.election.stop()  # released: the key is deleted at once
    assert old_leader.demotions == [DemoteReason.STOPPED]
    await asyncio.wait_for(new.promoted.wait(), 2.0)
    # The old follower saw the delete and campaigned; it read the mark after
    # its create and gave the key back, so it never led.
    assert old_follower.promotions == []
    assert not old_follower.election.is_leader
    old = await MemoryBackend(server).open_bucket(
        OLD, ttl=None, create=False, replicas=1, timeout=1
    )
    assert await old.get("beat", timeout=1) is None


async def test_an_old_leader_that_dies_holds_the_new_bucket_off_until_its_key_expires(
    make: Callable[..., Candidate], server: MemoryServer
) -> None:
    old_leader = make("old-a", bucket=OLD)
    await old_leader.election.start()
    await move(server)
    new = make("new-a", bucket=NEW)
    await new.election.start()
    loop = asyncio.get_running_loop()
    old_leader.backend.connected = False  # it can no longer renew: as if killed
    cut = loop.time()
    await asyncio.wait_for(new.promoted.wait(), 3.0)
    # Not before the old key's max_age ran out after its last renewal.
    assert loop.time() - cut >= 0.6 - 0.6 / 4


async def test_a_replica_started_on_a_moved_bucket_never_leads_unless_the_move_is_undone(
    make: Callable[..., Candidate], server: MemoryServer
) -> None:
    first = make("old-a", bucket=OLD)
    await first.election.start()
    await first.election.stop()
    await move(server)
    late = make("old-late", bucket=OLD)
    started = asyncio.get_running_loop().time()
    await late.election.start()
    assert asyncio.get_running_loop().time() - started < 0.3  # decided: it follows
    await asyncio.sleep(0.6 * 2)  # two TTLs without a campaign
    assert late.promotions == []
    await late.election.stop()

    # Deleting the new bucket undoes the move (a roll given up).
    await MemoryBackend(server).delete_bucket(NEW, timeout=1)
    again = make("old-again", bucket=OLD)
    await again.election.start()
    await asyncio.wait_for(again.promoted.wait(), 2.0)


@pytest.mark.parametrize("deleted", [True, False], ids=["old-bucket-deleted", "old-key-free"])
async def test_the_new_bucket_leads_at_once_when_the_old_one_holds_no_term(
    make: Callable[..., Candidate], server: MemoryServer, deleted: bool
) -> None:
    await MemoryBackend(server).open_bucket(OLD, ttl=0.6, create=True, replicas=1, timeout=1)
    await move(server)
    if deleted:
        await MemoryBackend(server).delete_bucket(OLD, timeout=1)
    new = make("new-a", bucket=NEW)
    await new.election.start()
    assert new.election.is_leader


async def test_replicas_that_waited_for_the_old_term_serve_as_successors_after_it(
    make: Callable[..., Candidate], server: MemoryServer
) -> None:
    """With fast failover, a replica that waited for the old bucket's term may be named later.

    Every replica on the new bucket waits while the old term lasts (and
    refuses promise requests meanwhile); the one that leads afterwards names
    another as its successor. One that went on refusing would leave the role
    to fail over by the TTL alone, after a roll that has usually made it longer.
    """
    old_leader = make("old-a", bucket=OLD, ttl=2.0)
    await old_leader.election.start()
    await move(server, ttl=2.0)
    replicas = [make(f"new-{n}", bucket=NEW, ttl=2.0, fast_failover=True) for n in "ab"]
    for replica in replicas:
        await replica.election.start()  # returns once it follows: it waits
    assert not any(r.election.is_leader for r in replicas)

    await old_leader.election.stop()
    first = await asyncio.wait_for(
        asyncio.wait(
            [asyncio.ensure_future(r.promoted.wait()) for r in replicas],
            return_when=asyncio.FIRST_COMPLETED,
        ),
        2.0,
    )
    assert first
    leader, other = replicas if replicas[0].election.is_leader else replicas[::-1]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3.0
    while leader.election.describe()["successor"] != other.election.instance_id:
        assert loop.time() < deadline, leader.election.describe()
        await asyncio.sleep(0.01)


class _Heard(logging.Handler):
    """Sets an event when the election logs a message containing ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.DEBUG)
        self.text = text
        self.event = asyncio.Event()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.records.append(record)
            self.event.set()


@pytest.fixture
def hear() -> Iterator[Callable[[str], _Heard]]:
    logger = logging.getLogger("celery_nats_leader.election.kv")
    handlers: list[_Heard] = []
    level = logger.level
    logger.setLevel(logging.DEBUG)

    def listen(text: str) -> _Heard:
        handler = _Heard(text)
        handlers.append(handler)
        logger.addHandler(handler)
        return handler

    yield listen
    for handler in handlers:
        logger.removeHandler(handler)
    logger.setLevel(level)


async def test_a_new_bucket_marked_after_a_replica_opened_it_still_waits_for_the_old_term(
    make: Callable[..., Candidate], server: MemoryServer, hear: Callable[[str], _Heard]
) -> None:
    # A replica opened the new bucket before it was marked "migrated from"
    # (a tool or a hand that marks an existing bucket; --migrate-from
    # refuses such a bucket): it read no marks at start. Its first won
    # create reads them, and it waits for the old bucket's term like the rest.
    old_leader = make("old-a", bucket=OLD)
    await old_leader.election.start()
    admin = MemoryBackend(server)
    new_bucket = await admin.open_bucket(NEW, ttl=0.6, create=True, replicas=1, timeout=1)
    held = encode_record(instance_id="someone", token="t", epoch=None, priority=0, meta={})
    revision = await new_bucket.create("beat", held, timeout=1)
    new = make("new-a", bucket=NEW)
    await new.election.start()
    assert not new.election.is_leader  # someone holds the new bucket's key
    await admin.describe_bucket(OLD, BucketMarks(moved_to=NEW).describe(), timeout=1)
    await admin.describe_bucket(NEW, BucketMarks(migrated_from=OLD).describe(), timeout=1)
    marked_late = hear("was marked migrated from 'leaders' after this replica opened it")
    waiting = hear("waiting for the term of 'beat' on the old bucket 'leaders' to end")

    await new_bucket.delete("beat", last=revision, timeout=1)  # the new bucket's key is free
    await asyncio.wait_for(marked_late.event.wait(), 2.0)
    await asyncio.wait_for(waiting.event.wait(), 2.0)
    assert new.promotions == [] and not new.election.is_leader
    assert old_leader.election.is_leader

    await old_leader.election.stop()
    await asyncio.wait_for(new.promoted.wait(), 2.0)
    assert old_leader.demotions == [DemoteReason.STOPPED]


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (
            PermissionDeniedError("JetStream refused: permissions violation"),
            "beat: permission denied reading the old bucket 'leaders' (JetStream refused: "
            "permissions violation): this replica does not campaign for 'beat' until it can",
        ),
        (
            BackendTimeoutError("no answer within 1s"),
            "beat: cannot read the old bucket 'leaders' (no answer within 1s): this replica "
            "does not campaign for 'beat' until it can",
        ),
    ],
    ids=["permission-denied", "timeout"],
)
async def test_a_new_replica_that_cannot_read_the_old_bucket_says_so_at_warning(
    make: Callable[..., Candidate],
    server: MemoryServer,
    hear: Callable[[str], _Heard],
    monkeypatch: pytest.MonkeyPatch,
    error: ElectionError,
    said: str,
) -> None:
    await MemoryBackend(server).open_bucket(OLD, ttl=0.6, create=True, replicas=1, timeout=1)
    await move(server)
    new = make("new-a", bucket=NEW)
    attempts = 0
    fifth = asyncio.Event()
    real_open = new.backend.open_bucket

    async def open_bucket(name: str, **options: Any) -> Any:
        nonlocal attempts
        if name != OLD:
            return await real_open(name, **options)
        attempts += 1
        if attempts == 5:
            fifth.set()
        raise error

    monkeypatch.setattr(new.backend, "open_bucket", open_bucket)
    warned = hear(said)
    await new.election.start(wait=0.1)
    await asyncio.wait_for(fifth.wait(), 5.0)
    # Said once at WARNING (then at most every 30 s), and it does not lead:
    # an old bucket that cannot be read may hold the role.
    assert [r.levelno for r in warned.records] == [logging.WARNING]
    assert not new.election.is_leader and new.promotions == []
    if isinstance(error, PermissionDeniedError):
        assert (
            warned.records[0]
            .getMessage()
            .endswith(
                "Let its NATS user read 'leaders' until the roll ends (the permission sets in "
                "docs/operating.md), or delete 'leaders' if no replica uses it any more"
            )
        )

    # Readable again (here: deleted, the roll's last step): it leads.
    monkeypatch.setattr(new.backend, "open_bucket", real_open)
    await MemoryBackend(server).delete_bucket(OLD, timeout=1)
    await asyncio.wait_for(new.promoted.wait(), 2.0)
