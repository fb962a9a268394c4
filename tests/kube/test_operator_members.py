"""`pgherd operator` (in-process, kopf's KopfRunner) with real members: the emulated API server, the
emulated node (cluster_sim.py: every member pod runs `pgherd instance run` and its PostgreSQL as local
processes on its own 127.x pod IP) and a real S3 server on 127.0.0.1.

One cluster is shared by the whole module, the tests in order (each leaves it Running): it becomes
Running with a primary; the switchover annotation; a Backup Completed, then one Failed (its store
refuses); a Restore in place; a rollout (a restart parameter); scale 3 -> 5 -> 3 (spec.instances up,
the scale subresource down); the primary's pod deleted (switched over before its PostgreSQL stops).
The operator runs with `--member-address ip` semantics: there is no DNS here.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest

from pgherd.kube import names
from pgherd.kube.loop import OperatorConfig

from .cluster_sim import ClusterSim
from .conftest import TOKEN, USER
from .emulator import CRDS_DIR, EmulatedApiServer, pgherd_validator
from .test_operator import running_operator

NS = "apps"
NAME = "hippo"
S3_SECRET = "backup-store"
T = TypeVar("T")


def eventually(probe: Callable[[], T | None], timeout: float = 90.0, what: str = "") -> T:
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except (psycopg.Error, OSError) as exc:  # a member not answering yet
            last = None
            error: Exception | None = exc
        else:
            error = None
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(
        f"timed out after {timeout} s waiting for {what or probe} (last: {last!r}, {error!r})"
    )


@dataclass
class Bed:
    server: EmulatedApiServer
    sim: ClusterSim
    s3: Any  # tests/conftest.py S3Endpoint
    store_path: str

    def cluster(self) -> dict[str, Any]:
        found = self.server.read("postgresclusters", NS, NAME)
        assert found is not None
        return found

    def status(self) -> dict[str, Any]:
        return dict(self.cluster().get("status") or {})

    def pods(self) -> list[dict[str, Any]]:
        selector = f"{names.LABEL_CLUSTER}={NAME},{names.LABEL_COMPONENT}={names.COMPONENT_POSTGRES}"
        return self.server.items("pods", NS, label_selector=selector)

    def pod(self, member: str) -> dict[str, Any] | None:
        return self.server.read("pods", NS, member)

    def role(self, member: str) -> str | None:
        pod = self.pod(member)
        return None if pod is None else (pod["metadata"].get("labels") or {}).get(names.LABEL_ROLE)

    def password(self) -> str:
        secret = self.server.read("secrets", NS, names.secret_superuser(NAME))
        assert secret is not None
        return base64.b64decode(secret["data"][names.KEY_PASSWORD]).decode()

    def sql(self, member: str, query: str) -> list[tuple[Any, ...]]:
        pod = self.pod(member)
        assert pod is not None and pod["status"].get("podIP"), f"{member} has no pod IP"
        dsn = (
            f"host={pod['status']['podIP']} port={names.POSTGRES_PORT} user={names.SUPERUSER} "
            f"dbname=postgres connect_timeout=5"
        )
        with psycopg.connect(dsn, password=self.password(), autocommit=True) as conn, conn.cursor() as cur:
            cur.execute(query)
            return list(cur.fetchall()) if cur.description else []

    def settled(self, instances: int) -> dict[str, Any] | None:
        """Running, with `instances` members each streaming or primary, one pod labelled primary."""
        status = self.status()
        if status.get("phase") != "Running" or status.get("operation"):
            return None
        members = status.get("members") or []
        if len(members) != instances or not all(m.get("ready") for m in members):
            return None
        primaries = [
            p["metadata"]["name"] for p in self.pods() if self.role(p["metadata"]["name"]) == "primary"
        ]
        return status if primaries == [status.get("currentPrimary")] else None

    def wait_settled(self, instances: int = 3, timeout: float = 150) -> dict[str, Any]:
        return eventually(lambda: self.settled(instances), timeout, f"Running with {instances} ready members")

    def events(self, reason: str) -> list[dict[str, Any]]:
        return [e for e in self.server.items("events.k8s.io/v1/events", NS) if e.get("reason") == reason]


def cluster_manifest(s3: Any, store_path: str) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": "PostgresCluster",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {
            "instances": 3,
            "postgresVersion": 15,
            "storage": {"size": "1Gi"},
            "parameters": {"shared_buffers": "16MB", "max_connections": "40"},
            "backup": {
                "store": {
                    "s3": {
                        "bucket": s3.bucket,
                        "path": store_path,
                        "endpoint": s3.endpoint_url,
                        "region": s3.region,
                        "forcePathStyle": True,
                        "credentials": {"secretName": S3_SECRET},
                    }
                },
                "compression": "lz4",
            },
        },
    }


def s3_secret(s3: Any, secret_key: str | None = None) -> dict[str, Any]:
    def b64(text: str) -> str:
        return base64.b64encode(text.encode()).decode()

    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": S3_SECRET, "namespace": NS},
        "data": {
            "AWS_ACCESS_KEY_ID": b64(s3.access_key),
            "AWS_SECRET_ACCESS_KEY": b64(secret_key or s3.secret_key),
        },
    }


@pytest.fixture(scope="module")
def bed(work_root: Path, s3_server: Any) -> Iterator[Bed]:
    server = EmulatedApiServer(
        crds=[CRDS_DIR],
        validators=[pgherd_validator],
        tokens={TOKEN: USER},
        namespaces=[NS],
        graceful_pod_deletion=True,
    )
    server.start()
    octets = uuid.uuid4().bytes
    sim = ClusterSim(
        server.url,
        work_root / f"members-{uuid.uuid4().hex[:8]}",
        token=TOKEN,
        first_ip=f"127.{octets[0] % 250 + 1}.{octets[1]}.2",
        max_probe_period=1,
        stop_grace=3,
        job_backoff=(0.2, 1.0),
    )
    store_path = f"kube-{uuid.uuid4().hex[:10]}"
    config = OperatorConfig(member_address="ip", steady_interval=0.5, busy_interval=0.2)
    try:
        with sim:
            server.create(s3_secret(s3_server))
            server.create(cluster_manifest(s3_server, store_path))
            with running_operator(server, config=config):
                yield Bed(server, sim, s3_server, store_path)
            assert not sim.errors, sim.errors
    finally:
        server.stop()


def test_a_cluster_becomes_running_with_a_labelled_primary_behind_the_rw_service(bed: Bed) -> None:
    status = bed.wait_settled(3, timeout=240)
    primary = status["currentPrimary"]
    roles = {p["metadata"]["name"]: bed.role(p["metadata"]["name"]) for p in bed.pods()}
    assert roles == {m: ("primary" if m == primary else "replica") for m in (f"{NAME}-{i}" for i in range(3))}
    rw = bed.server.read("services", NS, names.service_rw(NAME))
    assert rw is not None
    selector = rw["spec"]["selector"]
    selected = [
        p["metadata"]["name"] for p in bed.pods() if selector.items() <= p["metadata"]["labels"].items()
    ]
    assert selected == [primary]
    bed.sql(primary, "CREATE TABLE marks (id int PRIMARY KEY, at text)")
    bed.sql(primary, "INSERT INTO marks VALUES (1, 'created')")
