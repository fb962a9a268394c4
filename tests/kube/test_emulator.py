"""The emulated API server (tests/kube/emulator.py) through real HTTP: the official kubernetes client,
raw requests, an aiohttp client in the emulator's own loop, kubectl, and a kopf operator."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import kopf.testing
import kubernetes.client
import kubernetes.dynamic
import kubernetes.watch
import pytest
import yaml
from kubernetes.client.exceptions import ApiException

from .conftest import TOKEN, USER
from .emulator import (
    CRDS_DIR,
    REPO,
    ApiCall,
    ApiError,
    EmulatedApiServer,
    KubeEmulator,
    calls_not_allowed,
    kopf_connection,
    parse_label_selector,
)

GROUP, VERSION, PLURAL = "pgherd.io", "v1alpha1", "postgresclusters"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC = "application/strategic-merge-patch+json"


def cluster(name: str = "hippo", instances: int = 3, **metadata: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "PostgresCluster",
        "metadata": {"name": name, **metadata},
        "spec": {"instances": instances, "postgresVersion": 16, "storage": {"size": "1Gi"}},
    }


def http(
    server: EmulatedApiServer,
    method: str,
    path: str,
    body: Any = None,
    content_type: str = "application/json",
    token: str | None = TOKEN,
    timeout: float = 10,
) -> tuple[int, Any]:
    """A raw request: (HTTP status, decoded JSON body)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(server.url + path, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", content_type)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def pgc_path(name: str = "", namespace: str = "default", sub: str = "") -> str:
    path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    return path + (f"/{name}" if name else "") + (f"/{sub}" if sub else "")


def cm_path(name: str = "", namespace: str = "default") -> str:
    return f"/api/v1/namespaces/{namespace}/configmaps" + (f"/{name}" if name else "")


def configmap(name: str, labels: dict[str, str] | None = None, **data: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "labels": labels or {}},
        "data": data,
    }


# --------------------------------------------------------------------------------------------------
# Create, read, update.


def test_create_answers_201_with_server_metadata(kube_api_client: Any) -> None:
    core = kubernetes.client.CoreV1Api(kube_api_client)
    first, code, _ = core.create_namespaced_config_map_with_http_info("default", configmap("one", a="1"))
    second = core.create_namespaced_config_map("default", configmap("two"))
    assert code == 201
    meta = first.metadata
    assert meta.uid and meta.creation_timestamp is not None and meta.generation == 1
    assert int(second.metadata.resource_version) > int(meta.resource_version)
    assert isinstance(meta.resource_version, str)
    assert core.read_namespaced_config_map("one", "default").data == {"a": "1"}


def test_generate_name_duplicates_and_missing_objects(kube_server: EmulatedApiServer) -> None:
    status, made = http(kube_server, "POST", cm_path(), {"metadata": {"generateName": "gen-"}})
    assert (
        status == 201 and made["metadata"]["name"].startswith("gen-") and len(made["metadata"]["name"]) == 9
    )
    assert made["apiVersion"] == "v1" and made["kind"] == "ConfigMap"
    status, body = http(kube_server, "POST", cm_path(), configmap("dup"))
    assert status == 201
    status, body = http(kube_server, "POST", cm_path(), configmap("dup"))
    assert (status, body["reason"], body["details"]["name"]) == (409, "AlreadyExists", "dup")
    assert body["message"] == 'configmaps "dup" already exists'
    status, body = http(kube_server, "GET", pgc_path("nothing"))
    assert (status, body["reason"], body["message"]) == (
        404,
        "NotFound",
        'postgresclusters.pgherd.io "nothing" not found',
    )
    status, body = http(kube_server, "POST", cm_path(namespace="absent"), configmap("x"))
    assert (status, body["message"]) == (404, 'namespaces "absent" not found')


@pytest.mark.parametrize(
    ("metadata", "field"),
    [
        ({}, "metadata.name"),
        ({"name": "Not_A_Name"}, "metadata.name"),
        ({"name": "a" * 254}, "metadata.name"),
        ({"name": "ok", "labels": {"bad key!": "x"}}, "metadata.labels"),
        ({"name": "ok", "labels": {"k": "not a value"}}, "metadata.labels.k"),
    ],
)
def test_invalid_names_and_labels_answer_422(
    kube_server: EmulatedApiServer, metadata: dict[str, Any], field: str
) -> None:
    status, body = http(kube_server, "POST", cm_path(), {"metadata": metadata})
    assert (status, body["reason"]) == (422, "Invalid")
    assert body["details"]["causes"][0]["field"] == field
    assert "is invalid" in body["message"]


def test_generation_follows_spec_and_resource_version_every_change(kube_server: EmulatedApiServer) -> None:
    _, created = http(kube_server, "POST", pgc_path(), cluster())
    rv = int(created["metadata"]["resourceVersion"])
    _, labelled = http(kube_server, "PATCH", pgc_path("hippo"), {"metadata": {"labels": {"a": "b"}}}, MERGE)
    assert labelled["metadata"]["generation"] == 1 and int(labelled["metadata"]["resourceVersion"]) > rv
    _, same = http(kube_server, "PATCH", pgc_path("hippo"), {"metadata": {"labels": {"a": "b"}}}, MERGE)
    assert same["metadata"]["resourceVersion"] == labelled["metadata"]["resourceVersion"]  # a no-op
    _, scaled = http(kube_server, "PATCH", pgc_path("hippo"), {"spec": {"instances": 5}}, MERGE)
    assert scaled["metadata"]["generation"] == 2
    _, status = http(
        kube_server, "PATCH", pgc_path("hippo", sub="status"), {"status": {"phase": "Running"}}, MERGE
    )
    assert status["metadata"]["generation"] == 2
    assert int(status["metadata"]["resourceVersion"]) > int(scaled["metadata"]["resourceVersion"])
    assert scaled["spec"]["failover"] == {"enabled": True, "detectionSeconds": 5}  # the CRD's defaults


