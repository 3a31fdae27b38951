"""The database fence on SQLite and PostgreSQL, with writers racing on separate connections."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import pytest
from django.db import connections, transaction

from celery_nats_leader.core.errors import ElectionError, LeadershipLostError
from celery_nats_leader.term.token import FencingToken
from django_nats_leader.fencing import StaleLeaderError, current_epoch, fenced
from django_nats_leader.models import FenceEpoch
from tests.django.conftest import PG_PROBLEM
from tests.django.fenceapp.models import Write

T = TypeVar("T")

#: Seconds any wait in these tests may take before the test fails.
LIMIT = 30.0


def backends(*, transaction: bool) -> list[Any]:
    params = []
    for alias in ("default", "postgres"):
        usable = alias == "default" or PG_PROBLEM[0] is None
        marks = (
            [pytest.mark.django_db(databases=[alias], transaction=transaction)] if usable else []
        )
        params.append(pytest.param(alias, marks=marks, id=alias))
    return params


def token(epoch: int, value: str | None = None) -> FencingToken:
    return FencingToken(epoch=epoch, value=value or f"{epoch:04d}-term-token")


def write(alias: str, epoch: int, writer: str, role: str = "jobs") -> None:
    with fenced(role, token(epoch), using=alias, holder=writer):
        Write.objects.using(alias).create(role=role, epoch=epoch, writer=writer)


def writers(alias: str, role: str = "jobs") -> list[str]:
    return list(Write.objects.using(alias).filter(role=role).values_list("writer", flat=True))


def in_thread(pool: ThreadPoolExecutor, fn: Callable[[], T]) -> Future[T]:
    """Run ``fn`` on a pool thread: its own database connection, closed afterwards."""

    def run() -> T:
        try:
            return fn()
        finally:
            connections.close_all()

    return pool.submit(run)


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + LIMIT
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


# ------------------------------------------------------------- single writer


@pytest.mark.parametrize("alias", backends(transaction=False), indirect=True)
def test_epochs_only_go_up(alias: str) -> None:
    assert current_epoch("jobs", using=alias) is None
    write(alias, 7, "first")
    assert current_epoch("jobs", using=alias) == 7
    write(alias, 7, "same term again")
    write(alias, 9, "next term")
    assert current_epoch("jobs", using=alias) == 9

    with pytest.raises(StaleLeaderError) as info:
        write(alias, 8, "paused ex-leader")
    assert (info.value.role, info.value.epoch, info.value.current_epoch) == ("jobs", 8, 9)
    assert str(info.value) == (  # quoted in docs/troubleshooting.md
        "stale leader for role 'jobs': its term (epoch 8) is older than epoch 9, "
        "already seen by the database"
    )
    assert writers(alias) == ["first", "same term again", "next term"]
    row = FenceEpoch.objects.using(alias).get(role="jobs")
    assert (row.epoch, row.holder, row.token_prefix) == (9, "next term", "0009-term-to")


@pytest.mark.parametrize("alias", backends(transaction=False), indirect=True)
def test_roles_are_fenced_separately(alias: str) -> None:
    write(alias, 50, "a", role="reports")
    write(alias, 3, "b", role="beat")
    assert current_epoch("reports", using=alias) == 50
    assert current_epoch("beat", using=alias) == 3


@pytest.mark.parametrize("alias", backends(transaction=False), indirect=True)
def test_tokens_in_header_form_and_missing_tokens(alias: str) -> None:
    with fenced("jobs", "12:abcdef-0123", using=alias) as row:
        assert row.epoch == 12
    with pytest.raises(StaleLeaderError, match="does not lead"), fenced("jobs", None, using=alias):
        pytest.fail("a missing token must not get through")


@pytest.mark.parametrize("alias", backends(transaction=False), indirect=True)
def test_same_epoch_with_another_token_is_rejected(alias: str) -> None:
    write(alias, 5, "a")
    other = token(5, "another-token")
    with (
        pytest.raises(StaleLeaderError, match="conflicting term"),
        fenced("jobs", other, using=alias),
    ):
        pytest.fail("must not run")


@pytest.mark.parametrize("alias", backends(transaction=False), indirect=True)
def test_failed_block_rolls_back_with_the_fence(alias: str) -> None:
    write(alias, 5, "a")
    with pytest.raises(RuntimeError), fenced("jobs", token(6), using=alias):
        Write.objects.using(alias).create(role="jobs", epoch=6, writer="b")
        raise RuntimeError("the write failed")
    assert current_epoch("jobs", using=alias) == 5
    assert writers(alias) == ["a"]


@pytest.mark.parametrize("alias", backends(transaction=False), indirect=True)
def test_inside_an_outer_transaction(alias: str) -> None:
    with transaction.atomic(using=alias):
        write(alias, 4, "a")
        write(alias, 6, "b")
        with pytest.raises(StaleLeaderError):
            write(alias, 5, "stale")
    assert writers(alias) == ["a", "b"]
    assert current_epoch("jobs", using=alias) == 6


def test_error_hierarchy() -> None:
    assert issubclass(StaleLeaderError, LeadershipLostError)
    assert issubclass(StaleLeaderError, ElectionError)


# ------------------------------------------------------------------- races


def _backend_pid(alias: str) -> int | None:
    if connections[alias].vendor != "postgresql":
        return None
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        return int(cursor.fetchone()[0])


def _waiting_on_lock(alias: str, pid: int) -> bool:
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
        row = cursor.fetchone()
    return bool(row and row[0] == "Lock")


class Racer:
    """A fenced writer on its own thread and connection that can be held inside the fence."""

    def __init__(self, alias: str, epoch: int, name: str, *, hold: bool = False) -> None:
        self.alias = alias
        self.epoch = epoch
        self.name = name
        self.hold = hold
        self.entered = threading.Event()  # inside the fence, lock held
        self.release = threading.Event()
        self.connected = threading.Event()
        self.pid: int | None = None

    def __call__(self) -> None:
        self.pid = _backend_pid(self.alias)
        self.connected.set()
        with fenced("race", token(self.epoch), using=self.alias, holder=self.name):
            Write.objects.using(self.alias).create(role="race", epoch=self.epoch, writer=self.name)
            self.entered.set()
            if self.hold:
                assert self.release.wait(LIMIT)


def _blocked(alias: str, racer: Racer, future: Future[None]) -> None:
    """Wait until ``racer`` is blocked by the fence (on PostgreSQL: waiting on the row lock)."""
    assert racer.connected.wait(LIMIT)
    if racer.pid is not None:
        wait_for(lambda: _waiting_on_lock(alias, racer.pid or 0), "the row lock wait")
    assert not future.done()
    assert not racer.entered.is_set()


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=8, thread_name_prefix="fence-racer") as executor:
        yield executor


@pytest.mark.parametrize("alias", backends(transaction=True), indirect=True)
def test_stale_writer_racing_a_newer_term_is_rejected(alias: str, pool: ThreadPoolExecutor) -> None:
    write(alias, 3, "earlier term")
    new = Racer(alias, 10, "new leader", hold=True)
    old = Racer(alias, 5, "paused ex-leader")
    new_done = in_thread(pool, new)
    assert new.entered.wait(LIMIT)  # the new term holds the fence row
    old_done = in_thread(pool, old)
    _blocked(alias, old, old_done)  # the stale writer waits for the lock ...
    new.release.set()
    new_done.result(LIMIT)
    with pytest.raises(StaleLeaderError) as info:  # ... then reads epoch 10 and fails
        old_done.result(LIMIT)
    assert (info.value.epoch, info.value.current_epoch) == (5, 10)
    assert not old.entered.is_set()
    assert writers(alias, "race") == ["new leader"]
    assert current_epoch("race", using=alias) == 10


@pytest.mark.parametrize("alias", backends(transaction=True), indirect=True)
def test_older_writer_first_then_newer(alias: str, pool: ThreadPoolExecutor) -> None:
    old = Racer(alias, 5, "old leader", hold=True)
    new = Racer(alias, 10, "new leader")
    old_done = in_thread(pool, old)
    assert old.entered.wait(LIMIT)
    new_done = in_thread(pool, new)
    _blocked(alias, new, new_done)
    old.release.set()
    old_done.result(LIMIT)
    new_done.result(LIMIT)
    assert writers(alias, "race") == ["old leader", "new leader"]
    assert current_epoch("race", using=alias) == 10
    with pytest.raises(StaleLeaderError):
        in_thread(pool, Racer(alias, 5, "old leader again")).result(LIMIT)


@pytest.mark.parametrize("alias", backends(transaction=True), indirect=True)
def test_first_writers_race_on_an_empty_role(alias: str, pool: ThreadPoolExecutor) -> None:
    epochs = random.Random(7).sample(range(1, 1000), 8)
    start = threading.Barrier(len(epochs))

    def racer(epoch: int) -> Callable[[], None]:
        def run() -> None:
            start.wait(LIMIT)
            with fenced("race", token(epoch), using=alias):
                Write.objects.using(alias).create(role="race", epoch=epoch, writer=str(epoch))

        return run

    futures = [in_thread(pool, racer(epoch)) for epoch in epochs]
    accepted, rejected = [], []
    for epoch, future in zip(epochs, futures, strict=True):
        try:
            future.result(LIMIT)
            accepted.append(epoch)
        except StaleLeaderError:
            rejected.append(epoch)
    # No IntegrityError: exactly one row was created, whoever came first.
    assert FenceEpoch.objects.using(alias).filter(role="race").count() == 1
    committed = [int(w) for w in writers(alias, "race")]
    assert sorted(committed) == sorted(accepted)
    # In commit order the epochs only go up: no write ever followed a newer term's.
    assert committed == sorted(committed)
    assert max(epochs) in accepted
    assert all(epoch < max(committed) for epoch in rejected)
    assert current_epoch("race", using=alias) == max(epochs)


@pytest.mark.parametrize("alias", backends(transaction=False), indirect=True)
def test_an_eager_run_never_creates_nor_raises_the_fence(alias: str) -> None:
    # task_always_eager gives leader-only tasks EAGER_TOKEN (epoch 0). A row
    # created at 0 would read as a KV term and refuse every ALLCALL term.
    from celery_nats_leader.term.token import ALLCALL_EPOCH_FLOOR
    from celery_nats_leader.worker.tasks import EAGER_TOKEN

    with fenced("jobs", EAGER_TOKEN, using=alias, holder="eager") as row:
        Write.objects.using(alias).create(role="jobs", epoch=0, writer="eager")
    assert row.epoch == 0 and row._state.adding  # never saved
    assert current_epoch("jobs", using=alias) is None
    allcall = FencingToken(ALLCALL_EPOCH_FLOOR + 1, "allcall-term")
    with fenced("jobs", allcall, using=alias, holder="allcall"):
        pass
    assert current_epoch("jobs", using=alias) == allcall.epoch
    # Once a real term was seen, an eager run is older than it: refused.
    with (
        pytest.raises(StaleLeaderError, match=r"an eager run \(epoch 0\) is older"),
        fenced("jobs", EAGER_TOKEN, using=alias, holder="eager"),
    ):
        Write.objects.using(alias).create(role="jobs", epoch=0, writer="too late")
    assert writers(alias) == ["eager"]
