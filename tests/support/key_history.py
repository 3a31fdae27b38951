"""Every stored revision of a test bucket's keys, on core NATS subjects.

The buckets keep one value a key (history 1): a KV watch misses a revision
replaced before its consumer sent it (a release and the successor's claim
milliseconds apart, on a loaded machine), and the tests that assert on a
key's sequence of writes must see every one. A bucket created with
:func:`republish` has its stream republish each message it stores, with its
sequence (``Nats-Sequence``), to ``_key_history.<bucket>.<key>`` (nats-server
2.9 can set that only at creation). The product never reads those subjects.
"""

from __future__ import annotations

from nats.js.api import RePublish

#: The subject prefix the copies are published under.
KEY_HISTORY = "_key_history"


def republish(bucket: str) -> RePublish:
    """The stream setting that copies every stored message of ``bucket``."""
    return RePublish(src=f"$KV.{bucket}.>", dest=f"{KEY_HISTORY}.{bucket}.>")


def copies_of(bucket: str, key: str = ">") -> str:
    """The core subject the copies of ``key`` (default every key) arrive on."""
    return f"{KEY_HISTORY}.{bucket}.{key}"


def key_of(bucket: str, subject: str) -> str:
    """The key a copy (on :func:`copies_of`) or a stored message's subject names."""
    for prefix in (f"{KEY_HISTORY}.{bucket}.", f"$KV.{bucket}."):
        if subject.startswith(prefix):
            return subject[len(prefix) :]
    raise ValueError(f"{subject!r} names no key of bucket {bucket!r}")
