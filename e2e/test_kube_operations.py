"""What only a Kubernetes shows, on the drivers that run one (localkube, kind): the operator as the chart's
Deployment, members as pods of a StatefulSet on a real kubelet, snapshot and prune Jobs run by the real
Job controller, the scheduler's and the kubelet's reasons, the scale subresource, a pod deleted the way
a drain deletes it (SIGTERM and its grace period), and the operator's requests as the API server's
audit log records them (localkube).

One cluster for the module, the tests in order (each leaves it Running): the labelled primary behind
the -rw Service; the switchover annotation; a Backup Completed by its Job, then one Failed (its store
refuses the key); Backups whose snapshot pod cannot start (the S3 Secret missing; the node cordoned)
Failed after backup.jobStartTimeoutSeconds, and one whose pod waits but starts in time Completed; a
Restore in place with the operator restarted in the middle; Restores refused (a Failed Backup; a Backup
expired by retention); a rollout (a restart parameter), replicas first and the old primary last; scale
3 -> 5 -> 3 (spec.instances up, the scale subresource down); the primary's pod deleted (switched over
before its PostgreSQL stops); one instance (its budget deleted) asked for a larger volume (refused by
the StorageClass, reported); finally every request of the operator granted by the chart's RBAC, and,
at the end of a run of the whole suite, every right the chart grants used by some scenario.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import psycopg
import pytest

from e2e import manifests, rbac
from e2e.checks import execute, query
from e2e.driver import DriverError, NewCluster
from e2e.drivers.kube import S3_SECRET, KubeDriver
from e2e.drivers.localkube import POD_SECURITY_ENFORCE, LocalKube, LocalKubeDriver

DRIVER = os.environ.get("PGHERD_E2E_DRIVER", "local")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        DRIVER not in ("localkube", "kind"),
        reason="Kubernetes only (Jobs, Secrets, the scheduler, the kubelet): run with PGHERD_E2E_DRIVER=localkube",
    ),
]

NAME = "e2e-kube-ops"
LABEL_CLUSTER = "pgherd.io/cluster"
LABEL_ROLE = "pgherd.io/role"
LABEL_COMPONENT = "app.kubernetes.io/component"
ANNOTATION_SWITCHOVER = "pgherd.io/switchover-to"
ANNOTATION_RESTORE = "pgherd.io/restore-job"
AGENT_PORT = 8008
SECRET_KEY = "AWS_SECRET_ACCESS_KEY"
# Phases only a sustained fault leads to (a failure is confirmed for failover.detectionSeconds).
UNHEALTHY = {"FailingOver", "Failed", "Recovering"}
T = TypeVar("T")


def eventually(probe: Callable[[], T | None], timeout: float = 180.0, what: str = "") -> T:
    """`probe()` until it gives something other than None/False; a connection or API error is "not yet"."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = probe()
            if value is not None and value is not False:
                return value
        except (psycopg.Error, OSError, DriverError) as exc:
            last = exc
        if time.monotonic() > deadline:
            raise AssertionError(
                f"not within {timeout:.0f} s: {what}" + (f" (last error: {last})" if last else "")
            )
        time.sleep(0.5)


