"""server_binary(): one nats-server per version, side by side, for the test matrix."""

from __future__ import annotations

import pytest

from celery_nats_leader.testing import (
    NatsServer,
    binary_version,
    find_nats_server_binary,
    server_binary,
)
from celery_nats_leader.testing.server_binaries import NEWEST, PINNED_VERSIONS


def test_system_and_newest_binaries_report_their_pinned_versions() -> None:
    assert binary_version(server_binary("2.9")) == "2.9.10"
    newest = server_binary("newest")
    assert binary_version(newest) == PINNED_VERSIONS[NEWEST]
    assert server_binary(NEWEST) == newest
    assert server_binary(PINNED_VERSIONS[NEWEST]) == newest


def test_unknown_versions_are_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"2\.10, 2\.11"):
        server_binary("2.13")
    with pytest.raises(ValueError, match="not a nats-server version"):
        server_binary("latest-ish")


def test_nats_server_version_points_the_harness_at_a_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NATS_SERVER_BIN", raising=False)
    monkeypatch.setenv("NATS_SERVER_VERSION", NEWEST)
    assert find_nats_server_binary() == server_binary(NEWEST)
    with NatsServer() as server:
        assert server.monitor("varz")["version"] == PINNED_VERSIONS[NEWEST]
    # NATS_SERVER_BIN (an explicit path) wins over the version.
    monkeypatch.setenv("NATS_SERVER_BIN", server_binary("system"))
    assert find_nats_server_binary() == server_binary("system")
