"""The emulated node (tests/kube/cluster_sim.py) against the emulated API server: StatefulSet pods
that really run, get loopback IPs, become Ready through their probes, keep their PVC directories,
are SIGTERMed on deletion; Jobs that succeed (termination message) and exhaust their backoffLimit;
Secrets and ConfigMaps as env and files; a cordoned node's unschedulable pods."""

from __future__ import annotations

import base64
import json
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .cluster_sim import NODE_NAME, UNSCHEDULABLE_MESSAGE, ClusterSim
from .conftest import TOKEN
from .emulator import EmulatedApiServer
from .waiting import eventually

pytestmark = pytest.mark.kube_emulator(graceful_pod_deletion=True)

# A pod's program: an HTTP server on $POD_IP:8080 answering /ready and /info (its env and files); on
# SIGTERM it writes a marker into its data volume and exits.
SERVER = r"""
import http.server, json, os, signal, sys
data = sys.argv[sys.argv.index("--data") + 1]
def term(*_):
    open(os.path.join(data, "terminated-" + os.environ["POD_NAME"]), "w").write("bye")
    os._exit(0)
signal.signal(signal.SIGTERM, term)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/info":
            files = {}
            for root in ("/etc/sim/secret", "/etc/sim/config"):
                path = os.environ["FILES_" + root.rsplit("/", 1)[1].upper()]
                files[root] = {n: open(os.path.join(path, n)).read() for n in sorted(os.listdir(path))}
            body = json.dumps({"env": dict(os.environ), "files": files, "data": data, "uid": os.getuid()})
        else:
            body = "ok"
        self.send_response(200); self.end_headers(); self.wfile.write(body.encode())
    def log_message(self, *a): pass
http.server.HTTPServer((os.environ["POD_IP"], 8080), H).serve_forever()
"""


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def statefulset(name: str = "web", replicas: int = 2) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "replicas": replicas,
            "serviceName": name,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},
            "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "Retain", "whenScaled": "Retain"},
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": {**labels, "tier": "web"}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [
                        {
                            "name": "server",
                            "image": "none",
                            "command": ["python", "-c", SERVER],
                            "args": ["--data", "/var/lib/data"],
                            "ports": [{"name": "http", "containerPort": 8080}],
                            "env": [
                                {
                                    "name": "POD_NAME",
                                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                                },
                                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                                {
                                    "name": "SECRET_TOKEN",
                                    "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}},
                                },
                                {
                                    "name": "GREETING",
                                    "valueFrom": {"configMapKeyRef": {"name": "settings", "key": "greeting"}},
                                },
                                {"name": "FILES_SECRET", "value": "/etc/sim/secret"},
                                {"name": "FILES_CONFIG", "value": "/etc/sim/config"},
                            ],
                            "envFrom": [{"configMapRef": {"name": "settings"}, "prefix": "CM_"}],
                            "readinessProbe": {
                                "httpGet": {"path": "/ready", "port": "http"},
                                "periodSeconds": 1,
                                "failureThreshold": 1,
                            },
                            "volumeMounts": [
                                {"name": "data", "mountPath": "/var/lib/data"},
                                {"name": "secret", "mountPath": "/etc/sim/secret", "readOnly": True},
                                {"name": "config", "mountPath": "/etc/sim/config", "readOnly": True},
                                {"name": "tmp", "mountPath": "/tmp"},
                            ],
                        }
                    ],
                    "volumes": [
                        {
                            "name": "secret",
                            "secret": {
                                "secretName": "creds",
                                "defaultMode": 0o440,
                                "items": [{"key": "token", "path": "token.txt"}],
                            },
                        },
                        {"name": "config", "configMap": {"name": "settings"}},
                        {"name": "tmp", "emptyDir": {}},
                    ],
                },
            },
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data", "labels": {"kind": "data"}},
                    "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
                }
            ],
        },
    }