@dataclass
class Bed:
    driver: KubeDriver
    secret: dict[str, str]  # the S3 Secret's data as the driver made it
    phases: list[str] = field(default_factory=list)  # every status.phase written, in order
    quorum: list[tuple[str, str]] = field(default_factory=list)  # (phase, QuorumHealthy) of every write
    watcher: subprocess.Popen[str] | None = None

    @property
    def namespace(self) -> str:
        return self.driver.namespace

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return self.driver.kube.run("-n", self.namespace, *args, input=stdin, check=check)

    def read(self, resource: str, name: str) -> dict[str, Any] | None:
        result = self.kubectl("get", resource, name, "-o", "json", "--ignore-not-found")
        return json.loads(result.stdout) if result.stdout.strip() else None

    def items(self, resource: str, selector: str | None = None) -> list[dict[str, Any]]:
        args = ["get", resource, "-o", "json", *(["-l", selector] if selector else [])]
        return list(json.loads(self.kubectl(*args).stdout).get("items") or [])

    def merge(self, resource: str, name: str, patch: dict[str, Any]) -> None:
        self.kubectl("patch", resource, name, "--type", "merge", "-p", json.dumps(patch))

    def create(self, manifest: dict[str, Any]) -> None:
        doc = {**manifest, "metadata": {**manifest["metadata"], "namespace": self.namespace}}
        self.kubectl("create", "-f", "-", stdin=json.dumps(doc))

    def watch_phases(self) -> None:
        """Record the phase (and QuorumHealthy) of every write of the cluster, from a watch (one JSON event
        a line, `kubectl get --raw`): a phase held for a single tick is seen too, which polling would miss."""
        path = (
            f"/apis/pgherd.io/v1alpha1/namespaces/{self.namespace}/postgresclusters"
            f"?watch=1&timeoutSeconds=7200&fieldSelector=metadata.name%3D{NAME}"
        )
        self.watcher = subprocess.Popen(
            [*self.driver.kube.kubectl, "get", "--raw", path],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )

        def run(stream: Any) -> None:
            for line in stream:
                status = (json.loads(line).get("object") or {}).get("status") or {}
                phase = str(status.get("phase") or "")
                if not self.phases or self.phases[-1] != phase:
                    self.phases.append(phase)
                for condition in status.get("conditions") or []:
                    if condition.get("type") == "QuorumHealthy":
                        self.quorum.append((phase, str(condition.get("status"))))

        threading.Thread(target=run, args=(self.watcher.stdout,), name="phases", daemon=True).start()

    def stop(self) -> None:
        if self.watcher is not None:
            self.watcher.kill()
            self.watcher.wait()

    def cluster(self) -> dict[str, Any]:
        found = self.read("postgresclusters.pgherd.io", NAME)
        assert found is not None
        return found

    def status(self) -> dict[str, Any]:
        return dict(self.cluster().get("status") or {})

    def pods(self) -> list[dict[str, Any]]:
        return self.items("pods", f"{LABEL_CLUSTER}={NAME},{LABEL_COMPONENT}=postgres")

    def pod(self, member: str) -> dict[str, Any] | None:
        return self.read("pods", member)

    def role(self, member: str) -> str | None:
        pod = self.pod(member)
        return None if pod is None else (pod["metadata"].get("labels") or {}).get(LABEL_ROLE)

    def sql(self, member: str, statement: str) -> list[tuple[Any, ...]]:
        return query(self.driver.member_dsn(member), statement)

    def mark(self, mark: int, what: str) -> None:
        """A row through the -rw Service, retried: right after a change of primary, kube-proxy may route
        to no endpoint for up to a second (its sync period), as any client of a Service sees."""
        statement = f"INSERT INTO marks VALUES ({mark}, '{what}') ON CONFLICT (id) DO NOTHING"

        def written() -> bool:
            execute(self.driver.rw_dsn(), statement)
            return True

        eventually(written, 60, f"the write of mark {mark}")

    def settled(self, instances: int) -> dict[str, Any] | None:
        """Running, with `instances` members each ready, one pod labelled primary: the current one."""
        status = self.status()
        if status.get("phase") != "Running" or status.get("operation"):
            return None
        members = status.get("members") or []
        if len(members) != instances or not all(m.get("ready") for m in members):
            return None
        labels = {
            p["metadata"]["name"]: (p["metadata"].get("labels") or {}).get(LABEL_ROLE) for p in self.pods()
        }
        primaries = [name for name, role in labels.items() if role == "primary"]
        return status if primaries == [status.get("currentPrimary")] else None

    def wait_settled(self, instances: int = 3, timeout: float = 300) -> dict[str, Any]:
        return eventually(lambda: self.settled(instances), timeout, f"Running with {instances} ready members")

    def events(self, reason: str) -> list[dict[str, Any]]:
        return [e for e in self.items("events.events.k8s.io") if e.get("reason") == reason]

    def put_secret(self, data: dict[str, str] | None) -> None:
        """The S3 Secret with `data` (base64 values), or deleted (None)."""
        if data is None:
            self.kubectl("delete", "secret", S3_SECRET, "--wait=true")
            return
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {"name": S3_SECRET, "namespace": self.namespace},
            "data": data,
        }
        self.kubectl("apply", "-f", "-", stdin=json.dumps(secret))

    def audit(self) -> list[dict[str, Any]] | None:
        """Every completed request in the API server's audit log (localkube), else None."""
        localkube: LocalKube | None = getattr(self.driver, "localkube", None)
        if localkube is None:
            return None
        return [e for e in localkube.audit_events() if e.get("stage") == "ResponseComplete"]

    def operator_user(self) -> str:
        return operator_user(self.driver.operator_namespace, self.driver.release)


def operator_user(namespace: str, account: str) -> str:
    return f"system:serviceaccount:{namespace}:{account}"


@pytest.fixture(scope="module")
def bed(new_cluster: NewCluster, pg_version: int) -> Iterator[Bed]:
    driver = new_cluster(
        manifests.cluster(
            NAME, postgres_version=pg_version, keep_last=5, parameters={"max_connections": "40"}
        )
    )
    assert isinstance(driver, KubeDriver)
    secret = driver.get("secrets", S3_SECRET)["data"]
    bed = Bed(driver, dict(secret))
    bed.watch_phases()
    try:
        yield bed
    finally:
        bed.stop()


