"""The shipped Prometheus alert rules and Grafana dashboard (deploy/).

``promtool check rules`` validates the rules and ``promtool test rules`` runs
their unit tests (deploy/prometheus/nats-leader-rules.test.yml: each alert
fires on the series it is meant for, and not on its look-alikes). Every
metric the rules and the dashboard query must be one the package exports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from celery_nats_leader.observe.prometheus import PrometheusObserver

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "nats-leader-rules.yml"
RULE_TESTS = DEPLOY / "prometheus" / "nats-leader-rules.test.yml"
DASHBOARD = DEPLOY / "grafana" / "nats-leader-dashboard.json"

#: The beat scheduler's tick counter (exported by the beat package with the
#: election metrics); the rules alert on its "lost" and "send_failed" outcomes.
BEAT_METRICS = {"nats_leader_beat_ticks_total"}


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("promtool is required when CI=true (scripts/bootstrap installs it)")
        pytest.skip("promtool not installed (Debian package prometheus; scripts/bootstrap)")
    return found


def exported_metrics() -> set[str]:
    names = set()
    for family in PrometheusObserver().registry.collect():
        names.add(family.name)
        if family.type in ("counter",):
            names.add(family.name + "_total")
        if family.type == "histogram":
            names.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    return names | BEAT_METRICS


def used_metrics(text: str) -> set[str]:
    return set(re.findall(r"\b(nats_leader_[a-z_]+)", text))


def test_promtool_checks_the_rules() -> None:
    result = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 12 rules found" in result.stdout


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    result = subprocess.run(
        [promtool(), "test", "rules", RULE_TESTS.name],
        cwd=RULE_TESTS.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_a_unit_test() -> None:
    alerts = set(re.findall(r"- alert: (\w+)", RULES.read_text()))
    tested = set(re.findall(r"alertname: (\w+)", RULE_TESTS.read_text()))
    assert alerts == tested
    assert len(alerts) == 12


def test_rules_and_dashboard_query_only_exported_metrics() -> None:
    exported = exported_metrics()
    assert {"nats_leader_has_leader", "nats_leader_connected", "nats_leader_failures_total"} <= (
        exported
    )
    assert used_metrics(RULES.read_text()) <= exported
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert exprs and used_metrics("\n".join(exprs)) <= exported
    variables = [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert used_metrics("\n".join(variables)) <= exported
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