def job(name: str, script: str, backoff_limit: int = 0) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "backoffLimit": backoff_limit,
            "activeDeadlineSeconds": 60,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "run",
                            "image": "none",
                            "command": ["python", "-c", script, "/dev/termination-log"],
                            "terminationMessagePath": "/dev/termination-log",
                            "terminationMessagePolicy": "FallbackToLogsOnError",
                        }
                    ],
                }
            },
        },
    }


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 20) -> Any:
    return eventually(probe, timeout, what)


def ready_pod(server: EmulatedApiServer, name: str, not_uid: str | None = None) -> dict[str, Any] | None:
    pod = server.read("pods", "default", name)
    if pod is None or pod["metadata"]["uid"] == not_uid or pod["metadata"].get("deletionTimestamp"):
        return None
    conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions") or ()}
    return pod if conditions.get("Ready") == "True" else None


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read())


@pytest.fixture
def sim(kube_server: EmulatedApiServer, work_root: Path) -> Iterator[ClusterSim]:
    octets = uuid.uuid4().bytes
    first_ip = f"127.{octets[0] % 250 + 1}.{octets[1]}.2"  # away from other workers' pods
    with ClusterSim(
        kube_server.url,
        work_root / f"sim-{uuid.uuid4().hex[:8]}",
        token=TOKEN,
        first_ip=first_ip,
        stop_grace=3,
    ) as simulator:
        yield simulator
    assert not simulator.errors


@pytest.fixture
def objects(kube_server: EmulatedApiServer) -> None:
    kube_server.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "creds"},
            "data": {"token": b64("s3cr3t"), "other": b64("unused")},
        }
    )
    kube_server.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "settings"},
            "data": {"greeting": "hello"},
        }
    )


def test_statefulset_pods_run_scale_and_survive_deletion(
    kube_server: EmulatedApiServer, sim: ClusterSim, objects: None
) -> None:
    kube_server.create(statefulset(replicas=2))
    pods = [wait_for(f"web-{i} Ready", lambda i=i: ready_pod(kube_server, f"web-{i}")) for i in range(2)]
    ips = [pod["status"]["podIP"] for pod in pods]
    assert len(set(ips)) == 2 and all(ip.startswith("127.") for ip in ips)
    web0 = pods[0]
    assert web0["spec"]["nodeName"] == "emulated"
    assert web0["spec"]["hostname"] == "web-0" and web0["spec"]["subdomain"] == "web"
    assert web0["metadata"]["labels"]["statefulset.kubernetes.io/pod-name"] == "web-0"
    assert web0["metadata"]["labels"]["apps.kubernetes.io/pod-index"] == "0"
    assert web0["metadata"]["labels"]["tier"] == "web"
    assert web0["metadata"]["ownerReferences"][0]["kind"] == "StatefulSet"
    status = web0["status"]["containerStatuses"][0]
    assert status["ready"] and status["started"] and "running" in status["state"]
    assert web0["status"]["phase"] == "Running"
    pvc = kube_server.read("persistentvolumeclaims", "default", "data-web-0")
    assert pvc is not None and pvc["metadata"]["labels"] == {"kind": "data", "app": "web"}
    assert pvc["status"]["phase"] == "Bound"

    # Env, files and the mapped paths reach the process, which runs as the unprivileged account.
    info = get_json(f"http://{ips[0]}:8080/info")
    env = info["env"]
    assert env["POD_NAME"] == "web-0" and env["POD_IP"] == ips[0] and env["NODE"] == "emulated"
    assert env["SECRET_TOKEN"] == "s3cr3t" and env["GREETING"] == "hello" and env["CM_greeting"] == "hello"
    assert env["PATH"].startswith(str(sim.venv / "bin"))
    # The node's own paths (the virtualenv, the pod's home) are never taken for container paths, even
    # under a directory a volume is mounted at in the container (/tmp here; a clone under /tmp in CI).
    assert Path(env["HOME"]).is_dir(), env["HOME"]
    assert info["files"] == {
        "/etc/sim/secret": {"token.txt": "s3cr3t"},
        "/etc/sim/config": {"greeting": "hello"},
    }
    assert info["data"] == str(sim.pvc_dir("default", "data-web-0"))
    assert env["TMPDIR"].endswith("/volumes/tmp")
    if sim.account is not None:
        assert info["uid"] == sim.account.uid

    wait_for(
        "the StatefulSet's status",
        lambda: (
            (kube_server.read("statefulsets", "default", "web") or {}).get("status", {}).get("readyReplicas")
            == 2
        ),
    )
    sts = kube_server.read("statefulsets", "default", "web")
    assert sts is not None and sts["status"]["currentRevision"] == sts["status"]["updateRevision"]

    # Deleting a pod: SIGTERM (a marker on its volume), then the same pod name again, same volume.
    data0 = sim.pvc_dir("default", "data-web-0")
    (data0 / "kept").write_text("still here")
    kube_server.remove("pods", "default", "web-0")
    wait_for("the SIGTERM marker", lambda: (data0 / "terminated-web-0").exists())
    again = wait_for("web-0 again", lambda: ready_pod(kube_server, "web-0", not_uid=web0["metadata"]["uid"]))
    assert again["status"]["podIP"] not in ips  # a new IP: none is reused while the simulator runs
    assert get_json(f"http://{again['status']['podIP']}:8080/info")["data"] == str(data0)
    assert (data0 / "kept").read_text() == "still here"

    # Scale down: the highest ordinal goes (SIGTERM), its PVC and directory stay.
    kube_server.merge("statefulsets", "default", "web", {"spec": {"replicas": 1}})
    wait_for("web-1 gone", lambda: kube_server.read("pods", "default", "web-1") is None)
    data1 = sim.pvc_dir("default", "data-web-1")
    assert (data1 / "terminated-web-1").exists()
    assert kube_server.read("persistentvolumeclaims", "default", "data-web-1") is not None
    assert kube_server.read("pods", "default", "web-0") is not None
    wait_for(
        "replicas 1",
        lambda: (
            (kube_server.read("statefulsets", "default", "web") or {}).get("status", {}).get("replicas") == 1
        ),
    )