def test_merge_json_and_strategic_patches(kube_server: EmulatedApiServer) -> None:
    http(kube_server, "POST", cm_path(), configmap("p", a="1", b="2"))
    _, merged = http(kube_server, "PATCH", cm_path("p"), {"data": {"a": None, "c": "3"}}, MERGE)
    assert merged["data"] == {"b": "2", "c": "3"}
    _, strategic = http(
        kube_server, "PATCH", cm_path("p"), {"data": {"d": "4"}, "$patch": "merge"}, STRATEGIC
    )
    assert strategic["data"] == {"b": "2", "c": "3", "d": "4"} and "$patch" not in strategic
    rv = strategic["metadata"]["resourceVersion"]
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "remove", "path": "/data/b"},
        {"op": "add", "path": "/data/e", "value": "5"},
    ]
    status, patched = http(kube_server, "PATCH", cm_path("p"), ops, JSON_PATCH)
    assert status == 200 and patched["data"] == {"c": "3", "d": "4", "e": "5"}
    status, body = http(kube_server, "PATCH", cm_path("p"), ops, JSON_PATCH)  # the test op fails now
    assert (status, body["reason"]) == (422, "Invalid")
    http(kube_server, "POST", pgc_path(), cluster())
    status, body = http(kube_server, "PATCH", pgc_path("hippo"), {"spec": {"instances": 5}}, STRATEGIC)
    assert status == 415  # as on a real server: no strategic merge patch for custom resources
    status, body = http(kube_server, "PATCH", pgc_path("hippo"), {"spec": {}}, "application/apply-patch+yaml")
    assert status == 415


def test_replace_with_a_stale_resource_version_conflicts(kube_api_client: Any) -> None:
    custom = kubernetes.client.CustomObjectsApi(kube_api_client)
    created = custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, cluster())
    fresh = dict(created, spec={**created["spec"], "instances": 5})
    replaced = custom.replace_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "hippo", fresh)
    assert replaced["spec"]["instances"] == 5 and replaced["metadata"]["generation"] == 2
    with pytest.raises(ApiException) as stale:
        custom.replace_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "hippo", fresh)
    assert stale.value.status == 409 and json.loads(stale.value.body)["reason"] == "Conflict"
    unconditional = dict(replaced, metadata={"name": "hippo"})
    with pytest.raises(ApiException) as missing:
        custom.replace_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "hippo", unconditional)
    assert missing.value.status == 422


def test_status_subresource(kube_api_client: Any, kube_server: EmulatedApiServer) -> None:
    custom = kubernetes.client.CustomObjectsApi(kube_api_client)
    created = custom.create_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, {**cluster(), "status": {"phase": "Forged"}}
    )
    assert "status" not in created  # create drops the status
    patched = custom.patch_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, "hippo", {"spec": {"instances": 4}, "status": {"phase": "Ignored"}}
    )
    assert patched["spec"]["instances"] == 4 and "status" not in patched
    status = custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, "default", PLURAL, "hippo", {"spec": {"instances": 9}, "status": {"phase": "Running"}}
    )
    assert status["status"] == {"phase": "Running"} and status["spec"]["instances"] == 4
    read = custom.get_namespaced_custom_object_status(GROUP, VERSION, "default", PLURAL, "hippo")
    assert read["status"]["phase"] == "Running"
    _, pod = http(
        kube_server, "POST", "/api/v1/namespaces/default/pods", {"metadata": {"name": "p"}, "spec": {}}
    )
    assert pod["status"] == {"phase": "Pending"}
    _, running = http(
        kube_server,
        "PATCH",
        "/api/v1/namespaces/default/pods/p/status",
        {"status": {"phase": "Running"}},
        MERGE,
    )
    assert running["status"]["phase"] == "Running"


def test_status_writes_follow_the_crd_schema(kube_server: EmulatedApiServer) -> None:
    """As a real API server: a status of the wrong type, or without a required field, answers 422 naming
    the field; fields the schema does not know, and nulls where it allows none, are pruned (silently:
    read back, they are gone); defaults are filled in."""
    kube_server.create(cluster("typed"))

    def write(status: dict[str, Any]) -> dict[str, Any]:
        return kube_server.merge(
            "postgresclusters", "default", "typed", {"status": status}, subresource="status"
        )

    for bad, field in (
        ({"phase": "Running", "readyInstances": "three"}, "status.readyInstances"),
        ({"members": [{"role": "primary"}]}, "status.members[0].name"),
        ({"members": [{"name": "typed-0", "role": "leader"}]}, "status.members[0].role"),
        ({"lastSuccessfulBackup": {"name": "b"}}, "status.lastSuccessfulBackup"),
    ):
        with pytest.raises(ApiError) as refused:
            write(bad)
        assert refused.value.code == 422 and field in refused.value.message, refused.value.message
    assert "status" not in (kube_server.read("postgresclusters", "default", "typed") or {})
    stored = write({"phase": "Running", "inventedField": 1, "members": [{"name": "typed-0", "bogus": 2}]})
    assert stored["status"]["phase"] == "Running" and "inventedField" not in stored["status"]
    assert stored["status"]["members"] == [
        {"name": "typed-0", "role": "unknown", "ready": False, "reachable": False}
    ]
    # the engine's memory is kept whole: the schema preserves it as it is
    stored = write({"engine": {"anything": {"nested": [1, "x", None]}}})
    assert stored["status"]["engine"] == {"anything": {"nested": [1, "x", None]}}


