"""The callback runner: in order, never on the loop, and loud about a callback that hangs."""

from __future__ import annotations

import asyncio
import logging
import threading

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
