"""The Celery app the test workers run (``celery -A cnl_celery_app worker``).

Configured by the JSON in ``$CNL_CONFIG`` (see ``conftest.Cluster.config``);
the tests build a client app from the same configuration with
:func:`make_app`. Every leader-only task records its attempt in the ledger and
then commits through the ledger's fenced, idempotent commit.
"""

from __future__ import annotations

import json
import os
import select
import threading
import time
from pathlib import Path
from typing import Any

from celery import Celery
from celery.signals import task_postrun, task_prerun, task_received
from cnl_celery_ledger import Ledger

from celery_nats_leader import (
    LeaderContext,
    LeadershipLostError,
    LeaderTask,
    install,
    leader_demoted,
    leader_only,
    leader_promoted,
    leader_service,
    run_once,
)
from celery_nats_leader.beat import FencedBeatTask
from celery_nats_leader.testing import kombu_fs

# kombu's filesystem transport writes a message file non-atomically: a polling
# consumer can read it empty and die. Tests use the atomic variant.
kombu_fs.register()

#: The worker's main process (module imported before the pool forks).
MAIN_PID = os.getpid()


def wait_for_file(path: str, timeout: float = 60.0) -> None:
    """Block until the test creates ``path`` (a cross-process barrier)."""
    deadline = time.monotonic() + timeout
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {path} never opened")
        time.sleep(0.01)


def make_app(config: dict[str, Any]) -> Celery:
    app = Celery("cnl", set_as_current=False)
    app.conf.update(
        broker_url=config["broker_url"],
        broker_transport_options=config.get("broker_transport_options", {}),
        broker_connection_retry_on_startup=True,
        task_default_queue=config["default_queue"],
        task_ignore_result=True,
        result_backend=None,
        worker_prefetch_multiplier=config.get("prefetch_multiplier", 1),
        worker_enable_remote_control=False,
        worker_send_task_events=False,
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        nats_leader_servers=config["nats_url"],
        nats_leader_bucket=config["bucket"],
        nats_leader_roles=config["roles"],
        nats_leader_ttl=config["ttl"],
        nats_leader_queue_prefix=config["queue_prefix"],
        nats_leader_required=config.get("required", False),
        nats_leader_metrics_port=config.get("metrics_port"),
        nats_leader_metrics_address="127.0.0.1",
        nats_leader_start_timeout=config.get("start_timeout", 10.0),
        **{f"nats_leader_{k}": v for k, v in config.get("extra", {}).items()},
    )
    if not config.get("without_leader"):
        install(app)  # (without: plain Celery, to compare our behaviour with Celery's own)
    ledger = Ledger(config["ledger"])
    role = config["roles"][0]

    def body(task: Any, seq: int, work: float, token: Any, hold: str | None = None) -> str:
        request = task.request
        common = {
            "seq": seq,
            "task_id": request.id,
            "name": task.name,
            "main_pid": MAIN_PID,
            "epoch": token.epoch,
            "checked_at": request.leader_checked_at,
        }
        ledger.attempt(**common)
        if work:
            time.sleep(work)  # the task's "work"
        if hold:
            # A test barrier between the run and its commit.
            wait_for_file(hold)
        outcome = ledger.commit(**common)
        if outcome == "stale":
            # The fenced resource saw a newer term: hand the task back.
            raise LeadershipLostError(f"epoch {token.epoch} is stale")
        return outcome

    @app.task(shared=False, bind=True, name="cnl.record")
    @leader_only(role=role)
    def record(self: Any, seq: int, work: float = 0.0, leader_token: Any = None, **kw: Any) -> str:
        return body(self, seq, work, leader_token, kw.get("hold"))

    @app.task(shared=False, bind=True, name="cnl.record_once")
    @leader_only(role=role)
    @run_once
    def record_once(
        self: Any, seq: int, work: float = 0.0, leader_token: Any = None, **kw: Any
    ) -> str:
        # The once-guard under @leader_only: the task id is claimed in KV first.
        return body(self, seq, work, leader_token, kw.get("hold"))

    @app.task(shared=False, bind=True, name="cnl.record_validated")
    @leader_only(role=role, validate=True)
    def record_validated(
        self: Any, seq: int, work: float = 0.0, leader_token: Any = None, **kw: Any
    ) -> str:
        return body(self, seq, work, leader_token, kw.get("hold"))

    @app.task(shared=False, bind=True, name="cnl.record_fenced", base=FencedBeatTask)
    @leader_only(role=role, validate=True)
    @run_once
    def record_fenced(
        self: Any, seq: int, work: float = 0.0, leader_token: Any = None, **kw: Any
    ) -> str:
        # Every guard at once: the beat token in the headers, the worker's
        # term validated against KV, the task id claimed in the once-guard.
        return body(self, seq, work, leader_token, kw.get("hold"))

    @app.task(shared=False, bind=True, name="cnl.record_class", base=LeaderTask, leader_role=role)
    def record_class(self: Any, seq: int, work: float = 0.0, **kw: Any) -> str:
        # LeaderTask without a leader_token parameter: the token is in the request.
        return body(self, seq, work, self.request.leader_token, kw.get("hold"))

    @app.task(shared=False, bind=True, name="cnl.skip")
    @leader_only(role=role, on_follower="skip")
    def skip(self: Any, seq: int, work: float = 0.0, leader_token: Any = None, **kw: Any) -> str:
        return body(self, seq, work, leader_token, kw.get("hold"))

    @app.task(shared=False, bind=True, name="cnl.raise")
    @leader_only(role=role, on_follower="raise")
    def raise_(self: Any, seq: int, work: float = 0.0, leader_token: Any = None, **kw: Any) -> str:
        return body(self, seq, work, leader_token, kw.get("hold"))

    @app.task(shared=False, name="cnl.bare")
    @leader_only
    def bare(seq: int) -> int:
        # Bare decorator, unbound task: role = first of nats_leader_roles.
        ledger.event("bare", name="cnl.bare", main_pid=MAIN_PID, info=str(seq))
        return seq

    @app.task(shared=False, bind=True, name="cnl.plain")
    def plain(self: Any, seq: int) -> int:
        ledger.event(
            "plain", name="cnl.plain", task_id=self.request.id, main_pid=MAIN_PID, info=str(seq)
        )
        return seq

    if config.get("service_dir"):
        service_dir = Path(config["service_dir"])

        @leader_service(app, role=role)
        def recorder(ctx: LeaderContext) -> None:
            # One file per worker; a sample's clock is read *before* the
            # check, so every "alive" instant was inside the term.
            with (service_dir / f"{MAIN_PID}.txt").open("a") as out:
                while True:
                    now = time.monotonic()
                    if ctx.stopped:
                        break
                    out.write(f"alive {ctx.token.epoch} {now!r}\n")
                    out.flush()
                    if ctx.wait(0.02):
                        break
                reason = ctx.reason.value if ctx.reason is not None else "stopped"
                out.write(f"stop {ctx.token.epoch} {time.monotonic()!r} {reason}\n")

    if config.get("hang_on_demote"):

        @leader_demoted.connect(weak=False)
        def hang(sender: str, **kwargs: Any) -> None:
            # A user's receiver that never returns (a stuck network call).
            threading.Event().wait()

    app.cnl_ledger = ledger
    return app


