"""``/healthz`` and ``/readyz`` of an Elector against a real nats-server.

What an orchestrator sees: HTTP status and JSON body, while the replica
runs, when its NATS server goes away and comes back, and when its election
loop is blocked.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from celery_nats_leader import ElectionConfig, Elector
from celery_nats_leader.observe.probes import ProbeServer
from celery_nats_leader.testing import NatsServer
from tests.integration.helpers import ROLE, TTL

pytestmark = pytest.mark.integration


def get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture
def replica(nats_server: NatsServer) -> Iterator[tuple[Elector, int]]:
    elector = Elector(nats_server.url, connect_options={"reconnect_time_wait": 0.1})
    elector.add_role(ElectionConfig(role=ROLE, ttl=TTL, create_bucket=True))
    server = ProbeServer.for_elector(elector, loop_timeout=0.5)
    port = server.serve(0, "127.0.0.1")
    try:
        yield elector, port
    finally:
        server.close()
        elector.stop()


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    # Polls an HTTP endpoint: the probe has no event to wait on from outside.
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_probes_follow_the_replica(replica: tuple[Elector, int], nats_server: NatsServer) -> None:
    elector, port = replica
    # Not started yet: not ready (no connection, the role has not campaigned).
    status, body = get(port, "/readyz")
    assert (status, body["status"], body["checks"]["nats_connected"]) == (503, "fail", False)
    assert body["checks"]["roles"][ROLE]["state"] == "init"

    elector.start(timeout=10)
    assert elector.role(ROLE).wait_for_leadership(TTL + 1)
    status, body = get(port, "/healthz")
    assert status == 200 and body["checks"]["election_loop"] is True
    assert 0 <= body["checks"]["loop_delay_seconds"] < 0.5
    status, body = get(port, "/readyz")
    assert status == 200
    assert body == {
        "status": "ok",
        "checks": {
            "nats_connected": True,
            "roles": {ROLE: {"started": True, "state": "leader", "is_leader": True, "error": None}},
        },
    }
    assert get(port, "/nothing")[0] == 404

    # NATS goes away: not ready, still alive (restarting would not help).
    nats_server.stop()
    wait_until(lambda: get(port, "/readyz")[0] == 503, 10, "readyz to fail")
    assert get(port, "/readyz")[1]["checks"]["nats_connected"] is False
    assert get(port, "/healthz")[0] == 200
    nats_server.start()
    wait_until(lambda: get(port, "/readyz")[0] == 200, 20, "readyz to pass again")


def test_a_blocked_election_loop_fails_liveness(replica: tuple[Elector, int]) -> None:
    elector, port = replica
    elector.start(timeout=10)
    release = threading.Event()
    blocking = threading.Event()

    async def block() -> None:
        blocking.set()
        release.wait(10)  # deliberately blocks the loop thread

    future = elector.loop.submit(block())
    try:
        # Probe only once the loop is really blocked (a busy machine may run
        # the probe's own check on the loop before this coroutine starts).
        assert blocking.wait(10)
        status, body = get(port, "/healthz")
        assert (status, body["checks"]["election_loop"]) == (503, False)
    finally:
        release.set()
        future.result(10)
    assert get(port, "/healthz")[0] == 200


def test_a_forked_child_does_not_hold_the_probe_port(replica: tuple[Elector, int]) -> None:
    # A prefork pool process or the beat of ``worker -B`` is a fork of the
    # worker: it must not keep the worker's listening socket (nothing would
    # answer on it there, and it would keep the port after the worker died).
    elector, _ = replica
    probes = ProbeServer.for_elector(elector)
    bound = probes.serve(0, "127.0.0.1")
    fd = probes._server.fileno() if probes._server is not None else -1
    assert fd >= 0
    with warnings.catch_warnings():
        # Python 3.12+ warns about fork() with threads running; that is the case tested.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: its copy is closed, and close() returns at once
        try:
            closed = probes._server is None
            try:
                os.fstat(fd)
            except OSError:
                pass
            else:
                closed = False
            probes.close()
        finally:
            os._exit(0 if closed else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    try:
        # The parent still answers (not started yet: its loop does not run).
        code, body = get(bound, "/healthz")
        assert (code, body["checks"]["election_loop"]) == (503, False)
    finally:
        probes.close()