def test_scale_subresource_as_the_crd_declares_it(
    kube_api_client: Any, kube_server: EmulatedApiServer
) -> None:
    custom = kubernetes.client.CustomObjectsApi(kube_api_client)
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, cluster())
    custom.patch_namespaced_custom_object_status(
        GROUP,
        VERSION,
        "default",
        PLURAL,
        "hippo",
        {"status": {"instances": 3, "selector": "pgherd.io/cluster=hippo"}},
    )
    scale = custom.get_namespaced_custom_object_scale(GROUP, VERSION, "default", PLURAL, "hippo")
    assert scale["kind"] == "Scale" and scale["spec"] == {"replicas": 3}
    assert scale["status"] == {"replicas": 3, "selector": "pgherd.io/cluster=hippo"}
    patched = custom.patch_namespaced_custom_object_scale(
        GROUP, VERSION, "default", PLURAL, "hippo", {"spec": {"replicas": 5}}
    )
    assert patched["spec"]["replicas"] == 5
    assert kube_server.read(PLURAL, "default", "hippo")["spec"]["instances"] == 5  # type: ignore[index]
    status, body = http(
        kube_server, "PUT", pgc_path("hippo", sub="scale"), {**patched, "spec": {"replicas": 7}}
    )
    assert status == 200 and body["spec"]["replicas"] == 7
    status, body = http(
        kube_server, "PUT", pgc_path("hippo", sub="scale"), {**patched, "spec": {"replicas": 2}}
    )
    assert status == 409  # patched's resourceVersion is stale now
    status, body = http(
        kube_server, "PATCH", pgc_path("hippo", sub="scale"), {"spec": {"replicas": 20}}, MERGE
    )
    assert (status, body["reason"]) == (422, "Invalid")  # pgherd's validator: at most 15 instances
    apps = kubernetes.client.AppsV1Api(kube_api_client)
    sts = {
        "metadata": {"name": "db"},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "db"}}, "template": {}},
    }
    apps.create_namespaced_stateful_set("default", sts)
    apps.patch_namespaced_stateful_set_scale("db", "default", {"spec": {"replicas": 3}})
    assert apps.read_namespaced_stateful_set_scale("db", "default").status.selector == "app=db"
    assert apps.read_namespaced_stateful_set("db", "default").spec.replicas == 3


def test_immutable_fields_are_refused(kube_server: EmulatedApiServer) -> None:
    sts = {
        "metadata": {"name": "db"},
        "spec": {"replicas": 1, "serviceName": "a", "selector": {}, "template": {}},
    }
    http(kube_server, "POST", "/apis/apps/v1/namespaces/default/statefulsets", sts)
    path = "/apis/apps/v1/namespaces/default/statefulsets/db"
    status, body = http(kube_server, "PATCH", path, {"spec": {"serviceName": "b"}}, MERGE)
    assert status == 422 and "Forbidden: updates to statefulset spec" in body["message"]
    assert http(kube_server, "PATCH", path, {"spec": {"replicas": 2}}, MERGE)[0] == 200


# --------------------------------------------------------------------------------------------------
# List and watch.


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("tier=db", ["a", "b"]),
        ("tier==db", ["a", "b"]),
        ("tier!=db", ["c", "d"]),
        ("tier in (db, web)", ["a", "b", "c"]),
        ("tier notin (db)", ["c", "d"]),
        ("tier", ["a", "b", "c"]),
        ("!tier", ["d"]),
        ("tier=db,zone=1", ["a"]),
        ("zone>1", ["b"]),
    ],
)
def test_list_with_label_selectors(kube_api_client: Any, selector: str, expected: list[str]) -> None:
    core = kubernetes.client.CoreV1Api(kube_api_client)
    labels = {
        "a": {"tier": "db", "zone": "1"},
        "b": {"tier": "db", "zone": "2"},
        "c": {"tier": "web"},
        "d": {},
    }
    for name, items in labels.items():
        core.create_namespaced_config_map("default", configmap(name, items))
    listed = core.list_namespaced_config_map("default", label_selector=selector)
    assert [item.metadata.name for item in listed.items] == expected
    assert int(listed.metadata.resource_version) >= 4


def test_label_selector_syntax_errors() -> None:
    with pytest.raises(ValueError, match="unable to parse"):
        parse_label_selector("a in b")


def test_list_with_field_selectors_and_across_namespaces(kube_api_client: Any) -> None:
    core = kubernetes.client.CoreV1Api(kube_api_client)
    core.create_namespace({"metadata": {"name": "other"}})
    for namespace in ("default", "other"):
        for name in ("p1", "p2"):
            core.create_namespaced_pod(namespace, {"metadata": {"name": name}, "spec": {"containers": []}})
    core.patch_namespaced_pod_status("p2", "other", {"status": {"phase": "Running"}})
    names = lambda pods: sorted((p.metadata.namespace, p.metadata.name) for p in pods.items)  # noqa: E731
    assert names(core.list_pod_for_all_namespaces(field_selector="metadata.name=p1")) == [
        ("default", "p1"),
        ("other", "p1"),
    ]
    assert names(core.list_pod_for_all_namespaces(field_selector="status.phase=Running")) == [("other", "p2")]
    assert names(
        core.list_pod_for_all_namespaces(field_selector="metadata.namespace!=default,status.phase!=Running")
    ) == [("other", "p1")]
    assert names(core.list_namespaced_pod("other")) == [("other", "p1"), ("other", "p2")]


