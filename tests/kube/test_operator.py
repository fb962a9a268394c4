"""`pgherd operator` in-process (kopf's KopfRunner) against the emulated API server.

No pod runs here (no kubelet): these tests cover what the operator does through the API alone — the
objects a cluster owns, status, leader election, the switchover annotation's refusal, scale, deletion,
bad input, and that every request it makes is one the chart's RBAC grants.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kopf.testing import KopfRunner

from pgherd.kube import names
from pgherd.kube.api import Credentials
from pgherd.kube.handlers import Election, Operator, build
from pgherd.kube.loop import OperatorConfig

from .conftest import TOKEN, USER
from .emulator import EmulatedApiServer, calls_not_allowed
from .waiting import eventually

REPO = Path(__file__).resolve().parents[2]
NS = "apps"
pytestmark = pytest.mark.kube_emulator(namespaces=[NS, "pgherd-system"])


def cluster_manifest(name: str = "hippo", instances: int = 3, **spec: Any) -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "examples" / "cluster-minimal.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": NS}
    doc["spec"]["instances"] = instances
    doc["spec"].update(spec)
    return doc


@contextlib.contextmanager
def running_operator(
    server: EmulatedApiServer,
    *,
    election: Election | None = None,
    token: str = TOKEN,
    config: OperatorConfig | None = None,
) -> Iterator[Operator]:
    operator = Operator(
        config=config or OperatorConfig(steady_interval=0.2, busy_interval=0.1),
        election=election,
        credentials=Credentials(server=server.url, token=token),
    )
    registry, settings = build(operator)
    with KopfRunner(
        ["run", "--standalone", "--namespace", NS], registry=registry, settings=settings, timeout=60
    ) as runner:
        yield operator
    assert runner.exception is None, runner.output


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(
        o.get("uid") == uid and o.get("controller") for o in obj["metadata"].get("ownerReferences") or []
    )


EXPECTED = {
    "statefulsets": ["hippo"],
    "services": ["hippo-rw", "hippo-ro", "hippo-r", "hippo-headless"],
    "secrets": ["hippo-superuser", "hippo-app", "hippo-replication", "hippo-agent", "hippo-operator"],
    "configmaps": ["hippo-config"],
    "serviceaccounts": ["hippo-postgres"],
    "poddisruptionbudgets": ["hippo"],
}


def test_a_cluster_gets_its_objects_and_status(kube_server: EmulatedApiServer) -> None:
    created = kube_server.create(cluster_manifest())
    uid = created["metadata"]["uid"]
    with running_operator(kube_server):
        cluster = eventually(
            lambda: (
                (c := kube_server.read("postgresclusters", NS, "hippo"))
                and (c.get("status") or {}).get("phase")
                and c
            ),
            what="a status",
        )
        for kind, wanted in EXPECTED.items():
            for name in wanted:
                obj = eventually(lambda k=kind, n=name: kube_server.read(k, NS, n), what=f"{kind}/{name}")
                assert owned_by(obj, uid), f"{kind}/{name} is not owned by the cluster"
                assert obj["metadata"]["labels"][names.LABEL_CLUSTER] == "hippo"
        # The engine's first action: the first member (StatefulSet replicas 0 -> 1), to be seeded by initdb.
        sts = eventually(
            lambda: (s := kube_server.read("statefulsets", NS, "hippo")) and s["spec"]["replicas"] == 1 and s,
            what="replicas 1",
        )
        assert sts["spec"]["updateStrategy"]["type"] == "OnDelete"
        status = cluster["status"]
        assert status["phase"] in ("Pending", "Creating")
        assert status["observedGeneration"] == cluster["metadata"]["generation"]
        assert (
            status["selector"]
            == f"{names.LABEL_CLUSTER}=hippo,{names.LABEL_COMPONENT}={names.COMPONENT_POSTGRES}"
        )
        assert {c["type"] for c in status["conditions"]} >= {"Ready"}
        assert "engine" in status
        # kopf's finalizer under pgherd.io names: the daemon needs it to stop before the object goes.
        assert names.FINALIZER in cluster["metadata"].get("finalizers", [])
        secret = kube_server.read("secrets", NS, "hippo-operator")
        assert secret is not None
    # Secrets are created once and never overwritten: a second operator reads them back.
    with running_operator(kube_server):
        time.sleep(1.0)
        assert kube_server.read("secrets", NS, "hippo-operator")["data"] == secret["data"]


def test_a_spec_change_is_observed(kube_server: EmulatedApiServer) -> None:
    kube_server.create(cluster_manifest())
    with running_operator(kube_server):
        eventually(lambda: kube_server.read("poddisruptionbudgets", NS, "hippo"), what="the PDB")
        eventually(
            lambda: (kube_server.read("statefulsets", NS, "hippo") or {}).get("spec", {}).get("replicas"),
            what="the first member ordered",
        )
        time.sleep(0.5)
        # Settled, with no member to ask: ticks (every 0.2 s) cost no request at all.
        mark = len(kube_server.calls)
        time.sleep(1.0)
        idle = [c for c in kube_server.calls[mark:] if c.user == USER and c.verb != "watch"]
        assert not idle, idle
        kube_server.merge("postgresclusters", NS, "hippo", {"spec": {"instances": 5}})
        cluster = eventually(
            lambda: (
                (c := kube_server.read("postgresclusters", NS, "hippo"))
                and (c.get("status") or {}).get("observedGeneration") == c["metadata"]["generation"]
                and c["metadata"]["generation"] > 1
                and c
            ),
            what="observedGeneration to catch up",
        )
        assert cluster["spec"]["instances"] == 5
        pdb = eventually(
            lambda: (
                (p := kube_server.read("poddisruptionbudgets", NS, "hippo"))
                and p["spec"]["minAvailable"] == 3
                and p
            ),
            what="the PDB to keep a majority of 5",
        )
        assert pdb["spec"]["selector"]["matchLabels"][names.LABEL_CLUSTER] == "hippo"
        # What changed is patched, once: no create attempt answered 409 first.
        budget_writes = [
            (c.verb, c.code)
            for c in kube_server.calls[mark:]
            if c.user == USER and c.resource == "poddisruptionbudgets"
        ]
        assert budget_writes == [("patch", 200)], budget_writes
        # Nothing but the status is written to the cluster itself (kopf's diff-base annotation would be
        # one more write, and one more watch event, per spec change).
        own = [
            (c.verb, c.subresource)
            for c in kube_server.calls[mark:]
            if c.user == USER and c.resource == "postgresclusters" and c.verb not in ("watch", "get", "list")
        ]
        assert own and set(own) == {("patch", "status")}, own


def test_a_one_instance_cluster_has_no_disruption_budget(kube_server: EmulatedApiServer) -> None:
    kube_server.create(cluster_manifest(instances=2))
    with running_operator(kube_server):
        eventually(lambda: kube_server.read("poddisruptionbudgets", NS, "hippo"), what="the PDB")
        kube_server.merge("postgresclusters", NS, "hippo", {"spec": {"instances": 1}})
        eventually(
            lambda: kube_server.read("poddisruptionbudgets", NS, "hippo") is None, what="the PDB to go"
        )


def test_an_unknown_switchover_target_is_refused_and_the_annotation_removed(
    kube_server: EmulatedApiServer,
) -> None:
    manifest = cluster_manifest()
    manifest["metadata"]["annotations"] = {names.ANNOTATION_SWITCHOVER: "hippo-9"}
    kube_server.create(manifest)
    with running_operator(kube_server):
        eventually(
            lambda: (
                names.ANNOTATION_SWITCHOVER
                not in (
                    kube_server.read("postgresclusters", NS, "hippo")["metadata"].get("annotations") or {}
                )
            ),
            what="the annotation to be removed",
        )
        events = eventually(
            lambda: [
                e for e in kube_server.items("events.k8s.io/v1/events", NS) if e.get("reason") == "Switchover"
            ],
            what="a Switchover event",
        )
        assert events[0]["type"] == "Warning" and "hippo-9" in events[0]["note"]


def test_deleting_a_cluster_runs_the_finalizer_and_leaves_nothing_blocked(
    kube_server: EmulatedApiServer,
) -> None:
    kube_server.create(cluster_manifest())
    with running_operator(kube_server):
        eventually(lambda: kube_server.read("statefulsets", NS, "hippo"), what="the StatefulSet")
        kube_server.remove("postgresclusters", NS, "hippo")
        eventually(
            lambda: kube_server.read("postgresclusters", NS, "hippo") is None, timeout=30, what="deletion"
        )
    # The garbage collector removes what the cluster owned.
    eventually(lambda: kube_server.read("statefulsets", NS, "hippo") is None, what="the StatefulSet to go")
    eventually(lambda: kube_server.read("services", NS, "hippo-rw") is None, what="the Services to go")


def data_volume(cluster: str, name: str) -> dict[str, Any]:
    """A PVC as the StatefulSet controller makes it from the claim template (labelled with the cluster)."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": NS, "labels": {names.LABEL_CLUSTER: cluster}},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }


