"""Every hook of the Prometheus observer labels its samples with bucket, role and instance."""

from __future__ import annotations

from celery_nats_leader.prometheus import PrometheusObserver


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
    assert all(s.labels["instance"] == "w1" for s in election)
    kinds = {s.labels["kind"] for s in samples if s.name == "nats_leader_failures_total"}
    assert kinds == {"renewal", "validation"}