def _acks_wait_for_the_next_delivery() -> None:
    """Each AMQP ack returns once the broker's next message is in the socket (1 s at most).

    What a loaded machine makes likely, made certain: the callback that the
    worker's event loop runs after an ack, kombu's deferred read, finds the
    next message already there.
    """
    from kombu.message import Message

    original = Message.ack

    def ack(self: Any, multiple: bool = False) -> None:
        original(self, multiple=multiple)
        sock = getattr(getattr(self.channel, "connection", None), "sock", None)
        if sock is not None:
            select.select([sock], [], [], 1.0)

    Message.ack = ack  # type: ignore[method-assign]


def _connect_recorders(ledger: Ledger) -> None:
    """Worker side: write signals and task outcomes into the ledger."""

    @leader_promoted.connect(weak=False)
    def on_promoted(sender: str, token: Any, **kwargs: Any) -> None:
        ledger.term("promoted", sender, MAIN_PID, token.epoch, None)

    @leader_demoted.connect(weak=False)
    def on_demoted(sender: str, reason: Any, **kwargs: Any) -> None:
        ledger.term("demoted", sender, MAIN_PID, None, str(reason.value))

    @task_postrun.connect(weak=False)
    def on_postrun(task: Any, task_id: str, state: str | None = None, **kwargs: Any) -> None:
        token = getattr(task.request, "leader_token", None)
        ledger.event(
            "postrun",
            name=task.name,
            task_id=task_id,
            main_pid=MAIN_PID,
            state=str(state),
            info="" if token is None else str(token.epoch),
        )

    @task_received.connect(weak=False)
    def on_received(request: Any, **kwargs: Any) -> None:
        # In the worker's main process, when a message becomes a reserved request.
        # ``info``: the task's ``seq`` (what the soak's checker names tasks by).
        args = request.args
        ledger.event(
            "received",
            name=request.name,
            task_id=request.id,
            main_pid=MAIN_PID,
            info=str(args[0]) if args else "",
        )

    @task_prerun.connect(weak=False)
    def on_prerun(
        task: Any, task_id: str, kwargs: dict[str, Any] | None = None, **rest: Any
    ) -> None:
        # A test barrier: hold the task *before* its leadership check until
        # the test creates the file (used to freeze the parent in between).
        barrier = (kwargs or {}).get("barrier")
        if not barrier:
            return
        ledger.event("at_barrier", name=task.name, task_id=task_id, main_pid=MAIN_PID)
        wait_for_file(barrier)


if "CNL_CONFIG" in os.environ:
    import faulthandler
    import signal

    # Diagnostics: SIGUSR1 dumps every thread's stack into the worker's log.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _config = json.loads(os.environ["CNL_CONFIG"])
    app = make_app(_config)
    _connect_recorders(app.cnl_ledger)
    if _config.get("acks_wait_for_the_next_delivery"):
        _acks_wait_for_the_next_delivery()
