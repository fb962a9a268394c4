"""The members' NetworkPolicy, enforced (localkube: kube-router's network policy controller on the node).

One cluster for the module, the tests in order: the operator made the policy and the cluster is healthy
behind it (the operator still reaches every agent); a pod of another namespace reaches PostgreSQL and
the metrics on every member and none of the agents; with `spec.networkPolicy.clients` narrowed to namespaces with a
label, that pod is refused PostgreSQL until its namespace gets the label, while the members (a
switchover: replicas connect to the new primary) and a Backup's snapshot Job keep working; with the
policy disabled the operator deletes it and the agents answer that pod again (the refusals were the
policy's). The probe pod runs the project's image (the only image on the node) under the restricted
Pod Security Standard.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from e2e import manifests
from e2e.checks import insert_ids, wait_ids_on_member
from e2e.driver import NewCluster, backup_phase, healthy, unless_failed
from e2e.drivers.localkube import LocalKubeDriver, restricted_namespace

DRIVER = os.environ.get("PGHERD_E2E_DRIVER", "local")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        DRIVER != "localkube",
        reason=(
            "NetworkPolicies need Kubernetes and an implementation that enforces them: localkube runs one"
            " (kube-router's); the sandbox (local) has no network between members to police, and kind's"
            " enforcement depends on its CNI. Run with PGHERD_E2E_DRIVER=localkube"
        ),
    ),
]

NAME = "e2e-netpol"
CLIENTS = "pgherd-e2e-netpol-clients"  # the other namespace, where the probe pod runs
PROBE = "probe"
CLIENT_LABEL = "e2e.pgherd.io/postgres-client"
AGENT_PORT = 8008
POSTGRES_PORT = 5432
METRICS_PORT = 9187
# kube-router applies a change of policy, pod or namespace within its sync; seconds here.
POLICY_TIMEOUT = 90.0
BACKUP_TIMEOUT = 240.0
# Connects and says how it went: open, refused (a policy's reject), timeout, or the error.
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()
    print("open")
except ConnectionRefusedError:
    print("refused")
except TimeoutError:
    print("timeout")
except OSError as error:
    print(f"error {error}")
"""


@pytest.fixture(scope="module")
def cluster(new_cluster: NewCluster, pg_version: int) -> LocalKubeDriver:
    driver = new_cluster(manifests.cluster(NAME, postgres_version=pg_version, instances=3))
    assert isinstance(driver, LocalKubeDriver)
    return driver


@pytest.fixture(scope="module")
def probe(cluster: LocalKubeDriver) -> Iterator[Callable[[str, int], str]]:
    """A restricted pod of the project's image in another namespace; probe(ip, port) connects from it."""
    kube = cluster.kube
    # The namespace of a run before (deleted without waiting) must be gone first.
    kube.run("wait", "--for=delete", f"namespace/{CLIENTS}", "--timeout=300s", check=False, timeout=320)
    kube.run("apply", "-f", "-", input=json.dumps(restricted_namespace(CLIENTS)))
    image = str(cluster.localkube.state.get("image") or "localkube.local/pgherd:e2e")
    context = {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": PROBE, "namespace": CLIENTS, "labels": {"app": "e2e-probe"}},
        "spec": {
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": 999,
                "runAsGroup": 999,
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "containers": [
                {
                    "name": PROBE,
                    "image": image,
                    "imagePullPolicy": "Never",
                    "command": ["sleep", "infinity"],
                    "securityContext": context,
                }
            ],
        },
    }
    kube.run("apply", "-f", "-", input=json.dumps(pod))
    kube.run("-n", CLIENTS, "wait", "--for=condition=Ready", f"pod/{PROBE}", "--timeout=120s", timeout=140)

    def connect(ip: str, port: int) -> str:
        result = kube.run(
            "-n", CLIENTS, "exec", PROBE, "--", "python3", "-c", CONNECT, ip, str(port), timeout=30
        )  # fmt: skip
        return result.stdout.strip()

    yield connect
    kube.run("delete", "namespace", CLIENTS, "--wait=false", check=False)


def member_ips(cluster: LocalKubeDriver) -> dict[str, str]:
    pods = cluster.get("pods")["items"]
    return {
        p["metadata"]["name"]: p["status"]["podIP"]
        for p in pods
        if (p["metadata"].get("labels") or {}).get("app.kubernetes.io/component") == "postgres"
        and (p.get("status") or {}).get("podIP")
    }


def policy(cluster: LocalKubeDriver) -> dict[str, Any] | None:
    found = cluster.kube.run(
        "-n", cluster.namespace, "get", "networkpolicy", NAME, "-o", "json", "--ignore-not-found"
    ).stdout  # fmt: skip
    return json.loads(found) if found.strip() else None


