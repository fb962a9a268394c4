"""`kubectl-pgherd` (its console script, a subprocess) against a real kube-apiserver and etcd
(tests/kube's control plane: no node, so no pod runs): the status of a cluster whose status the test
writes as the operator would, the requests and their refusals, Backups and Restores followed with
`--wait` while the test moves their phases, errors in one line (no such cluster, no permission, no
operator), a support report that holds no Secret value, and `version`."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from e2e.checks import secret_values
from e2e.localkube import apiserver_only

from kube.realkube import Kube
from kube.waiting import eventually

from . import phases

SCRIPT = Path(sys.executable).parent / "kubectl-pgherd"
OPERATOR_NS = "pgherd-plugin-op"
# Secret keys whose values are no secret: account names, and the certificates (public by design).
JSON = dict[str, Any]
SPEC = {
    "instances": 3,
    "postgresVersion": 16,
    "storage": {"size": "1Gi"},
    "backup": {
        "store": {"s3": {"bucket": "bkt", "credentials": {"secretName": "s3"}}},
        "schedule": "0 3 * * *",
    },
}


def run(
    kubeconfig: Path, namespace: str, *args: str, timeout: float = 60, check: int | None = 0
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [str(SCRIPT), "--kubeconfig", str(kubeconfig), "-n", namespace, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    if check is not None:
        assert result.returncode == check, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    return result


def start(kubeconfig: Path, namespace: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(SCRIPT), "--kubeconfig", str(kubeconfig), "-n", namespace, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, f"not one line: {result.stderr!r}"
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.fixture(scope="module")
def admin(control_plane: apiserver_only.ControlPlane) -> Path:
    return control_plane.kubeconfig


@pytest.fixture(scope="module")
def operator(kube: Kube) -> Iterator[JSON]:
    """The operator's Deployment as the chart labels it, ready (no pod runs: its status is written here)."""
    deployment = _operator_deployment(kube, "pgherd", ready=1)
    yield deployment
    kube.request("DELETE", f"/apis/apps/v1/namespaces/{OPERATOR_NS}/deployments/pgherd")


def _operator_deployment(kube: Kube, name: str, ready: int) -> JSON:
    if kube.read("namespaces", None, OPERATOR_NS) is None:
        kube.make_namespace(OPERATOR_NS)
    labels = {
        "app.kubernetes.io/name": "pgherd",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/component": "operator",
    }
    body = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name,
            "namespace": OPERATOR_NS,
            "labels": {**labels, "app.kubernetes.io/part-of": "pgherd", "app.kubernetes.io/version": "0.1.0"},
        },
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "operator", "image": "ghcr.io/pgherd/pgherd:0.1.0"}]},
            },
        },
    }
    path = f"/apis/apps/v1/namespaces/{OPERATOR_NS}/deployments"
    created = kube.request("POST", path, body)
    kube.request(
        "PATCH",
        f"{path}/{name}/status",
        {"status": {"replicas": 1, "readyReplicas": ready}},
        content_type="application/merge-patch+json",
    )
    return created


def make_cluster(kube: Kube, ns: str, document: Any = None, **spec: Any) -> JSON:
    """PostgresCluster "pg" with the status of ``document`` (phases.py) written to its status."""
    body = {
        "apiVersion": "pgherd.io/v1alpha1",
        "kind": "PostgresCluster",
        "metadata": {"name": "pg", "namespace": ns},
        "spec": {**SPEC, **spec},
    }
    created = kube.create(body)
    if document is not None:
        set_status(kube, ns, document["cluster"]["status"])
    return created


def set_status(kube: Kube, ns: str, status: JSON) -> None:
    kube.merge("postgresclusters", ns, "pg", {"status": status}, subresource="status")


def certificate() -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "*.pg-headless.apps.svc")])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(7)
        .not_valid_before(now - timedelta(days=1))
        .not_valid_after(now + timedelta(days=825))
        .sign(key, hashes.SHA256())
    )
    pem_key = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    return cert.public_bytes(serialization.Encoding.PEM).decode(), pem_key


