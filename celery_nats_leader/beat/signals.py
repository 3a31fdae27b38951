"""Holding ``celery beat``'s stop signals back while a tick is dispatched.

``celery beat``'s SIGTERM handler closes the scheduler and raises
``SystemExit`` wherever the main thread is, a KV round trip included;
between the commit and the record that would leave the tick pending on a
plain graceful stop, for the next scheduler to send (late, maybe twice).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = ["signals_deferred"]


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGTERM and SIGINT back while a tick is committed, sent and recorded.

    A signal that arrives meanwhile is handled on leaving, by the handler
    that was installed before. Python runs signal handlers on the main thread
    only, so swapping the handlers there for the millisecond of the dispatch
    is enough. Elsewhere (the embedded beat thread) signals never interrupt
    this code.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[tuple[int, FrameType | None]] = []

    def defer(signum: int, frame: FrameType | None) -> None:
        pending.append((signum, frame))

    saved: dict[int, Any] = {}
    try:
        for held in (signal.SIGTERM, signal.SIGINT):
            saved[held] = signal.signal(held, defer)
        yield
    finally:
        for number, handler in saved.items():
            signal.signal(number, handler)
        for signum, frame in pending:
            handler = saved.get(signum)
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                signal.raise_signal(signum)