def test_deleting_a_cluster_keeps_its_volumes_unless_its_delete_policy_says_delete(
    kube_server: EmulatedApiServer,
) -> None:
    kube_server.create(cluster_manifest(name="keep"))
    kube_server.create(cluster_manifest(name="drop", storage={"size": "1Gi", "deletePolicy": "Delete"}))
    volumes = {
        "keep": ["pgdata-keep-0", "pgdata-keep-1"],
        "drop": ["pgdata-drop-0", "pgdata-drop-1", "notes-drop"],  # the last is not a member's volume
    }
    for cluster, claims in volumes.items():
        for claim in claims:
            kube_server.create(data_volume(cluster, claim))
    with running_operator(kube_server):
        for cluster in volumes:
            eventually(
                lambda c=cluster: kube_server.read("statefulsets", NS, c), what=f"{cluster}'s StatefulSet"
            )
        for cluster in volumes:
            kube_server.remove("postgresclusters", NS, cluster)
        for cluster in volumes:
            eventually(
                lambda c=cluster: kube_server.read("postgresclusters", NS, c) is None,
                timeout=30,
                what="deletion",
            )
    left = {p["metadata"]["name"] for p in kube_server.items("persistentvolumeclaims", NS)}
    assert left == {"pgdata-keep-0", "pgdata-keep-1", "notes-drop"}


