"""`pgherd operator` in-process (kopf's KopfRunner) against the real API server (etcd, kube-apiserver and
the controller-manager's garbage collector: e2e/localkube/apiserver_only.py), as the chart's
ServiceAccount with the chart's RBAC, each test in its own namespace.

No node runs here (no kubelet, no StatefulSet controller): these tests cover what the operator does
through the API alone — the objects a cluster owns and their garbage collection, status, leader
election on a real Lease, the switchover annotation's refusal, scale, deletion, a spec the CRD accepts
and the operator refuses, a write the API server refuses, and that every request it makes is one the
chart's RBAC grants. What the operator sent is read from the API server's audit log.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from pgherd.kube import names
from pgherd.kube.api import KubeApi
from pgherd.kube.builders.common import cluster_owner
from pgherd.kube.loop import ClusterLoop, OperatorConfig

from .realkube import (
    ApiRefused,
    AuditLog,
    ChartIdentity,
    Kube,
    chart_election,
    not_granted,
    running_as,
    token_credential,
)
from .waiting import eventually

REPO = Path(__file__).resolve().parents[2]
JSON = dict[str, Any]


def cluster_manifest(ns: str, name: str = "hippo", instances: int = 3, **spec: Any) -> JSON:
    doc = yaml.safe_load((REPO / "examples" / "cluster-minimal.yaml").read_text())
    doc["metadata"] = {"name": name, "namespace": ns}
    doc["spec"]["instances"] = instances
    doc["spec"].update(spec)
    return dict(doc)


def cluster_with_status(kube: Kube, ns: str, key: str, what: str) -> JSON:
    """The cluster hippo once its status has ``key`` set."""
    return eventually(
        lambda: (c := kube.read("postgresclusters", ns, "hippo")) and (c.get("status") or {}).get(key) and c,
        what=what,
    )


def spec_observed(kube: Kube, ns: str, name: str = "hippo") -> JSON:
    """The cluster once its status.observedGeneration caught up with a spec changed since creation."""
    return eventually(
        lambda: (
            (c := kube.read("postgresclusters", ns, name))
            and (c.get("status") or {}).get("observedGeneration") == c["metadata"]["generation"] > 1
            and c
        ),
        what="observedGeneration to catch up",
    )


def owned_by(obj: JSON, uid: str) -> bool:
    return any(
        o.get("uid") == uid and o.get("controller") for o in obj["metadata"].get("ownerReferences") or []
    )


def cluster_in_phase(kube: Kube, ns: str, phase: str) -> JSON | None:
    cluster = kube.read("postgresclusters", ns, "hippo")
    return cluster if cluster and (cluster.get("status") or {}).get("phase") == phase else None


def phase_other_than(kube: Kube, ns: str, *phases: str) -> str | None:
    phase = ((kube.read("postgresclusters", ns, "hippo") or {}).get("status") or {}).get("phase")
    return phase if phase and phase not in phases else None


def absent(kube: Kube, resource: str, ns: str, name: str) -> Callable[[], bool]:
    return lambda: kube.read(resource, ns, name) is None


def events(kube: Kube, ns: str, keep: Callable[[JSON], bool]) -> list[JSON]:
    return [e for e in kube.items("events", ns) if keep(e)]


EXPECTED = {
    "statefulsets": ["hippo"],
    "services": ["hippo-rw", "hippo-ro", "hippo-r", "hippo-headless"],
    "secrets": ["hippo-superuser", "hippo-app", "hippo-replication", "hippo-agent", "hippo-operator"],
    "configmaps": ["hippo-config"],
    "serviceaccounts": ["hippo-postgres"],
    "poddisruptionbudgets": ["hippo"],
    "networkpolicies": ["hippo"],
}


def test_a_cluster_gets_its_objects_and_status(
    kube: Kube, namespace: str, chart_operator: ChartIdentity
) -> None:
    ns = namespace
    uid = kube.create(cluster_manifest(ns))["metadata"]["uid"]
    with running_as(chart_operator):
        cluster = cluster_with_status(kube, ns, "phase", "a status")
        for kind, wanted in EXPECTED.items():
            for name in wanted:
                obj = eventually(partial(kube.read, kind, ns, name), what=f"{kind}/{name}")
                assert owned_by(obj, uid), f"{kind}/{name} is not owned by the cluster"
                assert obj["metadata"]["labels"][names.LABEL_CLUSTER] == "hippo"
        # The engine's first action: the first member (StatefulSet replicas 0 -> 1), to be seeded by initdb.
        sts = eventually(
            lambda: (s := kube.read("statefulsets", ns, "hippo")) and s["spec"]["replicas"] == 1 and s,
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
        secret = kube.read("secrets", ns, "hippo-operator")
        assert secret is not None
    # Secrets are created once and never overwritten: a second operator reads them back.
    with running_as(chart_operator):
        time.sleep(1.0)
        again = kube.read("secrets", ns, "hippo-operator")
        assert again is not None and again["data"] == secret["data"]
        assert again["metadata"]["resourceVersion"] == secret["metadata"]["resourceVersion"]


def test_the_rw_service_selects_nothing_even_when_an_earlier_version_made_it_with_a_selector(
    kube: Kube, namespace: str, chart_operator: ChartIdentity
) -> None:
    """-rw routes through the slice the operator writes (tests/kube/test_rw_slice.py): a selector left by
    an earlier version would make Kubernetes' controller write a second slice beside it."""
    ns = namespace
    uid = kube.create(cluster_manifest(ns))["metadata"]["uid"]
    owner = cluster_owner("hippo", uid)  # as the operator made it: changing owners needs delete rights
    kube.create(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "hippo-rw", "namespace": ns, "ownerReferences": [owner]},
            "spec": {
                "selector": {names.LABEL_CLUSTER: "hippo", names.LABEL_ROLE: names.ROLE_PRIMARY},
                "ports": [{"name": "postgres", "port": 5432, "targetPort": "postgres"}],
            },
        }
    )
    with running_as(chart_operator):
        eventually(
            lambda: (
                "selector"
                not in ((kube.read("services", ns, "hippo-rw") or {}).get("spec") or {"selector": 1})
            ),
            what="the -rw Service without a selector",
        )
        # The same pass makes -ro and -r just after -rw (builders/services.py's order): a read at the
        # moment -rw changed may come before them (the clean-clone run of 2026-12-07 19:31 did).
        others = ("hippo-ro", "hippo-r", "hippo-headless")
        eventually(lambda: all(kube.read("services", ns, s) for s in others), what="the other Services")
    for service in others:
        found = kube.read("services", ns, service)
        assert found is not None and found["spec"]["selector"][names.LABEL_CLUSTER] == "hippo", found


