"""The configuration page lists every setting the code reads, under both spellings."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from celery_nats_leader.config import ElectionConfig
from celery_nats_leader.config.settings import LeaderSettings

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _section(title: str) -> str:
    text = PAGE.read_text()
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else None]


def _first_cells(section: str) -> set[str]:
    """Every backquoted name in the first column of the section's tables."""
    names: set[str] = set()
    for row in re.findall(r"^\| ([^|]+) \|", section, re.M):
        names.update(re.findall(r"`([A-Za-z_]+)`", row))
    return names


FIELDS = {f.name for f in dataclasses.fields(LeaderSettings)}


def test_django_table_has_every_setting() -> None:
    listed = _first_cells(_section("Django: `NATS_LEADER`"))
    missing = sorted(name.upper() for name in FIELDS if name.upper() not in listed)
    assert missing == [], f"NATS_LEADER keys missing from {PAGE.name}: {missing}"
    unknown = sorted(n for n in listed if n.lower() not in FIELDS)
    assert unknown == [], f"documented but not settings: {unknown}"


def test_celery_tables_have_every_setting() -> None:
    listed = _first_cells(_section("Celery: `nats_leader_*`")) | _first_cells(_section("Beat"))
    missing = sorted(f"nats_leader_{n}" for n in FIELDS if f"nats_leader_{n}" not in listed)
    assert missing == [], f"Celery settings missing from {PAGE.name}: {missing}"


def test_election_config_table_has_every_field() -> None:
    listed = _first_cells(_section("The election: `ElectionConfig`"))
    fields = {f.name for f in dataclasses.fields(ElectionConfig)}
    missing = sorted(fields - listed)
    assert missing == [], f"ElectionConfig fields missing from {PAGE.name}: {missing}"
