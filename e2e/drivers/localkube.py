"""The `localkube` driver: the kind driver's mapping on a real single-node Kubernetes on this machine
(`python -m e2e.localkube up --dir DIR`: etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
containerd + runc, the kubelet and kube-proxy, the project's image, an S3 server and the chart installed
by helm). One cluster per test session, each scenario in its own namespace.

    PGHERD_E2E_DRIVER=localkube          select this driver
    PGHERD_E2E_LOCALKUBE_DIR=DIR         use the cluster already up in DIR (left running at the end);
                                         else one is brought up in a temporary directory for the session
                                         and taken down when it ends

How the scenarios' operations map:
  kill(member)          SIGKILL of the member's container (its init, the agent: the PID namespace goes
                        with it, PostgreSQL included), found through the CRI (crictl): a crash, which the
                        kubelet answers by restarting the container after its back-off
  kill(member, wipe)    the same, then the PVC and the pod deleted: the StatefulSet makes a new, empty claim
  kill(.., keep_down)   every node cordoned first, the pod deleted: its new pod stays Pending
                        (unschedulable) until bring_back()
  switchover(to)        annotation pgherd.io/switchover-to=<member|any> on the PostgresCluster
  kill_operator()       the operator Deployment scaled to 0 and its pod force-deleted; resume: scaled to 1
  rw_dsn()              the `<cluster>-rw` Service's ClusterIP, port 5432 (kube-proxy on this host),
                        verify-full against the app Secret's ca.crt for the Service's DNS name
  member_dsn(name)      the pod's IP, port 5432 (the pods' bridge is this host's), verified for the
                        member's headless name
The backup store is the cluster's S3 server (DIR/s3.json), over HTTPS with a private CA: its keys and its
CA copied from `default/pgherd-e2e-s3` and `default/pgherd-e2e-s3-ca` into each scenario's namespace, the
CA named by the store's endpointCA. Every scenario's namespace enforces the `restricted` Pod Security
Standard: a member, a Job's pod or a scenario's own pod that is not restricted is refused.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import psycopg

from e2e.driver import ClusterStatus, DriverError
from e2e.drivers.kube import (
    POSTGRES_PORT,
    REPO_ROOT,
    S3_CA_KEYS,
    S3_CA_SECRET,
    S3_KEYS,
    S3_SECRET,
    Kube,
    KubeDriver,
    kubectl_binary,
    store_at,
)
from e2e.localkube import partition, s3
from e2e.localkube.processes import stop
from e2e.localkube.prometheus_binaries import prometheus_bin
from e2e.localkube.settings import Layout, Settings
from e2e.localkube.state import State
from e2e.rbac import Grant, bound_grants

UP_TIMEOUT = 1800.0  # a cold start builds the image
RW_ROUTE_WAIT = 20.0
CONTAINER = "postgres"
POD_SECURITY_ENFORCE = "pod-security.kubernetes.io/enforce"


def restricted_namespace(name: str) -> dict[str, Any]:
    """A namespace under the `restricted` Pod Security Standard, enforced by the API server's PodSecurity
    admission: a pod (a member, a Job's, a scenario's own) that is not restricted is refused."""
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": {POD_SECURITY_ENFORCE: "restricted"}},
    }


class LocalKube:
    """The session's cluster: DIR, its state and its admin kubeconfig."""

    def __init__(self, directory: Path, *, owned: bool) -> None:
        self.dir = directory
        self.owned = owned
        self.state: dict[str, Any] = json.loads((directory / "state.json").read_text())
        self.s3: dict[str, Any] = json.loads((directory / "s3.json").read_text())

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "kubeconfig"

    @property
    def prometheus_url(self) -> str | None:
        """The cluster's Prometheus (`up --prometheus`), or None when it has none."""
        info = self.dir / "prometheus.json"
        return str(json.loads(info.read_text())["url"]) if info.exists() else None

    def crictl(self, *args: str) -> subprocess.CompletedProcess[str]:
        binary = Path(self.state["binDir"]) / "crictl"
        endpoint = f"unix://{self.dir / 'containerd' / 'containerd.sock'}"
        return subprocess.run(
            [str(binary), "--runtime-endpoint", endpoint, *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def kill_container(self, namespace: str, pod: str, container: str) -> bool:
        """SIGKILL of the running `container` of the pod, found through the CRI: its init, and with it
        its PID namespace. False when none is running (not started yet, or in its crash back-off)."""
        found = self.crictl(
            "ps", "-q", "--state", "running", "--name", f"^{container}$",
            "--label", f"io.kubernetes.pod.name={pod}", "--label", f"io.kubernetes.pod.namespace={namespace}",
        )  # fmt: skip
        if found.returncode != 0:
            raise DriverError(f"crictl ps for {namespace}/{pod}: {found.stderr.strip()}")
        killed = False
        for found_id in found.stdout.split():
            inspected = self.crictl("inspect", "-o", "json", found_id)
            with contextlib.suppress(ValueError, KeyError):
                pid = int(json.loads(inspected.stdout)["info"]["pid"])
                # A container that exited between ps and inspect reports pid 0: os.kill(0) would kill
                # our own process group.
                if pid > 1:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        killed = True
        return killed

    @classmethod
    def up(cls) -> LocalKube:
        given = os.environ.get("PGHERD_E2E_LOCALKUBE_DIR")
        if given:
            directory = Path(given).resolve()
            if not (directory / "state.json").exists():
                raise DriverError(f"PGHERD_E2E_LOCALKUBE_DIR={given}: no cluster there (state.json)")
            return cls(directory, owned=False)
        directory = Path(
            tempfile.mkdtemp(prefix="pgherd-localkube-", dir=os.environ.get("PGHERD_E2E_WORKDIR"))
        )
        command = [sys.executable, "-m", "e2e.localkube", "up", "--dir", str(directory)]
        if prometheus_bin() is not None:  # built by make setup-kube; else the monitoring scenarios skip
            command.append("--prometheus")
        try:
            result = subprocess.run(
                command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=UP_TIMEOUT, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise DriverError(f"`{' '.join(command)}` did not finish within {UP_TIMEOUT:.0f} s") from exc
        cluster = cls(directory, owned=True) if (directory / "state.json").exists() else None
        if cluster is not None:
            atexit.register(cluster.down)
        if result.returncode != 0 or cluster is None:
            raise DriverError(
                f"`{' '.join(command)}` failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        return cluster

    def audit_events(self) -> list[dict[str, Any]]:
        """Every entry of the API server's audit log (DIR/audit.log: every request, Metadata level)."""
        with open(self.dir / "audit.log") as log:
            return [json.loads(line) for line in log if line.strip()]

    def admission_plugins(self) -> list[str]:
        """The admission plugins the running kube-apiserver was started with on top of the defaults."""
        pid = int((self.state.get("processes") or {}).get("kube-apiserver", {}).get("pid") or 0)
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return []
        flags = [a.decode() for a in argv]
        for i, flag in enumerate(flags[:-1]):
            if flag == "--enable-admission-plugins":
                return flags[i + 1].split(",")
        return []

    def grants_of_service_account(self, namespace: str, name: str) -> set[Grant]:
        """What RBAC grants the ServiceAccount, read from the cluster's bindings and roles."""

        def items(*resource: str) -> list[dict[str, Any]]:
            result = subprocess.run(
                [kubectl_binary(), "--kubeconfig", str(self.kubeconfig), "get", *resource, "-o", "json"],
                capture_output=True, text=True, timeout=60, check=True,
            )  # fmt: skip
            found: list[dict[str, Any]] = json.loads(result.stdout)["items"]
            return found

        cluster_roles = {r["metadata"]["name"]: r for r in items("clusterroles")}
        roles = {(r["metadata"]["namespace"], r["metadata"]["name"]): r for r in items("roles", "-A")}
        bindings = items("clusterrolebindings") + items("rolebindings", "-A")
        return bound_grants((namespace, name), bindings, cluster_roles, roles)

    def down(self) -> None:
        if self.owned:
            subprocess.run(
                [sys.executable, "-m", "e2e.localkube", "down", "--dir", str(self.dir)],
                cwd=REPO_ROOT,
                capture_output=True,
                timeout=300,
                check=False,
            )


class LocalKubeDriver(KubeDriver):
    name = "localkube"
    _cluster: ClassVar[LocalKube | None] = None

    @classmethod
    def session_cluster(cls) -> LocalKube | None:
        """The session's localkube cluster, once a scenario has brought it up or found it."""
        return cls._cluster

    @classmethod
    def shared_cluster(cls) -> LocalKube:
        """The session's cluster, found or brought up on first use: other systems on the same cluster
        (the failover bench's Patroni) share it."""
        if LocalKubeDriver._cluster is None:
            LocalKubeDriver._cluster = LocalKube.up()
        return LocalKubeDriver._cluster

    def __init__(self, workdir: Path, cluster: str) -> None:
        self.localkube = self.shared_cluster()
        s3 = self.localkube.s3
        # HTTPS with a private CA (DIR/s3-tls); a DIR brought up before that serves HTTP.
        private_ca = str(s3["endpoint"]).startswith("https://")
        path = f"e2e-{cluster}-{int(time.time())}"
        store = store_at(str(s3["endpoint"]), str(s3["bucket"]), path, private_ca=private_ca)
        kube = Kube(
            kubeconfig=self.localkube.kubeconfig,
            cache_dir=Path(workdir) / "kubectl-cache",
            kubectl=kubectl_binary(),
        )
        major = int(
            os.environ.get("PGHERD_E2E_PG_VERSION") or self.localkube.state.get("postgresMajor") or 16
        )
        super().__init__(workdir, cluster, kube, postgres_version=major, store=store)
        self._following: tuple[threading.Event, threading.Thread] | None = None
        operator = self.localkube.state.get("operator") or {}
        self.operator_namespace = str(operator.get("namespace") or "pgherd-system")
        self.release = str(operator.get("release") or "pgherd")
        # A namespace of the same name from before (down() does not wait for it) must be gone first.
        phase = self.kube.run(
            "get", "namespace", self.namespace, "-o", "jsonpath={.status.phase}", check=False
        )
        if phase.stdout.strip() == "Terminating":
            self.kube.run(
                "wait", "--for=delete", f"namespace/{self.namespace}", "--timeout=300s", timeout=320
            )
        self.kube.run("apply", "-f", "-", input=json.dumps(restricted_namespace(self.namespace)))
        self.copy_secret("default", S3_SECRET, S3_SECRET, S3_KEYS)
        if private_ca:
            self.copy_secret("default", S3_CA_SECRET, S3_CA_SECRET, S3_CA_KEYS)

    # -- members ----------------------------------------------------------------------------------------

    def kill(self, member: str, wipe: bool = False, keep_down: bool = False) -> None:
        """SIGKILL of the member's container (a crash); with wipe or keep_down, then the kind driver's
        deletions (and the cordon)."""
        self._kill_container(member)
        if wipe or keep_down:
            super().kill(member, wipe=wipe, keep_down=keep_down)

    def _kill_container(self, member: str) -> None:
        # The container's init (its agent): the PID namespace, PostgreSQL included, dies with it.
        if not self.kill_if_running(member):
            raise DriverError(f"no running {CONTAINER} container of {member}\n{self.describe()}")

    def kill_if_running(self, member: str) -> bool:
        """SIGKILL of the member's container when it runs; False when it does not (in back-off)."""
        return self.localkube.kill_container(self.namespace, member, CONTAINER)

    @contextlib.contextmanager
    def store_unreachable(self) -> Iterator[None]:
        """The backup store down (the session's S3 server stopped: connections refused) for the block,
        then served again from the same address and data. Every cluster of the session shares it."""
        layout = Layout(self.localkube.dir)
        state = State.load(layout)
        server = state.process("s3")
        if server is not None:
            stop(server, 10.0)
        try:
            yield
        finally:
            state.add_process(s3.serve_again(layout))

    # -- the operator and connections ------------------------------------------------------------------

    def rw_dsn(self) -> str:
        service = self.get("services", f"{self.cluster}-rw")
        return self.dsn(str(service["spec"]["clusterIP"]), POSTGRES_PORT)

    def wait_for(
        self, predicate: Callable[[ClusterStatus], bool], timeout: float, what: str
    ) -> ClusterStatus:
        """As every driver's, and once the status shows a Running cluster with a primary, until the -rw
        Service reaches a writable member: kube-proxy applies a change of its endpoints a moment (up to
        its 1 s sync period and more under load) after the operator moved the label, and a client that
        connects in between is refused, as any client of a Service is. Not waited for past RW_ROUTE_WAIT:
        the scenario's own check then fails with what it sees."""
        status = super().wait_for(predicate, timeout, what)
        if status.get("phase") == "Running" and status.get("primary"):
            deadline = time.monotonic() + RW_ROUTE_WAIT
            while time.monotonic() < deadline:
                with (
                    contextlib.suppress(psycopg.Error, DriverError),
                    psycopg.connect(self.rw_dsn(), connect_timeout=2) as conn,
                ):
                    if conn.execute("SELECT NOT pg_is_in_recovery()").fetchone() == (True,):
                        break
                time.sleep(0.2)
        return status

    def status_rw_dsn(self) -> str | None:
        try:
            return self.rw_dsn()
        except DriverError:
            return None

    def member_dsn(self, name: str) -> str:
        ip = (self.get("pods", name).get("status") or {}).get("podIP")
        if not ip:
            raise DriverError(f"pod {name} has no IP yet")
        return self.dsn(str(ip), POSTGRES_PORT, self.member_host(name))

    def describe(self) -> str:
        lines = [
            f"localkube: {self.localkube.dir} (logs/, audit.log); namespace {self.namespace}; look with",
            f"  kubectl --kubeconfig {self.localkube.kubeconfig} -n {self.namespace} get pgc,pgbackup,pgrestore,pods,pvc,events",
            f"  kubectl --kubeconfig {self.localkube.kubeconfig} -n {self.operator_namespace} logs deployment/{self.release}",
        ]
        lines.extend(self.kube_state())
        return "\n".join(lines)

    # -- partitions --------------------------------------------------------------------------------------

    def addresses(self, name: str) -> list[str]:
        """The addresses behind a name of a partition group: a member (its pod's IP), "operator" (the
        operator's pods), "operator/<pod>" (one of them) or "node" (the node: the API server, the kubelet, DNS, S3, this host's clients)."""
        if name == "node":
            return [Settings.from_json(self.localkube.state["settings"]).node_ip]
        if name == "operator" or name.startswith("operator/"):
            pods = self.kube.json(
                "-n", self.operator_namespace, "get", "pods", "-l",
                "app.kubernetes.io/name=pgherd,app.kubernetes.io/component=operator",
            )["items"]  # fmt: skip
            if name != "operator":  # operator/<pod>: one replica of the operator
                pods = [p for p in pods if p["metadata"]["name"] == name.partition("/")[2]]
            found = [str(p["status"]["podIP"]) for p in pods if (p.get("status") or {}).get("podIP")]
        else:
            ip = (self.get("pods", name).get("status") or {}).get("podIP")
            found = [str(ip)] if ip else []
        if not found:
            raise DriverError(f"{name!r} has no address to cut off")
        return found

    def partition(self, groups: Sequence[Iterable[str]]) -> None:
        """Packets dropped, both ways, between every two groups of names (members, "operator", "node"):
        silence, as a real partition is (e2e/localkube/partition.py). The cut follows the names: a pod
        made again (a fence deletes it) gets a new address, and a real partition cuts off where the
        member runs, not one address, so the rules follow it until heal(). A name in no group reaches
        everyone."""
        self.heal()
        named = [list(group) for group in groups]
        applied = [[a for name in group for a in self.addresses(name)] for group in named]
        partition.partition(applied)
        stop = threading.Event()

        def follow() -> None:
            current = applied
            while not stop.wait(0.2):
                try:
                    wanted = [[a for name in group for a in self._current_addresses(name)] for group in named]
                except (DriverError, subprocess.SubprocessError, ValueError):
                    continue
                if wanted != current and not stop.is_set():
                    partition.partition(wanted)
                    current = wanted

        thread = threading.Thread(target=follow, name="partition-follow", daemon=True)
        thread.start()
        self._following = (stop, thread)

    def _current_addresses(self, name: str) -> list[str]:
        try:
            return self.addresses(name)
        except DriverError:
            return []  # no address yet: nothing of it to cut until it has one

    def heal(self) -> None:
        following = self._following
        if following is not None:
            stop, thread = following
            stop.set()
            thread.join(timeout=30)
            self._following = None
        partition.heal()

    def down(self, *, keep: bool = False) -> None:
        """The scenario's namespace deleted without waiting for it to go: its pods stop in their grace
        periods while the next scenario starts (16 s a module otherwise); the session's cluster goes
        with everything in it. A partition left by a failed scenario is healed first."""
        self.heal()
        if not keep:
            self.kube.run("delete", "namespace", self.namespace, "--wait=false", check=False, timeout=60)
