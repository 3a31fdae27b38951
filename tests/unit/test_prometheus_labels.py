"""Every hook of the Prometheus observer labels its samples with bucket, role and instance_id."""

from __future__ import annotations

import threading

import pytest

from celery_nats_leader.observe.prometheus import PrometheusObserver


def test_every_hook_writes_bucket_role_instance() -> None:
    observer = PrometheusObserver(bucket="main")
    observer.track("reports", "other")
    for role in ("jobs", "reports"):
        observer.state_changed(role, "w1", "candidate", "leader")
        observer.campaign(role, "w1", True)
        observer.heartbeat(role, "w1", 0.001, False)
        observer.validation(role, "w1", False)
        observer.set_leader(role, "w1", True)
        observer.set_election_error(role, "w1", False)
    samples = [
        sample
        for family in observer.registry.collect()
        for sample in family.samples
        if not sample.name.endswith("_created")
    ]
    election = [s for s in samples if "role" in s.labels]
    assert election, samples
    assert {(s.labels["bucket"], s.labels["role"]) for s in election} == {
        ("main", "jobs"),
        ("other", "reports"),
    }
    assert all(s.labels["instance_id"] == "w1" for s in election)
    kinds = {s.labels["kind"] for s in samples if s.name == "nats_leader_failures_total"}
    assert kinds == {"renewal", "validation"}


def test_no_label_is_renamed_by_a_default_scrape() -> None:
    # Prometheus attaches the target labels ``instance`` (host:port) and
    # ``job`` to every scraped sample; with default settings
    # (honor_labels: false) a scraped label of either name becomes
    # ``exported_instance`` / ``exported_job``, and ``$labels.instance`` in an
    # alert shows the target's host:port, not the replica.
    from celery_nats_leader.beat.metrics import TickMetrics

    observer = PrometheusObserver()
    observer.state_changed("jobs", "w1", "candidate", "leader")
    observer.connected.labels("w1").set(1)
    observer.failures.labels("leaders", "jobs", "w1", "error").inc()
    ticks = TickMetrics("beat", "w1")
    ticks.export_to(observer.registry, observer.namespace)
    ticks.add("nightly", "dispatched")
    names = {
        label
        for family in observer.registry.collect()
        for sample in family.samples
        for label in sample.labels
    }
    assert not names & {"instance", "job"}, names
    assert {"bucket", "role", "instance_id", "kind", "entry", "outcome"} <= names


def test_the_namespace_prefixes_every_metric() -> None:
    from celery_nats_leader.beat.metrics import TickMetrics

    observer = PrometheusObserver(namespace="billing_leader")
    TickMetrics("beat", "w1").export_to(observer.registry, observer.namespace)
    families = {family.name for family in observer.registry.collect()}
    assert "billing_leader_is_leader" in families
    assert "billing_leader_beat_ticks" in families
    assert all(name.startswith("billing_leader_") for name in families), families


def test_a_leader_stopped_by_a_permanent_error_counts_one_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The election demotes its leader (reason "error") and then reports the
    # error: one failure of kind "error", not one per callback.
    from celery_nats_leader import ElectionConfig, Elector
    from celery_nats_leader.core.errors import PermissionDeniedError
    from celery_nats_leader.nats.memory import MemoryBackend, MemoryBucket, MemoryServer

    server = MemoryServer()
    observer = PrometheusObserver()
    elector = Elector(backend_factory=lambda: MemoryBackend(server), observer=observer)
    handle = elector.add_role(
        ElectionConfig(role="jobs", instance_id="w1", ttl=1.0, create_bucket=True)
    )
    observer.watch_elector(elector, "w1")
    stopped = threading.Event()
    handle.on_error(lambda _error: stopped.set())
    elector.start(timeout=5.0)
    try:
        assert handle.wait_for_leadership(5.0)

        async def denied(self: MemoryBucket, *args: object, **kwargs: object) -> int:
            raise PermissionDeniedError("permissions violation for publish")

        monkeypatch.setattr(MemoryBucket, "update", denied)
        assert stopped.wait(5.0)
        assert not handle.is_leader
    finally:
        elector.stop()

    def failures(kind: str) -> float | None:
        return observer.registry.get_sample_value(
            "nats_leader_failures_total",
            {"bucket": "leaders", "role": "jobs", "instance_id": "w1", "kind": kind},
        )

    assert failures("error") == 1.0