def test_watch_from_a_resource_version(kube_api_client: Any, kube_server: EmulatedApiServer) -> None:
    core = kubernetes.client.CoreV1Api(kube_api_client)
    core.create_namespaced_config_map("default", configmap("before"))
    since = core.list_namespaced_config_map("default").metadata.resource_version
    core.create_namespaced_config_map("default", configmap("after", {"w": "1"}))
    core.patch_namespaced_config_map("after", "default", {"data": {"x": "1"}})
    core.patch_namespaced_config_map("after", "default", {"metadata": {"labels": {"w": "2"}}})
    core.delete_namespaced_config_map("after", "default")
    seen = [
        (event["type"], event["object"].metadata.name, (event["object"].data or {}).get("x"))
        for event in kubernetes.watch.Watch().stream(
            core.list_namespaced_config_map, "default", resource_version=since, timeout_seconds=1
        )
    ]
    assert seen == [
        ("ADDED", "after", None),
        ("MODIFIED", "after", "1"),
        ("MODIFIED", "after", "1"),
        ("DELETED", "after", "1"),
    ]
    selected = [
        event["type"]
        for event in kubernetes.watch.Watch().stream(
            core.list_namespaced_config_map,
            "default",
            resource_version=since,
            label_selector="w=1",
            timeout_seconds=1,
        )
    ]
    assert selected == ["ADDED", "MODIFIED", "DELETED"]  # the relabelled object left the selection
    started = time.monotonic()
    current = [
        e["object"].metadata.name
        for e in kubernetes.watch.Watch().stream(
            core.list_namespaced_config_map, "default", timeout_seconds=1
        )
    ]
    assert current == ["before"] and 0.9 < time.monotonic() - started < 5  # timeoutSeconds honoured


def test_watch_streams_live_events_with_the_last_state_on_deletion(kube_server: EmulatedApiServer) -> None:
    http(kube_server, "POST", pgc_path(), cluster(finalizers=["test/hold"]))
    path = pgc_path() + "?watch=true&timeoutSeconds=3&fieldSelector=metadata.name%3Dhippo"
    _, listed = http(kube_server, "GET", pgc_path())
    path += f"&resourceVersion={listed['metadata']['resourceVersion']}"
    events: list[dict[str, Any]] = []

    def watch() -> None:
        with urllib.request.urlopen(kube_server.url + path, timeout=10) as response:
            assert response.headers["Content-Type"].startswith("application/json")
            for line in response:
                events.append(json.loads(line))
                if events[-1]["type"] == "DELETED":
                    return

    watcher = threading.Thread(target=watch)
    watcher.start()
    time.sleep(0.2)
    http(kube_server, "PATCH", pgc_path("hippo", sub="status"), {"status": {"phase": "Deleting"}}, MERGE)
    http(kube_server, "DELETE", pgc_path("hippo"))
    http(kube_server, "PATCH", pgc_path("hippo"), {"metadata": {"finalizers": None}}, MERGE)
    watcher.join(5)
    assert [e["type"] for e in events] == ["MODIFIED", "MODIFIED", "MODIFIED", "DELETED"]
    last = events[-1]["object"]
    assert last["status"]["phase"] == "Deleting" and last["metadata"]["deletionTimestamp"]


@pytest.mark.asyncio
async def test_aiohttp_in_the_emulators_own_loop(kube_emulator: KubeEmulator) -> None:
    url = kube_emulator.base_url
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session:

        async def watch() -> list[str]:
            seen = []
            async with session.get(
                url + pgc_path(), params={"watch": "true", "timeoutSeconds": "2"}
            ) as response:
                async for line in response.content:
                    seen.append(json.loads(line)["type"])
                    if len(seen) == 2:
                        return seen
            return seen

        watching = asyncio.create_task(watch())
        await asyncio.sleep(0.1)
        async with session.post(url + pgc_path(), json=cluster()) as response:
            assert response.status == 201
        async with session.patch(
            url + pgc_path("hippo"), json={"spec": {"instances": 4}}, headers={"Content-Type": MERGE}
        ) as r:
            assert (await r.json())["metadata"]["generation"] == 2
        assert await asyncio.wait_for(watching, 5) == ["ADDED", "MODIFIED"]
    assert kube_emulator.objects[f"{GROUP}/{VERSION}/{PLURAL}", "default", "hippo"] >= {
        "spec": {"instances": 4}
    }
    assert kube_emulator.read(PLURAL, "default", "hippo")["metadata"]["generation"] == 2  # type: ignore[index]


# --------------------------------------------------------------------------------------------------
# Delete.


def test_finalizers_hold_a_deleted_object_until_released(kube_server: EmulatedApiServer) -> None:
    http(kube_server, "POST", pgc_path(), cluster(finalizers=["a/one", "b/two"]))
    status, marked = http(kube_server, "DELETE", pgc_path("hippo"))
    assert status == 200 and marked["metadata"]["deletionTimestamp"] and marked["metadata"]["generation"] == 2
    status, _ = http(
        kube_server,
        "PATCH",
        pgc_path("hippo"),
        {"metadata": {"finalizers": ["a/one", "b/two", "c/3"]}},
        MERGE,
    )
    assert status == 422  # no new finalizers on an object being deleted
    http(kube_server, "PATCH", pgc_path("hippo"), {"metadata": {"finalizers": ["b/two"]}}, MERGE)
    assert http(kube_server, "GET", pgc_path("hippo"))[0] == 200
    ops = [{"op": "remove", "path": "/metadata/finalizers/0"}]
    status, last = http(kube_server, "PATCH", pgc_path("hippo"), ops, JSON_PATCH)
    assert status == 200 and "finalizers" not in last["metadata"]
    assert http(kube_server, "GET", pgc_path("hippo"))[0] == 404
    assert http(kube_server, "DELETE", pgc_path("hippo"))[0] == 404