@pytest.mark.kube_emulator(validators=[])
def test_a_spec_the_crd_cannot_refuse_gets_a_condition_and_an_event(kube_server: EmulatedApiServer) -> None:
    bad = cluster_manifest()
    bad["spec"]["instances"] = 40  # beyond 15: refused by the schema on a real API server, not here
    kube_server.create(bad)
    with running_operator(kube_server):
        cluster = eventually(lambda: cluster_in_phase(kube_server, "Failed"), what="phase Failed")
        ready = next(c for c in cluster["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "False" and "spec.instances" in ready["message"]
        eventually(
            lambda: [
                e
                for e in kube_server.items("events.k8s.io/v1/events", NS)
                if "spec.instances" in (e.get("note") or "")
            ],
            what="an Event naming the field",
        )
        time.sleep(0.5)
        assert kube_server.read("statefulsets", NS, "hippo") is None  # nothing acted on a bad spec
        # Corrected, the cluster is built; spoiled again and put back as it was, the Failed status
        # written meanwhile is replaced (the decision is the same as before the failure).
        kube_server.merge("postgresclusters", NS, "hippo", {"spec": {"instances": 3}})
        eventually(lambda: phase_other_than(kube_server, "Failed"), what="the phase to leave Failed")
        eventually(lambda: kube_server.read("statefulsets", NS, "hippo"), what="the StatefulSet")
        time.sleep(0.5)
        kube_server.merge("postgresclusters", NS, "hippo", {"spec": {"instances": 40}})
        eventually(lambda: phase_other_than(kube_server, "Creating", "Pending"), what="phase Failed again")
        kube_server.merge("postgresclusters", NS, "hippo", {"spec": {"instances": 3}})
        eventually(lambda: phase_other_than(kube_server, "Failed"), what="the phase to leave Failed again")


def test_a_refused_object_write_fails_the_cluster_until_it_passes(kube_server: EmulatedApiServer) -> None:
    """The API server refuses a write of an owned object (here: every PodDisruptionBudget write, 500):
    a condition and an Event say so, nothing else is done meanwhile; once writes pass again the status
    says what the engine decided, even though that decision was written before the failure."""
    refusing = {"on": False}

    def inject() -> None:
        emulator = kube_server.emulator
        (
            emulator[
                lambda request: (
                    refusing["on"]
                    and request.method == "PATCH"
                    and "/poddisruptionbudgets/" in str(request.url.path)
                )
            ]
            << 500
            << {"kind": "Status", "reason": "InternalError", "message": "etcd is slow"}
        )

    kube_server.call(inject)
    kube_server.create(cluster_manifest())
    with running_operator(kube_server):
        eventually(lambda: phase_other_than(kube_server, "Failed"), what="a first status")
        eventually(lambda: kube_server.read("statefulsets", NS, "hippo"), what="the StatefulSet")
        refusing["on"] = True
        kube_server.merge("postgresclusters", NS, "hippo", {"spec": {"instances": 5}})
        cluster = eventually(lambda: cluster_in_phase(kube_server, "Failed"), what="phase Failed")
        ready = next(c for c in cluster["status"]["conditions"] if c["type"] == "Ready")
        assert ready["reason"] == "ObjectsFailed" and "etcd is slow" in ready["message"]
        refusing["on"] = False
        eventually(lambda: phase_other_than(kube_server, "Failed"), what="the phase to leave Failed")
        eventually(
            lambda: (
                (kube_server.read("poddisruptionbudgets", NS, "hippo") or {})
                .get("spec", {})
                .get("minAvailable")
                == 3
            ),
            what="the PDB for 5 members",
        )


def test_what_the_kubelet_reports_of_a_stuck_pod_becomes_a_condition_and_an_event(
    kube_server: EmulatedApiServer,
) -> None:
    """A member pod that cannot start (its S3 credentials Secret missing, its image not found, no node
    with room) is reported as the kubelet and the scheduler say it: condition PodsHealthy False naming
    the pod and the cause, and a Warning Event; when the pod starts, the condition turns True."""
    kube_server.create(cluster_manifest())
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "hippo-0",
            "namespace": NS,
            "labels": {names.LABEL_CLUSTER: "hippo", names.LABEL_COMPONENT: names.COMPONENT_POSTGRES},
        },
        "spec": {"containers": [{"name": names.CONTAINER_POSTGRES, "image": "x"}]},
    }
    waiting = {
        "phase": "Pending",
        "containerStatuses": [
            {
                "name": names.CONTAINER_POSTGRES,
                "ready": False,
                "restartCount": 0,
                "image": "x",
                "imageID": "",
                "state": {
                    "waiting": {
                        "reason": "CreateContainerConfigError",
                        "message": 'secret "backup-store" not found',
                    }
                },
            }
        ],
    }
    with running_operator(kube_server):
        eventually(lambda: kube_server.read("statefulsets", NS, "hippo"), what="the StatefulSet")
        kube_server.create(pod)
        kube_server.merge("pods", NS, "hippo-0", {"status": waiting}, subresource="status")

        def pods_healthy() -> dict[str, Any] | None:
            status = (kube_server.read("postgresclusters", NS, "hippo") or {}).get("status") or {}
            return next((c for c in status.get("conditions") or [] if c["type"] == "PodsHealthy"), None)

        condition = eventually(
            lambda: (c := pods_healthy()) and c["status"] == "False" and c, what="PodsHealthy False"
        )
        assert condition["reason"] == "CreateContainerConfigError"
        assert "hippo-0" in condition["message"] and 'secret "backup-store" not found' in condition["message"]
        (event,) = eventually(
            lambda: [
                e
                for e in kube_server.items("events.k8s.io/v1/events", NS)
                if e.get("reason") == "CreateContainerConfigError"
            ],
            what="a Warning Event",
        )
        assert event["type"] == "Warning" and "backup-store" in event["note"]
        running = {
            "phase": "Running",
            "containerStatuses": [
                {
                    **waiting["containerStatuses"][0],
                    "state": {"running": {"startedAt": "2026-11-24T00:00:00Z"}},
                }
            ],
        }
        kube_server.merge("pods", NS, "hippo-0", {"status": running}, subresource="status")
        eventually(lambda: (c := pods_healthy()) and c["status"] == "True", what="PodsHealthy True")


