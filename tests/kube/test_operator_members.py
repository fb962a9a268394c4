"""`pgherd operator` (in-process, kopf's KopfRunner) with real members: the emulated API server, the
emulated node (cluster_sim.py: every member pod runs `pgherd instance run` and its PostgreSQL as local
processes on its own 127.x pod IP) and a real S3 server on 127.0.0.1.

One cluster is shared by the whole module, the tests in order (each leaves it Running): it becomes
Running with a primary; the switchover annotation; a Backup Completed, then one Failed (its store
refuses); Backups whose snapshot pod cannot start (the S3 Secret missing; the node cordoned) Failed
after backup.jobStartTimeoutSeconds, and one whose pod waits but starts in time Completed; a Restore
in place; a rollout (a restart parameter); scale 3 -> 5 -> 3 (spec.instances up,
the scale subresource down); the primary's pod deleted (switched over before its PostgreSQL stops).
The operator runs with `--member-address ip` semantics: there is no DNS here.
"""

from __future__ import annotations

import base64
import contextlib
import json
import ssl
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest

from pgherd.kube import names
from pgherd.kube.loop import OperatorConfig

from . import waiting
from .cluster_sim import NODE_NAME, ClusterSim
from .conftest import TOKEN, USER
from .emulator import CRDS_DIR, EmulatedApiServer, calls_not_allowed, pgherd_validator
from .test_operator import chart_rules, running_operator

NS = "apps"
NAME = "hippo"
S3_SECRET = "backup-store"
SIM_TOKEN, PERSON_TOKEN = (
    "kubelet",
    "person",
)  # the emulated node's and the person's requests: not the operator's
T = TypeVar("T")


def eventually(probe: Callable[[], T | None], timeout: float = 180.0, what: str = "") -> T:
    """Members are slow to answer at first: a connection or HTTP error means "not yet"."""
    return waiting.eventually(probe, timeout, what, interval=0.2, tolerate=(psycopg.Error, OSError))


CONFIG = OperatorConfig(member_address="ip", steady_interval=0.5, busy_interval=0.2)


@dataclass
class Bed:
    server: EmulatedApiServer
    sim: ClusterSim
    s3: Any  # tests/conftest.py S3Endpoint
    store_path: str
    operator: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    phases: list[str] = field(default_factory=list)  # every status.phase written, in order (watch_phases)
    # every QuorumHealthy condition status written, with the phase of that write (watch_phases)
    quorum: list[tuple[str, str]] = field(default_factory=list)

    def watch_phases(self) -> None:
        """Record the phase of every write of the cluster (a watch stream, in a daemon thread): a phase
        held for a single tick is seen too, which polling would miss."""

        def run() -> None:
            url = (
                f"{self.server.url}/apis/{names.API_VERSION}/namespaces/{NS}/{names.PLURAL_CLUSTERS}"
                f"?watch=1&fieldSelector=metadata.name%3D{NAME}&timeoutSeconds=3600"
            )
            request = urllib.request.Request(url, headers={"Authorization": f"Bearer {PERSON_TOKEN}"})
            with contextlib.suppress(OSError, ValueError), urllib.request.urlopen(request) as stream:
                for line in stream:
                    status = json.loads(line)["object"].get("status") or {}
                    phase = status.get("phase") or ""
                    if not self.phases or self.phases[-1] != phase:
                        self.phases.append(phase)
                    healthy = next(
                        (c for c in status.get("conditions") or [] if c.get("type") == "QuorumHealthy"), None
                    )
                    if healthy is not None:
                        self.quorum.append((phase, str(healthy.get("status"))))

        threading.Thread(target=run, name="phases", daemon=True).start()

    def start_operator(self) -> None:
        self.operator.enter_context(running_operator(self.server, config=CONFIG))

    def stop_operator(self) -> None:
        """As a crash would leave it: nothing in memory survives, the next one reads the API."""
        self.operator.close()

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

    def wait_settled(self, instances: int = 3, timeout: float = 300) -> dict[str, Any]:
        return eventually(lambda: self.settled(instances), timeout, f"Running with {instances} ready members")

    def scale(self, replicas: int) -> None:
        """PATCH the scale subresource over HTTP."""
        url = (
            f"{self.server.url}/apis/{names.API_VERSION}/namespaces/{NS}/{names.PLURAL_CLUSTERS}/{NAME}/scale"
        )
        request = urllib.request.Request(
            url,
            data=json.dumps({"spec": {"replicas": replicas}}).encode(),
            method="PATCH",
            headers={
                "Authorization": f"Bearer {PERSON_TOKEN}",
                "Content-Type": "application/merge-patch+json",
            },
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            assert json.load(answer)["spec"]["replicas"] == replicas

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
                "retention": {"keepLast": 5},
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
        tokens={TOKEN: USER, SIM_TOKEN: "kubelet", PERSON_TOKEN: "person"},
        namespaces=[NS],
        graceful_pod_deletion=True,
    )
    server.start()
    octets = uuid.uuid4().bytes
    sim = ClusterSim(
        server.url,
        work_root / f"members-{uuid.uuid4().hex[:8]}",
        token=SIM_TOKEN,
        first_ip=f"127.{octets[0] % 250 + 1}.{octets[1]}.2",
        max_probe_period=1,
        stop_grace=3,
        job_backoff=(0.2, 1.0),
    )
    store_path = f"kube-{uuid.uuid4().hex[:10]}"
    try:
        with sim:
            server.create(s3_secret(s3_server))
            server.create(cluster_manifest(s3_server, store_path))
            bed = Bed(server, sim, s3_server, store_path)
            bed.watch_phases()
            bed.start_operator()
            try:
                yield bed
            finally:
                bed.stop_operator()
            assert not sim.errors, sim.errors
    finally:
        server.stop()