def make_secrets(kube: Kube, ns: str) -> None:
    """The cluster's Secrets, with values as random as the operator's."""
    import secrets as random

    cert, key = certificate()

    def secret(name: str, data: dict[str, str], kind: str = "Opaque") -> None:
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        kube.create(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": kind,
                "metadata": {"name": name, "namespace": ns},
                "data": encoded,
            }
        )

    password = random.token_urlsafe(32)
    secret("pg-superuser", {"username": "postgres", "password": random.token_urlsafe(32)})
    secret(
        "pg-app",
        {
            "username": "app",
            "password": password,
            "uri": f"postgresql://app:{password}@pg-rw.{ns}.svc:5432/app",
        },
    )
    secret("pg-replication", {"username": "streaming_replica", "password": random.token_urlsafe(32)})
    secret(
        "pg-agent",
        {"tls.crt": cert, "tls.key": key, "ca.crt": cert, "token.sha256": random.token_hex(32)},
        "kubernetes.io/tls",
    )
    secret("pg-operator", {"token": random.token_urlsafe(32), "ca.crt": cert, "ca.key": key})
    secret(
        "s3", {"AWS_ACCESS_KEY_ID": random.token_hex(10), "AWS_SECRET_ACCESS_KEY": random.token_urlsafe(30)}
    )


def event(kube: Kube, ns: str, reason: str, note: str, warning: bool = False) -> None:
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    kube.request(
        "POST",
        f"/apis/events.k8s.io/v1/namespaces/{ns}/events",
        {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"name": f"pg.{time.monotonic_ns()}", "namespace": ns},
            "eventTime": stamp,
            "reportingController": "pgherd.io/operator",
            "reportingInstance": "test",
            "action": reason,
            "reason": reason,
            "note": note,
            "type": "Warning" if warning else "Normal",
            "regarding": {
                "apiVersion": "pgherd.io/v1alpha1",
                "kind": "PostgresCluster",
                "name": "pg",
                "namespace": ns,
            },
        },
    )


def kubeconfig_for(
    control_plane: apiserver_only.ControlPlane, kube: Kube, ns: str, account: str, path: Path
) -> Path:
    """A kubeconfig logging in as ServiceAccount ``account`` of ``ns`` (a token from the TokenRequest API)."""
    kube.create(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account, "namespace": ns}}
    )
    token = kube.token(ns, account)
    ca = base64.b64encode(control_plane.ca_file.read_bytes()).decode()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "c", "cluster": {"server": control_plane.api_url, "certificate-authority-data": ca}}
        ],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": account, "context": {"cluster": "c", "user": account, "namespace": ns}}],
        "current-context": account,
    }
    path.write_text(yaml.safe_dump(config))
    return path


# -- no operator: first, while none is installed ------------------------------------------------------------


def test_a_request_nothing_would_act_on_is_refused(kube: Kube, namespace: str, admin: Path) -> None:
    make_cluster(kube, namespace, phases.running())
    refused = run(admin, namespace, "switchover", "pg", "--to", "pg-1", check=1)
    if "no pgherd operator is installed" not in refused.stderr:
        pytest.skip(
            "an operator Deployment exists already in this session: the module's tests ran out of order"
        )
    assert "no pgherd operator is installed" in error_line(refused)
    _operator_deployment(kube, "pgherd-down", ready=0)
    try:
        down = run(admin, namespace, "backup", "pg", check=1)
        assert f"the pgherd operator {OPERATOR_NS}/pgherd-down has no ready replica (0/1)" in error_line(down)
    finally:
        kube.request("DELETE", f"/apis/apps/v1/namespaces/{OPERATOR_NS}/deployments/pgherd-down")
    annotations = kube.read("postgresclusters", namespace, "pg")["metadata"].get("annotations") or {}  # type: ignore[index]
    assert "pgherd.io/switchover-to" not in annotations
    assert kube.items("backups", namespace) == []


# -- status -----------------------------------------------------------------------------------------------------


