"""The messages quoted in docs/troubleshooting.md are what the software prints.

Each quoted message is a ``text`` block preceded by
``<!-- message: FRAGMENT -->``: the fragment must be in the block, in the
package's source (one string literal, so the code still says it) and in a
test outside ``tests/docs`` (so a test produces the message and checks it).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "troubleshooting.md"
MESSAGE = re.compile(
    r"^<!-- message: (?P<fragment>.+?) -->\n```text\n(?P<body>.*?)^```$", re.M | re.S
)
#: The symptoms the page must answer (issue 23).
SYMPTOMS = [
    "A role never gets a leader",
    "`max_age` does not match the TTL",
    '"beat role held by a non-scheduler"',
    "The leader queue backs up",
    "Leadership flaps",
    "A fence refused a write",
    "Permission errors",
]


def _text(folders: list[Path]) -> str:
    return "\n".join(p.read_text() for folder in folders for p in sorted(folder.rglob("*.py")))


SOURCE = _text([ROOT / "celery_nats_leader", ROOT / "django_nats_leader"])
TESTS = "\n".join(
    p.read_text() for p in sorted((ROOT / "tests").rglob("*.py")) if "docs" not in p.parts
)
QUOTED = [(m["fragment"], m["body"]) for m in MESSAGE.finditer(PAGE.read_text())]


def test_every_symptom_has_a_section_with_a_quoted_message() -> None:
    text = PAGE.read_text()
    headings = re.findall(r"^## (.+)$", text, re.M)
    assert headings == SYMPTOMS
    sections = re.split(r"^## .+$", text, flags=re.M)[1:]
    for heading, section in zip(headings, sections, strict=True):
        assert "<!-- message: " in section, heading
    # Every message marker is parsed (a marker before another fence would be dropped).
    assert len(QUOTED) == text.count("<!-- message: ")


@pytest.mark.parametrize(("fragment", "body"), QUOTED, ids=[f for f, _ in QUOTED])
def test_quoted_message_is_printed_by_the_code_and_checked_by_a_test(
    fragment: str, body: str
) -> None:
    assert fragment in body
    assert fragment in SOURCE, f"{fragment!r} is no longer in the package's source"
    assert fragment in TESTS, f"no test outside tests/docs checks {fragment!r}"
