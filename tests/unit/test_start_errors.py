"""Which start-up errors are retried, and how JetStream's refusals are translated."""

from __future__ import annotations

import threading
from typing import Any

import nats.errors
import nats.js.errors
import pytest

from celery_nats_leader.core.backoff import retry_transient
from celery_nats_leader.core.errors import (
    BackendError,
    BackendTimeoutError,
    BucketConfigError,
    BucketNotFoundError,
    ElectionError,
    ElectionStoppedError,
    JetStreamUnavailableError,
    NatsUnavailableError,
    NotConnectedError,
    PermissionDeniedError,
    is_transient,
)
from celery_nats_leader.election.elector import Elector
from celery_nats_leader.nats.jetstream import (
    _bucket_api_error,
    _connection_error,
    _jetstream_refusal,
)


def unavailable(err_code: int) -> nats.js.errors.ServiceUnavailableError:
    return nats.js.errors.ServiceUnavailableError(
        code=503, err_code=err_code, description="from the server"
    )


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (NatsUnavailableError("x"), True),
        (BackendError("x"), True),
        (BackendTimeoutError("x"), True),
        (NotConnectedError("x"), True),
        (BucketNotFoundError("x"), False),
        (BucketConfigError("x"), False),
        (JetStreamUnavailableError("x"), False),
        (PermissionDeniedError("x"), False),
    ],
)
def test_what_is_transient(exc: ElectionError, transient: bool) -> None:
    assert is_transient(exc) is transient


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        # A cluster electing a stream leader, a store that was full: retry.
        (unavailable(10008), BackendError),
        # Insufficient resources (an R3 bucket on a cluster missing a node): retry.
        (unavailable(10023), BackendError),
        # JetStream off for the server or the account: say so, do not retry.
        (unavailable(10076), JetStreamUnavailableError),
        (unavailable(10039), JetStreamUnavailableError),
        (nats.errors.NoRespondersError(), JetStreamUnavailableError),
        # A 503 status with no JetStream error body: nobody serves the API.
        (nats.js.errors.ServiceUnavailableError(), JetStreamUnavailableError),
    ],
)
def test_jetstream_refusals(exc: Exception, expected: type[ElectionError]) -> None:
    translated = _jetstream_refusal(exc)
    assert type(translated) is expected
    assert is_transient(translated) is (expected is BackendError)


def test_bucket_api_errors() -> None:
    bad = nats.js.errors.BadBucketError(code=400, description="not a KV stream")
    assert isinstance(_bucket_api_error(bad, "leaders"), BucketConfigError)
    denied = nats.js.errors.APIError(code=403, description="Permissions Violation")
    assert isinstance(_bucket_api_error(denied, "leaders"), PermissionDeniedError)
    other = nats.js.errors.ServerError(code=500, description="oops")
    assert type(_bucket_api_error(other, "leaders")) is BackendError


def test_connection_errors_are_transient() -> None:
    for exc in (
        nats.errors.OutboundBufferLimitError(),
        nats.errors.ConnectionReconnectingError(),
        nats.errors.ConnectionClosedError(),
    ):
        assert isinstance(_connection_error(exc), NotConnectedError)


def test_retry_transient_retries_until_it_works() -> None:
    calls: list[float] = []

    def flaky(remaining: float) -> str:
        calls.append(remaining)
        if len(calls) < 3:
            raise BackendError("JetStream system temporarily unavailable")
        return "started"

    assert retry_transient(flaky, timeout=10.0, what="test") == "started"
    assert len(calls) == 3
    # Each attempt is told the time left, which shrinks.
    assert 0 < calls[2] < calls[0] <= 10.0


def test_retry_transient_raises_a_permanent_error_at_once() -> None:
    calls = 0

    def missing(_remaining: float) -> None:
        nonlocal calls
        calls += 1
        raise BucketNotFoundError("no bucket")

    with pytest.raises(BucketNotFoundError):
        retry_transient(missing, timeout=10.0, what="test")
    assert calls == 1


def test_retry_transient_gives_up_at_the_deadline() -> None:
    calls = 0

    def down(_remaining: float) -> None:
        nonlocal calls
        calls += 1
        raise NatsUnavailableError("no server")

    with pytest.raises(NatsUnavailableError):
        retry_transient(down, timeout=0.3, what="test")
    # 50, 100, ~200 ms of backoff: the deadline stops it after a few attempts.
    assert 2 <= calls <= 4


def test_stop_from_another_thread_ends_a_required_start_that_is_retrying() -> None:
    failed = threading.Event()

    def unreachable() -> Any:
        failed.set()
        raise NatsUnavailableError("no server")

    elector = Elector(backend_factory=unreachable)
    stopper = threading.Thread(target=lambda: (failed.wait(10), elector.stop()))
    stopper.start()
    try:
        # Without the stop it would retry for 30 s; with it, it ends saying why.
        with pytest.raises(ElectionStoppedError, match="stopped"):
            elector.start(timeout=30.0)
    finally:
        stopper.join(10)
    assert failed.is_set()
    assert not elector.loop.is_running


async def test_a_server_that_never_says_hello_costs_no_socket() -> None:
    # A listener that accepts the TCP connection and never sends INFO (a
    # half-started server, a wrong port behind a proxy): every attempt ends in
    # NatsUnavailableError within its timeout, and gives its socket back.
    import asyncio
    import os
    import time

    from celery_nats_leader.config.connection import ConnectOptions
    from celery_nats_leader.nats.connection import connect

    accepted: list[asyncio.StreamWriter] = []

    async def silent(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    options = ConnectOptions(servers=(f"nats://127.0.0.1:{port}",))
    before = len(os.listdir("/proc/self/fd"))
    tasks_before = len(asyncio.all_tasks())
    for timeout in (1.0, 3.0):
        started = time.monotonic()
        with pytest.raises(NatsUnavailableError, match="could not connect"):
            await connect(options, timeout=timeout)
        assert time.monotonic() - started < timeout + 1.0
    # Our side of every accepted connection is closed: closing the listener's
    # side leaves nothing of them open in this process.
    assert len(accepted) >= 2
    for writer in accepted:
        writer.close()
    server.close()
    await server.wait_closed()
    for _ in range(50):  # the transports close on the loop's next iterations
        if len(os.listdir("/proc/self/fd")) <= before - 1:
            break
        await asyncio.sleep(0.02)
    assert len(os.listdir("/proc/self/fd")) == before - 1  # the listener's own socket
    assert len(asyncio.all_tasks()) == tasks_before
