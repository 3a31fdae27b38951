"""Moved to :mod:`celery_nats_leader.ops.cli`; this import path keeps working."""

from __future__ import annotations

from celery_nats_leader.ops.cli import nats_leader

__all__ = ["nats_leader"]


if __name__ == "__main__":  # pragma: no cover - ``python -m celery_nats_leader.cli``
    import sys

    sys.exit(nats_leader())
