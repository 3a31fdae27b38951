"""The worker integration: signals, ``celery nats-leader status``, metrics, start-up errors."""

from __future__ import annotations

import asyncio
import json
import os
import re
import urllib.request
from typing import Any

import pytest
from cnl_celery_harness import Cluster, run_cli, wait_for

from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.nats.connection import connect
from celery_nats_leader.nats.jetstream import JetStreamBackend
from celery_nats_leader.testing import NatsServer, free_port

pytestmark = [pytest.mark.celery, pytest.mark.integration]


def test_signals_promote_and_demote_before_handover(cluster_factory: Any) -> None:
    cluster: Cluster = cluster_factory(ttl=2.0)
    first = cluster.start_worker("w1", pool="solo", concurrency=1)
    cluster.wait_leader()
    second = cluster.start_worker("w2", pool="solo", concurrency=1)
    first.terminate()
    cluster.wait_leader(exclude=(first,))
    assert first.wait(60) == 0

    terms = cluster.ledger.terms()
    assert [(t.event, t.role, t.main_pid) for t in terms] == [
        ("promoted", cluster.role, first.pid),
        ("demoted", cluster.role, first.pid),
        ("promoted", cluster.role, second.pid),
    ]
    promoted_first, demoted_first, promoted_second = terms
    assert promoted_first.epoch is not None and promoted_second.epoch is not None
    assert promoted_second.epoch > promoted_first.epoch
    assert demoted_first.reason == "stopped"
    # leader_demoted runs before the key is released, so before any successor.
    assert demoted_first.t < promoted_second.t


def test_status_cli(cluster_factory: Any) -> None:
    cluster: Cluster = cluster_factory(ttl=2.0)
    first = cluster.start_worker("w1", pool="threads")
    cluster.wait_leader()
    second = cluster.start_worker("w2", pool="threads")

    # A generous window: a busy worker may answer the roster request late.
    result = run_cli(cluster, "status", "--json", "--window", "2")
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["bucket"] == cluster.config["bucket"]
    assert body["leaderless"] == []
    (role,) = [r for r in body["roles"] if r["role"] == cluster.role]
    promotion = cluster.ledger.promotions()[-1]
    assert role["has_leader"] is True
    assert role["epoch"] == promotion.epoch
    assert role["leader_meta"]["pid"] == first.pid
    assert role["leader_meta"]["worker"].startswith("w1@")
    assert role["expires_in"] is not None and role["expires_in"] > 0
    assert sorted(c["meta"]["pid"] for c in role["candidates"]) == sorted([first.pid, second.pid])

    table = run_cli(cluster, "status")
    assert table.returncode == 0, table.stderr
    assert re.search(rf"^{re.escape(cluster.role)}\s+\S+\s+{promotion.epoch}\s", table.stdout, re.M)

    # Nobody left: the configured role has no leader, exit code 1.
    first.stop()
    second.stop()
    result = run_cli(cluster, "status", "--json")
    assert result.returncode == 1
    assert json.loads(result.stdout)["leaderless"] == [cluster.role]

    # NATS unreachable: exit code 2, and a message saying so.
    cluster.config["nats_url"] = f"nats://127.0.0.1:{free_port('127.0.0.1')}"
    result = run_cli(cluster, "status", "--timeout", "1")
    assert result.returncode == 2
    assert "could not connect to NATS" in result.stderr


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def _sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_metrics_endpoint(cluster_factory: Any) -> None:
    cluster: Cluster = cluster_factory(ttl=2.0)
    leader_port, follower_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    cluster.start_worker("w1", config={"metrics_port": leader_port})
    cluster.wait_leader()
    cluster.start_worker("w2", config={"metrics_port": follower_port})
    role = cluster.role
    for seq in range(3):
        cluster.send("cnl.record_validated", seq)
    wait_for(lambda: cluster.ledger.committed() == 3, 60, "three validated tasks")

    def leader_metrics() -> str | None:
        text = _scrape(leader_port)
        heartbeats = _sample(text, "nats_leader_heartbeat_seconds_count", role=role)
        validations = _sample(text, "nats_leader_token_validations_total", role=role)
        return text if heartbeats and heartbeats >= 2 and validations and validations >= 3 else None

    def both_workers() -> str:
        lines = []
        for name, port in (("w1", leader_port), ("w2", follower_port)):
            lines += [
                f"{name}: {line}"
                for line in _scrape(port).splitlines()
                if line.startswith("nats_leader_") and "_bucket{" not in line
            ]
        return "\n".join(lines)

    text = wait_for(
        leader_metrics, 30, "renewals and validations in the metrics", diagnostics=both_workers
    )
    assert _sample(text, "nats_leader_is_leader", role=role) == 1.0
    assert _sample(text, "nats_leader_campaigns_total", role=role, outcome="won") == 1.0
    assert _sample(text, "nats_leader_transitions_total", role=role, to_state="leader") == 1.0
    assert _sample(text, "nats_leader_heartbeat_failures_total", role=role) in (None, 0.0)
    assert _sample(text, "nats_leader_token_validation_failures_total", role=role) in (None, 0.0)

    follower = _scrape(follower_port)
    assert _sample(follower, "nats_leader_is_leader", role=role) == 0.0
    assert _sample(follower, "nats_leader_transitions_total", role=role, to_state="follower") == 1.0


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"ttl": "soon", "extra": {"rolse": ["typo"]}},
            "nats_leader_ttl='soon' must be a number of seconds",
        ),
        (
            {"roles": ["jobs", "no spaces please"]},
            "nats_leader_roles='no spaces please' is not a valid role name",
        ),
        (
            {"extra": {"heartbeat_interval": 5}},
            "nats_leader_heartbeat_interval=5.0 is too long for nats_leader_ttl=2.0",
        ),
        (
            {"extra": {"role_options": {"other": {"ttl": 3}}}},
            "nats_leader_role_options names role(s) other",
        ),
    ],
)
def test_bad_config_stops_the_worker_with_a_clear_error(
    cluster_factory: Any, config: dict[str, Any], message: str
) -> None:
    cluster: Cluster = cluster_factory(ttl=2.0)
    worker = cluster.start_worker("bad", config=config, wait=False)
    assert worker.wait(60) == os.EX_CONFIG
    log = worker.log()
    assert "ConfigError" in log and message in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    if "rolse" in config.get("extra", {}):
        assert "did you mean 'nats_leader_roles'?" in log, log[-3000:]


