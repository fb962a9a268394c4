"""The `kube-emulated` driver: the kind driver's mapping on an emulated Kubernetes cluster on this machine
(`python -m e2e.emulated up`: the emulated API server, a node running pods as local processes on their
own 127.x addresses, an S3 server, and the real `pgherd operator` from the chart). One emulated cluster
per driver, in the driver's workdir (`<workdir>/emulated`, kept with its logs when a test failed).

    PGHERD_E2E_DRIVER=kube-emulated   select this driver
    PGHERD_E2E_EMULATED_PROBE_PERIOD  cap on the pods' probe periods in seconds (default 1)

How the scenarios' operations map (as the kind driver's, but for the connections and the operator):
  kill(member)          kill -9 of the pod's processes: the kubelet starts the container again after its
                        back-off ($PGHERD_E2E_RESTART_DELAY, 6 s as the local driver's restart delay)
  kill(member, wipe)    the same, then the kind driver's deletion of the PVC and the pod (grace 0): the
                        StatefulSet's new pod gets a new claim, a new, empty volume
  switchover(to)        annotation pgherd.io/switchover-to=<member|any> on the PostgresCluster
  kill_operator()       kill -9 of the operator process (a lost operator pod); at a step: the moment a
                        watch of the PostgresCluster shows the step in its status
  resume_operator()     the operator started again, as a new pod of its Deployment (a new identity:
                        it waits for the Lease of the killed one to expire), until its liveness answers
  rw_dsn()              the `<cluster>-rw` Service resolved at each connection: the ready pod its
                        selector picks, at its pod IP, port 5432 (no Service proxy here)
  member_dsn(name)      the pod's IP, port 5432
The backup store is the emulated cluster's S3 server (bucket pgherd-e2e, a path per cluster), its keys
copied from `default/pgherd-e2e-s3` into the cluster's namespace as `pgherd-e2e-s3`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from e2e.driver import DriverError, operation_at
from e2e.drivers.kube import POSTGRES_PORT, REPO_ROOT, S3_KEYS, S3_SECRET, Kube, KubeDriver, env, store_at
from e2e.drivers.local import RESTART_DELAY, installed_postgres_major
from e2e.emulated import state

UP_TIMEOUT = 180.0
AT_STEP_TIMEOUT = 180.0
# A Service without a ready pod behind it: the client's connection is refused, as through kube-proxy.
NO_ENDPOINT = ("127.0.0.1", 9)


def kubectl_binary() -> str:
    """$KUBECTL, else .tools/bin/kubectl (make setup), else kubectl on PATH."""
    local = REPO_ROOT / ".tools" / "bin" / "kubectl"
    return os.environ.get("KUBECTL") or (str(local) if os.access(local, os.X_OK) else "kubectl")


class KubeEmulatedDriver(KubeDriver):
    name = "kube-emulated"
    poll_interval = 0.5

    def __init__(self, workdir: Path, cluster: str) -> None:
        self.dir = Path(workdir) / "emulated"
        self._up()
        info = state.read_state(self.dir)
        s3 = info["s3"]
        super().__init__(
            workdir,
            cluster,
            Kube(
                kubeconfig=self.dir / "kubeconfig",
                cache_dir=self.dir / "kubectl-cache",
                kubectl=kubectl_binary(),
            ),
            postgres_version=installed_postgres_major(),
            store=store_at(s3["endpoint"], s3["bucket"], f"e2e-{cluster}"),
        )
        self._api = str(info["api"])
        self._endpoints: dict[str, tuple[str, int]] = {}
        self._token = self._kubeconfig_token()
        try:
            namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": self.namespace}}
            self.kube.run("apply", "-f", "-", input=json.dumps(namespace))
            self.copy_secret(str(s3["secretNamespace"]), str(s3["secret"]), S3_SECRET, S3_KEYS)
        except BaseException:
            self.down(keep=True)  # the suite never sees a driver that failed to start: bring it down here
            raise

    def _up(self) -> None:
        argv = [
            sys.executable, "-m", "e2e.emulated", "up", "--dir", str(self.dir),
            "--max-probe-period", env("PGHERD_E2E_EMULATED_PROBE_PERIOD", "1"),
            "--restart-delay", str(RESTART_DELAY),
            "--stop-grace", "2",  # at down: nothing to keep clean
        ]  # fmt: skip
        try:
            result = subprocess.run(
                argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=UP_TIMEOUT, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise DriverError(f"`{' '.join(argv)}` did not finish within {UP_TIMEOUT:.0f} s") from exc
        if result.returncode != 0:
            raise DriverError(f"`{' '.join(argv)}` failed: {result.stderr.strip() or result.stdout.strip()}")

    def _kubeconfig_token(self) -> str:
        config = yaml.safe_load((self.dir / "kubeconfig").read_text())
        return str(config["users"][0]["user"]["token"])

    # -- reading the API directly (the connections' hot path: no kubectl process per connection) ------------

    def _get(self, path: str, **params: str) -> Any:
        url = self._api + path + (f"?{urllib.parse.urlencode(params)}" if params else "")
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {self._token}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise DriverError(f"GET {path}: {exc.code} {exc.reason}") from exc

    def get(self, resource: str, name: str | None = None) -> Any:
        """As kubectl get, straight from the API: status() is polled every half second, and a kubectl
        process per read costs the 2-core machine more than the cluster it watches."""
        plural, _, group = resource.partition(".")
        base = f"/apis/{group}/v1alpha1" if group == "pgherd.io" else "/api/v1"
        found = self._get(f"{base}/namespaces/{self.namespace}/{plural}" + (f"/{name}" if name else ""))
        if found is None:
            raise DriverError(f"{resource} {name or ''} not found in {self.namespace}")
        return found

    def _pod_ip(self, name: str) -> str | None:
        pod = self._get(f"/api/v1/namespaces/{self.namespace}/pods/{name}")
        if not pod or pod["metadata"].get("deletionTimestamp"):
            return None
        return (pod.get("status") or {}).get("podIP") or None

    def service_endpoint(self, service: str) -> tuple[str, int]:
        """The address a connection to the Service reaches now: a ready pod its selector picks (as its
        Endpoints would list it), its pod IP and the Service's target port; NO_ENDPOINT without one."""
        svc = self._get(f"/api/v1/namespaces/{self.namespace}/services/{service}")
        if not svc:
            return NO_ENDPOINT
        selector = ",".join(f"{k}={v}" for k, v in sorted((svc["spec"].get("selector") or {}).items()))
        pods = self._get(f"/api/v1/namespaces/{self.namespace}/pods", labelSelector=selector)["items"]
        chosen, seen = NO_ENDPOINT, []
        for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
            status = pod.get("status") or {}
            ready = any(
                c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ()
            )
            deleting = bool(pod["metadata"].get("deletionTimestamp"))
            seen.append(
                f"{pod['metadata']['name']}{'' if ready else ' (not ready)'}{' (deleting)' if deleting else ''}"
            )
            if chosen == NO_ENDPOINT and status.get("podIP") and not deleting and ready:
                chosen = str(status["podIP"]), POSTGRES_PORT
        self._log_endpoint(service, chosen, seen)
        return chosen

    def _log_endpoint(self, service: str, chosen: tuple[str, int], seen: list[str]) -> None:
        """Each change of a Service's resolution, in <workdir>/endpoints.log (for a post-mortem)."""
        if self._endpoints.get(service) == chosen:
            return
        self._endpoints[service] = chosen
        with open(self.workdir / "endpoints.log", "a") as log:
            now = time.time()
            stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1000):03d}"
            log.write(
                f"{stamp} {service} -> {chosen[0]}:{chosen[1]} (selected: {', '.join(seen) or 'none'})\n"
            )

    def kill(self, member: str, wipe: bool = False, keep_down: bool = False) -> None:
        """kill -9 of the pod's processes (its agent, PostgreSQL and their children, all at once): the
        container dies and the kubelet starts it again after its back-off (`--restart-delay`, the local
        driver's restart delay). With wipe, then the kind driver's PVC and pod deletion: the recreated
        pod's claim is a new, empty volume."""
        pod = self._get(f"/api/v1/namespaces/{self.namespace}/pods/{member}")
        if pod is None:
            raise DriverError(f"no pod {member} to kill\n{self.describe()}")
        root = self.dir / "root"
        claims = [
            v["persistentVolumeClaim"]["claimName"]
            for v in pod["spec"].get("volumes") or ()
            if v.get("persistentVolumeClaim")
        ]
        state.kill_tree(
            root / "pods" / self.namespace / f"{member}-{pod['metadata']['uid'][:8]}",
            *(root / "volumes" / self.namespace / claim for claim in claims),
        )
        if wipe or keep_down:
            super().kill(member, wipe=wipe, keep_down=keep_down)

    # -- the operator and connections --------------------------------------------------------------------

    def stop_operator(self) -> None:
        state.kill_operator(self.dir)

    def kill_operator(self, at_step: str | None = None, done: int = 0) -> None:
        """At once, or the moment the PostgresCluster's status shows the step: watched, not polled, so that
        a step the operator leaves within a fraction of a second (a switchover's promotion) is caught."""
        if at_step is None:
            self.stop_operator()
            return
        reached = operation_at(at_step, done)
        path = f"/apis/pgherd.io/v1alpha1/namespaces/{self.namespace}/postgresclusters"
        deadline = time.monotonic() + AT_STEP_TIMEOUT
        while time.monotonic() < deadline:
            listed = self._get(path, fieldSelector=f"metadata.name={self.cluster}")
            for item in listed["items"]:
                if reached({"operation": (item.get("status") or {}).get("operation")}):
                    self.stop_operator()
                    return
            for event in self._watch(path, listed["metadata"]["resourceVersion"], deadline):
                if reached({"operation": (event["object"].get("status") or {}).get("operation")}):
                    self.stop_operator()
                    return
        raise DriverError(f"the operation did not reach step {at_step!r} within {AT_STEP_TIMEOUT:.0f} s")

    def _watch(self, path: str, resource_version: str, deadline: float) -> Iterator[dict[str, Any]]:
        """This cluster's watch events from `resource_version` until `deadline` (or the server ends it)."""
        params = {
            "watch": "1",
            "fieldSelector": f"metadata.name={self.cluster}",
            "resourceVersion": resource_version,
            "timeoutSeconds": str(max(1, int(deadline - time.monotonic()))),
        }
        url = f"{self._api}{path}?{urllib.parse.urlencode(params)}"
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {self._token}"})
        with urllib.request.urlopen(request, timeout=AT_STEP_TIMEOUT) as response:
            for line in response:
                event = json.loads(line)
                if event.get("type") in ("ADDED", "MODIFIED"):
                    yield event

    def resume_operator(self) -> None:
        state.start_operator(self.dir)
        port = state.read_state(self.dir)["operatorLiveness"]
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2).close()
                return
            except (urllib.error.URLError, OSError) as exc:
                if time.monotonic() > deadline or state.operator_pid(self.dir) is None:
                    raise DriverError(f"the operator did not come back: {exc}\n{self.describe()}") from exc
                time.sleep(0.2)

    def status_rw_dsn(self) -> str | None:
        try:
            return self.rw_dsn()
        except DriverError:
            return None  # the cluster's Secrets are not made yet

    def rw_dsn(self) -> str:
        return self.dsn(*self.service_endpoint(f"{self.cluster}-rw"))

    def member_dsn(self, name: str) -> str:
        ip = self._pod_ip(name)
        if ip is None:
            raise DriverError(f"pod {name} has no IP (not running)\n{self.describe()}")
        return self.dsn(ip, POSTGRES_PORT)

    def describe(self) -> str:
        lines = [
            f"kube-emulated: {self.dir}, namespace {self.namespace}; look with",
            f"  kubectl --kubeconfig {self.dir}/kubeconfig -n {self.namespace} get pgc,backups.pgherd.io,restores.pgherd.io,pods,pvc,jobs",
            f"  logs: {self.dir}/operator.log, node.log; pods' output in {self.dir}/root/pods/{self.namespace}/;"
            f" where -rw led: {self.workdir}/endpoints.log",
        ]
        log = self.dir / "operator.log"
        if log.exists():
            lines.append("  last operator log lines:")
            lines.extend(f"    {line}" for line in log.read_text(errors="replace").splitlines()[-20:])
        return "\n".join(lines)

    def down(self, *, keep: bool = False) -> None:
        if not (self.dir / state.STATE).exists():
            return
        subprocess.run(
            [sys.executable, "-m", "e2e.emulated", "down", "--dir", str(self.dir), *(["--keep"] if keep else [])],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=180, check=True,
        )  # fmt: skip