def test_a_spec_change_is_observed(
    kube: Kube, namespace: str, chart_operator: ChartIdentity, audit: AuditLog
) -> None:
    ns, user = namespace, chart_operator.user
    kube.create(cluster_manifest(ns))
    with running_as(chart_operator):
        eventually(lambda: kube.read("poddisruptionbudgets", ns, "hippo"), what="the PDB")
        eventually(
            lambda: (kube.read("statefulsets", ns, "hippo") or {}).get("spec", {}).get("replicas"),
            what="the first member ordered",
        )
        time.sleep(0.5)
        # Settled, with no member to ask: ticks (every 0.2 s) cost no request at all.
        mark = audit.fence()
        time.sleep(1.0)
        audit.fence()
        idle = [e.short() for e in audit.of(user, mark) if e.verb != "watch"]
        assert not idle, idle
        mark = audit.fence()
        kube.merge(
            "postgresclusters", ns, "hippo", {"spec": {"instances": 5, "parameters": {"work_mem": "8MB"}}}
        )
        cluster = eventually(
            lambda: (
                (c := kube.read("postgresclusters", ns, "hippo"))
                and (c.get("status") or {}).get("observedGeneration") == c["metadata"]["generation"]
                and c["metadata"]["generation"] > 1
                and c
            ),
            what="observedGeneration to catch up",
        )
        assert cluster["spec"]["instances"] == 5
        eventually(
            lambda: "8MB" in str((kube.read("configmaps", ns, names.configmap("hippo")) or {}).get("data")),
            what="the parameters' ConfigMap",
        )
        pdb = kube.read("poddisruptionbudgets", ns, "hippo")
        assert pdb is not None and pdb["spec"]["minAvailable"] == "51%"  # a majority of the members
        assert pdb["spec"]["selector"]["matchLabels"][names.LABEL_CLUSTER] == "hippo"
        time.sleep(0.5)
        done = audit.of(user, mark)
        # What changed is patched, once: no create attempt answered 409 first.
        writes = [(e.verb, e.code) for e in done if e.resource == "configmaps"]
        assert writes == [("patch", 200)], writes
        # The budget, a percentage of the members, is the same at every size: not written.
        budget_writes = [(e.verb, e.code) for e in done if e.resource == "poddisruptionbudgets"]
        assert budget_writes == [], budget_writes
        # Nothing but the status is written to the cluster itself (kopf's diff-base annotation would be
        # one more write, and one more watch event, per spec change).
        own = [
            (e.verb, e.subresource)
            for e in done
            if e.resource == "postgresclusters" and e.verb not in ("watch", "get", "list")
        ]
        assert own and set(own) == {("patch", "status")}, own


