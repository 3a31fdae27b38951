"""A term of leadership: its record in KV, its fencing token, and reading it from any process.

* :mod:`.record`: :class:`~.record.LeaderRecord`, the JSON value of a role's
  key;
* :mod:`.token`: :class:`~.token.FencingToken`, the term's epoch and
  revision;
* :mod:`.current`: a role's current term, read from any process
  (:func:`term_of`, :class:`Term`, :func:`read_term`, :class:`TermReader`,
  re-exported here: ``from celery_nats_leader.term import TermReader`` is
  the import path).

``celery_nats_leader.token`` and ``celery_nats_leader.record``, their old
paths, keep working.
"""

from __future__ import annotations

from celery_nats_leader.term.current import (
    Term,
    TermReader,
    read_term,
    term_of,
)

__all__ = [
    "Term",
    "TermReader",
    "read_term",
    "term_of",
]
