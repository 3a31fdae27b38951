"""The example Django project; its Celery app loads with Django (the usual ``proj/__init__.py``)."""

from __future__ import annotations

from exampleproj.celery import app as celery_app

__all__ = ["celery_app"]