def test_a_cluster_becomes_running_with_a_labelled_primary_behind_the_rw_service(bed: Bed) -> None:
    status = bed.wait_settled(3, timeout=400)
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


def replica_of(status: dict[str, Any]) -> str:
    return next(m["name"] for m in status["members"] if m["name"] != status["currentPrimary"])


def test_the_switchover_annotation_runs_to_completion(bed: Bed) -> None:
    before = bed.wait_settled()
    target = replica_of(before)
    seen, seen_quorum = len(bed.phases), len(bed.quorum)
    bed.server.merge(
        "postgresclusters", NS, NAME, {"metadata": {"annotations": {names.ANNOTATION_SWITCHOVER: target}}}
    )
    eventually(
        lambda: names.ANNOTATION_SWITCHOVER not in (bed.cluster()["metadata"].get("annotations") or {}),
        what="the annotation to be removed",
    )
    after = bed.wait_settled()
    assert after["currentPrimary"] == target
    assert bed.role(target) == "primary" and bed.role(before["currentPrimary"]) == "replica"
    assert bed.sql(target, "SELECT pg_is_in_recovery()") == [(False,)]
    (event,) = [e for e in bed.events("Switchover") if target in e["note"]]
    assert event["type"] == "Normal"
    # The members re-pointed at the new primary stayed observed: the quorum was never reported lost.
    assert "QuorumLost" not in bed.phases[seen:], bed.phases[seen:]
    # Nor was QuorumHealthy written False at any step of the planned switchover.
    during = bed.quorum[seen_quorum:]
    assert during and all(healthy == "True" for _, healthy in during), during
    bed.sql(target, "INSERT INTO marks VALUES (2, 'switched over')")


def backup_manifest(name: str) -> dict[str, Any]:
    return {
        "apiVersion": names.API_VERSION,
        "kind": "Backup",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"cluster": {"name": NAME}},
    }


def backup_phase(bed: Bed, name: str, phase: str) -> dict[str, Any] | None:
    found = bed.server.read("backups", NS, name) or {}
    status = found.get("status") or {}
    return status if status.get("phase") == phase else None