def test_status_explains_the_cluster_read_from_the_api_server(
    kube: Kube, namespace: str, admin: Path, operator: JSON
) -> None:
    make_cluster(kube, namespace, phases.failing_over())
    make_secrets(kube, namespace)
    event(
        kube,
        namespace,
        "Failover",
        "primary pg-0 failed (unreachable 6s, confirmed by 2 members)",
        warning=True,
    )
    shown = run(admin, namespace, "status", "pg").stdout
    assert shown.startswith(f"PostgresCluster pg in namespace {namespace}: FailingOver\n")
    for phrase in (
        "Why:     fencing the old primary pg-0: waiting for evidence that it stopped",
        "[>] fence the old primary pg-0 until it provably cannot write",
        "Operator: pgherd-plugin-op/pgherd (ghcr.io/pgherd/pgherd:0.1.0, 0.1.0): 1/1 ready",
        "pg-agent tls.crt (the members' server certificate): expires in ",
        "Warning Failover: primary pg-0 failed",
        "PrimaryAvailable False",
    ):
        assert phrase in shown, f"{phrase!r} not in\n{shown}"
    # Valid 825 days from when make_secrets made it: 824 d and some hours, or 825 d within its second.
    assert re.search(r"server certificate\): expires in 82[45] d ", shown), shown
    assert "PRIVATE KEY" not in shown
    summary = json.loads(run(admin, namespace, "status", "pg", "-o", "json").stdout)
    assert summary["phase"] == "FailingOver" and summary["operation"]["kind"] == "Failover"
    assert [m["name"] for m in summary["members"]] == ["pg-0", "pg-1", "pg-2"]


def test_status_of_a_missing_cluster_names_the_namespace(kube: Kube, namespace: str, admin: Path) -> None:
    missing = run(admin, namespace, "status", "nope", check=1)
    assert error_line(missing) == (
        f"error: no PostgresCluster 'nope' in namespace '{namespace}' (kubectl get pgc -A lists them all;"
        " -n NAMESPACE looks elsewhere)"
    )


def test_no_permission_names_the_verb_and_the_resource(
    kube: Kube, namespace: str, control_plane: apiserver_only.ControlPlane, tmp_path: Path
) -> None:
    make_cluster(kube, namespace, phases.running())
    nobody = kubeconfig_for(control_plane, kube, namespace, "nobody", tmp_path / "nobody")
    refused = run(nobody, namespace, "status", "pg", check=1)
    assert error_line(refused) == (
        f"error: no permission to get postgresclusters.pgherd.io 'pg' in namespace '{namespace}' as"
        f" system:serviceaccount:{namespace}:nobody: the API server refused (403)"
    )
    # May read the cluster and nothing else: the status is shown, with what it could not read.
    reader = kubeconfig_for(control_plane, kube, namespace, "reader", tmp_path / "reader")
    kube.create(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "read-pgc", "namespace": namespace},
            "rules": [
                {"apiGroups": ["pgherd.io"], "resources": ["postgresclusters"], "verbs": ["get", "patch"]}
            ],
        }
    )
    kube.create(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "read-pgc", "namespace": namespace},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "read-pgc"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        }
    )
    shown = eventually(
        lambda: (r := run(reader, namespace, "status", "pg", check=None)).returncode == 0 and r, what="RBAC"
    )
    assert "Running" in shown.stdout.splitlines()[0]
    assert f"certificates: no permission to get secrets 'pg-agent' in namespace '{namespace}'" in shown.stdout
    assert "the operator: no permission to list deployments.apps in any namespace" in shown.stdout
    # A request it may make, but the operator check it may not: not refused for that; the backup it may not create is.
    refused = run(reader, namespace, "backup", "pg", check=1)
    assert error_line(refused).startswith("error: no permission to create backups.pgherd.io 'pg-")


# -- requests ---------------------------------------------------------------------------------------------------


def annotations(kube: Kube, ns: str) -> dict[str, str]:
    return dict((kube.read("postgresclusters", ns, "pg") or {})["metadata"].get("annotations") or {})


def test_switchover_annotation_and_its_refusals(
    kube: Kube, namespace: str, admin: Path, operator: JSON
) -> None:
    make_cluster(kube, namespace, phases.running())
    assert "refused" not in run(admin, namespace, "switchover", "pg", "--to", "pg-1").stdout
    assert annotations(kube, namespace)["pgherd.io/switchover-to"] == "pg-1"
    again = run(admin, namespace, "switchover", "pg", "--to", "pg-2", check=1)
    assert "a switchover of pg to pg-1 is already asked for" in error_line(again)
    kube.merge(
        "postgresclusters", namespace, "pg", {"metadata": {"annotations": {"pgherd.io/switchover-to": None}}}
    )
    assert "pg-0 is already the primary of pg" in error_line(
        run(admin, namespace, "switchover", "pg", "--to", "pg-0", check=1)
    )
    assert "has no member pg-9" in error_line(
        run(admin, namespace, "switchover", "pg", "--to", "pg-9", check=1)
    )
    set_status(kube, namespace, phases.degraded()["cluster"]["status"])
    assert "pg is Degraded, not Running" in error_line(run(admin, namespace, "switchover", "pg", check=1))