def test_owner_references_cascade_and_orphan(kube_api_client: Any, kube_server: EmulatedApiServer) -> None:
    custom = kubernetes.client.CustomObjectsApi(kube_api_client)
    core = kubernetes.client.CoreV1Api(kube_api_client)
    apps = kubernetes.client.AppsV1Api(kube_api_client)

    def owned_by(obj: dict[str, Any] | Any, kind: str) -> list[dict[str, Any]]:
        meta = obj["metadata"] if isinstance(obj, dict) else obj.metadata
        return [
            {
                "apiVersion": "v1",
                "kind": kind,
                "name": meta["name"] if isinstance(meta, dict) else meta.name,
                "uid": meta["uid"] if isinstance(meta, dict) else meta.uid,
            }
        ]

    owner = custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, cluster())
    sts = apps.create_namespaced_stateful_set(
        "default",
        {
            "metadata": {"name": "hippo", "ownerReferences": owned_by(owner, "PostgresCluster")},
            "spec": {"selector": {}, "template": {}},
        },
    )
    core.create_namespaced_pod(
        "default",
        {
            "metadata": {"name": "hippo-0", "ownerReferences": owned_by(sts, "StatefulSet")},
            "spec": {"containers": []},
        },
    )
    core.create_namespaced_secret(
        "default", {"metadata": {"name": "s", "ownerReferences": owned_by(owner, "PostgresCluster")}}
    )
    core.create_namespaced_config_map("default", configmap("kept"))
    custom.delete_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, "hippo", propagation_policy="Background"
    )
    assert (
        kube_server.items("pods") == []
        and kube_server.items("secrets") == []
        and kube_server.items("statefulsets") == []
    )
    assert [cm["metadata"]["name"] for cm in kube_server.items("configmaps")] == ["kept"]

    owner = custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, cluster())
    core.create_namespaced_secret(
        "default", {"metadata": {"name": "s", "ownerReferences": owned_by(owner, "PostgresCluster")}}
    )
    custom.delete_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, "hippo", propagation_policy="Orphan"
    )
    orphan = core.read_namespaced_secret("s", "default")
    assert orphan.metadata.owner_references is None


def test_delete_preconditions_and_collections(kube_server: EmulatedApiServer) -> None:
    for name, tier in (("a", "x"), ("b", "x"), ("c", "y")):
        http(kube_server, "POST", cm_path(), configmap(name, {"tier": tier}))
    status, body = http(kube_server, "DELETE", cm_path("a"), {"preconditions": {"uid": "not-the-uid"}})
    assert status == 409
    status, body = http(kube_server, "DELETE", cm_path() + "?labelSelector=tier%3Dx")
    assert status == 200 and sorted(i["metadata"]["name"] for i in body["items"]) == ["a", "b"]
    assert [cm["metadata"]["name"] for cm in kube_server.items("configmaps")] == ["c"]
    http(kube_server, "POST", "/api/v1/namespaces", {"metadata": {"name": "two"}})
    http(kube_server, "POST", cm_path(namespace="two"), configmap("d", {"tier": "y"}))
    status, body = http(kube_server, "DELETE", "/api/v1/configmaps?labelSelector=tier%3Dy")
    assert status == 200 and len(body["items"]) == 2 and kube_server.items("configmaps") == []


def test_deleting_a_namespace_deletes_its_content(kube_server: EmulatedApiServer) -> None:
    http(kube_server, "POST", "/api/v1/namespaces", {"metadata": {"name": "gone"}})
    http(kube_server, "POST", cm_path(namespace="gone"), configmap("c"))
    http(kube_server, "POST", pgc_path(namespace="gone"), cluster(finalizers=["x/y"]))
    status, body = http(kube_server, "DELETE", "/api/v1/namespaces/gone")
    assert status == 200 and body["status"]["phase"] == "Terminating"
    assert http(kube_server, "POST", cm_path(namespace="gone"), configmap("new"))[0] == 403
    assert kube_server.items("configmaps", "gone") == []
    http(kube_server, "PATCH", pgc_path("hippo", namespace="gone"), {"metadata": {"finalizers": None}}, MERGE)
    assert http(kube_server, "GET", "/api/v1/namespaces/gone")[0] == 404


@pytest.mark.kube_emulator(graceful_pod_deletion=True)
def test_pods_on_a_node_wait_for_their_kubelet(kube_server: EmulatedApiServer) -> None:
    pods = "/api/v1/namespaces/default/pods"
    http(
        kube_server,
        "POST",
        pods,
        {"metadata": {"name": "p"}, "spec": {"nodeName": "n1", "terminationGracePeriodSeconds": 5}},
    )
    _, marked = http(kube_server, "DELETE", pods + "/p")
    assert marked["metadata"]["deletionGracePeriodSeconds"] == 5
    assert http(kube_server, "GET", pods + "/p")[0] == 200
    http(kube_server, "DELETE", pods + "/p", {"gracePeriodSeconds": 0})
    assert http(kube_server, "GET", pods + "/p")[0] == 404


def test_eviction_respects_a_disruption_budget(kube_server: EmulatedApiServer) -> None:
    pods = "/api/v1/namespaces/default/pods"
    for name in ("a-0", "a-1"):
        http(kube_server, "POST", pods, {"metadata": {"name": name, "labels": {"app": "a"}}, "spec": {}})
    pdb = {"metadata": {"name": "a"}, "spec": {"selector": {"matchLabels": {"app": "a"}}, "minAvailable": 2}}
    http(kube_server, "POST", "/apis/policy/v1/namespaces/default/poddisruptionbudgets", pdb)
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "a-0"}}
    assert http(kube_server, "POST", pods + "/a-0/eviction", eviction)[0] == 201  # no status: allowed
    http(
        kube_server,
        "PATCH",
        "/apis/policy/v1/namespaces/default/poddisruptionbudgets/a/status",
        {"status": {"disruptionsAllowed": 0}},
        MERGE,
    )
    status, body = http(kube_server, "POST", pods + "/a-1/eviction", dict(eviction, metadata={"name": "a-1"}))
    assert (status, body["reason"]) == (429, "TooManyRequests")
    assert [p["metadata"]["name"] for p in kube_server.items("pods")] == ["a-1"]