def cluster_in_phase(server: EmulatedApiServer, phase: str) -> dict[str, Any] | None:
    cluster = server.read("postgresclusters", NS, "hippo")
    return cluster if cluster and (cluster.get("status") or {}).get("phase") == phase else None


def phase_other_than(server: EmulatedApiServer, *phases: str) -> str | None:
    phase = ((server.read("postgresclusters", NS, "hippo") or {}).get("status") or {}).get("phase")
    return phase if phase and phase not in phases else None


@pytest.mark.kube_emulator(tokens={TOKEN: "tester", "first": "first", "second": "second"})
def test_leader_election_only_one_acts_and_the_other_takes_over(kube_server: EmulatedApiServer) -> None:
    """Two operators; each one's requests are told apart by its token. Only the Lease holder writes
    the cluster's objects; when it stops, the other takes over within the lease duration."""
    timing = {"lease_duration": 2.0, "renew_deadline": 1.5, "retry": 0.2}
    first = Election(namespace="pgherd-system", name="pgherd-leader", identity="first", **timing)
    second = Election(namespace="pgherd-system", name="pgherd-leader", identity="second", **timing)
    kube_server.create(cluster_manifest())
    with running_operator(kube_server, election=first, token="first") as one:
        eventually(lambda: one.holding(), what="the first to lead")
        with running_operator(kube_server, election=second, token="second") as two:
            eventually(lambda: kube_server.read("statefulsets", NS, "hippo"), what="the StatefulSet")
            time.sleep(1.0)
            assert one.holding() and not two.holding()
            writes = [
                c
                for c in kube_server.calls
                if c.user == "second" and c.verb in ("create", "patch", "update", "delete")
            ]
            assert [(c.resource, c.name) for c in writes if c.resource != "leases"] == []
            lease = kube_server.read("leases", "pgherd-system", "pgherd-leader")
            assert lease["spec"]["holderIdentity"] == "first"
    kube_server.create(cluster_manifest(name="second-cluster"))
    with running_operator(kube_server, election=second, token="second") as two:
        eventually(lambda: two.holding(), timeout=10, what="the second to take over")
        eventually(lambda: kube_server.read("statefulsets", NS, "second-cluster"), what="the second to act")
        lease = kube_server.read("leases", "pgherd-system", "pgherd-leader")
        assert lease["spec"]["holderIdentity"] == "second" and lease["spec"]["leaseTransitions"] >= 1


