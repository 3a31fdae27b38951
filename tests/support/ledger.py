"""A SQLite file shared by every process of one test, as a ledger of what happened."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from typing import Any


class SqliteLedger:
    """One SQLite database written by many processes (pytest, workers, beat).

    Each process and thread gets its own connection (never used across a
    fork); the journal is WAL so readers do not block writers.

    Args:
        path: The database file.
        schema: SQL run by :meth:`create` (``CREATE TABLE IF NOT EXISTS ...``).

    """

    def __init__(self, path: str, schema: str) -> None:
        self.path = path
        self.schema = schema
        self._local = threading.local()

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None or self._local.pid != os.getpid():
            conn = sqlite3.connect(self.path, timeout=60, isolation_level=None)
            conn.execute("PRAGMA busy_timeout = 60000")
            self._local.conn = conn
            self._local.pid = os.getpid()
        return conn

    def create(self) -> None:
        """Create the file and its tables (once, before the processes start)."""
        conn = self._conn()
        conn.execute("PRAGMA journal_mode = WAL")
        conn.executescript(self.schema)

    def close(self) -> None:
        """Close this thread's connection."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def execute(self, sql: str, params: Sequence[Any] = ()) -> sqlite3.Cursor:
        """Run one statement, like :meth:`sqlite3.Connection.execute` (autocommit)."""
        return self._conn().execute(sql, params)

    @contextlib.contextmanager
    def immediate(self) -> Iterator[sqlite3.Connection]:
        """A write transaction taken at once (``BEGIN IMMEDIATE``): serialises writers."""
        conn = self._conn()
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield conn
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def rows(self, sql: str, *params: Any) -> list[tuple[Any, ...]]:
        """Every row of a query."""
        return list(self._conn().execute(sql, params).fetchall())

    def count(self, sql: str, *params: Any) -> int:
        """The single number a ``SELECT COUNT(*) ...`` returns."""
        return int(self._conn().execute(sql, params).fetchone()[0])
