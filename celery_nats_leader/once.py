"""Moved to :mod:`celery_nats_leader.recipes.once_guard`; this import path keeps working."""

from __future__ import annotations

from celery_nats_leader.recipes.once_guard import (
    ONCE_VERSION,
    Claim,
    ClaimLostError,
    OnceGuard,
    Verdict,
    decode_once,
    once_key,
)

__all__ = [
    "ONCE_VERSION",
    "Claim",
    "ClaimLostError",
    "OnceGuard",
    "Verdict",
    "decode_once",
    "once_key",
]