def test_switchover_wait_follows_the_operator(
    kube: Kube, namespace: str, admin: Path, operator: JSON
) -> None:
    make_cluster(kube, namespace, phases.running())
    waiting = start(admin, namespace, "switchover", "pg", "--to", "pg-1", "--wait", "--timeout", "60")
    eventually(
        lambda: annotations(kube, namespace).get("pgherd.io/switchover-to") == "pg-1", what="the request"
    )
    set_status(kube, namespace, phases.switching_over()["cluster"]["status"])
    time.sleep(1.5)
    # The operator: pg-1 promoted, the annotation removed.
    done = phases.running()["cluster"]["status"]
    done["currentPrimary"] = "pg-1"
    set_status(kube, namespace, done)
    kube.merge(
        "postgresclusters", namespace, "pg", {"metadata": {"annotations": {"pgherd.io/switchover-to": None}}}
    )
    out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 0, err
    assert "SwitchingOver: draining pg-0" in out and "switched over: pg-1 is the primary" in out


def test_a_refused_switchover_exits_non_zero_with_the_operators_reason(
    kube: Kube, namespace: str, admin: Path, operator: JSON
) -> None:
    make_cluster(kube, namespace, phases.running())
    waiting = start(admin, namespace, "switchover", "pg", "--to", "pg-2", "--wait", "--timeout", "60")
    eventually(
        lambda: annotations(kube, namespace).get("pgherd.io/switchover-to") == "pg-2", what="the request"
    )
    event(
        kube,
        namespace,
        "Switchover",
        "switchover to pg-2 refused: it is 20000000 bytes behind the primary",
        True,
    )
    kube.merge(
        "postgresclusters", namespace, "pg", {"metadata": {"annotations": {"pgherd.io/switchover-to": None}}}
    )
    _, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 1
    assert err.strip() == "error: switchover to pg-2 refused: it is 20000000 bytes behind the primary"


def test_pause_resume_restart_and_upgrade_requests(
    kube: Kube, namespace: str, admin: Path, operator: JSON
) -> None:
    make_cluster(kube, namespace, phases.running())
    assert "pg paused" in run(admin, namespace, "pause", "pg").stdout
    assert kube.read("postgresclusters", namespace, "pg")["spec"]["paused"] is True  # type: ignore[index]
    assert "already paused" in run(admin, namespace, "pause", "pg").stdout
    assert "pg is paused (spec.paused)" in error_line(run(admin, namespace, "restart", "pg", check=1))
    assert "pg resumed" in run(admin, namespace, "resume", "pg").stdout
    assert kube.read("postgresclusters", namespace, "pg")["spec"]["paused"] is False  # type: ignore[index]
    said = run(admin, namespace, "restart", "pg").stdout
    assert "rolling restart of pg (pgherd.io/restart=" in said
    stamp = annotations(kube, namespace)["pgherd.io/restart"]
    assert datetime.fromisoformat(stamp) > datetime.now(UTC) - timedelta(minutes=1)
    for action in ("confirm", "rollback"):
        refused = run(admin, namespace, "upgrade", action, "pg", check=1)
        assert (
            f"no upgrade of pg waits for a {'confirmation' if action == 'confirm' else 'rollback'}"
            in error_line(refused)
        )
    set_status(kube, namespace, phases.old_major_kept()["cluster"]["status"])
    assert "pg-2 is kept on PostgreSQL 16" in run(admin, namespace, "upgrade", "confirm", "pg").stdout
    assert annotations(kube, namespace)["pgherd.io/confirm-upgrade"] == "17"
    assert "already being confirmed" in error_line(run(admin, namespace, "upgrade", "confirm", "pg", check=1))
    run(admin, namespace, "upgrade", "rollback", "pg")
    assert annotations(kube, namespace)["pgherd.io/rollback-upgrade"] == "17"


