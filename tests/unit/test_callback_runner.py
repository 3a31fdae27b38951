"""The callback runner: in order, never on the loop, and loud about a callback that hangs."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

import pytest

from celery_nats_leader.election.callbacks import CallbackRunner


async def test_a_hanging_callback_is_reported_and_the_next_waits_for_it() -> None:
    release = threading.Event()
    calls: list[str] = []

    def on_promote(role: str) -> None:
        calls.append(f"promote {role}")
        release.wait(10)

    def on_demote(role: str) -> None:
        calls.append(f"demote {role}")

    runner = CallbackRunner("reports", slow_warning=0.2)
    runner.start()
    runner.submit([on_promote], "reports")
    demoted = runner.submit([on_demote], "reports")

    # The warnings are logged on the loop: a handler there wakes the test.
    two_warnings = asyncio.Event()

    class Slow(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "still running" in record.getMessage():
                seen.append(record.getMessage())
                if len(seen) == 2:
                    two_warnings.set()

    seen: list[str] = []
    handler = Slow()
    logging.getLogger("celery_nats_leader.election.callbacks").addHandler(handler)
    try:
        await asyncio.wait_for(two_warnings.wait(), 10)
    finally:
        logging.getLogger("celery_nats_leader.election.callbacks").removeHandler(handler)

    # Logged at 0.2 s, then at each doubling (0.4 s), naming the callback.
    assert len(seen) == 2, seen
    assert "on_promote" in seen[0]
    assert "still running after 0.2s" in seen[0]
    assert "still running after 0.4s" in seen[1]
    assert calls == ["promote reports"]  # the demote waits: callbacks run in order
    assert not demoted.done()

    release.set()
    await asyncio.wait_for(demoted, 5)
    assert calls == ["promote reports", "demote reports"]
    await runner.stop(timeout=1)


async def test_a_callback_that_returns_in_time_is_not_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_nats_leader.election.callbacks")
    runner = CallbackRunner("reports", slow_warning=5.0)
    runner.start()
    seen: list[str] = []

    async def on_promote(role: str) -> None:
        seen.append(role)

    await asyncio.wait_for(runner.submit([on_promote, seen.append], "reports"), 5)
    await runner.stop(timeout=1)
    assert seen == ["reports", "reports"]
    assert [r for r in caplog.records if "still running" in r.getMessage()] == []


async def test_stop_returns_after_a_cancelled_callback_has_unwound() -> None:
    order: list[str] = []

    async def on_demote(role: str) -> None:
        try:
            await asyncio.Event().wait()  # never returns
        finally:
            order.append("cleanup started")
            await asyncio.sleep(0)  # cleanup that itself awaits (closing a client)
            order.append("cleanup done")

    runner = CallbackRunner("reports")
    runner.start()
    runner.submit([on_demote], "reports")
    await runner.stop(timeout=0.1)
    order.append("stop returned")
    assert order == ["cleanup started", "cleanup done", "stop returned"]


async def test_a_callback_cancelled_on_its_own_does_not_stop_the_others(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.ERROR, logger="celery_nats_leader.election.callbacks")
    ran: list[str] = []

    async def on_promote(role: str) -> None:
        # What a callback sees when something it awaits is cancelled under it.
        raise asyncio.CancelledError

    runner = CallbackRunner("reports")
    runner.start()
    runner.submit([on_promote], "reports")
    await asyncio.wait_for(runner.submit([ran.append], "reports"), 5)
    await runner.stop(timeout=1)
    assert ran == ["reports"]
    (record,) = [r for r in caplog.records if "raised" in r.getMessage()]
    assert "on_promote" in record.getMessage()


class Records(logging.Handler):
    """The runner's records at ``level`` and above; wakes a waiter on each (on any thread)."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self._loop.call_soon_threadsafe(self._changed.set)

    def containing(self, text: str) -> list[str]:
        return [r.getMessage() for r in self.records if text in r.getMessage()]

    async def wait_for(self, text: str, count: int = 1) -> list[str]:
        while len(self.containing(text)) < count:
            self._changed.clear()
            await asyncio.wait_for(self._changed.wait(), 10)
        return self.containing(text)


@pytest.fixture
async def records() -> AsyncIterator[Records]:
    handler = Records(logging.WARNING)
    logger = logging.getLogger("celery_nats_leader.election.callbacks")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


ABANDON_AFTER = 0.5
#: Scheduling slack on a loaded two-core host.
SLACK = 1.0


