"""What the kernel says about a process (Linux ``/proc``)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["thread_states"]


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