def test_restarting_one_member_deletes_its_pod(
    kube: Kube, namespace: str, admin: Path, operator: JSON
) -> None:
    make_cluster(kube, namespace, phases.running())
    labels = {"pgherd.io/cluster": "pg", "app.kubernetes.io/component": "postgres"}
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "pg-postgres", "namespace": namespace},
        }
    )
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "pg-1", "namespace": namespace, "labels": labels},
            "spec": {
                "serviceAccountName": "pg-postgres",
                "automountServiceAccountToken": False,
                "containers": [{"name": "postgres", "image": "ghcr.io/pgherd/pgherd:0.1.0"}],
            },
        }
    )
    assert "restart of pg-1 (its pod deleted" in run(admin, namespace, "restart", "pg", "pg-1").stdout
    eventually(
        lambda: kube.read("pods", namespace, "pg-1") is None, what="pg-1 deleted"
    )  # never scheduled: at once
    assert "has no member pg-7" in error_line(run(admin, namespace, "restart", "pg", "pg-7", check=1))


# -- backups and restores ---------------------------------------------------------------------------------------


def set_phase(kube: Kube, resource: str, ns: str, name: str, **status: Any) -> None:
    kube.merge(resource, ns, name, {"status": status}, subresource="status")


def test_backup_wait_follows_its_phases_to_completed_and_to_failed(
    kube: Kube, namespace: str, admin: Path, operator: JSON
) -> None:
    make_cluster(kube, namespace, phases.running())
    waiting = start(admin, namespace, "backup", "pg", "--backup-name", "b1", "--wait", "--timeout", "60")
    backup = eventually(lambda: kube.read("backups", namespace, "b1"), what="Backup b1")
    assert backup["spec"] == {"cluster": {"name": "pg"}, "target": "preferStandby"}
    time.sleep(1.5)
    set_phase(
        kube,
        "backups",
        namespace,
        "b1",
        phase="Running",
        sourceMember="pg-2",
        startedAt="2026-01-01T12:00:00Z",
    )
    time.sleep(1.5)
    set_phase(
        kube, "backups", namespace, "b1", phase="Completed", backupId="20260101T120000", size="1.2Gi",
        storedSize="300.0Mi", startLSN="0/3000028", endLSN="0/3000138", timeline=1, verified=True,
        completedAt="2026-01-01T12:01:00Z",
    )  # fmt: skip
    out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 0, err
    assert "Backup b1 of pg created" in out
    assert "Pending: waiting for the operator" in out and "Running: snapshot Job streaming from pg-2" in out
    assert "Completed: snapshot 20260101T120000, 1.2Gi (300.0Mi stored), WAL 0/3000028 to 0/3000138" in out
    failing = start(admin, namespace, "backup", "pg", "--backup-name", "b2", "--wait", "--timeout", "60")
    eventually(lambda: kube.read("backups", namespace, "b2"), what="Backup b2")
    set_phase(
        kube, "backups", namespace, "b2", phase="Failed", error='pod b2-snapshot: secret "s3" not found'
    )
    _, err = failing.communicate(timeout=60)
    assert failing.returncode == 1
    assert err.strip() == 'error: Backup b2 Failed: pod b2-snapshot: secret "s3" not found'


def test_restore_wait_follows_its_phases(kube: Kube, namespace: str, admin: Path, operator: JSON) -> None:
    make_cluster(kube, namespace, phases.running())
    kube.create(
        {
            "apiVersion": "pgherd.io/v1alpha1",
            "kind": "Backup",
            "metadata": {"name": "b1", "namespace": namespace},
            "spec": {"cluster": {"name": "pg"}},
        }
    )
    set_phase(kube, "backups", namespace, "b1", phase="Completed", backupId="20260101T120000")
    refused = run(admin, namespace, "restore", "pg", "--backup", "nope", check=1)
    assert "Backup 'nope' not found" in error_line(refused)
    waiting = start(
        admin,
        namespace,
        "restore",
        "pg",
        "--backup",
        "b1",
        "--time",
        "2026-01-01T12:30:00Z",
        "--wait",
        "--timeout",
        "60",
    )
    restore = eventually(lambda: (items := kube.items("restores", namespace)) and items[0], what="a Restore")
    name = restore["metadata"]["name"]
    assert restore["spec"] == {
        "cluster": {"name": "pg"},
        "backup": "b1",
        "target": {"time": "2026-01-01T12:30:00Z"},
    }
    for step in (
        {"phase": "Fencing"},
        {"phase": "Restoring", "progress": {"bytesDone": 512, "bytesTotal": 1024}},
        {
            "phase": "Completed",
            "restoredTimeline": 2,
            "keptData": ["pg-0: /var/lib/pgherd/kept/20260101T120000"],
        },
    ):
        time.sleep(1.5)
        set_phase(kube, "restores", namespace, name, **step)
    out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 0, err
    assert f"Restore {name} created: pg is restored in place from b1 to 2026-01-01T12:30:00Z" in out
    assert "Fencing; the cluster: Running" in out and "Restoring (50% of 1.0Ki)" in out
    assert "Completed: pg restored on timeline 2; the members' old data kept aside" in out
    failing = start(
        admin, namespace, "restore", "pg", "--snapshot", "20260101T120000", "--wait", "--timeout", "60"
    )
    other = eventually(
        lambda: next((r for r in kube.items("restores", namespace) if r["metadata"]["name"] != name), None),
        what="a second Restore",
    )
    set_phase(
        kube,
        "restores",
        namespace,
        other["metadata"]["name"],
        phase="Failed",
        error="checksum mismatch in base.tar",
    )
    _, err = failing.communicate(timeout=60)
    assert failing.returncode == 1 and err.strip().endswith("Failed: checksum mismatch in base.tar")