# -- RBAC: every request the operator makes is one the chart grants ------------------------------------


def find_helm() -> str | None:
    local = REPO / ".tools" / "bin" / "helm"
    return shutil.which("helm") or (str(local) if os.access(local, os.X_OK) else None)


def chart_rules(*values: str) -> list[dict[str, Any]]:
    helm = find_helm()
    if helm is None:
        pytest.fail("helm not found: run `make setup` (scripts/ensure-helm.sh)", pytrace=False)
    rendered = subprocess.run(
        [
            helm,
            "template",
            "pgherd",
            str(REPO / "charts" / "pgherd"),
            "--namespace",
            "pgherd-system",
            *values,
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    rules: list[dict[str, Any]] = []
    for doc in yaml.safe_load_all(rendered):
        if doc and doc["kind"] in ("ClusterRole", "Role"):
            rules += doc.get("rules") or []
    return rules


def test_every_request_is_granted_by_the_chart(kube_server: EmulatedApiServer) -> None:
    """The requests of the tests above (objects, status, events, annotation, election), checked against
    the rendered ClusterRole and the leader-election Role."""
    election = Election(namespace="pgherd-system", name="pgherd-leader", identity="solo")
    manifest = cluster_manifest(storage={"size": "1Gi", "deletePolicy": "Delete"})
    manifest["metadata"]["annotations"] = {names.ANNOTATION_SWITCHOVER: "hippo-9"}
    kube_server.create(manifest)
    kube_server.create(data_volume("hippo", "pgdata-hippo-0"))
    with running_operator(kube_server, election=election):
        eventually(lambda: kube_server.read("poddisruptionbudgets", NS, "hippo"), what="the PDB")
        kube_server.merge("postgresclusters", NS, "hippo", {"spec": {"instances": 1}})
        eventually(
            lambda: kube_server.read("poddisruptionbudgets", NS, "hippo") is None, what="the PDB to go"
        )
        kube_server.remove("postgresclusters", NS, "hippo")
        eventually(
            lambda: kube_server.read("postgresclusters", NS, "hippo") is None, timeout=30, what="deletion"
        )
    operator_calls = [c for c in kube_server.calls if c.user == "tester"]
    assert operator_calls, "no request recorded"
    assert any(c.resource == "persistentvolumeclaims" and c.verb == "delete" for c in operator_calls)
    denied = calls_not_allowed(operator_calls, chart_rules("--set", "watchNamespaces={apps}"))
    assert denied == [], "requests the chart does not grant:\n" + "\n".join(str(c.astuple()) for c in denied)