def test_required_nats_unreachable_refuses_to_start(cluster_factory: Any) -> None:
    cluster: Cluster = cluster_factory(ttl=2.0)
    dead = f"nats://127.0.0.1:{free_port('127.0.0.1')}"
    worker = cluster.start_worker(
        "w1", config={"nats_url": dead, "required": True, "start_timeout": 2}, wait=False
    )
    assert worker.wait(60) == os.EX_UNAVAILABLE
    log = worker.log()
    assert "cannot start leader election (nats_leader_required=True)" in log, log[-3000:]
    assert "could not connect to NATS" in log
    assert "Traceback" not in log, log[-3000:]


def test_unreachable_nats_serves_ordinary_tasks_and_keeps_trying(cluster_factory: Any) -> None:
    port = free_port("127.0.0.1")
    late = NatsServer(port=port)
    try:
        cluster: Cluster = cluster_factory(ttl=2.0)
        config = {"nats_url": late.url, "extra": {"create_bucket": True}}
        worker = cluster.start_worker("w1", config=config)
        cluster.send("cnl.plain", 7)
        ledger = cluster.ledger
        wait_for(
            lambda: ledger.count("SELECT COUNT(*) FROM events WHERE kind = 'plain'"),
            60,
            "the ordinary task to run without NATS",
        )
        cluster.send("cnl.record", 1)
        wait_for(
            lambda: (
                "leader election is not running (1 failed attempt): NatsUnavailableError"
                in worker.log()
            ),
            30,
            "a loud warning",
        )
        assert ledger.committed() == 0

        late.start()
        wait_for(
            lambda: ledger.committed() == 1,
            60,
            "the leader-only task after NATS came",
            cluster.diagnostics,
        )
        assert ledger.rows("SELECT main_pid FROM commits") == [(worker.pid,)]
    finally:
        late.close()


async def _bucket_exists(url: str, bucket: str) -> bool:
    nc = await connect(ConnectOptions(servers=(url,)), timeout=5)
    try:
        await JetStreamBackend(nc).open_bucket(
            bucket, ttl=None, create=False, replicas=1, timeout=5
        )
        return True
    finally:
        await nc.close()


def test_missing_bucket_is_a_clear_error_when_required(cluster_factory: Any) -> None:
    cluster: Cluster = cluster_factory(ttl=2.0, create_bucket=False)
    worker = cluster.start_worker("w1", config={"required": True}, wait=False)
    assert worker.wait(60) != 0
    log = worker.log()
    assert worker.proc.returncode == os.EX_UNAVAILABLE
    assert "cannot start leader election" in log and "BucketNotFoundError: KV bucket" in log, log
    # One line that says what to do, not NATS's chained tracebacks.
    assert "Traceback" not in log, log[-3000:]
    assert not asyncio.run(_bucket_exists_quietly(cluster))


async def _bucket_exists_quietly(cluster: Cluster) -> bool:
    try:
        return await _bucket_exists(cluster.nats.url, cluster.config["bucket"])
    except Exception:
        return False


@pytest.mark.parametrize("pool", ["gevent", "eventlet"])
def test_green_pools_are_refused_at_start_with_a_clear_message(
    cluster_factory: Any, pool: str
) -> None:
    cluster: Cluster = cluster_factory(ttl=2.0)
    worker = cluster.start_worker("green", pool=pool, wait=False)
    assert worker.wait(60) == os.EX_CONFIG
    log = worker.log()
    assert f"the {pool} pool is not supported" in log, log[-3000:]
    assert "Use -P prefork (the default), threads or solo" in log
    assert "Traceback" not in log, log[-3000:]
    # Refused before campaigning: it never led.
    assert cluster.ledger.promotions() == []