def test_a_backup_runs_a_job_to_completed(bed: Bed) -> None:
    bed.wait_settled()
    bed.server.create(backup_manifest("first"))
    job = eventually(lambda: bed.server.read("jobs", NS, "first-snapshot"), what="the snapshot Job")
    assert job["metadata"]["labels"][names.LABEL_BACKUP] == "first"
    status = eventually(lambda: backup_phase(bed, "first", "Completed"), 300, "the Backup Completed")
    assert status["backupId"] and status["startLSN"] and status["endLSN"] and status["timeline"] >= 1
    # Read back by the Job (snapshot --verify); sizes as the CRD declares them: readable and exact.
    assert status["verified"] is True and "error" not in status
    assert isinstance(status["size"], str) and status["size"].endswith("Mi")
    assert isinstance(status["sizeBytes"], int) and status["sizeBytes"] > 1 << 20
    assert status["storePath"].startswith(f"s3://{bed.s3.bucket}/{bed.store_path}/{NAME}/")
    assert status["storePath"].endswith(f"/snapshots/{status['backupId']}/")
    assert status["size"] and status["storedSize"]
    keys = bed.s3.client().list_objects_v2(Bucket=bed.s3.bucket, Prefix=f"{bed.store_path}/{NAME}/")
    assert any(f"snapshots/{status['backupId']}/" in item["Key"] for item in keys.get("Contents", []))
    last = eventually(lambda: bed.status().get("lastSuccessfulBackup"), what="lastSuccessfulBackup")
    assert "first" in str(last) or status["backupId"] in str(last)
    # Retention (keepLast 5) runs a prune Job after the backup; it keeps this snapshot.
    prune = eventually(lambda: pruned(bed), 120, "a prune Job to succeed")
    assert status["backupId"] in prune["kept"] and prune["deleted_snapshots"] == []


def pruned(bed: Bed) -> dict[str, Any] | None:
    """The summary the cluster's succeeded prune Job left in its pod's termination message."""
    selector = f"{names.LABEL_CLUSTER}={NAME},{names.LABEL_COMPONENT}={names.COMPONENT_PRUNE}"
    for job in bed.server.items("jobs", NS, label_selector=selector):
        if not (job.get("status") or {}).get("succeeded"):
            continue
        for pod in bed.server.items("pods", NS, label_selector=f"job-name={job['metadata']['name']}"):
            for container in (pod.get("status") or {}).get("containerStatuses") or []:
                message = ((container.get("state") or {}).get("terminated") or {}).get("message")
                if message:
                    return dict(json.loads(message))
    return None


def test_a_backup_whose_store_refuses_fails_with_a_condition_and_an_event(bed: Bed) -> None:
    bed.wait_settled()
    bed.server.merge("secrets", NS, S3_SECRET, {"data": s3_secret(bed.s3, "not-the-key")["data"]})
    try:
        bed.server.create(backup_manifest("refused"))
        status = eventually(lambda: backup_phase(bed, "refused", "Failed"), 300, "the Backup Failed")
    finally:
        bed.server.merge("secrets", NS, S3_SECRET, {"data": s3_secret(bed.s3)["data"]})
    assert status.get("error")
    condition = eventually(
        lambda: next(
            (
                c
                for c in bed.status().get("conditions") or []
                if c["type"] == "LastBackupSucceeded" and c["status"] == "False"
            ),
            None,
        ),
        what="LastBackupSucceeded False",
    )
    assert "refused" in condition["message"]
    (event,) = eventually(lambda: bed.events("BackupFailed"), what="a BackupFailed Event")
    assert event["type"] == "Warning" and event["regarding"]["name"] == "refused"
    bed.wait_settled()  # the operator goes on


def start_timeout(bed: Bed, seconds: int | None) -> None:
    """spec.backup.jobStartTimeoutSeconds (None: back to the default)."""
    bed.server.merge("postgresclusters", NS, NAME, {"spec": {"backup": {"jobStartTimeoutSeconds": seconds}}})


def snapshot_pods(bed: Bed, backup: str) -> list[dict[str, Any]]:
    return bed.server.items("pods", NS, label_selector=f"job-name={names.snapshot_job(backup)}")