def postgres_sources(found: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The `from` of the policy's PostgreSQL rule; None when it admits anyone."""
    for rule in found["spec"]["ingress"]:
        if any(port.get("port") == POSTGRES_PORT for port in rule["ports"]):
            sources: list[dict[str, Any]] | None = rule.get("from")
            return sources
    raise AssertionError(f"no rule for {POSTGRES_PORT}: {found['spec']}")


def until(check: Callable[[], bool], what: str, timeout: float = POLICY_TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(1.0)


def reaches(probe: Callable[[str, int], str], ips: dict[str, str], port: int) -> dict[str, str]:
    return {member: probe(ip, port) for member, ip in ips.items()}


def test_the_operator_made_the_policy_and_the_cluster_is_healthy_behind_it(cluster: LocalKubeDriver) -> None:
    found = policy(cluster)
    assert found is not None, "the operator made no NetworkPolicy"
    owners = found["metadata"].get("ownerReferences") or []
    assert [(o["kind"], o["name"]) for o in owners] == [("PostgresCluster", NAME)]
    assert found["spec"]["podSelector"]["matchLabels"]["pgherd.io/cluster"] == NAME
    assert postgres_sources(found) is None  # anyone, by default
    # Healthy means every member reported through its agent: the operator's pod gets through.
    status = cluster.status()
    assert len(status["members"]) == 3 and all(m["ready"] for m in status["members"]), status["members"]


def test_another_namespace_reaches_postgres_but_not_the_agents(
    cluster: LocalKubeDriver, probe: Callable[[str, int], str]
) -> None:
    ips = member_ips(cluster)
    assert len(ips) == 3, ips
    assert reaches(probe, ips, POSTGRES_PORT) == dict.fromkeys(ips, "open")
    assert reaches(probe, ips, METRICS_PORT) == dict.fromkeys(ips, "open")  # scrapers run anywhere
    agents = reaches(probe, ips, AGENT_PORT)
    assert all(result in ("refused", "timeout") for result in agents.values()), agents


def test_narrowed_clients_keep_others_out_and_the_cluster_working(
    cluster: LocalKubeDriver, probe: Callable[[str, int], str]
) -> None:
    clients = [{"namespaceSelector": {"matchLabels": {CLIENT_LABEL: "yes"}}}]
    cluster.apply(
        manifests.cluster(NAME, postgres_version=cluster.postgres_version, networkPolicy={"clients": clients})
    )
    until(
        lambda: (p := policy(cluster)) is not None and postgres_sources(p) is not None, "the policy narrowed"
    )
    ips = member_ips(cluster)
    until(
        lambda: all(r in ("refused", "timeout") for r in reaches(probe, ips, POSTGRES_PORT).values()),
        "PostgreSQL refused to a namespace the clients do not name",
    )
    cluster.kube.run("label", "namespace", CLIENTS, f"{CLIENT_LABEL}=yes", "--overwrite")
    until(
        lambda: reaches(probe, ips, POSTGRES_PORT) == dict.fromkeys(ips, "open"),
        "PostgreSQL open again to the namespace once it carries the label",
    )

    # The members connect to each other anew (replicas to the new primary) and a snapshot Job streams
    # from one: both are let through by the policy's own rule, whatever `clients` says.
    before = cluster.status()["primary"]
    cluster.switchover()
    status = cluster.wait_for(unless_failed(healthy(3)), 180, "healthy after the switchover")
    assert status["primary"] != before
    insert_ids(cluster.rw_dsn(), range(1, 51))
    for member in status["members"]:
        wait_ids_on_member(cluster, member["name"], list(range(1, 51)), timeout=60)
    cluster.apply(manifests.backup("e2e-netpol-narrowed", NAME))
    status = cluster.wait_for(
        lambda s: backup_phase(s, "e2e-netpol-narrowed") in ("Completed", "Failed"),
        BACKUP_TIMEOUT,
        "the Backup taken under the narrowed policy",
    )
    assert backup_phase(status, "e2e-netpol-narrowed") == "Completed", status.get("backups")


def test_a_disabled_policy_is_deleted_and_the_agents_answer_again(
    cluster: LocalKubeDriver, probe: Callable[[str, int], str]
) -> None:
    cluster.apply(
        manifests.cluster(NAME, postgres_version=cluster.postgres_version, networkPolicy={"enabled": False})
    )
    until(lambda: policy(cluster) is None, "the operator to delete the NetworkPolicy")
    ips = member_ips(cluster)
    until(lambda: reaches(probe, ips, AGENT_PORT) == dict.fromkeys(ips, "open"), "the agents reachable again")
    cluster.wait_for(unless_failed(healthy(3)), 120, "healthy without a policy")
