"""Security against real servers configured that way: permissions, TLS with client certificates.

* The least-privilege users of ``deploy/nats/permissions.conf`` (the file
  the docs tell operators to include, used as is): a worker elects and leads,
  a read-only viewer reads status and events but cannot fence nor resign, and
  a user without the KV permission gets a PermissionDeniedError naming the
  subject (the web user presses the Django admin's buttons in
  tests/django/test_admin_web_user.py).
* TLS with ``verify: true`` and certificates generated here (openssl): a
  client with its certificate leads; one without is refused at connect time.
* NKeys, and JWT-based accounts (operator mode) with a user's ``.creds``
  file: the user leads; one signed by an account the server does not trust
  is refused.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_nats_leader import ElectionConfig, Elector
from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.core.errors import NatsUnavailableError, PermissionDeniedError
from celery_nats_leader.election.status import read_report
from celery_nats_leader.nats.connection import connect
from celery_nats_leader.nats.jetstream import JetStreamBackend
from celery_nats_leader.ops.events import ensure_events_stream, read_events
from celery_nats_leader.ops.fence_leader import fence_leader
from celery_nats_leader.testing import NatsServer

pytestmark = pytest.mark.integration

PERMISSIONS = Path(__file__).resolve().parents[2] / "deploy" / "nats" / "permissions.conf"
PASSWORDS = {
    "worker": "w-pw-1",
    "beat": "b-pw-1",
    "web": "web-pw-1",
    "viewer": "v-pw-1",
    "admin": "a-pw-1",
}
BUCKET, ROLE, TTL = "leaders", "reports", 2.0


@pytest.fixture
def secured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NatsServer]:
    """A server with the documented users (passwords from its environment)."""
    shutil.copy(PERMISSIONS, tmp_path / "permissions.conf")
    for user, password in PASSWORDS.items():
        monkeypatch.setenv(f"{user.upper()}_PASSWORD", password)
    (tmp_path / "server.conf").write_text("include ./permissions.conf\n")
    with NatsServer(extra_args=["-c", str(tmp_path / "server.conf")]) as server:
        yield server


def options(server: NatsServer, user: str) -> ConnectOptions:
    return ConnectOptions.build(server.url, {"user": user, "password": PASSWORDS[user]})


async def backend_of(server: NatsServer, user: str) -> JetStreamBackend:
    return JetStreamBackend(await connect(options(server, user), timeout=5))


async def test_least_privilege_users(secured: NatsServer) -> None:
    admin = await backend_of(secured, "admin")
    await admin.open_bucket(BUCKET, ttl=TTL, create=True, replicas=1, timeout=5)
    await ensure_events_stream(admin, BUCKET, max_age=600)

    worker = Elector(secured.url, connect_options={"user": "worker", "password": "w-pw-1"})
    worker.add_role(ElectionConfig(role=ROLE, bucket=BUCKET, ttl=TTL, instance_id="w1"))
    viewer = await backend_of(secured, "viewer")
    try:
        worker.start(timeout=10)
        handle = worker.role(ROLE)
        assert handle.wait_for_leadership(TTL + 1)
        assert handle.validate_token()

        # The viewer sees the leader (KV read + roster answer) and the events.
        report = await read_report(viewer, BUCKET, configured_roles=[ROLE], roster_window=0.5)
        (status,) = report.roles
        assert (status.leader_id, status.answering) == ("w1", True)
        events = await read_events(viewer, BUCKET, role=ROLE)
        assert events is not None and [(e.id, e.event.value) for e in events] == [
            ("w1", "promoted")
        ]
        # ... but may not end a term: a clear error naming the refused subject.
        with pytest.raises(PermissionDeniedError, match=r"(?i)\$KV\.leaders\.reports"):
            await fence_leader(viewer, BUCKET, ROLE, requester="viewer", timeout=1)
        with pytest.raises(
            PermissionDeniedError, match=r"(?i)_NATS_LEADER\.leaders\.reports\.resign"
        ):
            await viewer.request(f"_NATS_LEADER.{BUCKET}.{ROLE}.resign", b"{}", timeout=1)
        assert handle.is_leader and handle.validate_token()
    finally:
        worker.stop()
        await viewer.nc.close()
        await admin.nc.close()


async def test_the_beat_user_elects_and_keeps_the_schedule_state(secured: NatsServer) -> None:
    admin = await backend_of(secured, "admin")
    await admin.open_bucket(BUCKET, ttl=TTL, create=True, replicas=1, timeout=5)
    await admin.open_bucket(
        f"{BUCKET}_beat", ttl=None, create=True, replicas=1, timeout=5, persistent=True
    )
    await admin.nc.close()
    beat = await backend_of(secured, "beat")
    try:
        state = await beat.open_bucket(
            f"{BUCKET}_beat", ttl=None, create=False, replicas=1, timeout=5, persistent=True
        )
        revision = await state.create("nightly", b'{"last": 1}', timeout=2)
        assert await state.update("nightly", b'{"last": 2}', last=revision, timeout=2) > revision
        entry = await state.get("nightly", timeout=2)
        assert entry is not None and entry.value == b'{"last": 2}'
        # A read-only operator may not touch it (workers may: `worker -B` runs
        # beat; tests/beat/test_beat_permissions.py).
        viewer = await backend_of(secured, "viewer")
        try:
            with pytest.raises(PermissionDeniedError, match=r"(?i)kv_leaders_beat"):
                await viewer.open_bucket(
                    f"{BUCKET}_beat", ttl=None, create=False, replicas=1, timeout=1, persistent=True
                )
        finally:
            await viewer.nc.close()
    finally:
        await beat.nc.close()
    with Elector(secured.url, connect_options={"user": "beat", "password": "b-pw-1"}) as elector:
        handle = elector.add_role(ElectionConfig(role="beat", bucket=BUCKET, ttl=TTL))
        assert handle.wait_for_leadership(TTL + 1)


async def test_a_user_without_the_kv_permission_gets_a_clear_error(secured: NatsServer) -> None:
    admin = await backend_of(secured, "admin")
    await admin.open_bucket(BUCKET, ttl=TTL, create=True, replicas=1, timeout=5)
    await admin.nc.close()
    # The viewer may read the bucket but not write it: as a candidate, its
    # first campaign is refused, and the election stops with the reason.
    start_is_refused(
        secured.url,
        {"user": "viewer", "password": "v-pw-1"},
        PermissionDeniedError,
        "NATS refused",
        timeout=10,
        role=ElectionConfig(role=ROLE, bucket=BUCKET, ttl=TTL, request_timeout=0.4),
    )


async def test_a_refused_stream_api_call_names_the_refused_subject(secured: NatsServer) -> None:
    admin = await backend_of(secured, "admin")
    await admin.open_bucket(BUCKET, ttl=TTL, create=True, replicas=1, timeout=5)
    viewer = await backend_of(secured, "viewer")
    try:
        # The server answers nothing to a refused request: without the
        # refusal, this read as "JetStream did not answer: start nats-server
        # with -js".
        with pytest.raises(
            PermissionDeniedError, match=r"(?i)\$JS\.API\.STREAM\.DELETE\.KV_leaders"
        ):
            await viewer.delete_bucket(BUCKET, timeout=1)
        assert (await admin.bucket_info(BUCKET, timeout=5)).ttl == TTL
    finally:
        await viewer.nc.close()
        await admin.nc.close()


def start_is_refused(
    url: str,
    connect_options: dict[str, Any],
    error: type[Exception],
    match: str,
    *,
    timeout: float = 3,
    role: ElectionConfig | None = None,
) -> None:
    """An elector with ``connect_options`` fails to start with ``error`` (message ``match``)."""
    elector = Elector(url, connect_options=connect_options)
    elector.add_role(role or ElectionConfig(role=ROLE, ttl=TTL))
    try:
        with pytest.raises(error, match=match):
            elector.start(timeout=timeout)
    finally:
        elector.stop()


# -------------------------------------------------------------------- NKeys


def test_nkey_user(tmp_path: Path) -> None:
    """A user authenticated by an NKey (a signed nonce; no secret crosses the wire)."""
    import nkeys

    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    (tmp_path / "user.nk").write_bytes(seed)
    other = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    (tmp_path / "stranger.nk").write_bytes(other)
    (tmp_path / "nkeys.conf").write_text(f'authorization {{ users: [ {{nkey: "{public}"}} ] }}\n')
    with NatsServer(extra_args=["-c", str(tmp_path / "nkeys.conf")]) as server:
        leads_and_stranger_is_refused(
            server,
            member={"nkeys_seed": str(tmp_path / "user.nk")},
            stranger={"nkeys_seed": str(tmp_path / "stranger.nk")},
        )


def leads_and_stranger_is_refused(
    server: NatsServer, *, member: dict[str, Any], stranger: dict[str, Any]
) -> None:
    """The member's credentials elect and lead; the stranger's are refused at connect time."""
    with Elector(server.url, connect_options=member) as elector:
        handle = elector.add_role(ElectionConfig(role=ROLE, ttl=TTL, create_bucket=True))
        assert handle.wait_for_leadership(TTL + 1)
        assert handle.token is not None and handle.token.epoch == 1
    start_is_refused(server.url, stranger, NatsUnavailableError, "could not connect")


# ---------------------------------------------------------------------- JWT


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _jwt(signer: Any, subject: Any, name: str, claims: dict[str, Any]) -> str:
    """A NATS JWT (v2) about ``subject``, signed by ``signer`` (what ``nsc`` writes)."""
    body: dict[str, Any] = {
        "iat": int(time.time()),
        "iss": signer.public_key.decode(),
        "name": name,
        "sub": subject.public_key.decode(),
        "nats": {**claims, "version": 2},
    }
    body["jti"] = _b64(hashlib.sha256(json.dumps(body, sort_keys=True).encode()).digest())
    head = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())
    payload = _b64(json.dumps(body).encode())
    return f"{head}.{payload}.{_b64(signer.sign(f'{head}.{payload}'.encode()))}"


def _keypair(prefix: int) -> tuple[bytes, Any]:
    import nkeys

    seed = nkeys.encode_seed(os.urandom(32), prefix)
    return seed, nkeys.from_seed(bytearray(seed))


def _creds(path: Path, account: Any, name: str) -> Path:
    """A user of ``account`` as a ``.creds`` file (its JWT and its NKey seed)."""
    import nkeys

    seed, user = _keypair(nkeys.PREFIX_BYTE_USER)
    claims = {"type": "user", "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1}
    path.write_text(
        "-----BEGIN NATS USER JWT-----\n"
        f"{_jwt(account, user, name, claims)}\n"
        "------END NATS USER JWT------\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{seed.decode()}\n"
        "------END USER NKEY SEED------\n"
    )
    return path


def test_jwt_user_credentials(tmp_path: Path) -> None:
    """A ``.creds`` user of a JWT-based account (operator mode), and one the server does not trust.

    The server trusts an operator; the account (with JetStream) and the
    user are JWTs signed down that chain, as ``nsc`` makes them.
    """
    import nkeys

    _, operator = _keypair(nkeys.PREFIX_BYTE_OPERATOR)
    _, account = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    _, system = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    _, unknown = _keypair(nkeys.PREFIX_BYTE_ACCOUNT)
    unlimited = {"subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1}
    unlimited |= {"wildcards": True, "conn": -1, "leaf": -1}
    jetstream = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
    system_key = system.public_key.decode()
    operator_jwt = _jwt(
        operator, operator, "op", {"type": "operator", "system_account": system_key}
    )
    accounts = {
        account.public_key.decode(): _jwt(
            operator, account, "app", {"type": "account", "limits": unlimited | jetstream}
        ),
        system_key: _jwt(operator, system, "SYS", {"type": "account", "limits": unlimited}),
    }
    preload = "\n".join(f'  {key}: "{token}"' for key, token in accounts.items())
    (tmp_path / "operator.conf").write_text(
        f'operator: "{operator_jwt}"\nsystem_account: {system_key}\n'
        f"resolver: MEMORY\nresolver_preload: {{\n{preload}\n}}\n"
    )
    worker = _creds(tmp_path / "worker.creds", account, "worker")
    stranger_creds = _creds(tmp_path / "stranger.creds", unknown, "stranger")
    with NatsServer(extra_args=["-c", str(tmp_path / "operator.conf")]) as server:
        leads_and_stranger_is_refused(
            server,
            member={"user_credentials": str(worker)},
            stranger={"user_credentials": str(stranger_creds)},
        )


# ---------------------------------------------------------------------- TLS


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def certs(tmp_path: Path) -> Path:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it."""
    if shutil.which("openssl") is None:
        pytest.fail("openssl is required to generate the test certificates")
    d = tmp_path / "certs"
    d.mkdir()
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
             "-out", "ca.pem", "-days", "1", "-subj", "/CN=cnl-test-ca", cwd=d)  # fmt: skip
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-out", f"{name}.pem", "-days", "1",
                 "-extfile", f"{name}.ext", cwd=d)  # fmt: skip
    return d


