"""The resign request and answer: one spelling for the leader and every asker."""

from __future__ import annotations

import json

import pytest

from celery_nats_leader.election.control import ResignAnswer, ResignRequest


def test_a_fence_request_carries_what_the_leader_reads() -> None:
    body = ResignRequest(requester="ops", leader_id="web-3:1:a", reason="fence", verify=True)
    assert json.loads(body.encode()) == {
        "requester": "ops",
        "id": "web-3:1:a",
        "reason": "fence",
        "verify": True,
    }
    assert ResignRequest.decode(body.encode()) == body


def test_a_takeover_request_names_no_leader() -> None:
    body = ResignRequest(requester="cand-b", priority=10, reason="takeover").encode()
    assert json.loads(body) == {"requester": "cand-b", "priority": 10, "reason": "takeover"}
    assert ResignRequest.decode(body).priority == 10


@pytest.mark.parametrize(
    "data", [b"", b"not json", b"[1, 2]", b'{"id": 3, "priority": "high", "verify": "yes"}']
)
def test_a_malformed_request_is_a_plain_one(data: bytes) -> None:
    assert ResignRequest.decode(data) == ResignRequest()


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b'{"id": "a", "accepted": true}', ResignAnswer("a", True)),
        (b'{"id": "a", "accepted": false}', ResignAnswer("a", False)),
        (b'{"accepted": "yes"}', ResignAnswer(None, False)),
        (b"garbage", ResignAnswer(None, False)),
    ],
)
def test_only_accepted_true_is_an_acceptance(data: bytes, expected: ResignAnswer) -> None:
    assert ResignAnswer.decode(data) == expected
    assert ResignAnswer.decode(expected.encode()) == expected