def test_a_cluster_without_pods_ticks_at_the_idle_pace_and_its_spec_change_wakes_it(
    kube: Kube, namespace: str, chart_operator: ChartIdentity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No pod to ask (only the garbage collector runs here: no pod is made): the loop ticks every
    idle_interval (10 s) rather than every steady_interval, and a spec change still reaches the status at
    once, by its watch event."""
    ns = namespace
    ticks: list[float] = []
    tick = ClusterLoop.tick

    async def counted_tick(loop: ClusterLoop) -> None:
        ticks.append(time.monotonic())
        await tick(loop)

    monkeypatch.setattr(ClusterLoop, "tick", counted_tick)
    kube.create(cluster_manifest(ns))
    with running_as(chart_operator, config=OperatorConfig(steady_interval=0.2, busy_interval=0.1)):
        cluster_with_status(kube, ns, "observedGeneration", "the first status")
        time.sleep(1.0)
        settled = len(ticks)
        time.sleep(2.0)
        assert len(ticks) - settled <= 1, ticks  # 0.2 s apart, ten would have come
        changed = time.monotonic()
        kube.merge("postgresclusters", ns, "hippo", {"spec": {"instances": 5}})
        spec_observed(kube, ns)
        assert time.monotonic() - changed < 3.0  # woken by the watch, not by the 10 s timer


def test_a_one_instance_cluster_has_no_disruption_budget(
    kube: Kube, namespace: str, chart_operator: ChartIdentity
) -> None:
    ns = namespace
    kube.create(cluster_manifest(ns, instances=2))
    with running_as(chart_operator):
        eventually(lambda: kube.read("poddisruptionbudgets", ns, "hippo"), what="the PDB")
        kube.merge("postgresclusters", ns, "hippo", {"spec": {"instances": 1}})
        eventually(lambda: kube.read("poddisruptionbudgets", ns, "hippo") is None, what="the PDB to go")


def test_the_network_policy_follows_the_spec(
    kube: Kube, namespace: str, chart_operator: ChartIdentity
) -> None:
    """Created with the cluster (PostgreSQL open to anyone), narrowed to `clients`, deleted when disabled."""
    ns = namespace
    kube.create(cluster_manifest(ns, instances=1))
    with running_as(chart_operator):
        policy = eventually(lambda: kube.read("networkpolicies", ns, "hippo"), what="the NetworkPolicy")
        postgres = [r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == names.POSTGRES_PORT]
        assert postgres and "from" not in postgres[0], policy["spec"]
        clients = [{"namespaceSelector": {"matchLabels": {"team": "shop"}}}]
        kube.merge("postgresclusters", ns, "hippo", {"spec": {"networkPolicy": {"clients": clients}}})
        narrowed = eventually(
            lambda: (
                (p := kube.read("networkpolicies", ns, "hippo"))
                and any(r.get("from", [])[1:] == clients for r in p["spec"]["ingress"])
                and p
            ),
            what="the policy narrowed to the clients",
        )
        assert narrowed["metadata"]["uid"] == policy["metadata"]["uid"]  # patched, not made again
        kube.merge("postgresclusters", ns, "hippo", {"spec": {"networkPolicy": {"enabled": False}}})
        eventually(lambda: kube.read("networkpolicies", ns, "hippo") is None, what="the policy to go")


def test_an_unknown_switchover_target_is_refused_and_the_annotation_removed(
    kube: Kube, namespace: str, chart_operator: ChartIdentity
) -> None:
    ns = namespace
    manifest = cluster_manifest(ns)
    manifest["metadata"]["annotations"] = {names.ANNOTATION_SWITCHOVER: "hippo-9"}
    kube.create(manifest)
    with running_as(chart_operator):
        eventually(
            lambda: (
                names.ANNOTATION_SWITCHOVER
                not in (
                    (kube.read("postgresclusters", ns, "hippo") or {})["metadata"].get("annotations") or {}
                )
            ),
            what="the annotation to be removed",
        )
        found = eventually(
            lambda: events(kube, ns, lambda e: e.get("reason") == "Switchover"), what="a Switchover event"
        )
        assert found[0]["type"] == "Warning" and "hippo-9" in found[0]["note"]
        assert found[0]["regarding"]["name"] == "hippo"


def test_deleting_a_cluster_runs_the_finalizer_and_the_garbage_collector_removes_what_it_owned(
    kube: Kube, namespace: str, chart_operator: ChartIdentity
) -> None:
    ns = namespace
    kube.create(cluster_manifest(ns))
    with running_as(chart_operator):
        eventually(lambda: kube.read("statefulsets", ns, "hippo"), what="the StatefulSet")
        eventually(lambda: kube.read("services", ns, "hippo-rw"), what="the Services")
        kube.remove("postgresclusters", ns, "hippo")
        eventually(lambda: kube.read("postgresclusters", ns, "hippo") is None, timeout=30, what="deletion")
    # The controller-manager's garbage collector removes what the cluster owned (its ownerReferences).
    for kind, wanted in EXPECTED.items():
        for name in wanted:
            eventually(absent(kube, kind, ns, name), what=f"{kind}/{name} to go")


def data_volume(ns: str, cluster: str, name: str) -> JSON:
    """A PVC as the StatefulSet controller makes it from the claim template (labelled with the cluster)."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "namespace": ns, "labels": {names.LABEL_CLUSTER: cluster}},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
    }


