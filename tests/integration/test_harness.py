"""Tests of the real-server harness in ``celery_nats_leader.testing``.

Everything here runs real ``nats-server`` processes and real TCP through the
fault proxy; nothing is mocked. Port clashes are provoked by binding a port the
harness picked before the server gets to bind it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import nats
import nats.errors
import pytest
from nats.aio.client import Client
from nats.js.api import KeyValueConfig
from nats.js.kv import KeyValue

from celery_nats_leader.testing import (
    FaultProxy,
    NatsCluster,
    NatsServer,
    NatsServerError,
    ThreadedFaultProxy,
    find_nats_server_binary,
    free_port,
)

pytestmark = pytest.mark.integration

T = TypeVar("T")

# Fast client-side retry settings: the defaults (2 s connect timeout, 2 s
# between reconnects) would make every fault test slow.
CLIENT_OPTIONS: dict[str, Any] = {
    "connect_timeout": 2,
    "reconnect_time_wait": 0.1,
    "max_reconnect_attempts": -1,
}


async def eventually(
    action: Callable[[], Awaitable[T]], *, timeout: float = 20.0, interval: float = 0.1
) -> T:
    """Retry ``action`` until it succeeds, for conditions no event tells us about."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await action()
        except (nats.errors.Error, asyncio.TimeoutError):
            if time.monotonic() >= deadline:
                raise
        await asyncio.sleep(interval)


