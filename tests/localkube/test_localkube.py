"""localkube end to end: `python -m e2e.localkube up --no-operator`, a claim of the default StorageClass
written by a restricted pod (uid 999, fsGroup 999) and read by the next pod, a Service reached from the
host by its ClusterIP and from a pod by its DNS name, the claim's directory removed with it, a
NetworkPolicy enforced (kube-router), then `down`, which must leave no process, mount, bridge, cgroup,
iptables rule or ipset behind.

Runs only where it can: as root, with the Kubernetes binaries built (scripts/ensure-kubernetes.sh; this
test never starts a 12-minute build), the node's Debian packages installed, and no other localkube
cluster on the machine (one per machine: see e2e/localkube/lock.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e.localkube import binaries, host, lock, netpol
from e2e.localkube.settings import BUSYBOX_IMAGE, REPO, Layout
from e2e.localkube.state import State


def unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root"
    try:
        binaries.check_host()
    except binaries.Missing as exc:
        return str(exc)
    if binaries.built_bin_dir() is None:
        return (
            "the Kubernetes binaries are not built: run scripts/ensure-kubernetes.sh (about 12 minutes cold)"
        )
    if binaries.built_network_policy_bin() is None:
        return "kube-router is not built: run scripts/ensure-network-policies.sh (about 3 minutes cold)"
    if host.bridge_exists("lk0"):
        return "another localkube cluster runs on this machine (bridge lk0 exists)"
    return None


REASON = unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]
UP_TIMEOUT = 300


def localkube(*args: str, timeout: float = UP_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "e2e.localkube", *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


class Cluster:
    def __init__(self, directory: Path) -> None:
        self.layout = Layout(directory)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120) -> str:
        argv = [binaries.tool("kubectl"), "--kubeconfig", str(self.layout.kubeconfig), *args]
        result = subprocess.run(
            argv, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {result.stderr}")
        return result.stdout

    def apply(self, *docs: dict[str, Any]) -> None:
        self.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json"))

    def wait_ready(self, pod: str) -> None:
        self.kubectl("wait", "--for=condition=Ready", f"pod/{pod}", "--timeout=120s", timeout=130)

    def wait_deleted(self, *what: str) -> None:
        self.kubectl("delete", *what, "--wait=true", "--timeout=120s", timeout=130)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    directory = tmp_path_factory.mktemp("localkube") / "cluster"
    started = localkube("up", "--dir", str(directory), "--no-operator")
    if started.returncode != 0:
        pytest.fail(f"up failed ({started.returncode}):\n{started.stdout}\n{started.stderr}")
    yield Cluster(directory)
    # The last test brings it down and checks what is left; this one only makes sure it is gone.
    if Layout(directory).state.exists():
        localkube("down", "--dir", str(directory), "--keep", timeout=180)


def restricted_pod(name: str, command: str, *, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A pod as pgherd's members run: uid and gid 999, fsGroup 999, nothing privileged."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": {
            "securityContext": {
                "runAsUser": 999,
                "runAsGroup": 999,
                "runAsNonRoot": True,
                "fsGroup": 999,
                "fsGroupChangePolicy": "OnRootMismatch",
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "main",
                    "image": BUSYBOX_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sh", "-c", command],
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                    "ports": [{"containerPort": 8080}],
                }
            ],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
        },
    }


def test_claim_pod_and_service_round_trip(cluster: Cluster) -> None:
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "web"},
        "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]},
    }
    writer = restricted_pod(
        "writer",
        "mkdir -m 700 /data/pgdata && echo kept > /data/pgdata/file && exec httpd -f -p 8080 -h /www",
        labels={"app": "web"},
    )
    cluster.apply(claim, service, writer)
    cluster.wait_ready("writer")
    bound = cluster.get("pvc", "data")
    assert bound["status"]["phase"] == "Bound"
    assert bound["spec"]["storageClassName"] == "standard"  # the default class, not named by the claim
    volume = cluster.get("pv", bound["spec"]["volumeName"])
    directory = Path(volume["spec"]["local"]["path"])
    assert directory.parent == cluster.layout.volumes
    assert (directory / "pgdata" / "file").read_text() == "kept\n"
    assert (directory / "pgdata").stat().st_uid == 999

    # The Service from the host (kube-proxy's rules) and from a pod by name (CoreDNS).
    cluster_ip = cluster.get("service", "web")["spec"]["clusterIP"]
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://{cluster_ip}/", timeout=2) as answer:
                assert answer.read() == b"hello from localkube\n"
                break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    page = cluster.kubectl("exec", "writer", "--", "wget", "-qO-", "http://web.default.svc/")
    assert page == "hello from localkube\n"

    # The data outlives its pod.
    cluster.wait_deleted("pod", "writer")
    cluster.apply(restricted_pod("reader", "cat /data/pgdata/file && exec sleep 3600"))
    cluster.wait_ready("reader")
    assert cluster.kubectl("logs", "reader").strip() == "kept"

    # Deleting the claim deletes the volume and its directory (reclaimPolicy Delete).
    cluster.wait_deleted("pod", "reader")
    cluster.wait_deleted("pvc", "data")
    deadline = time.monotonic() + 60
    while directory.exists() or cluster.get("pv")["items"]:
        assert time.monotonic() < deadline, f"{directory} or its PersistentVolume is still there"
        time.sleep(0.5)


def plain_pod(name: str, command: str, labels: dict[str, str]) -> dict[str, Any]:
    """A restricted busybox pod without a volume."""
    pod = restricted_pod(name, command, labels=labels)
    pod["spec"].pop("volumes")
    pod["spec"]["containers"][0].pop("volumeMounts")
    return pod


def test_a_network_policy_is_enforced(cluster: Cluster) -> None:
    """kube-router's controller on the node: a pod a policy selects takes connections from the peers the
    policy names only (others are rejected at once); the host always gets through (the kubelet's
    probes); without the policy everyone does."""
    cluster.apply(
        plain_pod("server", "exec httpd -f -p 8080 -h /www", {"app": "server"}),
        plain_pod("friend", "exec sleep 3600", {"role": "friend"}),
        plain_pod("stranger", "exec sleep 3600", {"role": "stranger"}),
    )
    for pod in ("server", "friend", "stranger"):
        cluster.wait_ready(pod)
    server_ip = cluster.get("pod", "server")["status"]["podIP"]

    def fetch(pod: str) -> bool:
        """The page through the pod (busybox's wget: its -T segfaults in this build, hence no timeout
        of its own; a policy's reject answers at once anyway)."""
        argv = [binaries.tool("kubectl"), "--kubeconfig", str(cluster.layout.kubeconfig), "exec", pod, "--"]
        try:
            result = subprocess.run(
                [*argv, "wget", "-qO-", f"http://{server_ip}:8080/"],
                capture_output=True, text=True, timeout=15, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return False
        return result.returncode == 0 and result.stdout == "hello from localkube\n"

    def until(check: Any, what: str) -> None:
        deadline = time.monotonic() + 60
        while not check():
            assert time.monotonic() < deadline, what
            time.sleep(0.5)

    until(lambda: fetch("friend") and fetch("stranger"), "both reach the server before any policy")
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "friends-only"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "server"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {"role": "friend"}}}], "ports": [{"port": 8080}]}
            ],
        },
    }
    cluster.apply(policy)
    until(lambda: not fetch("stranger"), "the stranger refused once the policy is there")
    assert fetch("friend")
    with urllib.request.urlopen(f"http://{server_ip}:8080/", timeout=3) as answer:  # from the node
        assert answer.read() == b"hello from localkube\n"
    assert any(line.startswith("-N KUBE-POD-FW-") for line in host.run("iptables", "-S").stdout.splitlines())
    cluster.wait_deleted("networkpolicy", "friends-only")
    until(lambda: fetch("stranger"), "the stranger let in again once the policy is gone")
    cluster.kubectl("delete", "pod", "server", "friend", "stranger", "--grace-period=0", "--wait=false")


def test_down_leaves_nothing(cluster: Cluster) -> None:
    state = State.load(cluster.layout)
    settings = state.settings
    assert settings is not None
    recorded = state.processes()
    assert {p.name for p in recorded} >= {
        "etcd",
        "kube-apiserver",
        "kubelet",
        "containerd",
        "kube-proxy",
        "kube-router",
        "coredns",
    }

    stopped = localkube("down", "--dir", str(cluster.layout.root), "--keep", timeout=180)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert [p.name for p in recorded if p.alive] == []
    assert host.mounts_under(cluster.layout.root) == []
    assert not host.bridge_exists(settings.bridge)
    assert host.kube_rules() == []
    assert netpol.ipsets() == []
    assert not any((h / settings.cgroup_root.lstrip("/")).exists() for h in host.hierarchies())
    assert lock.LOCK_FILE.read_text().strip() != str(cluster.layout.root)
    # A second down is harmless, and then DIR goes.
    again = localkube("down", "--dir", str(cluster.layout.root), timeout=180)
    assert again.returncode == 0, again.stdout + again.stderr
    assert not cluster.layout.root.exists()