def test_volumes_grow_only_where_the_storage_class_allows(kube_server: EmulatedApiServer) -> None:
    classes = "/apis/storage.k8s.io/v1/storageclasses"
    default = {"storageclass.kubernetes.io/is-default-class": "true"}
    http(
        kube_server,
        "POST",
        classes,
        {"metadata": {"name": "fixed", "annotations": default}, "provisioner": "x"},
    )
    http(
        kube_server,
        "POST",
        classes,
        {"metadata": {"name": "elastic"}, "provisioner": "x", "allowVolumeExpansion": True},
    )
    claims = "/api/v1/namespaces/default/persistentvolumeclaims"
    for name, storage_class in (("a", None), ("b", "elastic")):
        spec: dict[str, Any] = {"resources": {"requests": {"storage": "1Gi"}}}
        if storage_class:
            spec["storageClassName"] = storage_class
        _, claim = http(kube_server, "POST", claims, {"metadata": {"name": name}, "spec": spec})
        assert claim["spec"]["storageClassName"] == (storage_class or "fixed")
    grow = {"spec": {"resources": {"requests": {"storage": "2Gi"}}}}
    assert http(kube_server, "PATCH", claims + "/a", grow, MERGE)[0] == 403
    assert http(kube_server, "PATCH", claims + "/b", grow, MERGE)[0] == 200
    shrink = {"spec": {"resources": {"requests": {"storage": "500Mi"}}}}
    assert http(kube_server, "PATCH", claims + "/b", shrink, MERGE)[0] == 422
    assert http(kube_server, "PATCH", claims + "/b", {"spec": {"volumeName": "pv"}}, MERGE)[0] == 422


# --------------------------------------------------------------------------------------------------
# Discovery, kinds, validation.


def test_discovery_serves_builtins_and_the_crds(kube_api_client: Any) -> None:
    dynamic = kubernetes.dynamic.DynamicClient(kube_api_client)
    pgc = dynamic.resources.get(api_version=f"{GROUP}/{VERSION}", kind="PostgresCluster")
    assert (pgc.name, pgc.namespaced, pgc.short_names) == (PLURAL, True, ["pgc"])
    assert set(pgc.subresources) == {"status", "scale"}
    for kind in ("Backup", "Restore"):
        assert dynamic.resources.get(api_version=f"{GROUP}/{VERSION}", kind=kind).subresources.keys() == {
            "status"
        }
    crds = kubernetes.client.ApiextensionsV1Api(kube_api_client).list_custom_resource_definition()
    assert sorted(crd.metadata.name for crd in crds.items) == [
        f"{p}.{GROUP}" for p in ("backups", "postgresclusters", "restores")
    ]
    groups = kubernetes.client.ApisApi(kube_api_client).get_api_versions()
    assert {"apps", "batch", "coordination.k8s.io", "events.k8s.io", "policy", GROUP} <= {
        g.name for g in groups.groups
    }


