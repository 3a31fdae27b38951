"""kombu's filesystem transport, with atomic writes.

kombu's own ``filesystem`` transport creates the message file, then writes
it; a consumer polling at that instant moves the still-empty file away and
dies on ``JSONDecodeError`` ("Unrecoverable error"), which takes the worker
down. This channel writes the message to a hidden temporary file first and
renames it into place, so a consumer sees a message whole or not at all.

The exchange tables (which queues an exchange routes to) have the same race:
kombu creates the table file, then locks and writes it, so a worker declaring
its queues while another starts reads an empty table ("JSONDecodeError" at
start-up), and two creators truncate each other's table. Here a table is
changed under an exclusive lock on a lock file of its own and replaced whole
(write, then rename), and read without a lock: always whole.
Call :func:`register` to make ``atomicfs://`` broker URLs use it (the example
project and the Celery tests do, in every process that uses the app).
"""

from __future__ import annotations

import fcntl
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem, virtual
from kombu.utils.encoding import bytes_to_str, str_to_bytes
from kombu.utils.json import dumps, loads

#: The broker URL scheme of this transport.
SCHEME = "atomicfs"


class Channel(filesystem.Channel):
    """A filesystem channel whose ``_put`` is atomic (write, then rename)."""

    # kombu itself names this parameter differently in the two base classes.
    def _put(self, queue: Any, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        # Consumers only pick up "<stamp>_<uuid>.<queue>.msg"; this name never matches.
        partial = os.path.join(self.data_folder_out, f".{uuid.uuid4().hex}.partial")
        try:
            with open(partial, "wb") as file:
                body: bytes = str_to_bytes(dumps(payload))  # type: ignore[no-untyped-call]
                file.write(body)
            os.replace(partial, final)
        except OSError as exc:
            raise ChannelError(f"Cannot add file {final!r} to directory") from exc

    def _table_path(self, exchange: str) -> str:
        # kombu 5.6+ validates the exchange name here; older ones join it.
        finder = getattr(super(), "_exchange_file", None)
        if finder is not None:
            return str(finder(exchange))
        return os.path.join(str(self.control_folder), f"{exchange}.exchange")

    @contextmanager
    def _table_changing(self, path: str) -> Iterator[None]:
        """Hold the exclusive lock of one exchange table (a file beside it)."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(f"{path}.lock", "a") as lock_file:
            fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)

    @staticmethod
    def _read_table(path: str) -> list[tuple[str, str, str]]:
        try:
            with open(path, "rb") as file:
                raw = file.read()
        except FileNotFoundError:
            return []
        rows = loads(bytes_to_str(raw))  # type: ignore[no-untyped-call]
        return [(str(q[0]), str(q[1]), str(q[2])) for q in rows]

    @staticmethod
    def _write_table(path: str, table: list[tuple[str, str, str]]) -> None:
        partial = f"{path}.{uuid.uuid4().hex}.partial"
        with open(partial, "wb") as file:
            file.write(str_to_bytes(dumps(table)))  # type: ignore[no-untyped-call]
        os.replace(partial, path)

    def get_table(self, exchange: str) -> list[Any]:
        """The queues bound to ``exchange`` (a whole table, or none)."""
        row = getattr(filesystem, "exchange_queue_t", None)
        table = self._read_table(self._table_path(exchange))
        return [row(*q) for q in table] if row is not None else table

    def _queue_bind(self, exchange: str, routing_key: Any, pattern: Any, queue: Any) -> None:
        path = self._table_path(exchange)
        binding = (routing_key or "", pattern or "", queue or "")
        try:
            with self._table_changing(path):
                table = self._read_table(path)
                if binding not in table:
                    self._write_table(path, [binding, *table])
        except OSError as exc:
            raise ChannelError(f"Cannot open {path}") from exc

    def _delete(
        self, queue: Any, exchange: Any, routing_key: Any, pattern: Any, *args: Any, **kwargs: Any
    ) -> None:
        # The virtual channel's part (the queue's messages), then the table.
        virtual.Channel._delete(  # type: ignore[no-untyped-call]
            self, queue, exchange, routing_key, pattern, *args, **kwargs
        )
        path = self._table_path(exchange)
        binding = (routing_key or "", pattern or "", queue or "")
        with self._table_changing(path):
            table = self._read_table(path)
            if binding in table:
                table.remove(binding)
                self._write_table(path, table)


class Transport(filesystem.Transport):
    """The filesystem transport with :class:`Channel`."""

    Channel = Channel


def register() -> None:
    """Make ``atomicfs://`` broker URLs use this transport (idempotent)."""
    TRANSPORT_ALIASES.setdefault(SCHEME, f"{__name__}:Transport")
