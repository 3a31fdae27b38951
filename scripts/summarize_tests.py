"""Print the timing summary of a scripts/test run: each step, each tier.

    scripts/summarize_tests.py LOG_DIR SETUP_SECONDS LINT_SECONDS TOTAL_SECONDS

Reads LOG_DIR/steps (name, exit status, seconds per step) and the JUnit
reports LOG_DIR/*.xml (every pytest run, the oldest set's tiers included:
nox writes them there when CNL_TEST_LOGS names the folder). The last line is
the plain count line, "N passed, N failed", of every test run together;
above it, each failed test with the first line of its message, so a CI log
names what failed even when the per-run logs are gone.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path


def main() -> int:
    """Print the summary; always 0 (scripts/test decides the exit status)."""
    logs = Path(sys.argv[1])
    setup, lint, total = (int(arg) for arg in sys.argv[2:5])
    print("== timing summary")
    print(f"{'step':<10} {'status':<8} {'seconds':>8}")
    print(f"{'set-up':<10} {'ok':<8} {setup:>8}")
    print(f"{'lint':<10} {'ok':<8} {lint:>8}")
    steps = (logs / "steps").read_text().split("\n") if (logs / "steps").exists() else []
    for line in filter(None, steps):
        name, code, seconds = line.split()
        print(f"{name:<10} {'ok' if code == '0' else 'FAILED':<8} {int(seconds):>8}")
    print(f"{'wall':<10} {'':<8} {total:>8}")
    totals: Counter[str] = Counter()
    failures: list[str] = []
    print()
    header = ("run", "tier", "tests", "passed", "failed", "skipped", "sec")
    print("{:<22} {:<12} {:>6} {:>7} {:>7} {:>8} {:>7}".format(*header))
    for report in sorted(logs.glob("*.xml")):
        tiers: dict[str, Counter[str]] = defaultdict(Counter)
        seconds: dict[str, float] = defaultdict(float)
        for case in ET.parse(report).getroot().iter("testcase"):
            parts = (case.get("classname") or "").split(".")
            tier = parts[1] if parts[0] == "tests" and len(parts) > 1 else parts[0]
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    outcome = "failed"
                    message = (child.get("message") or child.text or "").strip()
                    first = message.splitlines()[0][:200] if message else ""
                    failures.append(
                        f"{report.stem}: {case.get('classname')}::{case.get('name')}: {first}"
                    )
                elif child.tag == "skipped":
                    outcome = "skipped"
            tiers[tier][outcome] += 1
            seconds[tier] += float(case.get("time") or 0)
        for tier in sorted(tiers):
            c = tiers[tier]
            totals.update(c)
            print(
                f"{report.stem:<22} {tier:<12} {sum(c.values()):>6} {c['passed']:>7} "
                f"{c['failed']:>7} {c['skipped']:>8} {seconds[tier]:>7.0f}"
            )
    if failures:
        print()
        print("== failed")
        for line in failures:
            print(line)
    print()
    print(f"{totals['passed']} passed, {totals['failed']} failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
