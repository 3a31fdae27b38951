"""The database fence across election strategies, on PostgreSQL (and SQLite).

KV epochs are stream revisions (small numbers); ALLCALL epochs are wall-clock
milliseconds (~1.7e12). A fence raised by one strategy's terms must neither
lock the other strategy's terms out silently and for good, nor order them
against its own: it refuses them with :class:`StrategyChangedError`, whose
message says what to run, and ``manage.py election_fence_reset`` moves the
fence to the role's configured strategy after a switch.
"""

from __future__ import annotations

import json
import time
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from celery_nats_leader.core.errors import ConfigError, LeadershipLostError
from celery_nats_leader.election.allcall_protocol import new_epoch
from celery_nats_leader.term.token import FencingToken, epoch_strategy
from django_nats_leader.fencing import (
    StaleLeaderError,
    StrategyChangedError,
    current_epoch,
    fenced,
)
from tests.django.fenceapp.models import Write
from tests.django.test_fencing import backends

ROLE = "jobs"
#: A KV term's epoch: a stream revision.
KV_EPOCH = 57


def allcall_epoch() -> int:
    """An epoch as an ALLCALL leader makes one now."""
    return new_epoch(time.time(), 0)


def write(alias: str, token: FencingToken, writer: str) -> None:
    with fenced(ROLE, token, using=alias, holder=writer):
        Write.objects.using(alias).create(role=ROLE, epoch=token.epoch, writer=writer)


def reset(alias: str, strategy: str, *args: str) -> str:
    out = StringIO()
    call_command(
        "election_fence_reset", ROLE, "--database", alias, *args, stdout=out, stderr=StringIO()
    )
    return out.getvalue()


@pytest.fixture
def configured(settings: Any) -> Any:
    """``NATS_LEADER`` naming the role (no server is needed to reset a fence)."""

    def apply(strategy: str) -> None:
        settings.NATS_LEADER = {
            "SERVERS": ["nats://127.0.0.1:4222"],
            "ROLES": [ROLE],
            "STRATEGY": strategy,
        }

    return apply


def test_epochs_tell_their_strategy() -> None:
    assert epoch_strategy(KV_EPOCH) == "kv"
    assert epoch_strategy(allcall_epoch()) == "allcall"
    assert epoch_strategy(new_epoch(0.0, 0)) == "allcall"  # even with a clock before 2001


@pytest.mark.parametrize("alias", backends(transaction=True), indirect=True)
def test_switching_a_role_from_allcall_to_kv(alias: str, configured: Any) -> None:
    old = FencingToken(allcall_epoch(), "allcall-term")
    write(alias, old, "allcall-leader")
    # The role now runs KV: its terms' epochs are revisions, far below. The
    # fence refuses them with a message that says what to run, and nothing
    # in the block runs.
    kv = FencingToken(KV_EPOCH, "kv-term")
    with pytest.raises(StrategyChangedError) as info:
        write(alias, kv, "kv-leader")
    error = info.value
    # A configuration problem, not a lost leadership: inside @leader_only a
    # LeadershipLostError is requeued, and the same leader could never pass.
    assert isinstance(error, ConfigError)
    assert not isinstance(error, (StaleLeaderError, LeadershipLostError))
    assert (error.fence_strategy, error.token_strategy) == ("allcall", "kv")
    assert (error.epoch, error.current_epoch) == (KV_EPOCH, old.epoch)
    assert "manage.py election_fence_reset jobs" in str(error)
    assert "stop every allcall process of the role" in str(error)
    assert current_epoch(ROLE, using=alias) == old.epoch
    assert list(Write.objects.using(alias).values_list("writer", flat=True)) == ["allcall-leader"]

    # A reset while the role is still configured ALLCALL refuses: it would
    # lower an ALLCALL fence below its own stale leaders.
    configured("allcall")
    with pytest.raises(CommandError, match="already a 'allcall' term") as refused:
        reset(alias, "allcall")
    assert refused.value.returncode == 1
    assert current_epoch(ROLE, using=alias) == old.epoch

    configured("kv")
    doc = json.loads(reset(alias, "kv", "--json"))
    assert doc == {"role": ROLE, "strategy": "kv", "forgotten_epoch": old.epoch}
    assert current_epoch(ROLE, using=alias) is None
    write(alias, kv, "kv-leader")
    assert current_epoch(ROLE, using=alias) == KV_EPOCH
    # From now on the fence is a KV fence: an older KV term is stale as
    # always, and a stray ALLCALL process is refused, not let in above it.
    with pytest.raises(StaleLeaderError, match="older than epoch 57"):
        write(alias, FencingToken(KV_EPOCH - 1, "older-kv-term"), "stale")
    with pytest.raises(StrategyChangedError, match="'kv' strategy"):
        write(alias, FencingToken(allcall_epoch(), "stray"), "stray-allcall")
    assert current_epoch(ROLE, using=alias) == KV_EPOCH
    # And a second reset refuses to lower the KV fence.
    with pytest.raises(CommandError, match="already a 'kv' term: lowering it") as again:
        reset(alias, "kv")
    assert again.value.returncode == 1
    assert sorted(Write.objects.using(alias).values_list("writer", flat=True)) == [
        "allcall-leader",
        "kv-leader",
    ]


@pytest.mark.parametrize("alias", backends(transaction=True), indirect=True)
def test_reset_without_a_fence_changes_nothing(alias: str, configured: Any) -> None:
    configured("kv")
    assert reset(alias, "kv") == "role 'jobs' has no database fence yet; nothing to reset\n"
    assert current_epoch(ROLE, using=alias) is None
