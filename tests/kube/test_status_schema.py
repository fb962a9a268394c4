"""The status the operator writes against its model, every field typed.

The CRD keeps the items of the status's lists (conditions, members, certificates) as written, for the
API server's CPU at every write (crdgen._lean_lists): its pruning and validation of those items no
longer catch a wrong field. These tests do: every phase's document, as the Kubernetes adapter builds
it, holds nothing the model does not type (`status_problems`), and the e2e driver checks each status
it reads on a real cluster the same way (e2e/drivers/kube.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from engine.builders import down, settled
from pgherd.api.admission import status_problems
from pgherd.api.crdgen import all_crds
from pgherd.engine import decide
from pgherd.kube.status import cluster_status
from pgherd_backup.agent.wire import Status
from plugin.phases import ALL, IMAGE


def merged(patch: Any) -> Any:
    """What a JSON merge patch of `patch` onto nothing stores: a null in an object removes its key; a
    list is stored as it is, nulls in its items included."""
    if isinstance(patch, dict):
        return {key: merged(value) for key, value in patch.items() if value is not None}
    return patch


@pytest.mark.parametrize("phase", sorted(ALL))
def test_every_phase_document_fits_the_model(phase: str) -> None:
    status = ALL[phase]()["cluster"]["status"]
    assert status_problems(merged(status)) == []


def test_unknown_values_are_left_out_not_written_as_null() -> None:
    """An unreachable member has no LSN, lag or version; a certificate of yours no renewal: a typed
    schema pruned those nulls, the lean one would keep them, so the adapter leaves them out."""
    spec, view, engine = settled()
    view = replace(view, members=(view.members[0], down(view.members[1]), view.members[2]))
    decision = decide(spec, view, engine)
    certificates = [
        {"name": "server", "secret": "db-server", "notAfter": "2027-01-01T00:00:00Z", "renewAt": None}
    ]
    status = cluster_status(
        decision,
        view,
        {},
        image=IMAGE,
        statuses={"pg-0": Status(member="pg-0", cluster="pg", role="primary", server_version="16.4")},
        certificates=certificates,
    )
    assert status_problems(merged(status)) == []
    assert status["members"][0]["version"] == "16.4"
    assert status["members"][1] == {
        "name": "pg-1",
        "role": "unknown",
        "ready": False,
        "reachable": False,
        "timeline": 1,
    }
    assert status["certificates"] == [{k: v for k, v in certificates[0].items() if v is not None}]


def test_a_wrong_field_is_a_problem() -> None:
    """The check is not vacuous: what a typed schema refused or pruned, it names."""
    member = {"name": "db-0", "role": "leader", "ready": "yes", "lagBytes": None, "extra": 1}
    problems = {p.path for p in status_problems({"members": [member], "conditions": [{"type": "Ready"}]})}
    assert problems == {
        "status.members[0].role",
        "status.members[0].ready",
        "status.members[0].lagBytes",
        "status.members[0].extra",
        "status.conditions[0].status",
    }


def test_the_lean_lists_still_say_their_fields() -> None:
    """kubectl explain shows each list's fields in its description; the scale subresource's and the
    printer columns' fields keep their types."""
    crd = all_crds()["pgherd.io_postgresclusters.yaml"]
    status = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for name, fields in {
        "conditions": ("type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"),
        "members": ("name", "role", "ready", "reachable", "timeline", "version", "receivedLSN", "lagBytes"),
        "certificates": ("name", "secret", "notAfter", "renewAt"),
    }.items():
        assert status[name]["items"] == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        for field in fields:
            assert f"\n- {field} (" in status[name]["description"], (name, field)
    assert "primary, replica, unknown, fenced" in status["members"]["description"]
    assert {status[key]["type"] for key in ("instances", "readyInstances")} == {"integer"}
    assert status["selector"]["type"] == status["currentPrimary"]["type"] == "string"
    assert len(status["phase"]["enum"]) == 14


def test_the_api_server_keeps_the_status_as_written(kube, namespace) -> None:
    """On the real API server: the lean lists are stored as the operator writes them (the conditions an
    atomic list, so the managed fields no longer track each one's fields), the scale
    subresource still reads the status's typed fields, and the published OpenAPI (kubectl explain)
    names the members' fields."""
    from .test_operator import cluster_manifest

    kube.create(cluster_manifest(namespace))
    status = merged(ALL["Running"]()["cluster"]["status"])
    status["selector"] = "pgherd.io/cluster=hippo"
    written = kube.merge("postgresclusters", namespace, "hippo", {"status": status}, subresource="status")
    assert written["status"] == status
    assert written["metadata"]["managedFields"][-1]["fieldsV1"]["f:status"]["f:conditions"] == {}
    scale = kube.request("GET", kube.path("postgresclusters", namespace, "hippo", "scale"))
    assert scale["status"] == {"replicas": status["instances"], "selector": status["selector"]}
    openapi = kube.request("GET", "/openapi/v3/apis/pgherd.io/v1alpha1")
    schema = next(v for k, v in openapi["components"]["schemas"].items() if k.endswith(".PostgresCluster"))
    assert "- receivedLSN (string)" in schema["properties"]["status"]["properties"]["members"]["description"]