def fails_in_bounded_time(bed: Bed, backup: str, timeout: int) -> dict[str, Any]:
    """Create the Backup; it must be Failed once its Job's pod has waited ``timeout`` seconds (plus the
    operator's ticks), long before the Job's own deadline; its Job and pod are deleted."""
    started = time.monotonic()
    bed.server.create(backup_manifest(backup))
    status = eventually(lambda: backup_phase(bed, backup, "Failed"), 120, f"the Backup {backup} Failed")
    elapsed = time.monotonic() - started
    # The pod's creationTimestamp has whole seconds: the wait may look up to a second longer.
    assert timeout - 1 <= elapsed < timeout + 30, elapsed
    assert status["error"].startswith(f"the snapshot Job's pod did not start within {timeout} s")
    assert status.get("completedAt")
    eventually(
        lambda: (
            bed.server.read("jobs", NS, names.snapshot_job(backup)) is None and not snapshot_pods(bed, backup)
        ),
        60,
        "the snapshot Job and its pod deleted",
    )
    events = eventually(
        lambda: [e for e in bed.events("BackupFailed") if e["regarding"]["name"] == backup],
        what="a BackupFailed Event",
    )
    assert events[0]["type"] == "Warning" and events[0]["regarding"]["kind"] == "Backup"
    assert status["error"] in events[0]["note"]
    return status


def test_a_backup_whose_job_pod_misses_its_secret_fails_within_the_start_timeout(bed: Bed) -> None:
    """The S3 credentials Secret is missing: the kubelet reports CreateContainerConfigError, which
    would otherwise hold the Job for its 6-hour deadline."""
    bed.wait_settled()
    start_timeout(bed, 3)
    bed.server.remove("secrets", NS, S3_SECRET)
    try:
        status = fails_in_bounded_time(bed, "no-secret", 3)
    finally:
        bed.server.create(s3_secret(bed.s3))
        start_timeout(bed, None)
    assert f'CreateContainerConfigError: secret "{S3_SECRET}" not found' in status["error"], status
    assert "LastBackupSucceeded" in {
        c["type"] for c in bed.status().get("conditions") or [] if c["status"] == "False"
    }
    bed.wait_settled()


def test_a_backup_whose_job_pod_cannot_be_scheduled_fails_within_the_start_timeout(bed: Bed) -> None:
    """No node takes the pod (the only node cordoned): the scheduler's reason is in the error."""
    bed.wait_settled()
    start_timeout(bed, 3)
    bed.server.merge("nodes", None, NODE_NAME, {"spec": {"unschedulable": True}})  # kubectl cordon
    try:
        status = fails_in_bounded_time(bed, "no-node", 3)
    finally:
        bed.server.merge("nodes", None, NODE_NAME, {"spec": {"unschedulable": None}})
        start_timeout(bed, None)
    assert "Unschedulable: 0/1 nodes are available: 1 node(s) were unschedulable" in status["error"], status
    bed.wait_settled()


def test_a_backup_whose_job_pod_starts_within_the_start_timeout_completes(bed: Bed) -> None:
    """A pod that waits (here for its Secret, a reason that needs a person) but starts before the
    timeout is not failed: its Backup completes."""
    bed.wait_settled()
    start_timeout(bed, 20)
    bed.server.remove("secrets", NS, S3_SECRET)
    try:
        bed.server.create(backup_manifest("late-secret"))

        def waiting_for_its_secret() -> bool:
            for pod in snapshot_pods(bed, "late-secret"):
                for container in (pod.get("status") or {}).get("containerStatuses") or []:
                    waiting = (container.get("state") or {}).get("waiting") or {}
                    if waiting.get("reason") == "CreateContainerConfigError":
                        return True
            return False

        eventually(waiting_for_its_secret, 60, "the snapshot pod waiting for its Secret")
        time.sleep(2)
    finally:
        bed.server.create(s3_secret(bed.s3))

    def completed() -> dict[str, Any] | None:
        status = dict((bed.server.read("backups", NS, "late-secret") or {}).get("status") or {})
        assert status.get("phase") != "Failed", status  # a phase is final: fail at once
        return status if status.get("phase") == "Completed" else None

    try:
        status = eventually(completed, 300, "the Backup Completed")
    finally:
        start_timeout(bed, None)
    assert status["verified"] is True and "error" not in status