def test_a_crd_created_through_the_api_is_served(kube_server: EmulatedApiServer) -> None:
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {
            "group": "example.com",
            "scope": "Cluster",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object"}},
                }
            ],
        },
    }
    assert http(kube_server, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)[0] == 201
    assert http(kube_server, "POST", "/apis/example.com/v1/widgets", {"metadata": {"name": "w"}})[0] == 201
    _, resources = http(kube_server, "GET", "/apis/example.com/v1")
    assert [r["name"] for r in resources["resources"]] == ["widgets"]
    http(kube_server, "DELETE", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.example.com")
    assert http(kube_server, "GET", "/apis/example.com/v1/widgets")[0] == 404


@pytest.mark.parametrize(
    ("api_version", "kind", "extra"),
    [
        ("coordination.k8s.io/v1", "Lease", {"spec": {"holderIdentity": "me", "leaseDurationSeconds": 15}}),
        (
            "events.k8s.io/v1",
            "Event",
            {
                "reason": "Test",
                "note": "hello",
                "action": "Tested",
                "eventTime": "2025-01-01T00:00:00.000000Z",
            },
        ),
        (
            "v1",
            "Event",
            {"reason": "Test", "message": "hello", "involvedObject": {"kind": "Pod", "name": "p"}},
        ),
        ("v1", "Pod", {"spec": {"containers": [{"name": "c", "image": "i"}]}}),
        ("v1", "PersistentVolumeClaim", {"spec": {"resources": {"requests": {"storage": "1Gi"}}}}),
        ("v1", "Service", {"spec": {"ports": [{"port": 5432}]}}),
        ("v1", "Secret", {"stringData": {"password": "x"}}),
        ("v1", "ConfigMap", {"data": {"a": "b"}}),
        ("v1", "ServiceAccount", {}),
        ("apps/v1", "StatefulSet", {"spec": {"selector": {}, "template": {}}}),
        ("batch/v1", "Job", {"spec": {"template": {}}}),
        ("policy/v1", "PodDisruptionBudget", {"spec": {"minAvailable": 2}}),
    ],
)
def test_every_kind_the_operator_uses_is_storable(
    kube_api_client: Any, api_version: str, kind: str, extra: dict[str, Any]
) -> None:
    resource = kubernetes.dynamic.DynamicClient(kube_api_client).resources.get(
        api_version=api_version, kind=kind
    )
    created = resource.create(
        body={"apiVersion": api_version, "kind": kind, "metadata": {"name": "x"}, **extra},
        namespace="default",
    )
    assert created.metadata.uid and created.kind == kind
    assert [item.metadata.name for item in resource.get(namespace="default").items] == ["x"]
    resource.delete(name="x", namespace="default")
    assert resource.get(namespace="default").items == []


def test_pgherd_validator_refuses_bad_objects_with_the_reasons(kube_server: EmulatedApiServer) -> None:
    status, body = http(kube_server, "POST", pgc_path(), cluster(instances=16))
    assert (status, body["reason"]) == (422, "Invalid")
    assert body["message"].startswith('PostgresCluster.pgherd.io "hippo" is invalid: spec.instances')
    assert body["details"]["causes"][0]["field"] == "spec.instances"
    assert http(kube_server, "POST", pgc_path(), cluster())[0] == 201
    status, body = http(kube_server, "PATCH", pgc_path("hippo"), {"spec": {"postgresVersion": 99}}, MERGE)
    assert status == 422 and "spec.postgresVersion" in body["message"]


@pytest.mark.kube_emulator(validators=[])
def test_custom_validators_and_no_validation(kube_server: EmulatedApiServer) -> None:
    assert http(kube_server, "POST", pgc_path(), cluster(instances=16))[0] == 201


# --------------------------------------------------------------------------------------------------
# The request log, identities, RBAC.


def test_the_request_log_names_rbac_verbs_and_users(kube_server: EmulatedApiServer) -> None:
    http(kube_server, "POST", pgc_path(), cluster())
    http(kube_server, "GET", pgc_path("hippo"))
    http(kube_server, "GET", pgc_path(), token="someone-else")
    http(kube_server, "GET", pgc_path() + "?watch=true&timeoutSeconds=0.1")
    http(kube_server, "PATCH", pgc_path("hippo", sub="status"), {"status": {}}, MERGE)
    http(kube_server, "PUT", pgc_path("hippo", sub="scale"), {"spec": {"replicas": 3}})
    http(kube_server, "DELETE", pgc_path("hippo"))
    http(kube_server, "DELETE", cm_path())
    calls = [c for c in kube_server.calls if c.api_group in (GROUP, "")]
    assert [c.astuple() for c in calls] == [
        ("create", GROUP, PLURAL, None, "default", None),
        ("get", GROUP, PLURAL, None, "default", "hippo"),
        ("list", GROUP, PLURAL, None, "default", None),
        ("watch", GROUP, PLURAL, None, "default", None),
        ("patch", GROUP, PLURAL, "status", "default", "hippo"),
        ("update", GROUP, PLURAL, "scale", "default", "hippo"),
        ("delete", GROUP, PLURAL, None, "default", "hippo"),
        ("deletecollection", "", "configmaps", None, "default", None),
    ]
    assert [c.user for c in calls] == [USER, USER, None, USER, USER, USER, USER, USER]
    assert [c.code for c in calls] == [201, 200, 200, 200, 200, 200, 200, 200]
    rules = [
        {
            "apiGroups": [GROUP],
            "resources": [PLURAL, f"{PLURAL}/status"],
            "verbs": ["get", "list", "watch", "patch", "create", "delete"],
        }
    ]
    missing = calls_not_allowed(calls, rules)
    assert [(c.verb, c.rbac_resource) for c in missing] == [
        ("update", f"{PLURAL}/scale"),
        ("deletecollection", "configmaps"),
    ]


@pytest.mark.kube_emulator(
    tokens={"op-a": "operator-a", "op-b": "operator-b"},
    require_token=True,
    rbac={
        "operator-b": [
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create"]}
        ]
    },
)
def test_identities_and_enforced_rbac(kube_server: EmulatedApiServer) -> None:
    leases = "/apis/coordination.k8s.io/v1/namespaces/default/leases"
    assert http(kube_server, "GET", leases, token=None)[0] == 401
    assert http(kube_server, "POST", leases, {"metadata": {"name": "a"}}, token="op-a")[0] == 201
    assert http(kube_server, "POST", leases, {"metadata": {"name": "b"}}, token="op-b")[0] == 201
    status, body = http(kube_server, "DELETE", leases + "/b", token="op-b")
    assert (status, body["reason"]) == (403, "Forbidden") and 'User "operator-b" cannot delete' in body[
        "message"
    ]
    assert [(c.user, c.verb, c.code) for c in kube_server.calls] == [
        (None, "list", 401),
        ("operator-a", "create", 201),
        ("operator-b", "create", 201),
        ("operator-b", "delete", 403),
    ]


def test_user_reactions_override_the_emulation(kube_server: EmulatedApiServer) -> None:
    import kmock

    def refuse() -> None:
        (
            kube_server.emulator["patch", kmock.resource("v1/configmaps")]
            << 422
            << {"kind": "Status", "reason": "Injected"}
        )

    kube_server.call(refuse)
    http(kube_server, "POST", cm_path(), configmap("c", a="1"))
    status, body = http(kube_server, "PATCH", cm_path("c"), {"data": {"a": "2"}}, MERGE)
    assert (status, body["reason"]) == (422, "Injected")
    assert kube_server.read("configmaps", "default", "c")["data"] == {"a": "1"}  # type: ignore[index]


# --------------------------------------------------------------------------------------------------
# kubectl.


def test_kubectl_apply_get_scale_and_delete(
    kubectl: Callable[..., Any], kube_server: EmulatedApiServer
) -> None:
    example = REPO / "examples" / "cluster-minimal.yaml"
    name = yaml.safe_load(example.read_text())["metadata"]["name"]
    assert "created" in kubectl("apply", "-f", str(example)).stdout
    assert "unchanged" in kubectl("apply", "-f", str(example)).stdout
    kube_server.merge(
        PLURAL, "default", name, {"status": {"phase": "Running", "instances": 3}}, subresource="status"
    )
    table = kubectl("get", "pgc").stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "INSTANCES", "READY", "PRIMARY", "AGE"]
    assert table[1].split()[:3] == [name, "Running", "3"]
    kubectl("scale", f"pgc/{name}", "--replicas", "5")
    assert kubectl("get", "pgc", name, "-o", "jsonpath={.spec.instances}").stdout == "5"
    kube_server.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"{name}-0", "namespace": "default"},
            "spec": {},
        }
    )
    assert f"{name}-0" in kubectl("get", "pods").stdout
    assert "deleted" in kubectl("delete", "pod", f"{name}-0").stdout
    assert kube_server.items("pods") == []
    assert "No resources found" in kubectl("get", "pods").stderr
    refused = kubectl(
        "apply",
        "-f",
        "-",
        check=False,
        stdin=yaml.safe_dump(
            dict(yaml.safe_load(example.read_text()), metadata={"name": "b"}, spec={"instances": 30})
        ),
    )
    assert refused.returncode != 0 and "spec.instances" in refused.stderr