def test_a_cluster_becomes_running_with_a_labelled_primary_behind_the_rw_service(bed: Bed) -> None:
    status = bed.wait_settled(3, timeout=400)
    primary = status["currentPrimary"]
    roles = {p["metadata"]["name"]: bed.role(p["metadata"]["name"]) for p in bed.pods()}
    assert roles == {m: ("primary" if m == primary else "replica") for m in (f"{NAME}-{i}" for i in range(3))}
    rw = bed.read("services", f"{NAME}-rw")
    assert rw is not None
    # No selector: the operator writes the Service's one EndpointSlice (no controller writes another).
    assert not rw["spec"].get("selector"), rw["spec"]
    slices = bed.items("endpointslices.discovery.k8s.io", f"kubernetes.io/service-name={NAME}-rw")
    assert [s["metadata"]["labels"].get("endpointslice.kubernetes.io/managed-by") for s in slices] == [
        "operator.pgherd.io"
    ], slices
    # The Service's endpoints, as kube-proxy routes them: the primary's address alone.
    addresses = {a for s in slices for e in s.get("endpoints") or [] for a in e.get("addresses") or []}
    assert addresses == {bed.pod(primary)["status"]["podIP"]}  # type: ignore[index]
    targets = [e["targetRef"]["name"] for s in slices for e in s.get("endpoints") or []]
    assert targets == [primary]
    execute(bed.driver.rw_dsn(), "CREATE TABLE marks (id int PRIMARY KEY, at text)")
    bed.mark(1, "created")


def test_the_namespace_admits_restricted_pods_only(bed: Bed) -> None:
    """localkube's namespaces enforce the restricted Pod Security Standard: the members run (so did the
    Jobs of every scenario), and a pod that is not restricted is refused by the API server."""
    if not isinstance(bed.driver, LocalKubeDriver):
        pytest.skip("only the localkube driver labels its namespaces restricted")
    namespace = bed.driver.kube.json("get", "namespace", bed.namespace)
    assert namespace["metadata"]["labels"][POD_SECURITY_ENFORCE] == "restricted"
    image = bed.pods()[0]["spec"]["containers"][0]["image"]
    loose = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "not-restricted", "namespace": bed.namespace},
        "spec": {"containers": [{"name": "main", "image": image, "command": ["sleep", "60"]}]},
    }
    refused = bed.kubectl("create", "--dry-run=server", "-f", "-", stdin=json.dumps(loose), check=False)
    assert refused.returncode != 0
    assert 'violates PodSecurity "restricted:latest"' in refused.stderr, refused.stderr


def test_the_switchover_annotation_runs_to_completion(bed: Bed) -> None:
    before = bed.wait_settled()
    target = next(m["name"] for m in before["members"] if m["name"] != before["currentPrimary"])
    seen, seen_quorum = len(bed.phases), len(bed.quorum)
    bed.merge(
        "postgresclusters.pgherd.io", NAME, {"metadata": {"annotations": {ANNOTATION_SWITCHOVER: target}}}
    )
    eventually(
        lambda: ANNOTATION_SWITCHOVER not in (bed.cluster()["metadata"].get("annotations") or {}),
        what="the annotation to be removed",
    )
    after = bed.wait_settled()
    assert after["currentPrimary"] == target
    assert bed.role(target) == "primary" and bed.role(before["currentPrimary"]) == "replica"
    assert bed.sql(target, "SELECT pg_is_in_recovery()") == [(False,)]
    events = [e for e in bed.events("Switchover") if target in (e.get("note") or "")]
    assert events and events[0]["type"] == "Normal", events
    assert "QuorumLost" not in bed.phases[seen:], bed.phases[seen:]
    during = bed.quorum[seen_quorum:]
    assert during and all(healthy == "True" for _, healthy in during), during
    bed.mark(2, "switched over")


def backup_manifest(name: str) -> dict[str, Any]:
    return manifests.backup(name, NAME)


def backup_status(bed: Bed, name: str, phase: str) -> dict[str, Any] | None:
    status = (bed.read("backups.pgherd.io", name) or {}).get("status") or {}
    return status if status.get("phase") == phase else None


def pruned(bed: Bed) -> dict[str, Any] | None:
    """The summary the cluster's succeeded prune Job left in its pod's termination message."""
    for job in bed.items("jobs", f"{LABEL_CLUSTER}={NAME},{LABEL_COMPONENT}=prune"):
        if not (job.get("status") or {}).get("succeeded"):
            continue
        for pod in bed.items("pods", f"job-name={job['metadata']['name']}"):
            for container in (pod.get("status") or {}).get("containerStatuses") or []:
                message = ((container.get("state") or {}).get("terminated") or {}).get("message")
                if message:
                    return dict(json.loads(message))
    return None


