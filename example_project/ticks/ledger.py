"""Reading the ledger: was every tick run exactly once, with no tick missing?

Pure functions over plain values (no Django), so they are easy to test.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timedelta


@dataclass(frozen=True)
class Run:
    """One ledger row: a run of the job.

    Attributes:
        slot: The tick it ran for (``None`` if it was not a beat dispatch).
        worker: The replica that ran it.
        dispatch_epoch: The beat term that dispatched it.
        leader_epoch: The ``default`` term that ran it (fenced).

    """

    slot: datetime | None
    worker: str
    dispatch_epoch: int | None
    leader_epoch: int


@dataclass
class Verdict:
    """What the ledger says.

    Attributes:
        ticks: Distinct ticks run.
        duplicates: Ticks run more than once, with their run counts.
        missing: Ticks absent between the first and the last one run.
        unslotted: Runs without a tick identity.
        dispatch_epochs: Beat terms that dispatched, in order of appearance.
        leader_epochs: ``default`` terms that ran the job, in order of appearance.

    """

    ticks: int = 0
    duplicates: dict[datetime, int] = field(default_factory=dict)
    missing: list[datetime] = field(default_factory=list)
    unslotted: int = 0
    dispatch_epochs: list[int] = field(default_factory=list)
    leader_epochs: list[int] = field(default_factory=list)

    @property
    def once_per_tick(self) -> bool:
        """Every tick between the first and the last ran exactly once."""
        return not self.duplicates and not self.missing and not self.unslotted


def verify(runs: list[Run], interval: float) -> Verdict:
    """Check that the runs cover consecutive ticks, each exactly once.

    Args:
        runs: The ledger rows, in any order.
        interval: The schedule's interval in seconds.

    Returns:
        The verdict.

    """
    verdict = Verdict()
    counts = Counter(r.slot for r in runs if r.slot is not None)
    verdict.unslotted = sum(1 for r in runs if r.slot is None)
    verdict.ticks = len(counts)
    verdict.duplicates = {slot: n for slot, n in sorted(counts.items()) if n > 1}
    slots = sorted(counts)
    step = timedelta(seconds=interval)
    for before, after in itertools.pairwise(slots):
        expected = before + step
        # A gap of k intervals means k - 1 ticks never ran.
        while after - expected >= step / 2:
            verdict.missing.append(expected)
            expected += step
    for run in sorted(runs, key=lambda r: (r.slot is None, r.slot)):
        if run.dispatch_epoch is not None and run.dispatch_epoch not in verdict.dispatch_epochs:
            verdict.dispatch_epochs.append(run.dispatch_epoch)
        if run.leader_epoch not in verdict.leader_epochs:
            verdict.leader_epochs.append(run.leader_epoch)
    return verdict