def test_kubectl_finds_the_crds_short_names(kubectl: Callable[..., Any]) -> None:
    resources = kubectl("api-resources", "--api-group", GROUP).stdout
    assert "pgc" in resources and "PostgresCluster" in resources


# --------------------------------------------------------------------------------------------------
# kopf.


def test_a_kopf_operator_runs_against_the_emulator(
    kube_server: EmulatedApiServer, kube_api_client: Any
) -> None:
    registry = kopf.OperatorRegistry()
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = "pgherd.io/finalizer"
    settings.peering.standalone = True
    settings.watching.connect_timeout = 5
    seen: list[str] = []
    url = kube_server.url

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> kopf.ConnectionInfo:
        return kopf_connection(url, TOKEN)

    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry)
    def created(patch: kopf.Patch, body: kopf.Body, **_: Any) -> None:
        patch.status["phase"] = "Creating"
        kopf.info(body, reason="Created", message="seen by the test operator")
        seen.append("create")

    @kopf.on.update(GROUP, VERSION, PLURAL, field="spec.instances", registry=registry)
    def scaled(new: Any, **_: Any) -> None:
        seen.append(f"instances={new}")

    @kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=1, registry=registry)
    async def ticker(name: str, namespace: str, stopped: kopf.DaemonStopped, **_: Any) -> None:
        ticks = 0
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session:
            while not stopped:
                ticks += 1
                status = {"status": {"readyInstances": ticks}}  # a field the schema knows
                await session.patch(
                    url + pgc_path(name, namespace, "status"), json=status, headers={"Content-Type": MERGE}
                )
                await stopped.wait(0.2)

    @kopf.on.delete(GROUP, VERSION, PLURAL, registry=registry)
    def deleted(**_: Any) -> None:
        seen.append("delete")

    def wait_for(check: Callable[[], bool], what: str, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"timed out waiting for {what}; seen {seen}"
            time.sleep(0.05)

    custom = kubernetes.client.CustomObjectsApi(kube_api_client)

    def current() -> dict[str, Any]:
        return kube_server.read(PLURAL, "default", "hippo") or {}

    args = ["run", "--standalone", "--namespace", "default", "--verbose"]
    with kopf.testing.KopfRunner(args, registry=registry, settings=settings, timeout=15) as runner:
        custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, cluster())
        wait_for(lambda: current().get("status", {}).get("phase") == "Creating", "on.create")
        wait_for(lambda: current().get("status", {}).get("readyInstances", 0) >= 2, "the daemon's status")
        assert "pgherd.io/finalizer" in current()["metadata"]["finalizers"]
        custom.patch_namespaced_custom_object(
            GROUP, VERSION, "default", PLURAL, "hippo", {"spec": {"instances": 5}}
        )
        wait_for(lambda: "instances=5" in seen, "on.update")
        custom.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "hippo")
        wait_for(lambda: not current(), "the deletion")
    assert runner.exit_code == 0, runner.output
    assert seen == ["create", "instances=5", "delete"]
    assert kube_server.items("events", "default"), "kopf posts events"
    verbs = {(c.verb, c.rbac_resource) for c in kube_server.calls if c.api_group == GROUP}
    assert {("list", PLURAL), ("watch", PLURAL), ("patch", PLURAL), ("patch", f"{PLURAL}/status")} <= verbs


def test_a_script_starts_and_stops_a_server_with_a_kubeconfig(tmp_path: Path) -> None:
    server = EmulatedApiServer(crds=[CRDS_DIR])
    url = server.start()
    try:
        config = yaml.safe_load(server.write_kubeconfig(tmp_path / "config").read_text())
        assert config["clusters"][0]["cluster"]["server"] == url and url.startswith("http://127.0.0.1:")
        assert config["users"][0]["user"]["token"]
        login = kopf.login_with_kubeconfig
        settings = kopf.OperatorSettings()

        old = os.environ.get("KUBECONFIG")
        os.environ["KUBECONFIG"] = str(tmp_path / "config")
        try:
            info = login(settings=settings)
        finally:
            if old is None:
                del os.environ["KUBECONFIG"]
            else:
                os.environ["KUBECONFIG"] = old
        assert info is not None and info.server == url and info.default_namespace == "default"
        assert http(server, "GET", "/version")[1]["major"] == "1"
        server.create(configmap("kept") | {"metadata": {"name": "kept", "namespace": "default"}})
    finally:
        server.stop()
    server.stop()  # idempotent
    again = server.start()  # the same store, served again
    try:
        assert http(server, "GET", cm_path("kept"))[0] == 200 and again.startswith("http://127.0.0.1:")
    finally:
        server.stop()


def test_api_call_tuple() -> None:
    call = ApiCall("patch", GROUP, VERSION, PLURAL, "status", "ns", "n", "u", 200)
    assert (
        call.astuple() == ("patch", GROUP, PLURAL, "status", "ns", "n")
        and call.rbac_resource == f"{PLURAL}/status"
    )