async def test_a_hung_sync_callback_is_abandoned_when_a_later_one_waits(
    records: Records,
) -> None:
    loop = asyncio.get_running_loop()
    release = threading.Event()
    hanging = asyncio.Event()
    threads: dict[str, str] = {}

    def on_promote(role: str) -> None:
        threads["promote"] = threading.current_thread().name
        loop.call_soon_threadsafe(hanging.set)
        release.wait(30)
        raise RuntimeError("came back too late")

    def on_demote(role: str) -> None:
        threads["demote"] = threading.current_thread().name

    runner = CallbackRunner("reports", abandon_after=ABANDON_AFTER)
    runner.start()
    try:
        promoted = runner.submit([on_promote], "reports")
        await asyncio.wait_for(hanging.wait(), 5)
        queued_at = loop.time()
        demoted = runner.submit([on_demote], "reports")

        # The demote runs once the promote has run ABANDON_AFTER, not never.
        await asyncio.wait_for(demoted, ABANDON_AFTER + SLACK)
        assert loop.time() - queued_at < ABANDON_AFTER + SLACK
        assert "demote" in threads
        assert threads["demote"] != threads["promote"]  # a fresh thread: the old one is stuck
        (error,) = [r for r in records.records if r.levelno == logging.ERROR]
        message = error.getMessage()
        assert "on_promote" in message
        assert "without waiting for it" in message
        assert "keeps its own" in message

        # What waits for "everything queued so far" still waits for it.
        barrier = runner.barrier()
        await asyncio.wait_for(runner.submit([on_demote], "reports"), 5)
        assert not barrier.done()
        assert not promoted.done()

        # A stop does not wait for it a second time.
        await asyncio.wait_for(runner.stop(timeout=30), 5)
    finally:
        release.set()
    # Its late end is told, once: nothing else is logged at ERROR again.
    (late,) = await records.wait_for("abandoned callback")
    assert "on_promote" in late and "raised after" in late
    assert len([r for r in records.records if "later callbacks" in r.getMessage()]) == 1
    await asyncio.wait_for(asyncio.gather(promoted, barrier), 5)


async def test_a_hung_async_callback_is_cancelled_and_unwinds_before_the_next(
    records: Records,
) -> None:
    order: list[str] = []
    hanging = asyncio.Event()

    async def on_promote(role: str) -> None:
        hanging.set()
        try:
            await asyncio.Event().wait()  # never returns
        finally:
            order.append("promote cleanup started")
            await asyncio.sleep(0)  # cleanup that itself awaits (closing a client)
            order.append("promote cleanup done")

    runner = CallbackRunner("reports", abandon_after=ABANDON_AFTER)
    runner.start()
    promoted = runner.submit([on_promote], "reports")
    await asyncio.wait_for(hanging.wait(), 5)
    demoted = runner.submit([order.append], "demote")

    await asyncio.wait_for(asyncio.gather(promoted, demoted), ABANDON_AFTER + SLACK)
    await runner.stop(timeout=1)
    assert order == ["promote cleanup started", "promote cleanup done", "demote"]
    (error,) = [r for r in records.records if r.levelno == logging.ERROR]
    assert "on_promote" in error.getMessage()
    assert "cancelled" in error.getMessage()


async def test_a_slow_callback_with_nothing_queued_behind_it_is_not_abandoned(
    records: Records,
) -> None:
    release = asyncio.Event()
    ended: list[str] = []

    async def on_promote(role: str) -> None:
        try:
            await release.wait()
            ended.append("returned")
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    runner = CallbackRunner("reports", slow_warning=ABANDON_AFTER / 2, abandon_after=ABANDON_AFTER)
    runner.start()
    promoted = runner.submit([on_promote], "reports")
    # Waiting for it (start() waits for the promote callbacks) queues nothing behind it.
    barrier = runner.barrier()
    # Logged at 0.25 s, 0.5 s and 1 s: it has run twice ABANDON_AFTER.
    await records.wait_for("still running", 3)
    assert not promoted.done() and not barrier.done()

    release.set()
    await asyncio.wait_for(asyncio.gather(promoted, barrier), 5)
    await runner.stop(timeout=1)
    assert ended == ["returned"]
    assert [r for r in records.records if r.levelno >= logging.ERROR] == []


async def test_callbacks_that_return_in_time_keep_their_order(records: Records) -> None:
    order: list[str] = []
    first_running = threading.Event()
    go_on = threading.Event()

    def first(event: str) -> None:
        first_running.set()
        go_on.wait(10)
        order.append(f"sync {event}")

    def sync(event: str) -> None:
        order.append(f"sync {event}")

    async def coro(event: str) -> None:
        await asyncio.sleep(0)
        order.append(f"async {event}")

    runner = CallbackRunner("reports", abandon_after=5.0)
    runner.start()
    done = [runner.submit([first, coro], "promoted")]
    done += [runner.submit([coro, sync], f"change {n}") for n in range(3)]
    done.append(runner.submit([sync, coro], "demoted"))
    # Everything was queued behind a running callback, which returns in time.
    assert await asyncio.to_thread(first_running.wait, 5)
    go_on.set()
    await asyncio.wait_for(asyncio.gather(*done), 5)
    await runner.stop(timeout=1)
    assert order == [
        "sync promoted",
        "async promoted",
        *(f"{kind} change {n}" for n in range(3) for kind in ("async", "sync")),
        "sync demoted",
        "async demoted",
    ]
    assert records.records == []
