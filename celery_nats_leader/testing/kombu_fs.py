"""kombu's filesystem transport, with atomic writes.

kombu's own ``filesystem`` transport creates the message file, then writes
it; a consumer polling at that instant moves the still-empty file away and
dies on ``JSONDecodeError`` ("Unrecoverable error"), which takes the worker
down. This channel writes the message to a hidden temporary file first and
renames it into place, so a consumer sees a message whole or not at all.
Call :func:`register` to make ``atomicfs://`` broker URLs use it (the example
project and the Celery tests do, in every process that uses the app).
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, filesystem
from kombu.utils.encoding import str_to_bytes
from kombu.utils.json import dumps

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


class Transport(filesystem.Transport):
    """The filesystem transport with :class:`Channel`."""

    Channel = Channel


def register() -> None:
    """Make ``atomicfs://`` broker URLs use this transport (idempotent)."""
    TRANSPORT_ALIASES.setdefault(SCHEME, f"{__name__}:Transport")