def test_a_backup_runs_a_job_to_completed(bed: Bed) -> None:
    bed.wait_settled()
    bed.create(backup_manifest("first"))
    job = eventually(lambda: bed.read("jobs", "first-snapshot"), what="the snapshot Job")
    assert job["metadata"]["labels"]["pgherd.io/backup"] == "first"
    status = eventually(lambda: backup_status(bed, "first", "Completed"), 300, "the Backup Completed")
    assert status["backupId"] and status["startLSN"] and status["endLSN"] and status["timeline"] >= 1
    assert status["verified"] is True and "error" not in status
    assert isinstance(status["sizeBytes"], int) and status["sizeBytes"] > 1 << 20
    assert status["storePath"].endswith(f"/snapshots/{status['backupId']}/")
    last = eventually(lambda: bed.status().get("lastSuccessfulBackup"), what="lastSuccessfulBackup")
    assert "first" in str(last) or status["backupId"] in str(last)
    # Retention (keepLast 5) runs a prune Job after the backup; it keeps this snapshot.
    prune = eventually(lambda: pruned(bed), 180, "a prune Job to succeed")
    assert status["backupId"] in prune["kept"] and prune["deleted_snapshots"] == []


def test_a_backup_whose_store_refuses_fails_with_a_condition_and_an_event(bed: Bed) -> None:
    bed.wait_settled()
    bed.put_secret({**bed.secret, SECRET_KEY: base64.b64encode(b"not-the-key").decode()})
    try:
        bed.create(backup_manifest("refused"))
        status = eventually(lambda: backup_status(bed, "refused", "Failed"), 300, "the Backup Failed")
    finally:
        bed.put_secret(bed.secret)
    assert status.get("error")

    def refused_condition() -> dict[str, Any] | None:
        conditions = bed.status().get("conditions") or []
        return next(
            (c for c in conditions if c["type"] == "LastBackupSucceeded" and c["status"] == "False"), None
        )

    condition = eventually(refused_condition, what="LastBackupSucceeded False")
    assert "refused" in condition["message"]
    # On the Backup (`kubectl describe pgbackup refused`), and on the cluster too (`kubectl describe pgc`).
    events = eventually(
        lambda: [e for e in bed.events("BackupFailed") if e["regarding"]["kind"] == "Backup"],
        what="a BackupFailed Event on the Backup",
    )
    assert [e["type"] for e in events] == ["Warning"] and events[0]["regarding"]["name"] == "refused"
    on_cluster = [e for e in bed.events("BackupFailed") if e["regarding"]["kind"] == "PostgresCluster"]
    assert on_cluster and all(e["type"] == "Warning" and "refused" in e["note"] for e in on_cluster), (
        on_cluster
    )
    bed.wait_settled()  # the operator goes on


def start_timeout(bed: Bed, seconds: int | None) -> None:
    """spec.backup.jobStartTimeoutSeconds (None: back to the default)."""
    bed.merge("postgresclusters.pgherd.io", NAME, {"spec": {"backup": {"jobStartTimeoutSeconds": seconds}}})


def snapshot_pods(bed: Bed, backup: str) -> list[dict[str, Any]]:
    return bed.items("pods", f"job-name={backup}-snapshot")


