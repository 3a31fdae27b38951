"""A ledger of what the test workers did, in SQLite (shared by all processes).

It plays two parts:

* a *record* of the run: promotions and demotions (from the signals), every
  run attempt of a leader-only task (pid, epoch, when its check passed) and
  the final state of every execution (from ``task_postrun``);
* a *fenced, idempotent resource*, the way an application should use the
  fencing token: :meth:`Ledger.commit` refuses a token older than the newest
  one it has seen ("stale") and a second commit of the same task
  ("duplicate"). This is what turns at-least-once delivery into
  exactly-once effects.

Times are ``time.monotonic()`` readings: CLOCK_MONOTONIC, one clock for the
whole host, so readings of different processes compare.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from tests.support.ledger import SqliteLedger

SCHEMA = """
CREATE TABLE IF NOT EXISTS terms (
    id INTEGER PRIMARY KEY, event TEXT, role TEXT, main_pid INTEGER, epoch INTEGER,
    reason TEXT, t REAL);
CREATE TABLE IF NOT EXISTS attempts (
    id INTEGER PRIMARY KEY, seq INTEGER, task_id TEXT, name TEXT, pid INTEGER,
    main_pid INTEGER, epoch INTEGER, checked_at REAL, t REAL);
CREATE TABLE IF NOT EXISTS commits (
    seq INTEGER PRIMARY KEY, task_id TEXT, name TEXT, pid INTEGER, main_pid INTEGER,
    epoch INTEGER, checked_at REAL, t REAL);
CREATE TABLE IF NOT EXISTS refusals (
    id INTEGER PRIMARY KEY, seq INTEGER, task_id TEXT, main_pid INTEGER, epoch INTEGER,
    kind TEXT, t REAL);
CREATE TABLE IF NOT EXISTS fence (id INTEGER PRIMARY KEY CHECK (id = 1), max_epoch INTEGER);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY, kind TEXT, name TEXT, task_id TEXT, pid INTEGER,
    main_pid INTEGER, state TEXT, info TEXT, t REAL);
INSERT OR IGNORE INTO fence (id, max_epoch) VALUES (1, 0);
"""


@dataclass(frozen=True)
class Term:
    event: str
    role: str
    main_pid: int
    epoch: int | None
    reason: str | None
    t: float


class Ledger(SqliteLedger):
    def __init__(self, path: str) -> None:
        super().__init__(path, SCHEMA)

    # ------------------------------------------------------------ writers

    def term(
        self, event: str, role: str, main_pid: int, epoch: int | None, reason: str | None
    ) -> None:
        self.execute(
            "INSERT INTO terms (event, role, main_pid, epoch, reason, t) VALUES (?,?,?,?,?,?)",
            (event, role, main_pid, epoch, reason, time.monotonic()),
        )

    def attempt(
        self, *, seq: int, task_id: str, name: str, main_pid: int, epoch: int, checked_at: float
    ) -> None:
        self.execute(
            "INSERT INTO attempts (seq, task_id, name, pid, main_pid, epoch, checked_at, t) "
            "VALUES (?,?,?,?,?,?,?,?)",
            (seq, task_id, name, os.getpid(), main_pid, epoch, checked_at, time.monotonic()),
        )

    def commit(
        self, *, seq: int, task_id: str, name: str, main_pid: int, epoch: int, checked_at: float
    ) -> str:
        """Fenced, idempotent commit: 'committed', 'duplicate' or 'stale'."""
        with self.immediate() as conn:
            (max_epoch,) = conn.execute("SELECT max_epoch FROM fence WHERE id = 1").fetchone()
            if epoch < max_epoch:
                outcome = "stale"
            elif conn.execute("SELECT 1 FROM commits WHERE seq = ?", (seq,)).fetchone():
                outcome = "duplicate"
            else:
                outcome = "committed"
                conn.execute(
                    "INSERT INTO commits (seq, task_id, name, pid, main_pid, epoch, checked_at, t) "
                    "VALUES (?,?,?,?,?,?,?,?)",
                    (
                        seq,
                        task_id,
                        name,
                        os.getpid(),
                        main_pid,
                        epoch,
                        checked_at,
                        time.monotonic(),
                    ),
                )
                conn.execute(
                    "UPDATE fence SET max_epoch = ? WHERE id = 1", (max(max_epoch, epoch),)
                )
            if outcome != "committed":
                conn.execute(
                    "INSERT INTO refusals (seq, task_id, main_pid, epoch, kind, t) "
                    "VALUES (?,?,?,?,?,?)",
                    (seq, task_id, main_pid, epoch, outcome, time.monotonic()),
                )
        return outcome

    def event(
        self,
        kind: str,
        *,
        name: str = "",
        task_id: str = "",
        main_pid: int = 0,
        state: str = "",
        info: str = "",
    ) -> None:
        self.execute(
            "INSERT INTO events (kind, name, task_id, pid, main_pid, state, info, t) "
            "VALUES (?,?,?,?,?,?,?,?)",
            (kind, name, task_id, os.getpid(), main_pid, state, info, time.monotonic()),
        )

    # ------------------------------------------------------------ readers

    def terms(self) -> list[Term]:
        return [
            Term(*row)
            for row in self.rows(
                "SELECT event, role, main_pid, epoch, reason, t FROM terms ORDER BY id"
            )
        ]

    def promotions(self) -> list[Term]:
        return [term for term in self.terms() if term.event == "promoted"]

    def committed(self) -> int:
        return self.count("SELECT COUNT(*) FROM commits")
