"""Moved to :mod:`celery_nats_leader.observe.prometheus`; this import path keeps working."""

from __future__ import annotations

from celery_nats_leader.observe.prometheus import PrometheusObserver

__all__ = ["PrometheusObserver"]
