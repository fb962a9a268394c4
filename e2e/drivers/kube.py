"""What the Kubernetes drivers (`kind`, `localkube`) share: kubectl, and the mapping of the driver
interface onto the API (status from the PostgresCluster's `.status` and the Backup and Restore objects,
kill by pod deletion, switchover by annotation, the operator killed when its status shows a step, the
`<cluster>-app` Secret's credentials). Each driver says how its operator is stopped and started and how
a libpq client reaches a pod."""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import yaml
from psycopg.conninfo import make_conninfo

from e2e.driver import (
    ClusterStatus,
    DriverError,
    Manifest,
    ManifestRefused,
    MemberStatus,
    ObjectStatus,
    PollingDriver,
    operation_at,
)
from pgherd.api.admission import status_problems

REPO_ROOT = Path(__file__).resolve().parents[2]
SWITCHOVER_ANNOTATION = "pgherd.io/switchover-to"
DATA_MOUNT = "/var/lib/pgherd"  # the member's volume in its pod (pgherd.kube.names.DATA_MOUNT)
SOCKET_DIR = f"{DATA_MOUNT}/agent/run"  # PostgreSQL's Unix socket in a member (agent options.socket_dir)
POSTGRES_PORT = 5432
S3_SECRET = "pgherd-e2e-s3"
S3_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
S3_CA_SECRET = "pgherd-e2e-s3-ca"  # an HTTPS S3 server's private CA (ca.crt): the store's endpointCA
S3_CA_KEYS = ("ca.crt",)
CRASH_POINT_ENV = "PGHERD_CRASH_POINT"  # operator/pgherd/kube/crashpoint.py


def env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def kubectl_binary() -> str:
    """$KUBECTL, else .tools/bin/kubectl (make setup), else kubectl on PATH."""
    local = REPO_ROOT / ".tools" / "bin" / "kubectl"
    return os.environ.get("KUBECTL") or (str(local) if os.access(local, os.X_OK) else "kubectl")


