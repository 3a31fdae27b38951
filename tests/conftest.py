"""Hooks of the whole suite: every report names the nats-server version it ran against.

``scripts/test`` runs the suite once per server version (``NATS_SERVER_VERSION``),
so a failure must say which server it failed on.
"""

from __future__ import annotations

import functools

import pytest

from celery_nats_leader.testing import binary_version, find_nats_server_binary


@functools.cache
def server_under_test() -> str:
    """``nats-server 2.15.1 (/path)``, or why there is none."""
    try:
        binary = find_nats_server_binary()
        return f"nats-server {binary_version(binary)} ({binary})"
    except (RuntimeError, ValueError) as exc:
        return f"no nats-server: {exc}"


def pytest_report_header() -> str:
    return server_under_test()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report: pytest.TestReport = yield
    if report.failed:
        report.sections.append(("server", server_under_test()))
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    failed = len(terminalreporter.stats.get("failed", ())) + len(
        terminalreporter.stats.get("error", ())
    )
    if failed:
        terminalreporter.write_line(f"{failed} failed or errored against {server_under_test()}")
