"""What the kernel says about a process (Linux ``/proc``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

__all__ = ["thread_states", "wait_thread_states"]

#: Seconds between two looks at /proc while waiting for a stop or a resume.
_STATE_POLL_SECONDS = 0.001


def thread_states(pid: int) -> list[str]:
    """Scheduler state letter of each thread of ``pid`` (empty if unknown).

    ``T`` means stopped (SIGSTOP): a process is frozen once all its threads are.

    Args:
        pid: The process.

    Returns:
        One letter per thread (``R``, ``S``, ``T``, ...), in no particular order.

    """
    states = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue  # thread exited meanwhile
        # "tid (comm) S ...": comm may contain spaces and parentheses.
        states.append(stat.rpartition(")")[2].split()[0])
    return states


def wait_thread_states(pid: int, *, stopped: bool, timeout: float) -> list[str] | None:
    """Poll ``/proc`` until every thread of ``pid`` is stopped (or none is).

    kill(2) only queues SIGSTOP / SIGCONT: until the kernel has acted on every
    thread, a "paused" process may still act (renew, notice a write, ...).

    Args:
        pid: The process.
        stopped: Wait for all threads stopped (``True``) or none (``False``).
        timeout: Seconds to wait.

    Returns:
        ``None`` once the state is reached, or when ``/proc`` says nothing
        (not Linux, process gone); else, after ``timeout``, the thread states
        last seen, for the caller's error message.

    """
    deadline = time.monotonic() + timeout
    while True:
        states = thread_states(pid)
        if not states or all((state in "Tt") == stopped for state in states):
            return None
        if time.monotonic() >= deadline:
            return states
        time.sleep(_STATE_POLL_SECONDS)