@pytest.fixture
def tls_server(certs: Path, tmp_path: Path) -> Iterator[NatsServer]:
    (tmp_path / "tls.conf").write_text(
        "tls {\n"
        f'  cert_file: "{certs / "server.pem"}"\n'
        f'  key_file: "{certs / "server.key"}"\n'
        f'  ca_file: "{certs / "ca.pem"}"\n'
        "  verify: true\n"
        "  timeout: 2\n"
        "}\n"
    )
    with NatsServer(extra_args=["-c", str(tmp_path / "tls.conf")]) as server:
        yield server


def test_tls_with_a_client_certificate(tls_server: NatsServer, certs: Path) -> None:
    url = tls_server.url.replace("nats://", "tls://")
    tls = {
        "ca_file": str(certs / "ca.pem"),
        "cert_file": str(certs / "client.pem"),
        "key_file": str(certs / "client.key"),
    }
    with Elector(url, connect_options={"tls": tls}) as elector:
        handle = elector.add_role(ElectionConfig(role=ROLE, ttl=TTL, create_bucket=True))
        assert handle.wait_for_leadership(TTL + 1)
        assert handle.validate_token()

    # Trusting the server is not enough: the server wants the client's certificate.
    start_is_refused(
        url,
        {"tls": {"ca_file": str(certs / "ca.pem")}},
        NatsUnavailableError,
        "could not connect",
    )
