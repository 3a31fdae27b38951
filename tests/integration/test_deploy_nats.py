"""The NATS server configurations of ``deploy/nats/``, started as shipped.

* ``single.conf`` with ``permissions.conf`` included, as the production
  checklist says: its JetStream limits apply, an operator (``admin``)
  creates the bucket, and a ``worker`` elects and leads on it.
* ``cluster.conf`` is what the cluster harness starts every node from
  (``tests/integration/test_cluster.py``); here a check that each node runs
  with the file's limits and the R3 bucket is created on it.

Only the store directory (and, for the cluster, ports, names and routes on
the command line) differ from the files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from celery_nats_leader import ElectionConfig, Elector
from celery_nats_leader.config.connection import ConnectOptions
from celery_nats_leader.nats.connection import connect
from celery_nats_leader.nats.jetstream import JetStreamBackend
from celery_nats_leader.testing import NatsServer
from celery_nats_leader.testing.cluster import with_store_dir
from tests.integration.helpers import in_thread, servers_under_test

pytestmark = pytest.mark.integration

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "nats"
PASSWORDS = {
    "worker": "w-pw-3",
    "beat": "b-pw-3",
    "web": "web-pw-3",
    "viewer": "v-pw-3",
    "admin": "a-pw-3",
}
TTL = 2.0
#: The limits the files set (max_memory_store 64MB, max_file_store 1GB).
MEMORY, STORAGE = 64 * 1024**2, 1024**3

SERVERS = servers_under_test()


def test_with_store_dir_replaces_only_the_store() -> None:
    text = (DEPLOY / "single.conf").read_text()
    replaced = with_store_dir(text, "/tmp/x y")
    assert 'store_dir: "/tmp/x y"' in replaced
    assert "/var/lib/nats/jetstream" not in replaced
    assert replaced.replace('store_dir: "/tmp/x y"', "") == text.replace(
        "store_dir: /var/lib/nats/jetstream", ""
    )
    with pytest.raises(ValueError, match="found 0"):
        with_store_dir("port: 4222\n", "/tmp")


@pytest.mark.parametrize("binary", list(SERVERS.values()), ids=list(SERVERS))
async def test_single_server_config_with_the_documented_users(
    binary: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    etc = tmp_path / "etc"
    etc.mkdir()
    shutil.copy(DEPLOY / "permissions.conf", etc / "permissions.conf")
    for user, password in PASSWORDS.items():
        monkeypatch.setenv(f"{user.upper()}_PASSWORD", password)
    # The file's own jetstream block enables JetStream (no -js/-sd flags).
    server = NatsServer(jetstream=False, binary=binary, extra_args=["-c", str(etc / "single.conf")])
    (etc / "single.conf").write_text(
        with_store_dir((DEPLOY / "single.conf").read_text(), server.store_dir)
        + "include ./permissions.conf\n"
    )
    with server:
        jetstream = server.monitor("varz")["jetstream"]["config"]
        assert (jetstream["max_memory"], jetstream["max_storage"]) == (MEMORY, STORAGE)
        assert jetstream["store_dir"].startswith(str(server.store_dir))

        admin = ConnectOptions.build(server.url, {"user": "admin", "password": "a-pw-3"})
        backend = JetStreamBackend(await connect(admin, timeout=5))
        try:
            await backend.open_bucket("leaders", ttl=TTL, create=True, replicas=1, timeout=5)
        finally:
            await backend.nc.close()

        worker = {"user": "worker", "password": "w-pw-3"}

        def elect() -> int:
            with Elector(server.url, connect_options=worker) as elector:
                handle = elector.add_role(ElectionConfig(role="reports", ttl=TTL))
                assert handle.wait_for_leadership(TTL + 1)
                assert handle.validate_token()
                assert handle.token is not None
                return handle.token.epoch

        assert await in_thread(elect) == 1
