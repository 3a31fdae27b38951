"""Every program in examples/ runs, and shows what its docstring promises."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_every_example_is_run_here() -> None:
    # A new example must get a test below (leader.py runs under three_candidates.py).
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == ["leader.py", "three_candidates.py"]


def test_examples_use_the_public_api_only() -> None:
    for path in EXAMPLES.glob("*.py"):
        text = path.read_text()
        imports = re.findall(r"^from (celery_nats_leader\S*) import", text, re.M)
        assert imports, path
        # Test helpers and the NATS internals are not what a user builds on.
        internal = ("celery_nats_leader.testing", "celery_nats_leader.nats")
        assert not [m for m in imports if m.startswith(internal)], path


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_three_candidates(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "NATS_URL"}  # it starts its own server
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "three_candidates.py")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    first = re.search(r"^1\. (candidate-\d) leads \(epoch (\d+)\)$", out, re.M)
    second = re.search(
        r"^2\. SIGKILL (candidate-\d): (candidate-\d) leads [\d.]+s later .* epoch (\d+)$",
        out,
        re.M,
    )
    third = re.search(
        r"^3\. SIGTERM (candidate-\d): it released the key; "
        r"(candidate-\d) leads (\d+) ms later, epoch (\d+)$",
        out,
        re.M,
    )
    assert first and second and third, out
    assert second[1] == first[1] and third[1] == second[2]
    assert len({first[1], second[2], third[2]}) == 3  # three different leaders
    assert int(first[2]) < int(second[3]) < int(third[4])
    # After each step the operator's view shows that leader, and the dead are gone.
    statuses = re.findall(
        r"^   status: leader (candidate-\d), epoch (\d+); live candidates: (.*)$", out, re.M
    )
    assert [s[0] for s in statuses] == [first[1], second[2], third[2]]
    assert [len(s[2].split(", ")) for s in statuses] == [3, 2, 1]


USER_SUITE = EXAMPLES / "testing"

#: -W error: no warning from the plugin or from what it drives.
PYTEST_ARGS = ("-p", "no:cacheprovider", "-p", "no:asyncio", "-W", "error", "-q", "-rA")


@pytest.mark.integration
@pytest.mark.timeout(170)
@pytest.mark.parametrize("autoload", [True, False], ids=["entry-point", "explicit-p"])
def test_a_users_suite_passes_with_the_pytest_plugin(autoload: bool) -> None:
    # examples/testing is a user's project: its app, its tests, its pytest.ini
    # (which names the plugin with -p). With the entry point loaded too, the
    # plugin must still load once; without autoload, -p alone enables it.
    env = dict(os.environ)
    if not autoload:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *PYTEST_ARGS],
        cwd=USER_SUITE,
        env=env,
        capture_output=True,
        text=True,
        timeout=160,
        check=False,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert re.search(r"^5 passed in ", out, re.M), out
    passed = sorted(re.findall(r"^PASSED test_reports\.py::(\w+)", out, re.M))
    assert passed == [
        "test_a_deposed_leader_does_not_close_the_books",
        "test_a_follower_skips_the_report",
        "test_one_leader_on_a_real_server",
        "test_the_leader_writes_the_report",
        "test_the_role_is_led_in_memory",
    ]


def test_the_testing_page_shows_the_example_suite_as_it_runs() -> None:
    page = (EXAMPLES.parent / "docs" / "testing.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```$", page, re.M | re.S)
    for name in ("reports.py", "test_reports.py"):
        assert (USER_SUITE / name).read_text() in blocks, f"docs/testing.md shows an old {name}"