def fails_in_bounded_time(bed: Bed, backup: str, timeout: int) -> dict[str, Any]:
    """Create the Backup; it must be Failed once its Job's pod has waited ``timeout`` seconds (plus the
    operator's ticks), long before the Job's own deadline; its Job and pod are deleted."""
    started = time.monotonic()
    bed.create(backup_manifest(backup))
    status = eventually(lambda: backup_status(bed, backup, "Failed"), 120, f"the Backup {backup} Failed")
    elapsed = time.monotonic() - started
    # The pod's creationTimestamp has whole seconds: the wait may look up to a second longer.
    assert timeout - 1 <= elapsed < timeout + 45, elapsed
    assert status["error"].startswith(f"the snapshot Job's pod did not start within {timeout} s"), status
    assert status.get("completedAt")
    eventually(
        lambda: bed.read("jobs", f"{backup}-snapshot") is None and not snapshot_pods(bed, backup),
        90,
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
    """The S3 credentials Secret is missing: the kubelet reports CreateContainerConfigError, which would
    otherwise hold the Job until its deadline."""
    bed.wait_settled()
    start_timeout(bed, 5)
    bed.put_secret(None)
    try:
        status = fails_in_bounded_time(bed, "no-secret", 5)
    finally:
        bed.put_secret(bed.secret)
        start_timeout(bed, None)
    assert f'CreateContainerConfigError: secret "{S3_SECRET}" not found' in status["error"], status
    failed = {c["type"] for c in bed.status().get("conditions") or [] if c["status"] == "False"}
    assert "LastBackupSucceeded" in failed
    bed.wait_settled()


def test_a_backup_whose_job_pod_cannot_be_scheduled_fails_within_the_start_timeout(bed: Bed) -> None:
    """No node takes the pod (every node cordoned): the scheduler's reason is in the error."""
    bed.wait_settled()
    start_timeout(bed, 5)
    bed.driver.cordon(True)
    try:
        status = fails_in_bounded_time(bed, "no-node", 5)
    finally:
        bed.driver.cordon(False)
        start_timeout(bed, None)
    assert "Unschedulable: 0/1 nodes are available: 1 node(s) were unschedulable" in status["error"], status
    bed.wait_settled()


def test_a_backup_whose_job_pod_starts_within_the_start_timeout_completes(bed: Bed) -> None:
    """A pod that waits (here for its Secret, a reason that needs a person) but starts before the timeout
    is not failed: its Backup completes."""
    bed.wait_settled()
    start_timeout(bed, 60)
    bed.put_secret(None)
    try:
        bed.create(backup_manifest("late-secret"))

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
        bed.put_secret(bed.secret)

    def completed() -> dict[str, Any] | None:
        status = dict((bed.read("backups.pgherd.io", "late-secret") or {}).get("status") or {})
        assert status.get("phase") != "Failed", status  # a phase is final: fail at once
        return status if status.get("phase") == "Completed" else None

    try:
        status = eventually(completed, 300, "the Backup Completed")
    finally:
        start_timeout(bed, None)
    assert status["verified"] is True and "error" not in status


def pods_healthy(bed: Bed) -> dict[str, Any] | None:
    return next((c for c in bed.status().get("conditions") or [] if c["type"] == "PodsHealthy"), None)


def test_a_member_pod_that_cannot_start_is_reported_as_the_kubelet_says(bed: Bed) -> None:
    """A replica's pod made again while the S3 Secret its container reads is missing: the kubelet's own
    reason (CreateContainerConfigError) in the condition PodsHealthy False, naming the pod, and a
    Warning Event; once the Secret is back the pod starts and the condition turns True."""
    before = bed.wait_settled()
    member = next(m["name"] for m in before["members"] if m["name"] != before["currentPrimary"])
    # No Job pod of the Backups above may be caught waiting for the Secret too: they are all done first.
    eventually(
        lambda: not [j for j in bed.items("jobs") if (j.get("status") or {}).get("active")],
        180,
        "no Job running",
    )
    bed.put_secret(None)
    try:
        bed.kubectl("delete", "pod", member, "--wait=true")
        condition = eventually(
            lambda: (c := pods_healthy(bed)) and c["status"] == "False" and member in c["message"] and c,
            180,
            f"PodsHealthy False naming {member}",
        )
        assert condition["reason"] == "CreateContainerConfigError", condition
        assert member in condition["message"] and f'secret "{S3_SECRET}" not found' in condition["message"]
        events = eventually(
            lambda: [
                e
                for e in bed.events("CreateContainerConfigError")
                if e.get("reportingController") == "pgherd.io/operator"
            ],
            what="the operator's Warning Event",
        )
        assert events[0]["type"] == "Warning" and S3_SECRET in events[0]["note"], events
    finally:
        bed.put_secret(bed.secret)
    eventually(lambda: (c := pods_healthy(bed)) and c["status"] == "True", 180, "PodsHealthy True")
    bed.wait_settled()


def restore_status(bed: Bed, name: str) -> dict[str, Any]:
    return dict((bed.read("restores.pgherd.io", name) or {}).get("status") or {})


def test_a_restore_completes_in_place_across_an_operator_restart(bed: Bed) -> None:
    before = bed.wait_settled()
    bed.mark(3, "after the backup")
    bed.create(manifests.restore("back", NAME, backup_name="first", immediate=True))
    # The operator stops once an agent took the restore; the next one follows the same restore.
    eventually(
        lambda: '"back"' in (bed.cluster()["metadata"].get("annotations") or {}).get(ANNOTATION_RESTORE, ""),
        180,
        "the restore taken by an agent",
    )
    bed.driver.stop_operator()
    bed.driver.resume_operator()
    seen: set[str] = set()

    def completed() -> dict[str, Any] | None:
        status = restore_status(bed, "back")
        seen.add(status.get("phase", "Pending"))
        assert status.get("phase") != "Failed", status
        return status if status.get("phase") == "Completed" else None

    status = eventually(completed, 400, "the Restore Completed")
    assert status["restoredTimeline"] > before["timeline"]
    assert status["startedAt"] and status["completedAt"] and status["snapshotId"]
    assert "Rebuilding" in seen, seen
    kept = sorted(entry.split(":", 1)[0] for entry in status["keptData"])
    assert kept == [f"{NAME}-{i}" for i in range(3)], status["keptData"]
    after = bed.wait_settled()
    assert after["currentPrimary"] == f"{NAME}-0"
    # Restored to the snapshot's end: what was written after the backup is gone.
    assert bed.sql(after["currentPrimary"], "SELECT id FROM marks ORDER BY id") == [(1,), (2,)]


def test_a_restore_of_a_failed_backup_fails_with_an_event_and_changes_nothing(bed: Bed) -> None:
    before = bed.wait_settled()
    seen = len(bed.phases)
    bed.create(manifests.restore("from-refused", NAME, backup_name="refused"))
    status = eventually(lambda: (s := restore_status(bed, "from-refused")).get("phase") == "Failed" and s)
    assert "refused" in status["error"] and status["completedAt"]
    events = eventually(lambda: bed.events("RestoreFailed"), what="a RestoreFailed Event")
    assert events[0]["type"] == "Warning" and events[0]["regarding"]["kind"] == "Restore"
    after = bed.wait_settled()
    assert after["currentPrimary"] == before["currentPrimary"] and after["timeline"] == before["timeline"]
    assert "Failed" not in bed.phases[seen:], bed.phases[seen:]


def test_retention_expires_a_backup_and_a_restore_naming_it_is_refused(bed: Bed) -> None:
    """Retention (keepLast 1 from now) runs a prune Job after the next Backup; the snapshot of "first" is
    deleted: the operator marks "first" Expired, with an Event, and a Restore naming it is refused at
    once with that reason, changing nothing."""
    before = bed.wait_settled()
    first = backup_status(bed, "first", "Completed")
    assert first is not None
    bed.merge("postgresclusters.pgherd.io", NAME, {"spec": {"backup": {"retention": {"keepLast": 1}}}})
    try:
        bed.create(backup_manifest("newest"))
        newest = eventually(lambda: backup_status(bed, "newest", "Completed"), 300, "the Backup newest")
        expired = eventually(lambda: backup_status(bed, "first", "Expired"), 180, "the Backup first Expired")
    finally:
        bed.merge("postgresclusters.pgherd.io", NAME, {"spec": {"backup": {"retention": {"keepLast": 5}}}})
    assert expired["backupId"] == first["backupId"] and expired["completedAt"] == first["completedAt"]
    assert expired["message"] == f"its snapshot {first['backupId']} was deleted by retention (keepLast: 1)"
    expired_at = datetime.fromisoformat(expired["expiredAt"].replace("Z", "+00:00"))
    assert expired_at >= datetime.fromisoformat(newest["completedAt"].replace("Z", "+00:00"))
    events = eventually(
        lambda: [e for e in bed.events("BackupExpired") if e["regarding"]["name"] == "first"],
        what="a BackupExpired Event",
    )
    assert events[0]["type"] == "Normal" and expired["message"] in events[0]["note"]

    bed.create(manifests.restore("from-expired", NAME, backup_name="first"))
    status = eventually(lambda: (s := restore_status(bed, "from-expired")).get("phase") == "Failed" and s)
    assert status["error"] == (
        f"Backup first is Expired (its snapshot was deleted by retention at {expired['expiredAt']});"
        " choose another Backup"
    )
    assert "startedAt" not in status  # refused before any member was fenced or asked to restore
    after = bed.wait_settled()
    assert after["currentPrimary"] == before["currentPrimary"] and after["timeline"] == before["timeline"]


def pod_deletions_by_the_operator(bed: Bed, since: str) -> list[str] | None:
    """The member pods the operator deleted since `since` (RFC 3339), in order, from the audit log; None
    where the API server keeps none (kind)."""
    events = bed.audit()
    if events is None:
        return None
    return [
        e["objectRef"]["name"]
        for e in events
        if e.get("verb") == "delete"
        and e["user"]["username"] == bed.operator_user()
        and (e.get("objectRef") or {}).get("resource") == "pods"
        and e["objectRef"].get("namespace") == bed.namespace
        and e["requestReceivedTimestamp"] >= since
        and e["objectRef"].get("name", "").startswith(f"{NAME}-")
    ]


def now_rfc3339() -> str:
    """Now, as the audit log writes its timestamps (UTC, microseconds), for comparing them as strings."""
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def test_a_restart_parameter_rolls_out_replicas_first_and_the_old_primary_last(bed: Bed) -> None:
    before = bed.wait_settled()
    seen = len(bed.phases)
    old_primary = before["currentPrimary"]
    since = now_rfc3339()
    bed.merge("postgresclusters.pgherd.io", NAME, {"spec": {"parameters": {"max_connections": "50"}}})
    plan = eventually(
        lambda: (op := bed.status().get("operation")) and op.get("kind") == "Rollout" and op,
        180,
        "a rollout plan in status.operation",
    )
    bed.wait_settled(timeout=400)
    deleted = pod_deletions_by_the_operator(bed, since)
    if deleted is not None:
        order = list(dict.fromkeys(deleted))
        assert order == plan["plan"] and order[-1] == old_primary, (order, plan)
        assert sorted(order) == sorted(m["name"] for m in before["members"])
    after = bed.status()
    assert after["currentPrimary"] != old_primary
    assert not UNHEALTHY & set(bed.phases[seen:]), bed.phases[seen:]
    for member in before["members"]:
        assert bed.sql(member["name"], "SHOW max_connections") == [("50",)]


def test_scale_up_with_spec_instances_and_down_with_the_scale_subresource(bed: Bed) -> None:
    bed.wait_settled()
    seen = len(bed.phases)
    bed.merge("postgresclusters.pgherd.io", NAME, {"spec": {"instances": 5}})
    status = bed.wait_settled(5, timeout=400)
    assert status["instances"] == 5
    assert {p["metadata"]["name"] for p in bed.pods()} == {f"{NAME}-{i}" for i in range(5)}
    count = "SELECT count(*) FROM marks"
    assert bed.sql(f"{NAME}-4", count) == bed.sql(status["currentPrimary"], count)
    bed.kubectl("scale", "postgrescluster", NAME, "--replicas=3")  # the scale subresource
    assert bed.cluster()["spec"]["instances"] == 3
    status = bed.wait_settled(3, timeout=300)
    eventually(lambda: len(bed.pods()) == 3, what="two pods gone")
    statefulset = bed.read("statefulsets", NAME)
    assert statefulset is not None and statefulset["spec"]["replicas"] == 3
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
        urllib.request.urlopen(f"https://{ip}:{AGENT_PORT}/startupz", timeout=1, context=context)
    except urllib.error.HTTPError:
        return True  # it answered
    except OSError:
        return False
    return True


def test_a_deleted_primary_pod_is_switched_over_before_its_postgres_stops(bed: Bed) -> None:
    """As a drain deletes it (SIGTERM, its grace period) on a node that takes no new pod (cordoned, as a
    drain leaves it): its agent holds PostgreSQL up until the engine switched over, a switchover, never
    a failover, done while the pod made again cannot start: the promotion never waits for it."""
    before = bed.wait_settled()
    old = before["currentPrimary"]
    bed.mark(4, "before the drain")
    old_pod = bed.pod(old)
    assert old_pod is not None
    seen = len(bed.phases)
    kinds: set[str] = set()
    replacement_ran: list[str] = []

    def switched() -> dict[str, Any] | None:
        status = bed.status()
        kinds.add(str((status.get("operation") or {}).get("kind") or status.get("phase")))
        pod = bed.pod(old)
        replacement = pod is not None and pod["metadata"]["uid"] != old_pod["metadata"]["uid"]
        if replacement and ((pod.get("status") or {}).get("podIP") or agent_answers(pod)):
            replacement_ran.append(pod["metadata"]["uid"])  # type: ignore[index]
        moved = status.get("currentPrimary") not in (None, old) and not status.get("operation")
        return status if moved else None

    bed.driver.cordon(True)
    try:
        started = time.monotonic()
        bed.kubectl("delete", "pod", old, "--wait=false")
        switched_over = eventually(switched, 120, "a switchover away from the deleted primary")
        elapsed = time.monotonic() - started
        # The pod made again is Pending (no node takes it) all along: nothing of it ran.
        assert replacement_ran == [], "the old primary's new pod ran before the promotion"
    finally:
        bed.driver.cordon(False)
    assert elapsed < 90, elapsed  # its agent did not wait out the time it may hold a primary
    assert bed.role(switched_over["currentPrimary"]) == "primary"
    assert not {"Failover", "FailingOver", "Failed"} & kinds, kinds
    after = eventually(
        lambda: (
            (pod := bed.pod(old)) is not None
            and pod["metadata"]["uid"] != old_pod["metadata"]["uid"]
            and bed.settled(3)
        ),
        300,
        "the old primary's pod back once the node takes pods again, the cluster settled",
    )
    assert after["currentPrimary"] == switched_over["currentPrimary"]
    # A switchover, never a failover: from the watch, which sees every phase written (the prepared
    # switchover of a deleted pod may start and end between two polls of the status).
    phases = bed.phases[seen:]
    assert "SwitchingOver" in phases and not {"FailingOver", "Failed", "QuorumLost"} & set(phases), phases
    assert (4,) in bed.sql(after["currentPrimary"], "SELECT id FROM marks")


def test_one_member_has_no_budget_and_a_larger_volume_is_asked_for(bed: Bed) -> None:
    """Scaled to one instance, the cluster's PodDisruptionBudget is deleted (any budget would block every
    drain of its node). A larger spec.storage.size makes the operator ask for each volume to grow:
    local-path's StorageClass cannot expand, the API server refuses, an Event says so, and the cluster
    stays Running on its volume as it is."""
    members = len(bed.wait_settled()["members"])
    # The disruption controller's reading of minAvailable "51%" (of the StatefulSet's replicas, rounded
    # up): a majority of the members must stay.
    budget = eventually(
        lambda: (
            (b := bed.read("poddisruptionbudgets", NAME))
            and (b.get("status") or {}).get("expectedPods") == members
            and b
        ),
        60,
        "the budget's status for every member",
    )
    assert budget["spec"]["minAvailable"] == "51%", budget["spec"]
    assert budget["status"]["desiredHealthy"] == members // 2 + 1, budget["status"]
    bed.merge("postgresclusters.pgherd.io", NAME, {"spec": {"instances": 1}})
    status = bed.wait_settled(1, timeout=300)
    eventually(lambda: bed.read("poddisruptionbudgets", NAME) is None, 120, "the budget deleted")
    (member,) = [m["name"] for m in status["members"]]
    bed.merge("postgresclusters.pgherd.io", NAME, {"spec": {"storage": {"size": "2Gi"}}})
    refused = eventually(
        lambda: (
            [e for e in bed.events("VolumeExpansionRefused") if f"pgdata-{member}" in e.get("note", "")]
            or None
        ),
        120,
        "the refused expansion reported",
    )
    assert "2Gi" in refused[0]["note"], refused[0]
    pvc = bed.read("persistentvolumeclaims", f"pgdata-{member}")
    assert pvc is not None and pvc["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert bed.wait_settled(1)["phase"] == "Running"


def test_every_request_of_the_operator_is_granted_by_the_chart(bed: Bed) -> None:
    """Everything above (members, labels, pods, Jobs, Backups, Restores, Events, scale), as the API
    server's audit log recorded it: no request of the operator's ServiceAccount was forbidden, and each
    is one the rules bound to it grant."""
    localkube: LocalKube | None = getattr(bed.driver, "localkube", None)
    if localkube is None:
        pytest.skip("this driver's API server keeps no audit log (localkube's does)")
    mine = rbac.requests_of(bed.operator_user(), localkube.audit_events())
    kinds = {(r.resource.partition("/")[0], r.verb) for r in mine}
    wanted = {
        ("pods", "patch"),
        ("pods", "delete"),
        ("jobs", "create"),
        ("restores", "patch"),
        ("leases", "update"),
    }
    assert wanted <= kinds, sorted(kinds)
    # Denied by authorization (RBAC), not a 403 of admission: a Backup the schedule creates while a
    # finished scenario's namespace is being deleted is refused by NamespaceLifecycle, allowed by RBAC.
    assert rbac.refused(mine) == [], "requests the chart does not grant:\n" + "\n".join(rbac.refused(mine))
    grants = localkube.grants_of_service_account(bed.driver.operator_namespace, bed.driver.release)
    assert rbac.ungranted(mine, grants) == [], "\n".join(rbac.ungranted(mine, grants))


@pytest.mark.session_end
def test_every_right_the_chart_grants_was_used_by_the_suite(whole_suite: None) -> None:
    """The other way round, at the end of a run of the whole suite: every verb of every rule bound to the
    operator's ServiceAccount was used by some request in the cluster's audit log (a right no scenario
    needs is one to take away), and again, none of them was refused. The log is the cluster's since it
    came up: the operator's first start (the Lease created) comes before the scenarios, and a cluster
    found up (PGHERD_E2E_LOCALKUBE_DIR) holds the sessions before this one too."""
    localkube = LocalKubeDriver.session_cluster()
    if localkube is None:
        pytest.skip("no localkube cluster in this session: the audit log is localkube's")
    operator = localkube.state.get("operator") or {}
    namespace, account = str(operator.get("namespace")), str(operator.get("release"))
    mine = rbac.requests_of(operator_user(namespace, account), localkube.audit_events())
    grants = localkube.grants_of_service_account(namespace, account)
    assert grants, f"no rule is bound to {namespace}/{account}"
    assert rbac.refused(mine) == [], "refused:\n" + "\n".join(rbac.refused(mine))
    unused = rbac.unused(grants, mine, localkube.admission_plugins())
    assert unused == [], (
        "rights the chart grants that no request of the whole suite used (take them away, or add the"
        " scenario that needs them):\n" + "\n".join(unused)
    )