def test_deleting_a_cluster_keeps_its_volumes_unless_its_delete_policy_says_delete(
    kube: Kube, namespace: str, chart_operator: ChartIdentity
) -> None:
    ns = namespace
    kube.create(cluster_manifest(ns, name="keep"))
    kube.create(cluster_manifest(ns, name="drop", storage={"size": "1Gi", "deletePolicy": "Delete"}))
    volumes = {
        "keep": ["pgdata-keep-0", "pgdata-keep-1"],
        "drop": ["pgdata-drop-0", "pgdata-drop-1", "notes-drop"],  # the last is not a member's volume
    }
    for cluster, claims in volumes.items():
        for claim in claims:
            made = kube.create(data_volume(ns, cluster, claim))
            # Kubernetes' own protection: a claim goes only once no pod uses it (nothing here).
            assert made["metadata"]["finalizers"] == ["kubernetes.io/pvc-protection"]
    with running_as(chart_operator):
        for cluster in volumes:
            eventually(partial(kube.read, "statefulsets", ns, cluster), what=f"{cluster}'s StatefulSet")
        for cluster in volumes:
            kube.remove("postgresclusters", ns, cluster)
        for cluster in volumes:
            eventually(absent(kube, "postgresclusters", ns, cluster), timeout=30, what="deletion")
    # The PVC protection controller lets the deleted claims go: none is used by a pod.
    eventually(
        lambda: (
            {p["metadata"]["name"] for p in kube.items("persistentvolumeclaims", ns)}
            == {"pgdata-keep-0", "pgdata-keep-1", "notes-drop"}
        ),
        what="only the member volumes of `drop` to go",
    )


# A spec the CRD accepts and the operator's model refuses. The CRD's patterns are evaluated by the API
# server's Go regexp (RE2), where \s is ASCII whitespace ([\t\n\f\r ]); the operator's pydantic models
# evaluate the same patterns with Rust's regex, where \s is Unicode whitespace. An S3 endpoint holding a
# no-break space (U+00A0) matches `^https?://[^\s/]+(/.*)?$` on the API server, not in the operator.
UNREADABLE_ENDPOINT = "http://minio\u00a0.example:9000"


def store(endpoint: str) -> JSON:
    return {"s3": {"bucket": "pgherd", "endpoint": endpoint, "credentials": {"secretName": "s3-keys"}}}


def test_a_spec_the_crd_accepts_and_the_operator_refuses_gets_a_condition_and_an_event(
    kube: Kube, namespace: str, chart_operator: ChartIdentity
) -> None:
    ns = namespace
    # What the schema forbids (instances beyond 15) the API server itself refuses, with its message.
    try:
        kube.create(cluster_manifest(ns, name="too-big", instances=40))
        raise AssertionError("instances 40 was accepted")
    except ApiRefused as refused:
        assert refused.status == 422
        assert (
            "spec.instances: Invalid value: 40: spec.instances in body should be less than or equal to 15"
            in str(refused)
        )
    kube.create(cluster_manifest(ns, backup={"store": store(UNREADABLE_ENDPOINT)}))  # accepted
    with running_as(chart_operator):
        cluster = eventually(lambda: cluster_in_phase(kube, ns, "Failed"), what="phase Failed")
        ready = next(c for c in cluster["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "False" and ready["reason"] == "InvalidSpec"
        assert "spec.backup.store.s3.endpoint" in ready["message"]
        eventually(
            lambda: events(kube, ns, lambda e: "spec.backup.store.s3.endpoint" in (e.get("note") or "")),
            what="an Event naming the field",
        )
        time.sleep(0.5)
        assert kube.read("statefulsets", ns, "hippo") is None  # nothing acted on a bad spec
        # Corrected, the cluster is built; spoiled again and put back as it was, the Failed status
        # written meanwhile is replaced (the decision is the same as before the failure).
        good = {"spec": {"backup": {"store": store("http://minio.example:9000")}}}
        bad = {"spec": {"backup": {"store": store(UNREADABLE_ENDPOINT)}}}
        kube.merge("postgresclusters", ns, "hippo", good)
        eventually(lambda: phase_other_than(kube, ns, "Failed"), what="the phase to leave Failed")
        eventually(lambda: kube.read("statefulsets", ns, "hippo"), what="the StatefulSet")
        time.sleep(0.5)
        kube.merge("postgresclusters", ns, "hippo", bad)
        eventually(lambda: phase_other_than(kube, ns, "Creating", "Pending"), what="phase Failed again")
        assert cluster_in_phase(kube, ns, "Failed")
        kube.merge("postgresclusters", ns, "hippo", good)
        eventually(lambda: phase_other_than(kube, ns, "Failed"), what="the phase to leave Failed again")


REFUSAL = "refused by the test's admission policy"


def refuse_configmap_updates(kube: Kube, ns: str) -> Callable[[], None]:
    """A ValidatingAdmissionPolicy (CEL, admissionregistration.k8s.io/v1) and its binding: every
    update (a PATCH is one) of a ConfigMap in `ns` is refused, 422 with REFUSAL, by the API server's own
    admission. Returns what removes them."""
    name = f"refuse-configmap-updates-{ns}"
    kube.create(
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["UPDATE"],
                            "resources": ["configmaps"],
                        }
                    ]
                },
                "validations": [{"expression": "false", "message": REFUSAL}],
            },
        }
    )
    kube.create(
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": {
                "policyName": name,
                "validationActions": ["Deny"],
                "matchResources": {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}},
            },
        }
    )

    def lift() -> None:
        kube.remove("validatingadmissionpolicybindings", None, name)
        kube.remove("validatingadmissionpolicies", None, name)

    return lift