def test_jobs_succeed_with_a_message_and_fail_after_backoff_limit(
    kube_server: EmulatedApiServer, sim: ClusterSim
) -> None:
    kube_server.create(job("ok", "import sys; open(sys.argv[1], 'w').write('{\"result\": 42}')"))
    kube_server.create(job("bad", "import sys; print('boom: no way'); sys.exit(3)", backoff_limit=1))

    def condition(name: str, kind: str) -> dict[str, Any] | None:
        obj = kube_server.read("jobs", "default", name) or {}
        return next((c for c in obj.get("status", {}).get("conditions") or () if c["type"] == kind), None)

    wait_for("ok Complete", lambda: condition("ok", "Complete"))
    status = kube_server.read("jobs", "default", "ok")["status"]  # type: ignore[index]
    assert status["succeeded"] == 1 and status["active"] == 0
    (pod,) = kube_server.items("pods", "default", label_selector="job-name=ok")
    assert pod["status"]["phase"] == "Succeeded"
    assert pod["metadata"]["labels"]["batch.kubernetes.io/job-name"] == "ok"
    assert (
        pod["metadata"]["labels"]["controller-uid"]
        == kube_server.read("jobs", "default", "ok")["metadata"]["uid"]
    )  # type: ignore[index]
    terminated = pod["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 0 and json.loads(terminated["message"]) == {"result": 42}

    failed = wait_for("bad Failed", lambda: condition("bad", "Failed"))
    assert failed["reason"] == "BackoffLimitExceeded"
    status = kube_server.read("jobs", "default", "bad")["status"]  # type: ignore[index]
    assert status["failed"] == 2 and status.get("succeeded", 0) == 0
    pods = kube_server.items("pods", "default", label_selector="job-name=bad")
    assert len(pods) == 2 and {p["status"]["phase"] for p in pods} == {"Failed"}
    terminated = pods[0]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert terminated["exitCode"] == 3 and "boom: no way" in terminated["message"]

    # Garbage collection: deleting the Job deletes its pods (through the kubelet's confirmation).
    kube_server.remove("jobs", "default", "bad")
    wait_for(
        "bad's pods gone", lambda: not kube_server.items("pods", "default", label_selector="job-name=bad")
    )


def test_a_cordoned_node_leaves_new_pods_unschedulable_until_uncordoned(
    kube_server: EmulatedApiServer, sim: ClusterSim
) -> None:
    """As `kubectl cordon`: a new pod stays Pending, PodScheduled False with the scheduler's reason and
    message, bound to no node; once uncordoned it is scheduled and runs."""
    kube_server.merge("nodes", None, NODE_NAME, {"spec": {"unschedulable": True}})
    kube_server.create(job("later", "import sys; open(sys.argv[1], 'w').write('{}')"))

    def unschedulable() -> dict[str, Any] | None:
        for pod in kube_server.items("pods", "default", label_selector="job-name=later"):
            scheduled = next(
                (c for c in pod.get("status", {}).get("conditions") or () if c["type"] == "PodScheduled"),
                None,
            )
            if scheduled is not None and scheduled["status"] == "False":
                return pod
        return None

    pod = wait_for("the pod Unschedulable", unschedulable)
    condition = pod["status"]["conditions"][0]
    assert condition["reason"] == "Unschedulable" and condition["message"] == UNSCHEDULABLE_MESSAGE
    assert pod["status"]["phase"] == "Pending" and not pod["spec"].get("nodeName")
    assert "containerStatuses" not in pod["status"]
    kube_server.merge("nodes", None, NODE_NAME, {"spec": {"unschedulable": None}})
    wait_for(
        "the Job Complete once uncordoned",
        lambda: (kube_server.read("jobs", "default", "later") or {}).get("status", {}).get("succeeded"),
    )


def test_a_real_member_runs_the_agent_at_its_pod_ip(
    kube_server: EmulatedApiServer, work_root: Path, tmp_path: Path
) -> None:
    """The builders' StatefulSet of a one-instance cluster: `pgherd instance run` answers the operator's
    client over HTTPS at the pod IP, and an initdb seed makes it a primary that turns Ready."""
    from pgherd.api.cluster import PostgresClusterSpec
    from pgherd.engine.revision import spec_revision
    from pgherd.kube import names
    from pgherd.kube.builders import configmap, secrets
    from pgherd.kube.builders import statefulset as sts_builder
    from pgherd.kube.builders.common import ClusterRef
    from pgherd_backup.agent.client import AgentClient

    spec = PostgresClusterSpec.model_validate({"instances": 1, "parameters": {"shared_buffers": "16MB"}})
    ref = ClusterRef("demo", "default", str(uuid.uuid4()), spec, "pgherd:test", spec_revision(spec))
    operator_data = secrets.generate_operator_data(ref.name)
    for manifest in (
        secrets.superuser_secret(ref, secrets.generate_superuser_data()),
        secrets.replication_secret(ref, secrets.generate_replication_data()),
        secrets.app_secret(ref, secrets.generate_app_data(ref)),
        secrets.operator_secret(ref, operator_data),
        secrets.agent_secret(ref, secrets.generate_agent_data(ref.name, ref.namespace, operator_data)),
        configmap.configmap(ref),
        sts_builder.statefulset(ref),
    ):
        kube_server.create(manifest)
    octets = uuid.uuid4().bytes
    root = work_root / f"sim-{uuid.uuid4().hex[:8]}"
    with ClusterSim(
        kube_server.url,
        root,
        token=TOKEN,
        first_ip=f"127.{octets[0] % 250 + 1}.{octets[1]}.2",
        max_probe_period=1,
        stop_grace=3,
    ) as sim:
        member = "demo-0"

        def started() -> dict[str, Any] | None:
            pod = kube_server.read("pods", "default", member)
            statuses = (pod or {}).get("status", {}).get("containerStatuses") or [{}]
            return pod if statuses[0].get("started") else None

        pod = wait_for("the agent's startup probe", started, timeout=60)
        ca = tmp_path / "ca.crt"
        ca.write_text(operator_data[names.KEY_CA_CERT])
        client = AgentClient(
            f"https://{pod['status']['podIP']}:{names.AGENT_PORT}",
            ca_file=ca,
            token=operator_data[names.KEY_TOKEN],
            server_hostname=secrets.agent_server_hostname(ref.name, member, ref.namespace),
        )
        status = client.status()
        assert status.postmaster == "stopped"
        client.seed("initdb", reason="a test")
        wait_for("a primary", lambda: client.status().role == "primary", timeout=90)
        wait_for("Ready", lambda: ready_pod(kube_server, member), timeout=30)
        assert sim.pvc_dir("default", f"{names.VOLUME_DATA}-{member}").joinpath("data", "PG_VERSION").exists()
    assert not sim.errors


def test_restarts_liveness_and_sigkill_after_the_grace_period(
    kube_server: EmulatedApiServer, sim: ClusterSim
) -> None:
    def pod(name: str, script: str, **container: Any) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name},
            "spec": {
                "terminationGracePeriodSeconds": 1,
                "containers": [
                    {"name": "c", "image": "none", "command": ["python", "-c", script], **container}
                ],
            },
        }

    def status(name: str) -> dict[str, Any]:
        found = kube_server.read("pods", "default", name) or {}
        return ((found.get("status") or {}).get("containerStatuses") or [{}])[0]

    # A crash under restartPolicy Always: restarted, restartCount and lastState kept.
    kube_server.create(pod("crash", "import sys; print('crashing'); sys.exit(7)"))
    wait_for("a restart", lambda: status("crash").get("restartCount", 0) >= 1)
    assert status("crash")["lastState"]["terminated"]["exitCode"] == 7
    # A liveness probe that fails (an exec probe) kills and restarts a running container.
    kube_server.create(
        pod(
            "unhealthy",
            "import time; time.sleep(600)",
            livenessProbe={"exec": {"command": ["false"]}, "periodSeconds": 1, "failureThreshold": 2},
        )
    )
    wait_for("a liveness restart", lambda: status("unhealthy").get("restartCount", 0) >= 1)
    # A process that ignores SIGTERM is SIGKILLed after the grace period; the pod object then goes.
    kube_server.create(
        pod("stubborn", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)")
    )
    wait_for("running", lambda: "running" in status("stubborn").get("state", {}))
    started = time.monotonic()
    kube_server.remove("pods", "default", "stubborn")
    wait_for("stubborn gone", lambda: kube_server.read("pods", "default", "stubborn") is None)
    assert 0.9 < time.monotonic() - started < 6


def test_a_deleted_claim_loses_its_volume(
    kube_server: EmulatedApiServer, sim: ClusterSim, objects: None
) -> None:
    """A PVC deleted and created again under the same name (a lost volume: the StatefulSet makes a new
    claim for the recreated pod) is a new, empty volume, as dynamic provisioning with reclaimPolicy
    Delete gives; the old claim's directory is removed."""
    kube_server.create(statefulset(replicas=1))
    web0 = wait_for("web-0 Ready", lambda: ready_pod(kube_server, "web-0"))
    data0 = sim.pvc_dir("default", "data-web-0")
    (data0 / "kept").write_text("lost with the claim")
    kube_server.remove("persistentvolumeclaims", "default", "data-web-0")
    kube_server.remove("pods", "default", "web-0")
    again = wait_for("web-0 again", lambda: ready_pod(kube_server, "web-0", not_uid=web0["metadata"]["uid"]))
    assert get_json(f"http://{again['status']['podIP']}:8080/info")["data"] == str(data0)
    assert not (data0 / "kept").exists()
    assert [p.name for p in data0.parent.iterdir() if "data-web-0" in p.name and p != data0] in (
        [],
        [".data-web-0.uid"],
    )
