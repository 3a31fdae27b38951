"""The ledger of executed beat ticks, in SQLite (written by the test workers).

Every execution of a periodic task records the tick it was dispatched for
(entry, slot), the term that dispatched it (epoch, dispatcher id), the
executing process and when it ran. Fenced tasks that were refused are
recorded too (the ``token`` column holds the epoch header they carried).

Times: ``wall`` is ``time.time()`` (to compare with slots, which are wall
times; all processes run on this one host) and ``mono`` is
``time.monotonic()`` (CLOCK_MONOTONIC, one clock for the whole host).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from tests.support.ledger import SqliteLedger

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY, task TEXT, task_id TEXT, entry TEXT, tick TEXT, epoch INTEGER,
    dispatcher TEXT, run INTEGER, pid INTEGER, wall REAL, mono REAL);
CREATE TABLE IF NOT EXISTS refusals (
    id INTEGER PRIMARY KEY, task TEXT, task_id TEXT, entry TEXT, tick TEXT, token TEXT,
    reason TEXT, pid INTEGER, mono REAL);
"""


@dataclass(frozen=True)
class Run:
    task: str
    task_id: str
    entry: str | None
    tick: str | None
    epoch: int | None
    dispatcher: str | None
    run: int | None
    pid: int
    wall: float
    mono: float


class BeatLedger(SqliteLedger):
    """The beat tests' ledger (:class:`tests.support.ledger.SqliteLedger` with its schema)."""

    def __init__(self, path: str) -> None:
        super().__init__(path, SCHEMA)

    def run(self, **fields: Any) -> None:
        self.execute(
            "INSERT INTO runs (task, task_id, entry, tick, epoch, dispatcher, run, pid, wall, mono)"
            " VALUES (?,?,?,?,?,?,?,?,?,?)",
            (
                fields["task"],
                fields["task_id"],
                fields.get("entry"),
                fields.get("tick"),
                fields.get("epoch"),
                fields.get("dispatcher"),
                fields.get("run"),
                os.getpid(),
                time.time(),
                time.monotonic(),
            ),
        )

    def refusal(self, **fields: Any) -> None:
        self.execute(
            "INSERT INTO refusals (task, task_id, entry, tick, token, reason, pid, mono)"
            " VALUES (?,?,?,?,?,?,?,?)",
            (
                fields["task"],
                fields["task_id"],
                fields.get("entry"),
                fields.get("tick"),
                fields.get("token"),
                fields.get("reason"),
                os.getpid(),
                time.monotonic(),
            ),
        )

    def runs(self, task: str | None = None) -> list[Run]:
        sql = "SELECT task, task_id, entry, tick, epoch, dispatcher, run, pid, wall, mono FROM runs"
        params: tuple[Any, ...] = ()
        if task is not None:
            sql += " WHERE task = ?"
            params = (task,)
        return [Run(*row) for row in self.rows(sql + " ORDER BY id", *params)]

    def refusals(self) -> list[tuple[Any, ...]]:
        return self.rows(
            "SELECT task, task_id, entry, tick, token, reason FROM refusals ORDER BY id"
        )