def restore_phase(bed: Bed, name: str) -> dict[str, Any]:
    found = bed.server.read("restores", NS, name) or {}
    return dict(found.get("status") or {})


def test_a_restore_completes_in_place(bed: Bed) -> None:
    before = bed.wait_settled()
    primary = before["currentPrimary"]
    bed.sql(primary, "INSERT INTO marks VALUES (3, 'after the backup')")
    bed.server.create(
        {
            "apiVersion": names.API_VERSION,
            "kind": "Restore",
            "metadata": {"name": "back", "namespace": NS},
            "spec": {"cluster": {"name": NAME}, "backup": "first", "target": {"immediate": True}},
        }
    )
    # The operator stops once the agent took the restore; the next one follows the same restore.
    eventually(
        lambda: (
            '"back"' in (bed.cluster()["metadata"].get("annotations") or {}).get(names.ANNOTATION_RESTORE, "")
        ),
        180,
        "the restore taken by an agent",
    )
    bed.stop_operator()
    bed.start_operator()
    seen: set[str] = set()

    def completed() -> dict[str, Any] | None:
        status = restore_phase(bed, "back")
        seen.add(status.get("phase", "Pending"))
        assert status.get("phase") != "Failed", status
        return status if status.get("phase") == "Completed" else None

    status = eventually(completed, 400, "the Restore Completed")
    assert status["restoredTimeline"] > before["timeline"]
    assert status["startedAt"] and status["completedAt"] and status["snapshotId"]
    assert "Rebuilding" in seen, seen
    # The restored member's old data and each survivor's, re-cloned once from the restored primary.
    kept = sorted(entry.split(":", 1)[0] for entry in status["keptData"])
    assert kept == [f"{NAME}-{i}" for i in range(3)], status["keptData"]
    after = bed.wait_settled()
    assert after["currentPrimary"] == f"{NAME}-0"
    # Restored to the snapshot's end: what was written after the backup is gone.
    assert bed.sql(after["currentPrimary"], "SELECT id FROM marks ORDER BY id") == [(1,), (2,)]
    record = bed.cluster()["metadata"]["annotations"][names.ANNOTATION_RESTORE]
    assert '"back"' in record and f'"{NAME}-0"' in record


def test_a_restore_of_a_failed_backup_fails_with_an_event_and_changes_nothing(bed: Bed) -> None:
    before = bed.wait_settled()
    seen = len(bed.phases)
    bed.server.create(
        {
            "apiVersion": names.API_VERSION,
            "kind": "Restore",
            "metadata": {"name": "from-refused", "namespace": NS},
            "spec": {"cluster": {"name": NAME}, "backup": "refused"},
        }
    )
    status = eventually(lambda: (s := restore_phase(bed, "from-refused")).get("phase") == "Failed" and s)
    assert "refused" in status["error"] and status["completedAt"]
    (event,) = eventually(lambda: bed.events("RestoreFailed"), what="a RestoreFailed Event")
    assert event["type"] == "Warning" and event["regarding"]["kind"] == "Restore"
    after = bed.wait_settled()
    assert after["currentPrimary"] == before["currentPrimary"] and after["timeline"] == before["timeline"]
    # The Restore failed; the cluster never did, not even for one write of its status.
    assert "Failed" not in bed.phases[seen:], bed.phases[seen:]