def refused_now(kube: Kube, ns: str) -> bool:
    """Whether a (dry-run) update of the cluster's ConfigMap is refused by the policy at this moment: the
    API server applies a new policy, and its removal, from its informers, a moment after they are written."""
    try:
        kube.merge(
            "configmaps", ns, names.configmap("hippo"), {"metadata": {"labels": {"probe": "x"}}}, dry_run=True
        )
    except ApiRefused as exc:
        if exc.status == 422 and REFUSAL in str(exc):
            return True
        raise
    return False


def test_a_refused_object_write_fails_the_cluster_until_it_passes(
    kube: Kube, namespace: str, chart_operator: ChartIdentity, audit: AuditLog
) -> None:
    """The API server refuses a write of an owned object (here: every ConfigMap update, by an admission
    policy): a condition and an Event say so, nothing else is done meanwhile; once writes pass
    again the status says what the engine decided, even though that decision was written before the
    failure."""
    ns = namespace
    kube.create(cluster_manifest(ns))
    with running_as(chart_operator):
        eventually(lambda: phase_other_than(kube, ns, "Failed"), what="a first status")
        eventually(lambda: kube.read("statefulsets", ns, "hippo"), what="the StatefulSet")
        eventually(lambda: kube.read("configmaps", ns, names.configmap("hippo")), what="the ConfigMap")
        lift = refuse_configmap_updates(kube, ns)
        try:
            eventually(lambda: refused_now(kube, ns), what="the policy in force")
            kube.merge(
                "postgresclusters", ns, "hippo", {"spec": {"instances": 5, "parameters": {"work_mem": "8MB"}}}
            )
            cluster = eventually(lambda: cluster_in_phase(kube, ns, "Failed"), what="phase Failed")
            ready = next(c for c in cluster["status"]["conditions"] if c["type"] == "Ready")
            assert ready["reason"] == "ObjectsFailed" and REFUSAL in ready["message"], ready
            eventually(
                lambda: events(kube, ns, lambda e: REFUSAL in (e.get("note") or "")),
                what="an Event with the refusal",
            )
            sts = kube.read("statefulsets", ns, "hippo")
            assert sts is not None and sts["spec"]["replicas"] == 1  # nothing else done meanwhile
            # While the writes are refused, Failed stands: the status is not written again at every
            # tick (the engine's phase, then Failed: a flap readers would see), and reads see Failed.
            mark = audit.fence()
            phases = []
            for _ in range(12):  # about 3 s: several ticks at the busy interval
                phases.append(
                    ((kube.read("postgresclusters", ns, "hippo") or {}).get("status") or {}).get("phase")
                )
                time.sleep(0.25)
            audit.fence()
            writes = [
                e
                for e in audit.of(chart_operator.user, since=mark)
                if e.resource == "postgresclusters" and e.subresource == "status" and e.verb == "patch"
            ]
            assert set(phases) == {"Failed"} and writes == [], (phases, [w.short() for w in writes])
        finally:
            lift()
        eventually(lambda: not refused_now(kube, ns), what="the policy lifted")
        eventually(lambda: phase_other_than(kube, ns, "Failed"), what="the phase to leave Failed")
        eventually(
            lambda: "8MB" in str((kube.read("configmaps", ns, names.configmap("hippo")) or {}).get("data")),
            what="the ConfigMap with the new parameters",
        )
    audit.fence()
    refused = [e for e in audit.of(chart_operator.user) if e.resource == "configmaps" and e.code == 422]
    assert refused and all(e.verb == "patch" and REFUSAL in e.message for e in refused)