async def eventually_true(condition: Callable[[], bool], *, timeout: float = 5.0) -> None:
    """Poll ``condition`` (something no event reports) until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def connect(servers: str | list[str], **options: Any) -> Client:
    return await nats.connect(servers, **{**CLIENT_OPTIONS, **options})


async def connect_once(url: str) -> Client:
    # allow_reconnect=False alone does not make nats-py 2.16 fail fast: the
    # initial connect still retries max_reconnect_attempts (60) times,
    # reconnect_time_wait (2 s) apart, before raising NoServersError.
    return await nats.connect(
        url,
        connect_timeout=1,
        allow_reconnect=False,
        max_reconnect_attempts=1,
        reconnect_time_wait=0.05,
    )


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def no_asyncio_errors() -> Iterator[None]:
    """Fail on errors asyncio only logs (exceptions in callbacks, lost task errors).

    Registered first, so it is torn down last: the proxy's and servers'
    shutdown happens while it still listens.
    """
    handler = _Collect()
    asyncio_logger = logging.getLogger("asyncio")
    asyncio_logger.addHandler(handler)
    try:
        yield
    finally:
        asyncio_logger.removeHandler(handler)
    assert not handler.records, [r.getMessage() for r in handler.records]


@pytest.fixture
def server() -> Iterator[NatsServer]:
    with NatsServer() as srv:
        yield srv


@pytest.fixture
async def proxy(server: NatsServer) -> AsyncIterator[FaultProxy]:
    async with FaultProxy("127.0.0.1", server.port) as prx:
        yield prx


@pytest.fixture
async def echo(server: NatsServer) -> AsyncIterator[None]:
    """A responder on subject ``echo``, connected to the server directly."""
    nc = await connect(server.url)

    async def reply(msg: Any) -> None:
        await msg.respond(msg.data)

    await nc.subscribe("echo", cb=reply)
    await nc.flush()
    try:
        yield
    finally:
        await nc.close()


class ConnectionEvents:
    """Client callbacks turned into events a test can await."""

    def __init__(self) -> None:
        self.disconnected = asyncio.Event()
        self.reconnected = asyncio.Event()

    async def on_disconnected(self) -> None:
        self.disconnected.set()

    async def on_reconnected(self) -> None:
        self.reconnected.set()

    def options(self) -> dict[str, Any]:
        return {"disconnected_cb": self.on_disconnected, "reconnected_cb": self.on_reconnected}


# -- binary lookup and ports -----------------------------------------------


def test_binary_from_env_must_be_executable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NATS_SERVER_BIN", "/nonexistent/nats-server")
    with pytest.raises(RuntimeError, match="apt-get install nats-server"):
        find_nats_server_binary()


def test_binary_from_env_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NATS_SERVER_BIN", raising=False)
    real = find_nats_server_binary()
    monkeypatch.setenv("NATS_SERVER_BIN", real)
    assert find_nats_server_binary() == real


def test_free_port_never_repeats_and_is_bindable() -> None:
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))


# -- NatsServer ---------------------------------------------------------------


async def test_server_kv_roundtrip_and_data_survives_restart(server: NatsServer) -> None:
    nc = await connect(server.url)
    try:
        kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket="harness"))
        await kv.put("k", b"v1")
        entry = await kv.get("k")
        assert entry.value == b"v1"
    finally:
        await nc.close()

    port, store_dir, first_pid = server.port, server.store_dir, server.pid
    # In a thread: restart() blocks until the server is ready again.
    await asyncio.to_thread(server.restart)
    assert (server.port, server.store_dir) == (port, store_dir)
    assert server.pid != first_pid

    nc = await connect(server.url)
    try:
        kv = await nc.jetstream().key_value("harness")
        assert (await kv.get("k")).value == b"v1"
        await kv.put("k", b"v2")
    finally:
        await nc.close()

    # A crash (SIGKILL) must not lose acknowledged writes either.
    await asyncio.to_thread(server.restart, graceful=False)
    nc = await connect(server.url)
    try:
        kv = await nc.jetstream().key_value("harness")
        assert (await kv.get("k")).value == b"v2"
    finally:
        await nc.close()


async def test_server_kill_breaks_connections(server: NatsServer) -> None:
    events = ConnectionEvents()
    nc = await connect(server.url, **events.options())
    try:
        server.kill()
        assert not server.is_running
        assert server.pid is None
        await asyncio.wait_for(events.disconnected.wait(), 10)
        assert not nc.is_connected
        # No request here: nats-py 2.16 buffers it while reconnecting, and then
        # close() raises ConnectionResetError trying to flush it to the dead socket.
    finally:
        await nc.close()

    with pytest.raises(nats.errors.NoServersError):
        await connect_once(server.url)


async def test_server_pause_and_resume(server: NatsServer, echo: None) -> None:
    nc = await connect(server.url)
    try:
        assert (await nc.request("echo", b"hi", timeout=2)).data == b"hi"
        server.pause()
        assert server.is_paused and server.is_running
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request("echo", b"hi", timeout=0.5)
        server.resume()
        assert not server.is_paused
        reply = await eventually(lambda: nc.request("echo", b"back", timeout=1))
        assert reply.data == b"back"
    finally:
        await nc.close()


def test_server_close_reaps_process_and_removes_files() -> None:
    srv = NatsServer()
    srv.start()
    pid, tmp_dir = srv.pid, srv.store_dir.parent
    assert pid is not None and tmp_dir.is_dir()
    srv.pause()  # close() must also stop a frozen server
    srv.close()
    srv.close()  # idempotent
    assert not srv.is_running
    assert not tmp_dir.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped, not a zombie (a zombie still accepts signal 0)
    with pytest.raises(NatsServerError):
        srv.start()


def test_server_without_jetstream() -> None:
    with NatsServer(jetstream=False) as srv:
        assert "Starting JetStream" not in srv.log_text()
        assert srv.is_running


@pytest.mark.parametrize("which", ["port", "monitor_port"])
def test_server_moves_to_new_ports_if_one_is_taken(which: str) -> None:
    srv = NatsServer()
    try:
        taken = getattr(srv, which)
        # Another process grabs the port between our pick and the server's bind.
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", taken))
            squatter.listen()
            srv.start()
            assert getattr(srv, which) != taken
            assert "address already in use" in srv.log_text()
        # Once started, the ports are fixed: a restart keeps them.
        port, monitor_port = srv.port, srv.monitor_port
        srv.restart()
        assert (srv.port, srv.monitor_port) == (port, monitor_port)
    finally:
        srv.close()


def test_server_monitoring() -> None:
    with NatsServer() as srv:
        assert srv.healthz() is None
        assert srv.monitor("varz")["port"] == srv.port
        assert srv.meta_leader() is None  # not clustered
        srv.pause()
        assert srv.healthz(timeout=0.2) is not None
        srv.resume()


def test_server_start_failure_reports_log_tail() -> None:
    # nats-server 2.9 reports an unknown flag first, then prints its usage text.
    srv = NatsServer(extra_args=["--no-such-flag"])
    try:
        with pytest.raises(NatsServerError, match="flag provided but not defined: -no-such-flag"):
            srv.start()
        assert not srv.is_running
    finally:
        srv.close()

    srv = NatsServer(extra_args=["-c", "/nonexistent.conf"])
    try:
        with pytest.raises(NatsServerError, match=r"nonexistent\.conf: no such file"):
            srv.start()
    finally:
        srv.close()


# -- NatsCluster ----------------------------------------------------------------


async def kv_leader_index(cluster: NatsCluster, nc: Client, bucket: str) -> int:
    """Index of the server leading the bucket's stream, once its RAFT group has elected one.

    A newly created R3 stream answers its create before its group has a
    leader (nats-server 2.15 takes a few hundred milliseconds): until then a
    publish gets "no responders" and stream info shows no leader.
    """

    async def elected() -> str:
        info = await nc.jetstream().stream_info(f"KV_{bucket}")
        if info.cluster is None or info.cluster.leader is None:
            raise nats.errors.Error(f"stream KV_{bucket} has no leader yet")
        return info.cluster.leader

    leader = await eventually(elected)
    return [s.server_name for s in cluster.servers].index(leader)


async def put_and_check(kv: KeyValue, key: str, value: bytes) -> None:
    await eventually(lambda: kv.put(key, value))

    async def read_back() -> None:
        entry = await kv.get(key)
        if entry.value != value:  # e.g. answered by a replica still catching up
            raise nats.errors.Error(f"read {entry.value!r}, expected {value!r}")

    await eventually(read_back)


@pytest.mark.parametrize("victim", ["kv_leader", "kv_follower"])
async def test_cluster_r3_kv_survives_losing_a_member(victim: str) -> None:
    with NatsCluster(3) as cluster:
        assert len(cluster.urls) == 3
        leader = cluster.wait_for_meta_leader()
        assert leader in {s.server_name for s in cluster.servers}

        nc = await connect(cluster.urls)
        try:
            kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket="harness", replicas=3))
            index = await kv_leader_index(cluster, nc, "harness")
            await kv.put("k", b"before")

            if victim == "kv_follower":
                index = (index + 1) % 3
            cluster.kill(index)
            assert not cluster.servers[index].is_running

            await put_and_check(kv, "k", b"after-kill")

            await asyncio.to_thread(cluster.restart, index)
            assert cluster.servers[index].is_running
            await put_and_check(kv, "k", b"after-restart")
        finally:
            await nc.close()


def test_cluster_moves_to_new_ports_if_a_route_port_is_taken() -> None:
    # nats-server 2.9 binds the route port only after logging "Server is
    # ready", and then exits; the cluster must notice and move to new ports.
    cluster = NatsCluster(3)
    try:
        taken = cluster.servers[1].cluster_port
        assert taken is not None
        with socket.socket() as squatter:
            squatter.bind(("127.0.0.1", taken))
            squatter.listen()
            cluster.start()
        assert all(s.is_running for s in cluster.servers)
        assert taken not in {s.cluster_port for s in cluster.servers}
        assert cluster.wait_for_meta_leader() in {s.server_name for s in cluster.servers}
    finally:
        cluster.close()


# -- FaultProxy -------------------------------------------------------------------


async def test_proxy_forwards(server: NatsServer, proxy: FaultProxy) -> None:
    assert proxy.url == f"nats://127.0.0.1:{proxy.port}"
    nc = await connect(proxy.url)
    try:
        kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket="proxied"))
        await kv.put("k", b"v")
        assert (await kv.get("k")).value == b"v"
        assert proxy.connections == 1
    finally:
        await nc.close()
    await proxy.wait_for_connections(0)


async def test_proxy_blackhole_and_heal(proxy: FaultProxy, echo: None) -> None:
    nc = await connect(proxy.url)
    try:
        assert (await nc.request("echo", b"1", timeout=2)).data == b"1"
        proxy.blackhole()
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request("echo", b"2", timeout=0.5)
        assert proxy.connections == 1  # a partition, not a disconnect
        proxy.heal()
        reply = await eventually(lambda: nc.request("echo", b"3", timeout=1))
        assert reply.data == b"3"
    finally:
        await nc.close()


async def test_proxy_reset_fires_disconnected_callback(proxy: FaultProxy, echo: None) -> None:
    events = ConnectionEvents()
    nc = await connect(proxy.url, **events.options())
    try:
        proxy.reset()
        await asyncio.wait_for(events.disconnected.wait(), 10)
        await asyncio.wait_for(events.reconnected.wait(), 10)
        assert (await nc.request("echo", b"again", timeout=2)).data == b"again"
        assert proxy.accepted >= 2  # the original connection and the reconnect
    finally:
        await nc.close()


async def test_proxy_refuse_and_accept(proxy: FaultProxy) -> None:
    proxy.refuse()
    # The TCP handshake succeeds (the kernel completes it), then the RST comes
    # in while the client waits for INFO.
    with pytest.raises(ConnectionResetError):
        await connect_once(proxy.url)
    assert proxy.accepted == 0
    proxy.accept()
    nc = await connect(proxy.url)
    try:
        assert nc.is_connected
    finally:
        await nc.close()


async def test_proxy_delay_adds_latency(proxy: FaultProxy) -> None:
    nc = await connect(proxy.url)
    try:
        kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket="slow"))
        await kv.put("k", b"v")

        proxy.delay(0.3)
        started = time.monotonic()
        assert (await kv.get("k")).value == b"v"
        assert time.monotonic() - started >= 0.3

        proxy.delay(0)
        started = time.monotonic()
        assert (await kv.get("k")).value == b"v"
        assert time.monotonic() - started < 0.3
    finally:
        await nc.close()


async def test_proxy_delay_preserves_order() -> None:
    # Raw TCP against an echo server: a chunk sent after the delay was lowered
    # must still come after the chunk that is held back.
    handler_done = asyncio.Event()

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1024):
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        finally:
            writer.close()
            handler_done.set()

    upstream = await asyncio.start_server(echo, "127.0.0.1", 0)
    async with upstream:
        port = upstream.sockets[0].getsockname()[1]
        async with FaultProxy("127.0.0.1", port) as prx:
            reader, writer = await asyncio.open_connection("127.0.0.1", prx.port)
            try:
                prx.delay(0.3)
                started = time.monotonic()
                writer.write(b"first")
                await writer.drain()
                await eventually_true(lambda: prx.in_flight > 0)
                prx.delay(0)
                writer.write(b"second")
                await writer.drain()
                data = await asyncio.wait_for(reader.readexactly(len(b"firstsecond")), 5)
                assert data == b"firstsecond"
                assert time.monotonic() - started >= 0.3
            finally:
                writer.close()
                await writer.wait_closed()
            await asyncio.wait_for(handler_done.wait(), 5)
        assert prx.in_flight == 0


async def test_proxy_stop_and_start_keep_the_port(proxy: FaultProxy, echo: None) -> None:
    events = ConnectionEvents()
    nc = await connect(proxy.url, **events.options())
    try:
        port = proxy.port
        await proxy.stop()
        await asyncio.wait_for(events.disconnected.wait(), 10)
        await proxy.start()
        assert proxy.port == port
        await asyncio.wait_for(events.reconnected.wait(), 10)
        assert (await nc.request("echo", b"back", timeout=2)).data == b"back"
    finally:
        await nc.close()


async def test_proxy_to_dead_server_resets_clients() -> None:
    with NatsServer() as srv:
        async with FaultProxy("127.0.0.1", srv.port) as prx:
            srv.stop()
            with pytest.raises(ConnectionResetError):
                await connect_once(prx.url)


async def test_threaded_proxy_controlled_from_other_threads(server: NatsServer, echo: None) -> None:
    events = ConnectionEvents()
    with ThreadedFaultProxy("127.0.0.1", server.port) as prx:
        nc = await connect(prx.url, **events.options())
        try:
            assert (await nc.request("echo", b"1", timeout=2)).data == b"1"
            assert prx.connections == 1

            await asyncio.to_thread(prx.blackhole)
            with pytest.raises(nats.errors.TimeoutError):
                await nc.request("echo", b"2", timeout=0.5)
            await asyncio.to_thread(prx.heal)

            await asyncio.to_thread(prx.reset)
            await asyncio.wait_for(events.disconnected.wait(), 10)
            await asyncio.wait_for(events.reconnected.wait(), 10)
            await asyncio.to_thread(prx.wait_for_connections, 1)
            reply = await eventually(lambda: nc.request("echo", b"3", timeout=1))
            assert reply.data == b"3"
        finally:
            await nc.close()
        await asyncio.to_thread(prx.wait_for_connections, 0)


async def test_proxy_stop_with_live_connections(server: NatsServer) -> None:
    events = ConnectionEvents()
    async with FaultProxy("127.0.0.1", server.port) as prx:
        nc = await connect(prx.url, **events.options())
    # Leaving the block stopped the proxy while the client was still connected.
    try:
        assert prx.connections == 0
        await asyncio.wait_for(events.disconnected.wait(), 10)
    finally:
        await nc.close()
