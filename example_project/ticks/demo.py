"""The one-command demo: three replicas, one singleton job, the leader killed, nothing lost.

``scripts/demo`` (``python manage.py demo``) does, in about a minute:

1. finds a JetStream-enabled NATS at ``$NATS_URL`` or starts a private
   ``nats-server`` (``celery_nats_leader.testing.NatsServer``);
2. starts three Celery worker replicas, each with an embedded beat running
   the leader scheduler (``celery -A exampleproj worker -B``);
3. waits for the singleton job to run a few times and prints
   ``manage.py election_status``;
4. kills the replica whose beat leads with SIGKILL (no goodbye, no release),
   right after a run, and waits while the others take over within the TTL;
5. prints ``election_status`` again, stops the replicas, and reads the
   ledger: every tick between the first and the last must have run exactly
   once. Exit status 0 if so, 1 if a tick ran twice, went missing, or the job
   stopped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test.utils import override_settings

from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.core.errors import ElectionError
from celery_nats_leader.nats import open_backend
from celery_nats_leader.ops.bucket import delete_bucket
from celery_nats_leader.ops.oneshot import run_sync
from celery_nats_leader.ops.status import fetch_report
from ticks.ledger import Run, Verdict, verify

#: Seconds a replica gets for a warm shutdown before it is killed.
STOP_TIMEOUT = 20.0
#: Seconds between "still waiting" lines while setting up.
PROGRESS_SECONDS = 5.0
#: The role whose leader runs the job (``ticks.tasks.ROLE``).
ROLE_DEFAULT = "default"

EPOCHS_EXPLAINED = (
    "  (why the epoch jumped: a term's epoch is the KV revision at which it began, and the "
    "bucket's revision counts every write to it - each renewal of each role's key, every few "
    "hundred ms. The new term starts at the revision of now, past all the renewals of the old "
    "one. Epochs only ever grow, which is what fencing needs; the size of the gap means "
    "nothing.)"
)


class DemoFailed(Exception):
    """The demo could not show what it promised; the message says why."""


@dataclass
class Replica:
    """One ``celery worker -B`` process group."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        """The worker's main process id (also its process group id)."""
        return self.proc.pid

    def owns(self, pid: int) -> bool:
        """Whether ``pid`` belongs to this replica (its embedded beat, its pool)."""
        if pid == self.pid:
            return True
        try:
            return os.getpgid(pid) == self.pid
        except ProcessLookupError:
            return False

    def kill(self) -> None:
        """SIGKILL the whole group: a crash, nothing is released."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait()
        self._wait_group_gone()

    def stop(self) -> None:
        """Warm shutdown (leaders hand over), then make sure nothing is left."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_TIMEOUT)
        # The embedded beat and pool children live in the same group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait()
        self._wait_group_gone()

    def _wait_group_gone(self, timeout: float = 5.0) -> None:
        """Return once no process of the group is left ("stopped" means gone)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(self.pid, 0)
            except ProcessLookupError:
                return
            # Orphaned children are reaped by init, not by us: nothing to wait on.
            time.sleep(0.02)

    def tail(self, lines: int = 25) -> str:
        """The end of its log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class Demo:
    """Runs the demo and prints what happens.

    Args:
        write: Prints one line.
        style: Django's command style (``SUCCESS``, ``ERROR``, ``MIGRATE_HEADING``).
        replicas: Worker replicas to start.
        before: Runs of the job to see before the kill.
        after: Runs of the job to see after the kill.
        timeout: Seconds for each waiting phase.

    """

    def __init__(
        self,
        write: Callable[[str], None],
        style: Any,
        *,
        replicas: int = 3,
        before: int = 5,
        after: int = 8,
        timeout: float = 60.0,
    ) -> None:
        self.write = write
        self.style = style
        self.replica_count = replicas
        self.before = before
        self.after = after
        self.timeout = timeout
        self.interval = float(settings.TICK_SECONDS)
        self.ttl = float(settings.NATS_LEADER["TTL"])
        self.data_dir = Path(settings.DATA_DIR)
        self.bucket = f"demo_{uuid.uuid4().hex[:8]}"
        self.url = ""
        self.own_server = True
        self.victim_beat_id: str | None = None
        self.logs = self.data_dir / "logs"
        self.replicas: list[Replica] = []
        self.interrupted = False
        # The live view: ledger rows already printed, beat terms already named.
        self.printed_id = 0
        self.beat_epochs: list[int] = []
        self.epochs_explained = False

    # -------------------------------------------------------------- phases

    def run(self) -> bool:
        """Run every phase; ``True`` when the ledger shows one run per tick."""
        self.write(
            self.style.MIGRATE_HEADING(
                f"celery-nats-leader demo: {self.replica_count} replicas, a singleton job every "
                f"{self.interval:g}s, election TTL {self.ttl:g}s"
            )
        )
        try:
            with self._nats() as url:
                self.url = url
                with override_settings(NATS_LEADER=self._nats_leader()):
                    try:
                        self._prepare()
                        self._start_replicas()
                        return self._scenario()
                    except KeyboardInterrupt:
                        # Ctrl-C: stop what was started, without a traceback. A
                        # second Ctrl-C must not abandon replicas half-stopped.
                        signal.signal(signal.SIGINT, signal.SIG_IGN)
                        self.interrupted = True
                        self.write("")
                        self.write("interrupted; stopping the replicas ...")
                        return False
                    finally:
                        self._stop_replicas()
                        self._drop_buckets()
        except KeyboardInterrupt:  # before any replica started (set-up)
            self.interrupted = True
            return False

    def _scenario(self) -> bool:
        self.write("")
        self.write(
            self.style.MIGRATE_HEADING(
                f"the job, live: one line per run (tick = the slot beat dispatched; epochs of the "
                f"beat term that sent it and of the {ROLE_DEFAULT!r} term that ran it)"
            )
        )
        self._wait(
            lambda: self._count() >= self.before, f"the job to run {self.before} times", live=True
        )
        self._status("election status (all replicas up)")
        victim, roles = self._beat_leader()
        # Kill right after a run, not in the middle of one: the next tick is
        # a whole interval away.
        seen = self._count()
        self._wait(lambda: self._count() > seen, "the next run", live=True)
        last_slot = self._last_slot()
        victim.kill()
        killed_at = time.monotonic()
        self.write(
            self.style.WARNING(
                f"killed {victim.name} (pid {victim.pid}) with SIGKILL: it led "
                f"{' and '.join(roles)}; its keys expire within the TTL ({self.ttl:g}s)"
            )
        )
        self.write(self.style.WARNING("  ---------- leader killed here ----------"))
        self._wait(lambda: self._count(after=last_slot) >= 1, "a run after the kill", live=True)
        paused = time.monotonic() - killed_at
        self.write(f"the job ran again {paused:.1f}s after the kill")
        self._wait(
            lambda: self._count(after=last_slot) >= self.after and self._beat_moved(victim),
            f"{self.after} runs after the kill",
            live=True,
        )
        self._status("election status (after the kill)")
        self._stop_replicas()
        verdict = self._ledger(last_slot)
        return self._conclude(verdict, last_slot, paused)

    # ------------------------------------------------------------- set-up

    @contextlib.contextmanager
    def _nats(self) -> Iterator[str]:
        configured = settings.NATS_LEADER["SERVERS"]
        url = configured if isinstance(configured, str) else configured[0]
        url = url.split(",")[0].strip()
        # The probe's connection errors are expected when nothing listens.
        quiet = logging.getLogger("celery_nats_leader.nats.connection")
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            ready = run_sync(lambda: _jetstream_ready(url))
        finally:
            quiet.setLevel(level)
        if ready:
            self.write(f"nats-server: using {url}")
            self.own_server = False
            yield url
            return
        from celery_nats_leader.testing import NatsServer

        self.own_server = True
        with NatsServer() as server:
            self.write(f"nats-server: none with JetStream at {url}; started one at {server.url}")
            yield server.url

    def _nats_leader(self) -> dict[str, Any]:
        return {**settings.NATS_LEADER, "SERVERS": self.url, "BUCKET": self.bucket}

    def _prepare(self) -> None:
        from django_nats_leader.models import FenceEpoch
        from ticks.models import Tick

        # Leftovers of an earlier run must not be consumed or counted.
        broker = settings.CELERY_BROKER_URL
        if broker.startswith(("atomicfs", "filesystem")):
            for folder in ("broker", "broker-processed", "broker-control"):
                shutil.rmtree(self.data_dir / folder, ignore_errors=True)
                (self.data_dir / folder).mkdir(parents=True)
        self.write("migrating the example database ...")
        call_command("migrate", verbosity=0, interactive=False)
        Tick.objects.all().delete()
        # A fresh bucket starts its epochs at 1 again: reset the fence too.
        FenceEpoch.objects.all().delete()
        self.logs.mkdir(parents=True, exist_ok=True)
        scheme = broker.split("://")[0]
        kind = "kombu filesystem transport (atomic writes)" if scheme == "atomicfs" else scheme
        self.write(f"broker: {kind}; database: {settings.DATABASES['default']['NAME']}")
        self.write(f"logs: {self.logs}")

    def _start_replicas(self) -> None:
        env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": os.environ.get(
                "DJANGO_SETTINGS_MODULE", "exampleproj.settings"
            ),
            "EXAMPLE_DATA_DIR": str(self.data_dir),
            "NATS_URL": self.url,
            "EXAMPLE_NATS_BUCKET": self.bucket,
            "EXAMPLE_TTL": f"{self.ttl:g}",
            "EXAMPLE_TICK_SECONDS": f"{self.interval:g}",
            "PYTHONUNBUFFERED": "1",
        }
        base_dir = Path(settings.BASE_DIR)
        for i in range(1, self.replica_count + 1):
            if i == 2:
                # The first replica takes both roles before the others start,
                # so that killing it shows both elections failing over.
                self._wait(self._first_leads, "replica1 to lead beat and default")
                self._name_leaders()
            name = f"replica{i}"
            schedule = self.data_dir / f"beat-{name}"
            for leftover in self.data_dir.glob(f"beat-{name}*"):
                leftover.unlink()
            log_path = self.logs / f"{name}.log"
            command = [
                sys.executable, "-m", "celery", "-A", "exampleproj", "worker", "-B",
                "-n", f"{name}@%h", "--pool", "threads", "--concurrency", "2",
                "--loglevel", "INFO", "--schedule", str(schedule),
                "--without-mingle", "--without-gossip", "--without-heartbeat",
            ]  # fmt: skip
            with log_path.open("wb") as log:
                proc = subprocess.Popen(
                    command,
                    cwd=base_dir,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: killed as a unit
                )
            self.replicas.append(Replica(name, proc, log_path))
            self.write(f"started {name} (pid {proc.pid}): celery worker -B")
        # The first status shows every replica as a candidate of both roles.
        self._wait(self._all_joined, f"all {self.replica_count} replicas to join both elections")

    def _all_joined(self) -> bool:
        try:
            roles = self._report()
        except ElectionError:
            return False
        return len(roles) == 2 and all(
            len(status.candidates) == self.replica_count for status in roles.values()
        )

    def _first_leads(self) -> bool:
        first = self.replicas[0]
        try:
            roles = self._report()
        except ElectionError:  # the bucket is created by the first campaign
            return False
        return (
            all(
                isinstance(status.leader_meta.get("pid"), int)
                and first.owns(status.leader_meta["pid"])
                for status in roles.values()
            )
            and len(roles) == 2
        )

    def _stop_replicas(self) -> None:
        alive = [r for r in self.replicas if r.proc.poll() is None]
        if alive:
            self.write(f"stopping {', '.join(r.name for r in alive)} (warm shutdown) ...")
        for replica in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(replica.pid, signal.SIGTERM)
        for replica in self.replicas:
            replica.stop()

    def _drop_buckets(self) -> None:
        if self.own_server or not self.url:
            return  # the private server's store goes away with it
        # The demo's verdict is its last word: no INFO line per deleted bucket.
        quiet = logging.getLogger("celery_nats_leader.ops.bucket")
        level = quiet.level
        quiet.setLevel(logging.WARNING)
        try:
            run_sync(lambda: _delete_buckets(self.url, [self.bucket, f"{self.bucket}_beat"]))
        finally:
            quiet.setLevel(level)

    # ------------------------------------------------------------ watching

    def _count(self, after: datetime | None = None) -> int:
        from ticks.models import Tick

        runs = Tick.objects.all()
        if after is not None:
            runs = runs.filter(slot__gt=after)
        return runs.count()

    def _last_slot(self) -> datetime | None:
        from ticks.models import Tick

        row = Tick.objects.exclude(slot=None).order_by("-slot").first()
        return None if row is None else row.slot

    def _wait(self, predicate: Callable[[], bool], what: str, *, live: bool = False) -> None:
        """Poll ``predicate``; print new runs (``live``) or progress every few seconds."""
        started = time.monotonic()
        deadline = started + self.timeout
        next_note = started + PROGRESS_SECONDS
        if not live:
            self.write(f"waiting for {what} ...")
        while True:
            if live:
                self._print_new_runs()
            if predicate():
                if live:
                    self._print_new_runs()
                return
            now = time.monotonic()
            if not live and now >= next_note:
                self.write(f"  ... still waiting for {what} ({now - started:.0f}s)")
                next_note = now + PROGRESS_SECONDS
            for replica in self.replicas:
                if replica.proc.poll() is not None and replica.proc.returncode != -signal.SIGKILL:
                    raise DemoFailed(
                        f"{replica.name} exited with {replica.proc.returncode}:\n{replica.tail()}"
                    )
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {r.name}\n{r.tail()}" for r in self.replicas)
                raise DemoFailed(f"gave up after {self.timeout:g}s waiting for {what}\n{tails}")
            time.sleep(0.1)  # polling a database table: there is no event to wait on

    def _status(self, title: str) -> None:
        self.write("")
        self.write(self.style.MIGRATE_HEADING(f"$ manage.py election_status   # {title}"))
        try:
            call_command("election_status", stdout=_Lines(self.write), stderr=_Lines(self.write))
        except CommandError as exc:
            self.write(self.style.ERROR(f"(exit {exc.returncode}: {exc})"))
        # The table names processes; say which replica each leader belongs to
        # (a replica's beat is a child process of its worker: another pid).
        with contextlib.suppress(ElectionError):
            named = [
                f"{role} -> {self._replica_of(status.leader_meta)}"
                + (" (its embedded beat)" if role == "beat" else "")
                for role, status in sorted(self._report().items())
                if status.has_leader
            ]
            self.write(f"leaders by replica: {', '.join(named)}")
        self.write("")

    def _report(self) -> dict[str, Any]:
        report = fetch_report(
            _settings(), configured_roles=("default", "beat"), only=("default", "beat")
        )
        return {status.role: status for status in report.roles}

    def _beat_leader(self) -> tuple[Replica, list[str]]:
        roles = self._report()
        beat = roles["beat"]
        pid = beat.leader_meta.get("pid")
        victim = next((r for r in self.replicas if isinstance(pid, int) and r.owns(pid)), None)
        if victim is None:
            raise DemoFailed(f"cannot tell which replica runs the beat leader {beat.leader_id}")
        led = [
            role
            for role, status in sorted(roles.items())
            if isinstance(status.leader_meta.get("pid"), int)
            and victim.owns(status.leader_meta["pid"])
        ]
        self.victim_beat_id = beat.leader_id
        return victim, led

    def _replica_of(self, meta: dict[str, Any]) -> str:
        """The replica that published ``meta`` (a leader record's), by its pid."""
        pid = meta.get("pid")
        for replica in self.replicas:
            if isinstance(pid, int) and replica.owns(pid):
                return replica.name
        return f"pid {pid}" if pid is not None else "an unknown process"

    def _name_leaders(self) -> None:
        """Say which replica leads each role, and with which epoch."""
        roles = self._report()
        for role, status in sorted(roles.items()):
            self.write(
                f"{self._replica_of(status.leader_meta)} leads {role!r} (epoch {status.epoch})"
            )

    def _print_new_runs(self) -> None:
        """One line per run of the job, as it lands in the ledger."""
        from ticks.models import Tick

        # Rows land as runs finish (two at once with a pool of 2): in tick order
        # within what one look finds.
        rows = list(Tick.objects.filter(id__gt=self.printed_id))
        if rows:
            self.printed_id = max(row.id for row in rows)
        for row in sorted(rows, key=lambda r: (r.slot is None, r.slot or datetime.min, r.id)):
            if row.dispatch_epoch is not None and row.dispatch_epoch not in self.beat_epochs:
                self._new_beat_term(row.dispatch_epoch)
            slot = row.slot.strftime("%H:%M:%S.%f")[:-3] if row.slot else "-"
            self.write(
                f"  tick {slot}  run {row.run or '-':>3}  ran on {row.worker.split('@')[0]:<9} "
                f"beat epoch {row.dispatch_epoch or '-':>4}  "
                f"{ROLE_DEFAULT} epoch {row.leader_epoch:>4}"
            )

    def _new_beat_term(self, epoch: int) -> None:
        previous = self.beat_epochs[-1] if self.beat_epochs else None
        self.beat_epochs.append(epoch)
        try:
            beat = self._report()["beat"]
            who = self._replica_of(beat.leader_meta) if beat.epoch == epoch else None
        except (ElectionError, KeyError):
            who = None
        self.write(f"  beat leader: {who or 'a replica that no longer leads'} (epoch {epoch})")
        if previous is not None and not self.epochs_explained:
            self.epochs_explained = True
            self.write(self.style.NOTICE(f"  beat epoch {previous} -> {epoch}"))
            self.write(EPOCHS_EXPLAINED)

    def _beat_moved(self, victim: Replica) -> bool:
        try:
            beat = self._report()["beat"]
        except ElectionError:
            return False
        return beat.has_leader and beat.leader_id != self.victim_beat_id

    # -------------------------------------------------------------- verdict

    def _ledger(self, last_slot: datetime | None) -> Verdict:
        from ticks.models import Tick

        rows = list(Tick.objects.order_by("slot", "id"))
        self.write(self.style.MIGRATE_HEADING("the ledger (one row per run of the job)"))
        self.write("  TICK          RUN  RAN ON                         BEAT EPOCH  LEADER EPOCH")
        marked = False
        for row in rows:
            if (
                not marked
                and last_slot is not None
                and row.slot is not None
                and row.slot > last_slot
            ):
                self.write(self.style.WARNING("  ---------- leader killed here ----------"))
                marked = True
            slot = row.slot.strftime("%H:%M:%S.%f")[:-3] if row.slot else "-"
            self.write(
                f"  {slot:<13} {row.run or '-':>3}  {row.worker:<30} "
                f"{row.dispatch_epoch or '-':>10}  {row.leader_epoch:>12}"
            )
        runs = [Run(r.slot, r.worker, r.dispatch_epoch, r.leader_epoch) for r in rows]
        return verify(runs, self.interval)

    def _conclude(self, verdict: Verdict, last_slot: datetime | None, paused: float) -> bool:
        after = self._count(after=last_slot)
        problems = []
        if verdict.duplicates:
            twice = ", ".join(f"{s:%H:%M:%S} x{n}" for s, n in verdict.duplicates.items())
            problems.append(f"ran more than once for tick(s) {twice}")
        if verdict.missing:
            problems.append(
                f"never ran for tick(s) {', '.join(f'{s:%H:%M:%S}' for s in verdict.missing)}"
            )
        if verdict.unslotted:
            problems.append(f"{verdict.unslotted} run(s) without a tick identity")
        if after < self.after:
            problems.append(f"only {after} run(s) after the kill: the job stopped")
        if len(verdict.dispatch_epochs) < 2:
            problems.append("the beat leader never changed")
        self.write("")
        if problems:
            for problem in problems:
                self.write(self.style.ERROR(f"FAILED: the singleton job {problem}"))
            return False
        self.write(
            self.style.SUCCESS(
                f"OK: {verdict.ticks} ticks, each run exactly once, none missing "
                f"({verdict.ticks - after} before the kill, {after} after). Beat terms "
                f"{' -> '.join(map(str, verdict.dispatch_epochs))}; the job paused "
                f"{paused:.1f}s while the dead leader's TTL ran out, then caught up."
            )
        )
        return True