def test_retention_expires_a_backup_and_a_restore_naming_it_is_refused(bed: Bed) -> None:
    """Retention (keepLast 1 from now) runs a prune Job after the next Backup; the snapshot of "first"
    is deleted: the operator marks "first" Expired (when, and which retention), with an Event, and a
    Restore naming it is refused at once with that reason, changing nothing."""
    before = bed.wait_settled()
    first = backup_phase(bed, "first", "Completed")
    assert first is not None
    bed.server.merge("postgresclusters", NS, NAME, {"spec": {"backup": {"retention": {"keepLast": 1}}}})
    try:
        bed.server.create(backup_manifest("newest"))
        newest = eventually(lambda: backup_phase(bed, "newest", "Completed"), 300, "the Backup newest")
        expired = eventually(lambda: backup_phase(bed, "first", "Expired"), 120, "the Backup first Expired")
    finally:
        bed.server.merge("postgresclusters", NS, NAME, {"spec": {"backup": {"retention": {"keepLast": 5}}}})
    assert expired["backupId"] == first["backupId"] and expired["completedAt"] == first["completedAt"]
    assert expired["message"] == f"its snapshot {first['backupId']} was deleted by retention (keepLast: 1)"
    expired_at = datetime.fromisoformat(expired["expiredAt"].replace("Z", "+00:00"))
    assert expired_at >= datetime.fromisoformat(newest["completedAt"].replace("Z", "+00:00"))
    prefix = f"{bed.store_path}/{NAME}/"
    keys = bed.s3.client().list_objects_v2(Bucket=bed.s3.bucket, Prefix=prefix).get("Contents", [])
    assert not [k for k in keys if f"/snapshots/{first['backupId']}/" in k["Key"]]
    assert [k for k in keys if f"/snapshots/{newest['backupId']}/" in k["Key"]]
    assert backup_phase(bed, "newest", "Completed") is not None
    (event,) = eventually(
        lambda: [e for e in bed.events("BackupExpired") if e["regarding"]["name"] == "first"],
        what="a BackupExpired Event",
    )
    assert event["type"] == "Normal" and expired["message"] in event["note"]

    bed.server.create(
        {
            "apiVersion": names.API_VERSION,
            "kind": "Restore",
            "metadata": {"name": "from-expired", "namespace": NS},
            "spec": {"cluster": {"name": NAME}, "backup": "first"},
        }
    )
    status = eventually(lambda: (s := restore_phase(bed, "from-expired")).get("phase") == "Failed" and s)
    assert status["error"] == (
        f"Backup first is Expired (its snapshot was deleted by retention at {expired['expiredAt']});"
        " choose another Backup"
    )
    assert "startedAt" not in status  # refused before any member was fenced or asked to restore
    after = bed.wait_settled()
    assert after["currentPrimary"] == before["currentPrimary"] and after["timeline"] == before["timeline"]


# Phases only a sustained fault leads to (a failure is confirmed for failover.detectionSeconds); a
# single slow /status on a loaded machine may show QuorumLost for a tick, which is not checked here.
UNHEALTHY = {"FailingOver", "Failed", "Recovering"}


def test_a_restart_parameter_rolls_out_replicas_first_and_the_old_primary_last(bed: Bed) -> None:
    before = bed.wait_settled()
    seen = len(bed.phases)
    old_primary = before["currentPrimary"]
    start = len(bed.server.calls)
    bed.server.merge("postgresclusters", NS, NAME, {"spec": {"parameters": {"max_connections": "50"}}})
    plan = eventually(
        lambda: (op := bed.status().get("operation")) and op.get("kind") == "Rollout" and op,
        180,
        "a rollout plan in status.operation",
    )
    bed.wait_settled(timeout=400)
    assert eventually(lambda: bed.status()["image"] and bed.status().get("operation") is None, what="done")
    deleted = [
        c.name
        for c in bed.server.calls[start:]
        if c.resource == "pods" and c.verb == "delete" and c.user == USER and c.name
    ]
    order = list(dict.fromkeys(deleted))
    assert order == plan["plan"] and order[-1] == old_primary, (order, plan)
    assert sorted(order) == sorted(m["name"] for m in before["members"])
    after = bed.status()
    assert after["currentPrimary"] != old_primary
    assert bed.sql(after["currentPrimary"], "SHOW max_connections") == [("50",)]
    assert not UNHEALTHY & set(bed.phases[seen:]), bed.phases[seen:]
    for member in before["members"]:
        assert bed.sql(member["name"], "SHOW max_connections") == [("50",)]