# -- report, version -----------------------------------------------------------------------------------------


def _bundle_files(path: Path) -> dict[str, bytes]:
    if path.suffix == ".zip":
        with zipfile.ZipFile(path) as archive:
            return {name: archive.read(name) for name in archive.namelist()}
    with tarfile.open(path) as archive:
        return {m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}  # type: ignore[union-attr]


def test_report_holds_no_secret_value(
    kube: Kube, namespace: str, admin: Path, operator: JSON, tmp_path: Path
) -> None:
    make_cluster(kube, namespace, phases.running())
    make_secrets(kube, namespace)
    event(kube, namespace, "SwitchedOver", "switched over to pg-1")
    values = secret_values(kube.items("secrets", namespace))
    assert len(values) > 20
    for name in ("bundle.tar.gz", "bundle.zip"):
        said = run(admin, namespace, "report", "pg", "-o", str(tmp_path / name)).stdout
        assert said.startswith(f"{tmp_path / name}: ")
        files = _bundle_files(tmp_path / name)
        names = {path.split("/", 1)[1] for path in files}
        assert {
            "README.txt",
            "status.txt",
            "status.json",
            "cluster.yaml",
            "backups.yaml",
            "events.yaml",
            "pods.yaml",
        } <= names
        text = files["pgherd-report-pg/status.txt"].decode()
        assert "pg-agent tls.crt (the members' server certificate): expires in" in text
        assert "switched over to pg-1" in files["pgherd-report-pg/events.yaml"].decode()
        leaked = [(path, v[:12]) for path, content in files.items() for v in values if v in content]
        assert not leaked, f"Secret values in the bundle: {leaked}"
    assert b"PRIVATE KEY" not in b"".join(_bundle_files(tmp_path / "bundle.zip").values())
    assert "name the bundle .tar.gz, .tgz or .zip" in error_line(
        run(admin, namespace, "report", "pg", "-o", str(tmp_path / "x.rar"), check=1)
    )


def test_version_names_the_plugin_and_the_operator(admin: Path, namespace: str, operator: JSON) -> None:
    lines = run(admin, namespace, "version").stdout.splitlines()
    assert lines[0] == "kubectl-pgherd 0.1.0"
    assert f"operator 0.1.0: {OPERATOR_NS}/pgherd, image ghcr.io/pgherd/pgherd:0.1.0, 1/1 ready" in lines


def test_version_without_the_right_to_list_deployments_still_names_the_plugin(
    kube: Kube, namespace: str, control_plane: apiserver_only.ControlPlane, tmp_path: Path
) -> None:
    nobody = kubeconfig_for(control_plane, kube, namespace, "nobody", tmp_path / "nobody")
    refused = run(nobody, namespace, "version", check=1)
    assert refused.stdout.splitlines() == ["kubectl-pgherd 0.1.0"]
    assert error_line(refused).startswith("error: the operator's version is unknown: no permission to list")


def test_a_missing_kubeconfig_is_one_line(tmp_path: Path) -> None:
    result = run(tmp_path / "none", "default", "status", "pg", check=1)
    assert (
        error_line(result)
        == f"error: no kubeconfig at {tmp_path / 'none'}: pass --kubeconfig, set KUBECONFIG, or run in a pod with a ServiceAccount"
    )
