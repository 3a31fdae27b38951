"""The fencing token: what a resource checks to reject a stale leader.

A token is ``(epoch, value)``. ``epoch`` is the KV revision at which the
term's record was created; revisions only grow, so epochs strictly increase
from one term to the next (Kleppmann's monotonic fencing token). ``value`` is
a random UUID that tells two holders of the same key apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from celery_nats_leader.core.errors import RecordFormatError

#: The smallest ALLCALL epoch. ALLCALL epochs are wall-clock milliseconds (at
#: least this value: 2001-09-09); KV epochs are stream revisions, which stay
#: below it (a bucket would need 10**12 writes). So an epoch alone says which
#: strategy made it, and the two families are never ordered against each other.
ALLCALL_EPOCH_FLOOR = 10**12


def epoch_strategy(epoch: int) -> Literal["kv", "allcall"]:
    """The strategy whose terms carry epochs like ``epoch``.

    Epochs of different strategies are not comparable (a KV revision is
    always far below an ALLCALL millisecond timestamp): a resource that
    orders tokens must not order a KV term against an ALLCALL one.

    Args:
        epoch: A term's epoch.

    Returns:
        ``"allcall"`` for epochs at or above :data:`ALLCALL_EPOCH_FLOOR`, else ``"kv"``.

    """
    return "allcall" if epoch >= ALLCALL_EPOCH_FLOOR else "kv"


@dataclass(frozen=True, order=True)
class FencingToken:
    """A leader's proof of its term.

    Compare tokens by ``epoch``: a resource that has seen epoch ``n`` must
    reject any token with a smaller epoch.

    Attributes:
        epoch: KV revision at which the term began; strictly increasing across terms.
        value: Random identifier of the term (a UUID4 string).

    """

    epoch: int
    value: str

    def __repr__(self) -> str:
        # Tokens are short-lived secrets: never print one whole into a log.
        return f"FencingToken(epoch={self.epoch}, value='{self.short}')"

    __str__ = __repr__

    @property
    def short(self) -> str:
        """The first characters of ``value``, safe to log."""
        return self.value[:8] + "…"

    def to_header(self) -> str:
        """Serialize for transport (for example in a task message header).

        Returns:
            ``"<epoch>:<value>"``.

        """
        return f"{self.epoch}:{self.value}"

    @classmethod
    def from_header(cls, text: str) -> FencingToken:
        """Parse the output of :meth:`to_header`.

        Args:
            text: ``"<epoch>:<value>"``.

        Returns:
            The token.

        Raises:
            RecordFormatError: If ``text`` is not a serialized token.

        """
        epoch_text, sep, value = text.partition(":")
        if not sep or not value or not epoch_text.isdigit():
            raise RecordFormatError(f"not a fencing token: {text[:20]!r}")
        return cls(epoch=int(epoch_text), value=value)
