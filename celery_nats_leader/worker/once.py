"""Moved to :mod:`celery_nats_leader.worker.once_tasks`; this import path keeps working."""

from __future__ import annotations

from celery_nats_leader.worker.once_tasks import OnceService, OnceTask, run_once, run_task_once

__all__ = ["OnceService", "OnceTask", "run_once", "run_task_once"]
