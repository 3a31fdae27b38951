"""Running one operator operation from synchronous code: Ctrl-C stays Ctrl-C."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from celery_nats_leader.core.errors import NatsUnavailableError
from celery_nats_leader.ops.oneshot import run_sync


def test_ctrl_c_is_not_turned_into_the_operations_own_error() -> None:
    # A connection attempt cut short by the cancel that asyncio.run makes of
    # Ctrl-C reports "could not connect"; a caller that polls for a state
    # catches that error and goes on, so the interrupt must come out as such.
    async def connect() -> None:
        try:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, while the operation runs
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise NatsUnavailableError("could not connect to NATS: cancelled") from None

    # As in a terminal: a run started in the background of a shell without
    # job control inherits SIGINT ignored, and would never see the interrupt.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_sync(connect)
    finally:
        signal.signal(signal.SIGINT, previous)


def test_an_operations_own_error_comes_out_unchanged() -> None:
    async def connect() -> None:
        raise NatsUnavailableError("could not connect to NATS within 1s: no answer")

    with pytest.raises(NatsUnavailableError, match="within 1s"):
        run_sync(connect)
    assert run_sync(lambda: asyncio.sleep(0, result=42)) == 42
