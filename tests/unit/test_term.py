"""The one entry decoder and the one "does the store hold this term" check."""

from __future__ import annotations

from celery_nats_leader.core.backend import KVEntry, Operation
from celery_nats_leader.term import Term, term_of
from celery_nats_leader.term.record import encode_record
from celery_nats_leader.term.token import FencingToken

TOKEN = "0f6b1d2e-5a1c-4c55-9e64-2b8f2c0e9a11"


def entry(value: bytes, revision: int = 7, operation: Operation = Operation.PUT) -> KVEntry:
    return KVEntry(key="beat", value=value, revision=revision, operation=operation)


def record_bytes(epoch: int | None = 5, instance_id: str = "web-1") -> bytes:
    return encode_record(instance_id=instance_id, token=TOKEN, epoch=epoch, priority=0, meta={})


def test_free_role_has_no_term() -> None:
    assert term_of(None) is None
    assert term_of(entry(b"", operation=Operation.DELETE)) is None
    assert term_of(entry(b"", operation=Operation.PURGE)) is None


def test_record_term() -> None:
    term = term_of(entry(record_bytes(epoch=5), revision=9))
    assert term is not None and term.record is not None
    assert (term.revision, term.epoch, term.record.id) == (9, 5, "web-1")
    # A term's first write carries no epoch: it is the revision of that write.
    first = term_of(entry(record_bytes(epoch=None), revision=9))
    assert first is not None and first.epoch == 9


def test_holds_compares_epoch_token_and_holder() -> None:
    term = term_of(entry(record_bytes(epoch=5)))
    assert term is not None
    assert term.holds(FencingToken(5, TOKEN))
    assert term.holds(FencingToken(5, TOKEN), "web-1")
    assert not term.holds(FencingToken(5, TOKEN), "web-2")
    assert not term.holds(FencingToken(4, TOKEN))
    assert not term.holds(FencingToken(5, TOKEN.replace("0", "1")))


def test_foreign_value_is_a_term_of_unknown_holder() -> None:
    term = term_of(entry(b"not a record", revision=12))
    assert term == Term(revision=12, record=None, problem="value at revision 12 is not JSON")
    # Newer than any term before it (for the beat fence), held by nobody we know.
    assert term.epoch == 12
    assert not term.holds(FencingToken(12, TOKEN))