def test_leader_election_only_one_acts_and_the_other_takes_over(
    kube: Kube, namespace: str, chart_operator: ChartIdentity, audit: AuditLog
) -> None:
    """Two replicas of the chart's operator (one ServiceAccount, a token each: the audit log tells their
    requests apart by the token's credential id) on the Lease the chart names. Only the Lease holder
    writes the cluster's objects; when it stops, the other takes over within the lease duration."""
    ns, identity = namespace, chart_operator
    timing = {"lease_duration": 2.0, "renew_deadline": 1.5, "retry": 0.2}
    first_token, second_token = identity.token, identity.new_token()
    second_credential = token_credential(second_token)
    first = chart_election(identity, "first", **timing)
    second = chart_election(identity, "second", **timing)
    kube.create(cluster_manifest(ns))
    with running_as(identity, election=first, token=first_token) as one:
        eventually(lambda: one.holding(), what="the first to lead")
        with running_as(identity, election=second, token=second_token) as two:
            eventually(lambda: kube.read("statefulsets", ns, "hippo"), what="the StatefulSet")
            time.sleep(1.0)
            assert one.holding() and not two.holding()
            audit.fence()
            by_second = audit.of(identity.user, credential=second_credential)
            assert any(e.resource == "leases" and e.verb == "get" for e in by_second), (
                "the second never looked"
            )
            writes = [e.short() for e in by_second if e.write]
            assert writes == [], writes
            lease = kube.read("leases", identity.namespace, identity.lease)
            assert lease is not None and lease["spec"]["holderIdentity"] == "first"
    kube.create(cluster_manifest(ns, name="second-cluster"))
    with running_as(identity, election=second, token=second_token) as two:
        eventually(lambda: two.holding(), timeout=10, what="the second to take over")
        eventually(lambda: kube.read("statefulsets", ns, "second-cluster"), what="the second to act")
        lease = kube.read("leases", identity.namespace, identity.lease)
        assert lease is not None
        assert lease["spec"]["holderIdentity"] == "second" and lease["spec"]["leaseTransitions"] >= 1
    audit.fence()
    taken = [
        e
        for e in audit.of(identity.user, credential=second_credential)
        if e.resource == "leases" and e.verb == "update" and e.code == 200
    ]
    assert taken, "the second never wrote the Lease"


# -- RBAC: every request the operator makes is one the chart grants, read from the audit log ----------


def exercise(kube: Kube, ns: str, identity: ChartIdentity) -> None:
    """What the operator does in the tests above, in one run: objects, status, events, the switchover
    annotation, scale-down (a PDB deleted), the network policy disabled (deleted), deletion with its
    volumes (deletePolicy Delete), on the Lease the chart names."""
    manifest = cluster_manifest(ns, storage={"size": "1Gi", "deletePolicy": "Delete"})
    manifest["metadata"]["annotations"] = {names.ANNOTATION_SWITCHOVER: "hippo-9"}
    kube.create(manifest)
    kube.create(data_volume(ns, "hippo", "pgdata-hippo-0"))
    # Renewed every 0.2 s: the Lease's update is exercised too.
    election = chart_election(identity, "solo", lease_duration=2.0, renew_deadline=1.5, retry=0.2)
    with running_as(identity, election=election):
        eventually(lambda: phase_other_than(kube, ns, "Failed"), what="a status")
        eventually(lambda: kube.read("poddisruptionbudgets", ns, "hippo"), what="the PDB")
        kube.merge("postgresclusters", ns, "hippo", {"spec": {"instances": 1}})
        eventually(lambda: kube.read("poddisruptionbudgets", ns, "hippo") is None, what="the PDB to go")
        kube.merge("postgresclusters", ns, "hippo", {"spec": {"networkPolicy": {"enabled": False}}})
        eventually(lambda: kube.read("networkpolicies", ns, "hippo") is None, what="the policy to go")
        kube.remove("postgresclusters", ns, "hippo")
        eventually(lambda: kube.read("postgresclusters", ns, "hippo") is None, timeout=30, what="deletion")


def rbac_problems(audit: AuditLog, identity: ChartIdentity) -> tuple[list[str], list[str]]:
    """(the requests of the identity the API server refused with 403, those the chart's rules do not
    grant), from the audit log."""
    audit.fence()
    done = audit.of(identity.user)
    refused = sorted({e.short() for e in done if e.code == 403})
    ungranted = sorted({e.short() for e in not_granted(done, identity.rules)})
    return refused, ungranted