def with_store(manifest: Manifest, store: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of `manifest`; a PostgresCluster without spec.backup.store gets `store`."""
    doc = dict(manifest)
    if store is None or doc.get("kind") != "PostgresCluster":
        return doc
    spec = dict(doc.get("spec") or {})
    backup = dict(spec.get("backup") or {})
    if backup.get("store"):
        return doc
    backup["store"] = store
    spec["backup"] = backup
    doc["spec"] = spec
    return doc


def store_at(endpoint: str, bucket: str, path: str, *, private_ca: bool = False) -> dict[str, Any]:
    """A PostgresCluster's spec.backup.store on that S3 server, its keys in the Secret S3_SECRET; with
    `private_ca`, an HTTPS endpoint verified by the CA of the Secret S3_CA_SECRET (endpointCA)."""
    s3: dict[str, Any] = {
        "bucket": bucket,
        "path": path,
        "endpoint": endpoint,
        "forcePathStyle": True,
        "credentials": {"secretName": S3_SECRET},
    }
    if private_ca:
        s3["endpointCA"] = {"secretName": S3_CA_SECRET}
    return {"s3": s3}


class Kube:
    """kubectl and helm with the given kubeconfig and context (default: $PGHERD_E2E_KUBE_CONTEXT);
    failures raise DriverError with their output."""

    def __init__(
        self,
        *,
        kubeconfig: Path | None = None,
        context: str | None = None,
        cache_dir: Path | None = None,
        kubectl: str | None = None,
    ) -> None:
        context = context or os.environ.get("PGHERD_E2E_KUBE_CONTEXT")
        options = [
            *(["--kubeconfig", str(kubeconfig)] if kubeconfig else []),
            *(["--context", context] if context else []),
        ]
        self.kubectl = [
            kubectl or env("KUBECTL", "kubectl"),
            *options,
            *(["--cache-dir", str(cache_dir)] if cache_dir else []),
        ]
        self.helm = [
            env("HELM", "helm"),
            *(["--kubeconfig", str(kubeconfig)] if kubeconfig else []),
            *(["--kube-context", context] if context else []),
        ]

    def run(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self._run([*self.kubectl, *args], input=input, check=check, timeout=timeout)

    def run_helm(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return self._run([*self.helm, *args], input=None, check=True, timeout=timeout)

    def json(self, *args: str) -> Any:
        return json.loads(self.run(*args, "-o", "json").stdout)

    @staticmethod
    def _run(
        argv: list[str], *, input: str | None, check: bool, timeout: float
    ) -> subprocess.CompletedProcess[str]:
        try:
            result = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise DriverError(f"`{' '.join(argv)}` did not finish within {timeout:.0f} s") from exc
        if check and result.returncode != 0:
            raise DriverError(
                f"`{' '.join(argv)}` exited with {result.returncode}: {result.stderr.strip() or result.stdout.strip()}"
            )
        return result


class KubeDriver(PollingDriver):
    """The driver interface on a Kubernetes API, for one cluster in its own namespace."""

    name = "kube"
    poll_interval = 1.0

    def __init__(
        self, workdir: Path, cluster: str, kube: Kube, *, postgres_version: int, store: dict[str, Any] | None
    ) -> None:
        self.workdir = Path(workdir)
        self.cluster = cluster
        self.kube = kube
        self.namespace = f"pgherd-e2e-{cluster}"[:63]
        self.postgres_version = postgres_version
        self._store = store
        self._credentials: dict[str, str] | None = None
        self._applied = 0
        self._kept_down: set[str] = set()
        self._held: set[str] = set()  # kept down since the nodes were cordoned

    # -- what a concrete driver provides ---------------------------------------------------------------

    def get(self, resource: str, name: str | None = None) -> Any:
        """An object of this namespace (`kubectl get RESOURCE NAME -o json`), or the list of them."""
        return self.kube.json("-n", self.namespace, "get", resource, *([name] if name else []))

    def backup_store(self) -> dict[str, Any]:
        cluster = self.get("postgresclusters.pgherd.io", self.cluster)
        return dict(cluster["spec"]["backup"]["store"]["s3"])

    # The operator's Deployment (the chart's release), for the drivers that run it as one.
    operator_namespace = "pgherd-system"
    release = "pgherd"

    def stop_operator(self) -> None:
        """The operator Deployment scaled to 0 and its pod force-deleted (a lost operator pod)."""
        ns = ("-n", self.operator_namespace)
        self.kube.run(*ns, "scale", "deployment", self.release, "--replicas=0")
        selector = f"app.kubernetes.io/instance={self.release},app.kubernetes.io/component=operator"
        self.kube.run(*ns, "delete", "pod", "-l", selector, "--grace-period=0", "--force", "--wait=false")

    def resume_operator(self) -> None:
        """Scaled back to 1, without a crash point, until its rollout is done."""
        ns = ("-n", self.operator_namespace)
        self.kube.run(*ns, "set", "env", f"deployment/{self.release}", f"{CRASH_POINT_ENV}-")
        self.kube.run(*ns, "scale", "deployment", self.release, "--replicas=1")
        self.kube.run(*ns, "rollout", "status", f"deployment/{self.release}", "--timeout=180s", timeout=200)

    def arm_operator_kill(self, at_step: str, done: int = 0) -> None:
        """The operator started again with a crash point (PGHERD_CRASH_POINT, operator/pgherd/kube/
        crashpoint.py): it freezes exactly once its operation reaches the step, as a kill there would
        leave things; kill_operator() then deletes the frozen pod. No operator of before runs meanwhile:
        it is stopped first."""
        ns = ("-n", self.operator_namespace)
        self.stop_operator()
        point = json.dumps({"step": at_step, "done": done})
        self.kube.run(*ns, "set", "env", f"deployment/{self.release}", f"{CRASH_POINT_ENV}={point}")
        self.kube.run(*ns, "scale", "deployment", self.release, "--replicas=1")
        self.kube.run(*ns, "rollout", "status", f"deployment/{self.release}", "--timeout=180s", timeout=200)
        super().arm_operator_kill(at_step, done)

    def kube_state(self) -> list[str]:
        """What a failure message needs of the namespace, the most telling last (a long message is cut in
        its middle): the operator's log without its routine lines, the latest events, then each pod's
        phase, address and containers' states."""
        lines: list[str] = []
        logs = self.kube.run(
            "-n", self.operator_namespace, "logs", f"deployment/{self.release}", "--tail=400", check=False, timeout=20
        )  # fmt: skip
        if logs.returncode == 0:
            told = [line for line in logs.stdout.splitlines() if not _ROUTINE_LOG.search(line)]
            lines.append("  the operator's last log lines (its routine 'succeeded' lines left out):")
            lines.extend(f"    {line}" for line in told[-30:])
        events = self.kube.run("-n", self.namespace, "get", "events", "-o", "json", check=False, timeout=20)
        if events.returncode == 0:
            items = sorted(
                json.loads(events.stdout)["items"],
                key=lambda e: str(e.get("lastTimestamp") or e.get("eventTime") or ""),
            )
            lines.append("  the namespace's last events:")
            lines.extend(
                f"    {e.get('lastTimestamp') or e.get('eventTime')} {e.get('type')} "
                f"{e['involvedObject'].get('name')} {e.get('reason')}: {str(e.get('message') or '')[:200]}"
                for e in items[-15:]
            )
        pods = self.kube.run("-n", self.namespace, "get", "pods", "-o", "json", check=False, timeout=20)
        if pods.returncode == 0:
            lines.append("  the namespace's pods:")
            lines.extend(f"    {_pod_line(pod)}" for pod in json.loads(pods.stdout)["items"])
        return lines

    def status_rw_dsn(self) -> str | None:
        """The rwDsn shown in status() (None when none was asked for yet)."""
        return None

    def rw_dsn(self) -> str:  # pragma: no cover - provided by the concrete driver
        raise NotImplementedError

    def member_dsn(self, name: str) -> str:  # pragma: no cover - provided by the concrete driver
        raise NotImplementedError

    # -- the Driver interface --------------------------------------------------------------------------

    def copy_secret(self, source_namespace: str, source: str, name: str, keys: tuple[str, ...]) -> None:
        """A Secret's `keys` into this cluster's namespace as `name`, on stdin (never on a command line or
        in the workdir: the keys stay out of logs and artifacts)."""
        data = self.kube.json("-n", source_namespace, "get", "secret", source).get("data") or {}
        missing = [key for key in keys if key not in data]
        if missing:
            raise DriverError(f"the Secret {source_namespace}/{source} lacks {', '.join(missing)}")
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {"name": name, "namespace": self.namespace},
            "data": {key: data[key] for key in keys},
        }
        self.kube.run("apply", "-f", "-", input=json.dumps(secret))

    def apply(self, manifest: Manifest) -> None:
        self._applied += 1
        doc = with_store(manifest, self._store)
        path = self.workdir / f"{self._applied:02d}-{str(doc.get('kind')).lower()}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        result = self.kube.run("-n", self.namespace, "apply", "-f", str(path), check=False)
        if result.returncode != 0:
            message = result.stderr.strip() or result.stdout.strip()
            if "is invalid" in message or "denied the request" in message or "Invalid value" in message:
                raise ManifestRefused(message)
            raise DriverError(f"kubectl apply of {path} failed: {message}\n{self.describe()}")

    def status(self) -> ClusterStatus:
        cluster = self.get("postgresclusters.pgherd.io", self.cluster)
        raw = cluster.get("status") or {}
        # The CRD keeps the status's list items as written: what the API server no longer checks there,
        # every status read here is checked for (a field the model does not type, a null).
        problems = status_problems(raw)
        if problems:
            raise DriverError(f"the operator wrote a status its model refuses: {problems}")
        members: list[MemberStatus] = [
            {
                "name": m["name"],
                "role": m.get("role", "unknown"),
                "ready": bool(m.get("ready")),
                "port": None,
                "dsn": None,
                "lagBytes": m.get("lagBytes"),
                "timeline": m.get("timeline"),
                "version": m.get("version"),
            }
            for m in raw.get("members") or []
        ]
        return {
            "phase": raw.get("phase"),
            "message": raw.get("message"),
            "primary": raw.get("currentPrimary"),
            "members": members,
            "rwDsn": self.status_rw_dsn(),
            "backups": self._objects("backups.pgherd.io", with_id=True),
            "restores": self._objects("restores.pgherd.io", with_id=False),
            "conditions": raw.get("conditions") or [],
            "operation": raw.get("operation"),
            "instances": raw.get("instances"),
            "readyInstances": raw.get("readyInstances"),
            "postgresVersion": raw.get("postgresVersion"),
        }

    def _objects(self, resource: str, *, with_id: bool) -> list[ObjectStatus]:
        """This cluster's Backups or Restores (fully qualified: `backups` alone may name another API's kind)."""
        items = self.get(resource).get("items", [])
        found: list[ObjectStatus] = []
        for item in items:
            if (item.get("spec") or {}).get("cluster", {}).get("name") != self.cluster:
                continue
            status = item.get("status") or {}
            entry: ObjectStatus = {
                "name": item["metadata"]["name"],
                "phase": status.get("phase"),
                "error": status.get("error"),
            }
            if with_id:
                entry["backupId"] = status.get("backupId")
                entry["verified"] = status.get("verified")
                entry["postgresVersion"] = status.get("postgresVersion")
            else:
                entry["keptData"] = status.get("keptData")
            found.append(entry)
        return found

    def kill(self, member: str, wipe: bool = False, keep_down: bool = False) -> None:
        """The pod deleted at once (grace 0), and with wipe its PVC: the StatefulSet makes a new, empty
        one. With keep_down, every node is cordoned first: the pod made again stays Pending,
        unschedulable, until bring_back()."""
        if keep_down:
            self._kept_down.add(member)
            self._held.add(member)
            self.cordon(True)
        claims: dict[str, str | None] = {}
        if wipe:
            pod = self.get("pods", member)
            for volume in pod["spec"].get("volumes", []):
                if volume.get("persistentVolumeClaim"):
                    claim = volume["persistentVolumeClaim"]["claimName"]
                    claims[claim] = self._claim_uid(claim)
            for claim in claims:
                self.kube.run("-n", self.namespace, "delete", "pvc", claim, "--wait=false")
        self.kube.run(
            "-n", self.namespace, "delete", "pod", member, "--grace-period=0", "--force", "--wait=false"
        )
        # Each claim gone, or made again (another uid: the StatefulSet may recreate it at once, before a
        # `kubectl wait --for=delete` would start and then wait for the new one).
        deadline = time.monotonic() + 120
        while any(self._claim_uid(claim) == uid for claim, uid in claims.items()):
            if time.monotonic() > deadline:
                raise DriverError(
                    f"the claims {sorted(claims)} of {member} were not deleted\n{self.describe()}"
                )
            time.sleep(0.2)
        if claims:
            # A pod recreated while its old claim was still terminating would wait forever for it: recreate it.
            phase = self.kube.run(
                "-n", self.namespace, "get", "pod", member, "-o", "jsonpath={.status.phase}", check=False
            )
            if phase.stdout.strip() == "Pending":
                self.kube.run(
                    "-n", self.namespace, "delete", "pod", member, "--grace-period=0", "--force", "--wait=false"
                )  # fmt: skip

    def bring_back(self, member: str) -> None:
        self._kept_down.discard(member)
        if self._kept_down:
            return
        self.cordon(False)
        # The scheduler should retry a pod it found unschedulable when its node is uncordoned; once in a
        # landing CI run it held the pod for its 5-minute flush instead. A pod never scheduled has no
        # container and no data: made again, it is scheduled at once.
        held, self._held = self._held, set()
        deadline = time.monotonic() + 10
        while held and time.monotonic() < deadline:
            held = {pod for pod in held if not self._scheduled_or_gone(pod)}
            if held:
                time.sleep(0.5)
        for pod in sorted(held):
            self.kube.run(
                "-n", self.namespace, "delete", "pod", pod, "--grace-period=0", "--force", "--wait=false",
                check=False,
            )  # fmt: skip

    def _scheduled_or_gone(self, member: str) -> bool:
        found = self.kube.run(
            "-n", self.namespace, "get", "pod", member, "-o", "jsonpath={.spec.nodeName}", check=False
        )
        return found.returncode != 0 or bool(found.stdout.strip())

    def cordon(self, cordoned: bool) -> None:
        """Every node cordoned (`kubectl cordon`), or uncordoned."""
        nodes = [n["metadata"]["name"] for n in self.kube.json("get", "nodes")["items"]]
        for node in nodes:
            self.kube.run("cordon" if cordoned else "uncordon", node)

    def _claim_uid(self, claim: str) -> str | None:
        try:
            return str(self.get("persistentvolumeclaims", claim)["metadata"]["uid"])
        except DriverError:
            return None

    def switchover(self, to: str | None = None) -> None:
        target = to or "any"
        self.kube.run(
            "-n", self.namespace, "annotate", "postgrescluster", self.cluster, f"{SWITCHOVER_ANNOTATION}={target}", "--overwrite"
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            annotations = (
                self.get("postgresclusters.pgherd.io", self.cluster)["metadata"].get("annotations") or {}
            )
            if SWITCHOVER_ANNOTATION not in annotations:
                primary = self.status().get("primary")
                if to is not None and primary != to:
                    raise DriverError(
                        f"switchover to {to} was not done (primary {primary}): see the cluster's Events\n{self.describe()}"
                    )
                return
            time.sleep(self.poll_interval)
        raise DriverError(
            f"the operator did not act on {SWITCHOVER_ANNOTATION}={target} within 120 s\n{self.describe()}"
        )

    def annotate(self, key: str, value: str | None) -> None:
        change = f"{key}={value}" if value is not None else f"{key}-"
        self.kube.run(
            "-n", self.namespace, "annotate", "postgrescluster", self.cluster, change, "--overwrite"
        )

    def break_upgrade(self, member: str, major: int) -> None:
        control = f"{DATA_MOUNT}/upgrade/pgdata-{major}/global/pg_control"
        self.kube.run("-n", self.namespace, "exec", member, "-c", "postgres", "--", "rm", control)

    def kill_operator(self, at_step: str | None = None, done: int = 0) -> None:
        """At once, or once the status shows the step: armed (arm_operator_kill), the operator is frozen
        there, so that the status holds the step until its pod is deleted."""
        if at_step is not None:
            self.wait_for(operation_at(at_step, done), 180, f"the operation to reach step {at_step!r}")
        self.stop_operator()

    def credentials(self) -> dict[str, str]:
        """The `<cluster>-app` Secret's keys (username, password, dbname, ca.crt), read once."""
        if self._credentials is None:
            secret = self.get("secrets", f"{self.cluster}-app")
            data = secret.get("data") or {}
            self._credentials = {k: base64.b64decode(v).decode() for k, v in data.items()}
        return self._credentials

    def ca_file(self) -> Path:
        """The cluster's CA (the app Secret's `ca.crt`) in a file, for libpq's sslrootcert."""
        path = self.workdir / "app-ca.crt"
        if not path.exists():
            ca = self.credentials().get("ca.crt")
            if not ca:
                raise DriverError(f"the Secret {self.cluster}-app has no ca.crt\n{self.describe()}")
            path.write_text(ca)
        return path

    def service_host(self) -> str:
        """The -rw Service's DNS name: the app Secret's host, a name the members' certificate holds."""
        return f"{self.cluster}-rw.{self.namespace}.svc"

    def member_host(self, member: str) -> str:
        """A member's name under the headless Service, which the members' certificate holds."""
        return f"{member}.{self.cluster}-headless.{self.namespace}.svc"

    def dsn(self, address: str, port: int, server_name: str | None = None) -> str:
        """The application's DSN, verifying the server as an application does (the app Secret's ca.crt,
        verify-full): libpq connects to `address` (hostaddr: an IP this machine reaches) and checks the
        certificate against `server_name`, the -rw Service's DNS name unless another is given."""
        c = self.credentials()
        return make_conninfo(
            host=server_name or self.service_host(),
            hostaddr=address,
            port=str(port),
            user=c.get("username", "app"),
            password=c.get("password", ""),
            dbname=c.get("dbname", "app"),
            sslmode="verify-full",
            sslrootcert=str(self.ca_file()),
            connect_timeout="5",
        )

    def superuser_value(self, query: str) -> str | None:
        """The one value `query` returns, run as the superuser on the primary's Unix socket (the only
        place the superuser may log in): psql in its pod's container."""
        primary = self.status().get("primary")
        if not primary:
            raise DriverError(f"no primary to ask\n{self.describe()}")
        result = self.kube.run(
            "-n", self.namespace, "exec", str(primary), "-c", "postgres", "--",
            "psql", "-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", SOCKET_DIR, "-U", "postgres",
            "-d", "postgres", "-c", query,
        )  # fmt: skip
        text = result.stdout.rstrip("\n")
        return text if text else None


# The operator's lines that say nothing of a failure: a handler that ran as it does every minute.
_ROUTINE_LOG = re.compile(r"Handler '[^']+' succeeded\.$")


def _pod_line(pod: dict[str, Any]) -> str:
    """One pod: name, uid's head, phase, address, node, creation, and each container's state."""
    meta, status = pod["metadata"], pod.get("status") or {}
    states = []
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        kind = next(iter(state), "?")
        detail = state.get(kind) or {}
        why = detail.get("reason") or detail.get("startedAt") or ""
        states.append(
            f"{container['name']}={kind}({why}, ready={container.get('ready')}, "
            f"restarts={container.get('restartCount')})"
        )
    return (
        f"{meta['name']} uid={str(meta.get('uid'))[:8]} {status.get('phase')} ip={status.get('podIP')} "
        f"node={pod['spec'].get('nodeName')} created={meta.get('creationTimestamp')} "
        f"{' '.join(states) or 'no container status'}"
        + (" deleting" if meta.get("deletionTimestamp") else "")
    )
