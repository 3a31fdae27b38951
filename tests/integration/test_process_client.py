"""ProcessClient: one loop thread and one NATS connection per process, on a real server."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import uuid
import warnings

import pytest

from celery_nats_leader import ElectionConfig, Elector
from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.core.errors import BackendTimeoutError
from celery_nats_leader.nats.process_client import ProcessClient
from celery_nats_leader.term import TermReader
from celery_nats_leader.testing import NatsServer
from tests.support.connections import connections_by_process


def _client_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "nats-leader-client")


def test_readers_of_a_process_share_one_connection(nats_server: NatsServer) -> None:
    bucket = f"pc_{uuid.uuid4().hex[:8]}"
    elector = Elector(nats_server.url, name="pc-test")
    elector.add_role(ElectionConfig(role="r", bucket=bucket, ttl=2.0, create_bucket=True))
    elector.start(timeout=10)
    threads_before = _client_threads()
    # Equal settings built separately: one client.
    readers = [TermReader(ConnectOptions(servers=(nats_server.url,)), bucket) for _ in range(3)]
    other = TermReader(
        ConnectOptions(servers=(nats_server.url,), options={"ping_interval": 7}), bucket
    )
    try:
        epochs = {reader.read("r", timeout=2).epoch for reader in readers}  # type: ignore[union-attr]
        assert len(epochs) == 1
        held = connections_by_process(nats_server, [os.getpid()])[os.getpid()]
        mine = f"celery-nats-leader client {socket.gethostname()}:{os.getpid()}"
        assert held.count(mine) == 1, held
        assert _client_threads() == threads_before + 1
        # Other connect options: another connection.
        assert other.read("r", timeout=2) is not None
        held = connections_by_process(nats_server, [os.getpid()])[os.getpid()]
        assert held.count(mine) == 2, held
        assert sorted(held) == sorted(["pc-test", mine, mine])
    finally:
        readers[0].close()
        other.close()
        elector.stop()
    assert _client_threads() == threads_before


def test_a_fork_child_builds_its_own_client(nats_server: NatsServer) -> None:
    bucket = f"pc_{uuid.uuid4().hex[:8]}"
    elector = Elector(nats_server.url, name="pc-test")
    elector.add_role(
        ElectionConfig(role="r", bucket=bucket, ttl=2.0, instance_id="a", create_bucket=True)
    )
    elector.start(timeout=10)
    reader = TermReader(ConnectOptions(servers=(nats_server.url,)), bucket)
    try:
        parent_term = reader.read("r", timeout=2)
        assert parent_term is not None
        parent_client = ProcessClient.for_connection(reader.connection)
        read_end, write_end = os.pipe()
        with warnings.catch_warnings():
            # Python 3.12+ warns about fork() in a threaded process: so does
            # every prefork Celery worker; the child below never uses a
            # thread it inherited.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: report, and leave without running pytest's exit
            code = 1
            try:
                client = ProcessClient.for_connection(reader.connection)
                term = reader.read("r", timeout=5)
                answer = {
                    "own": client is not parent_client and client.pid == os.getpid(),
                    "epoch": None if term is None else term.epoch,
                    "connections": connections_by_process(nats_server, [os.getpid()])[os.getpid()],
                }
                os.write(write_end, json.dumps(answer).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write_end)
        with os.fdopen(read_end) as pipe:
            answer = json.loads(pipe.read() or "{}")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert answer["own"] is True
        assert answer["epoch"] == parent_term.epoch
        # The child opened one connection of its own (it also holds the
        # parent's sockets, inherited over fork, which it never uses).
        opened = [name for name in answer["connections"] if name.endswith(f":{pid}")]
        assert opened == [f"celery-nats-leader client {socket.gethostname()}:{pid}"]
        # The parent's client was not disturbed by the child.
        assert ProcessClient.for_connection(reader.connection) is parent_client
        assert reader.read("r", timeout=2) is not None
    finally:
        reader.close()
        elector.stop()


def test_closed_at_exit(nats_server: NatsServer) -> None:
    bucket = f"pc_{uuid.uuid4().hex[:8]}"
    elector = Elector(nats_server.url, name="pc-test")
    elector.add_role(ElectionConfig(role="r", bucket=bucket, ttl=2.0, create_bucket=True))
    elector.start(timeout=10)
    # Exit handlers run last-registered first: this one, registered before
    # the package is imported, runs after the client's and sees what is left.
    program = f"""
import atexit, threading
atexit.register(lambda: print("left:", [t.name for t in threading.enumerate()
                                        if t.name == "nats-leader-client"]))
from celery_nats_leader.core.errors import BackendTimeoutError
from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.term import TermReader
term = TermReader(ConnectOptions(servers=({nats_server.url!r},)), {bucket!r}).read("r", timeout=5)
print("epoch:", term.epoch)
"""
    try:
        done = subprocess.run(
            [sys.executable, "-W", "error", "-c", program],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        elector.stop()
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.splitlines() == ["epoch: 1", "left: []"]


def test_a_closed_client_is_never_reopened(nats_server: NatsServer) -> None:
    connection = ConnectOptions(servers=(nats_server.url,))
    client = ProcessClient.for_connection(connection)

    async def connected() -> bool:
        return (await client.backend(5)).is_connected

    assert client.run(connected(), 5)
    client.close()
    # Kept by a caller past its close: it fails (callers retry), and does not
    # open a second connection beside the process's current client.
    with pytest.raises(BackendTimeoutError, match="was closed"):
        client.run(connected(), 5)
    current = ProcessClient.for_connection(connection)
    assert current is not client
    try:
        assert current.run(current.backend(5), 5).is_connected
        names = connections_by_process(nats_server, [os.getpid()])[os.getpid()]
        assert names.count(current.name) == 1, names
    finally:
        current.close()


def test_a_call_in_flight_when_the_client_closes_fails_as_an_election_error(
    nats_server: NatsServer,
) -> None:
    # close() (at exit, or a caller's) stops the loop under a call that is
    # waiting: the caller gets the package's error, that callers retry on
    # (the once-guard retries the task), not concurrent.futures' CancelledError.
    client = ProcessClient.for_connection(ConnectOptions(servers=(nats_server.url,)))
    started = threading.Event()
    raised: list[BaseException] = []

    async def waiting() -> None:
        await client.backend(5)
        started.set()
        await asyncio.Event().wait()  # an answer that never comes

    def call() -> None:
        try:
            client.run(waiting(), 30, what="the test's call")
        except BaseException as exc:
            raised.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    assert started.wait(10)
    client.close()
    caller.join(10)
    assert not caller.is_alive()
    assert [type(exc) for exc in raised] == [BackendTimeoutError]
    assert str(raised[0]) == "the test's call: the client was closed meanwhile"


def test_a_coroutines_own_runtime_error_is_not_taken_for_a_closed_client(
    nats_server: NatsServer,
) -> None:
    # Only a loop that is not running (a closed client) means "no answer";
    # a bug in the coroutine surfaces as itself.
    client = ProcessClient.for_connection(ConnectOptions(servers=(nats_server.url,)))

    async def broken() -> None:
        await client.backend(5)
        raise RuntimeError("a bug in the caller's coroutine")

    try:
        with pytest.raises(RuntimeError, match="a bug in the caller's coroutine") as info:
            client.run(broken(), 5)
        assert type(info.value) is RuntimeError
    finally:
        client.close()