def test_every_request_is_granted_by_the_chart(
    kube: Kube, namespace: str, chart_operator: ChartIdentity, audit: AuditLog
) -> None:
    exercise(kube, namespace, chart_operator)
    refused, ungranted = rbac_problems(audit, chart_operator)
    used = {(e.verb, e.rbac_resource) for e in audit.of(chart_operator.user)}
    # The run did exercise the rules that matter (else the check below proves little).
    for wanted in [
        ("create", "statefulsets"),
        ("patch", "postgresclusters/status"),
        ("patch", "postgresclusters"),
        ("delete", "poddisruptionbudgets"),
        ("delete", "networkpolicies"),
        ("delete", "persistentvolumeclaims"),
        ("create", "events"),
        ("create", "leases"),
        ("update", "leases"),
        ("watch", "postgresclusters"),
    ]:
        assert wanted in used, f"{wanted} not exercised; used: {sorted(used)}"
    assert refused == [], refused
    assert ungranted == [], "requests the chart's rules do not grant:\n" + "\n".join(ungranted)


def test_without_the_finalizers_right_admission_refuses_the_owned_objects(
    kube: Kube, namespace: str, chart_operator_factory: Callable[..., ChartIdentity], audit: AuditLog
) -> None:
    """The one right of the chart that no request uses: with OwnerReferencesPermissionEnforcement on (as
    here, and on OpenShift), an owner reference with blockOwnerDeletion needs `update` of the owner's
    finalizers. Without it the API server's admission refuses every object the operator makes."""

    def without_finalizers(docs: list[JSON]) -> None:
        for role in (d for d in docs if d["kind"] in ("ClusterRole", "Role")):
            role["rules"] = [r for r in role["rules"] if "postgresclusters/finalizers" not in r["resources"]]

    identity = chart_operator_factory(edit=without_finalizers, refusals=True)
    ns = namespace
    kube.create(cluster_manifest(ns))
    with running_as(identity):
        eventually(lambda: cluster_in_phase(kube, ns, "Failed"), what="phase Failed")
    audit.fence()
    refused = [e for e in audit.of(identity.user) if e.verb == "create" and e.code == 403]
    assert refused, "no create was refused"
    assert all("cannot set blockOwnerDeletion" in e.message for e in refused), [e.message for e in refused]


def test_a_rule_taken_from_the_chart_shows_as_refused_requests(
    kube: Kube, namespace: str, chart_operator_factory: Callable[..., ChartIdentity], audit: AuditLog
) -> None:
    """The check above can fail: without the chart's rule on PodDisruptionBudgets, the API server
    refuses the operator's requests on them (403 in the audit log), and the static check finds them
    ungranted; the cluster reports the failure."""

    def without_budgets(docs: list[JSON]) -> None:
        # The Role of the watched namespace (watchNamespaces set: Roles by default) holds the rules.
        for role in (d for d in docs if d["kind"] in ("ClusterRole", "Role")):
            role["rules"] = [r for r in role["rules"] if "poddisruptionbudgets" not in r["resources"]]

    identity = chart_operator_factory(edit=without_budgets, refusals=True)
    ns = namespace
    kube.create(cluster_manifest(ns))
    with running_as(identity):
        cluster = eventually(lambda: cluster_in_phase(kube, ns, "Failed"), what="phase Failed")
        ready = next(c for c in cluster["status"]["conditions"] if c["type"] == "Ready")
        assert ready["reason"] == "ObjectsFailed" and "poddisruptionbudgets" in ready["message"], ready
    refused, ungranted = rbac_problems(audit, identity)
    assert refused and all(
        "policy/poddisruptionbudgets" in line and line.endswith("-> 403") for line in refused
    )
    assert any(
        line.startswith(("get policy/poddisruptionbudgets", "create policy/poddisruptionbudgets"))
        for line in refused
    )
    assert ungranted and all("policy/poddisruptionbudgets" in line for line in ungranted), ungranted