def test_scale_up_with_spec_instances_and_down_with_the_scale_subresource(bed: Bed) -> None:
    bed.wait_settled()
    seen = len(bed.phases)
    bed.server.merge("postgresclusters", NS, NAME, {"spec": {"instances": 5}})
    status = bed.wait_settled(5, timeout=300)
    assert status["instances"] == 5
    assert {p["metadata"]["name"] for p in bed.pods()} == {f"{NAME}-{i}" for i in range(5)}
    primary = status["currentPrimary"]
    assert bed.sql(f"{NAME}-4", "SELECT count(*) FROM marks") == bed.sql(
        primary, "SELECT count(*) FROM marks"
    )
    bed.scale(3)  # as `kubectl scale pgc/hippo --replicas 3`
    assert bed.cluster()["spec"]["instances"] == 3
    status = bed.wait_settled(3, timeout=300)
    eventually(lambda: len(bed.pods()) == 3, what="two pods gone")
    assert bed.server.read("statefulsets", NS, NAME)["spec"]["replicas"] == 3  # type: ignore[index]
    assert status["instances"] == 3
    assert not UNHEALTHY & set(bed.phases[seen:]), bed.phases[seen:]


def agent_answers(pod: dict[str, Any] | None) -> bool:
    """The pod's agent answers its startup probe (as the kubelet asks: HTTPS, certificate not checked)."""
    ip = ((pod or {}).get("status") or {}).get("podIP")
    if not ip:
        return False
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        urllib.request.urlopen(f"https://{ip}:{names.AGENT_PORT}/startupz", timeout=1, context=context)
    except urllib.error.HTTPError:
        return True  # it answered
    except OSError:
        return False
    return True


def test_a_deleted_primary_pod_is_switched_over_before_its_postgres_stops(bed: Bed) -> None:
    """Its agent holds PostgreSQL up (within the grace period) until the engine switched over: a
    switchover, never a failover. The agent exits once fenced; its acknowledged fence stands for it, so
    the promotion never waits for the pod made again (on a drained node, it may not come back soon)."""
    before = bed.wait_settled()
    old = before["currentPrimary"]
    bed.sql(old, "INSERT INTO marks VALUES (4, 'before the drain')")
    old_pod = bed.pod(old)
    assert old_pod is not None
    seen = len(bed.phases)
    started = time.monotonic()
    bed.server.remove("pods", NS, old)
    kinds: set[str] = set()
    replacement_answered_first: list[bool] = []

    def replaced_and_settled() -> dict[str, Any] | None:
        status = bed.status()
        kinds.add(str((status.get("operation") or {}).get("kind") or status.get("phase")))
        pod = bed.pod(old)
        new_pod = pod is not None and pod["metadata"]["uid"] != old_pod["metadata"]["uid"]
        if status.get("currentPrimary") != old and not replacement_answered_first:
            replacement_answered_first.append(new_pod and agent_answers(pod))
        return bed.settled(3) if new_pod else None

    after = eventually(replaced_and_settled, 300, "the old primary's pod replaced, the cluster settled")
    assert time.monotonic() - started < 90  # its agent did not wait out the 97 s it may hold a primary
    assert after["currentPrimary"] != old and bed.role(after["currentPrimary"]) == "primary"
    assert "Switchover" in kinds and not {"Failover", "FailingOver", "Failed"} & kinds, kinds
    assert replacement_answered_first == [False], "the promotion waited for the old primary's new pod"
    assert "QuorumLost" not in bed.phases[seen:], bed.phases[seen:]
    assert (4,) in bed.sql(after["currentPrimary"], "SELECT id FROM marks")


def test_every_request_of_the_operator_is_granted_by_the_chart(bed: Bed) -> None:
    """Everything above (members, labels, pods, Jobs, Backups, Restores, Events, scale), checked against
    the rendered ClusterRole."""
    calls = [c for c in bed.server.calls if c.user == USER]
    kinds = {(c.resource, c.verb) for c in calls}
    assert {("pods", "patch"), ("pods", "delete"), ("jobs", "create"), ("restores", "patch")} <= kinds, kinds
    denied = calls_not_allowed(calls, chart_rules("--set", f"watchNamespaces={{{NS}}}"))
    assert denied == [], "requests the chart does not grant:\n" + "\n".join(str(c.astuple()) for c in denied)