class _Lines:
    """A file-like object that forwards each written line to ``write``."""

    def __init__(self, write: Callable[[str], None]) -> None:
        self._write = write

    def write(self, text: str) -> int:
        for line in text.rstrip("\n").split("\n"):
            self._write(line)
        return len(text)

    def flush(self) -> None:
        """Nothing buffered."""

    def isatty(self) -> bool:
        """Never a terminal (no screen clearing)."""
        return False


def _settings() -> Any:
    from django_nats_leader.conf import leader_settings

    return leader_settings()


async def _jetstream_ready(url: str) -> bool:
    try:
        backend = await open_backend(ConnectOptions(servers=(url,)), timeout=1.5, name="demo-probe")
    except ElectionError:
        return False
    async with backend:
        try:
            reply = await backend.request("$JS.API.INFO", b"", timeout=1.5)
            return "error" not in json.loads(reply)
        except (ElectionError, ValueError):
            return False


async def _delete_buckets(url: str, buckets: list[str]) -> None:
    async with await open_backend(
        ConnectOptions(servers=(url,)), timeout=2, name="demo-cleanup"
    ) as backend:
        for bucket in buckets:
            with contextlib.suppress(ElectionError):
                await delete_bucket(backend, bucket, timeout=2)


#: Exit status after Ctrl-C (128 + SIGINT, as shells report it).
EXIT_INTERRUPTED = 130


def main(write: Callable[[str], None], style: Any, **options: Any) -> int:
    """Run the demo (see :class:`Demo`).

    Returns:
        The exit status: 0 on success, 1 when the demo failed, 130 when
        interrupted (Ctrl-C; the replicas are stopped first).
    """
    demo = Demo(write, style, **options)
    try:
        ok = demo.run()
    except DemoFailed as exc:
        write(style.ERROR(f"FAILED: {exc}"))
        return 1
    if demo.interrupted:
        write(style.WARNING("interrupted; replicas stopped"))
        return EXIT_INTERRUPTED
    return 0 if ok else 1