def test_the_first_ticks_wait_for_each_other_up_to_the_request_pool(
    kube: Kube, namespace: str, chart_operator: ChartIdentity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At startup every cluster's first tick (the cluster read afresh, its Secrets and objects made) would
    run at once and wait for one of the API connections (2,000 clusters: ticks failed waiting for a
    pooled connection, each holding what it had built); at most `api_pool` of them run at a time, and
    every cluster still gets its objects and status."""
    ns = namespace
    clusters = [f"c{i}" for i in range(6)]
    for name in clusters:
        kube.create(cluster_manifest(ns, name, instances=1))
    starting: list[int] = [0]
    most: list[int] = [0]
    tick = ClusterLoop.tick

    async def counted_tick(loop: ClusterLoop) -> None:
        first = loop.engine is None
        starting[0] += first
        most[0] = max(most[0], starting[0])
        try:
            await tick(loop)
        finally:
            starting[0] -= first

    monkeypatch.setattr(ClusterLoop, "tick", counted_tick)
    config = OperatorConfig(steady_interval=0.2, busy_interval=0.1, api_pool=2)
    with running_as(chart_operator, config=config) as operator:
        for name in clusters:
            eventually(
                lambda name=name: ((kube.read("postgresclusters", ns, name) or {}).get("status") or {}).get(
                    "observedGeneration"
                ),
                what=f"{name}'s status",
            )
            eventually(lambda name=name: kube.read("statefulsets", ns, name), what=f"{name}'s StatefulSet")
        assert operator.api is not None and operator.api.pool == 2
    assert most[0] == 2, most


def test_a_loop_keeps_no_write_history(kube: Kube, namespace: str, chart_operator: ChartIdentity) -> None:
    """What stays in memory for each of thousands of clusters leaves out metadata.managedFields: the
    cluster's body kopf keeps for its loop (half of it: every status patch's fields; its status, which
    the loop keeps as it wrote it, is dropped too); once the certificate check settles, neither the
    agents' Secret nor its decoded values are kept (read again when the check is due)."""
    ns = namespace
    kube.create(cluster_manifest(ns, instances=1))
    with running_as(chart_operator) as operator:
        cluster = cluster_with_status(kube, ns, "certificates", "status.certificates")
        assert cluster["metadata"].get("managedFields")  # the API server keeps it
        loop = operator.loops[(ns, "hippo")]
        eventually(lambda: "managedFields" not in loop.body()["metadata"], what="the body without them")
        assert loop.body()["spec"]["instances"] == 1
        # Nor the status the watch brought: the loop keeps the one it read and wrote.
        assert "status" not in loop.body()
        assert loop.status_doc is not None and loop.status_doc["certificates"]
        secret = loop.owned._agent_secret
        assert secret is not None and "data" not in secret and "managedFields" not in secret["metadata"]
        assert loop.owned._decoded is None


def test_a_settled_tick_builds_no_status_document_until_an_input_changes(
    kube: Kube, namespace: str, chart_operator: ChartIdentity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A settled loop's tick (the engine's decision, the members, the certificates and the stored status
    as they were) reuses the status compared last: no document is built or compared at every tick of
    thousands of clusters. A spec change is still written, and its metrics follow."""
    from pgherd.kube import loop as loop_module
    from pgherd.kube import metrics

    ns = namespace
    kube.create(cluster_manifest(ns, instances=3))
    built: list[int] = [0]
    build = loop_module.cluster_status

    def counted(*args: Any, **kwargs: Any) -> JSON:
        built[0] += 1
        return build(*args, **kwargs)

    def ticks_done() -> float:
        return metrics.REGISTRY.get_sample_value("pgherd_reconcile_duration_seconds_count") or 0.0

    monkeypatch.setattr(loop_module, "cluster_status", counted)
    patch = KubeApi.patch

    async def answered_late(self: KubeApi, *args: Any, **kwargs: Any) -> JSON:
        # The status write's answer comes a moment after the API server stored it, as on a loaded
        # machine (a CI run once read the operator's own record of it in between).
        done = await patch(self, *args, **kwargs)
        if kwargs.get("subresource") == "status":
            await asyncio.sleep(0.3)
        return done

    monkeypatch.setattr(KubeApi, "patch", answered_late)
    with running_as(chart_operator) as operator:
        eventually(
            lambda: (kube.read("statefulsets", ns, "hippo") or {}).get("spec", {}).get("replicas"),
            what="the first member ordered",
        )
        cluster_with_status(kube, ns, "certificates", "status.certificates")
        time.sleep(0.5)
        before, ticks = built[0], ticks_done()
        time.sleep(1.0)  # ticks every 0.2 s
        assert ticks_done() >= ticks + 3
        assert built[0] == before, built
        figures = metrics.CLUSTERS.figures(ns, "hippo")
        assert figures.phase
        kube.merge("postgresclusters", ns, "hippo", {"spec": {"instances": 5}})
        spec_observed(kube, ns)
        assert built[0] > before
        loop = operator.loops[(ns, "hippo")]

        def recorded() -> bool:
            # The operator keeps what it wrote once the answer is in, and its figures after that: the
            # API server shows the write first.
            doc = loop.status_doc
            if doc is None or doc.get("observedGeneration") != 2:
                return False
            return figures.conditions == {c["type"]: c["status"] == "True" for c in doc["conditions"]}

        eventually(recorded, timeout=5, what="the written status kept by the loop, and its figures")
