"""The sandbox's object store admits manifests like the API server and versions the spec."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pgherd.api.admission import ManifestRefused
from pgherd.local.layout import SandboxPaths
from pgherd.local.objects import ObjectStore


def _cluster(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "pgherd.io/v1alpha1",
        "kind": "PostgresCluster",
        "metadata": {"name": "hippo"},
        "spec": spec,
    }


def test_generation_moves_only_with_the_spec(tmp_path: Path) -> None:
    store = ObjectStore(SandboxPaths(tmp_path))
    assert store.apply(_cluster(instances=3)) == "postgrescluster.pgherd.io/hippo created"
    assert store.cluster()["metadata"]["generation"] == 1
    assert store.apply(_cluster(instances=3)) == "postgrescluster.pgherd.io/hippo unchanged"
    assert store.apply(_cluster(instances=5)) == "postgrescluster.pgherd.io/hippo configured"
    stored = store.cluster()
    assert stored["metadata"]["generation"] == 2
    assert stored["spec"]["instances"] == 5
    assert stored["spec"]["failover"]["detectionSeconds"] == 5  # defaults applied like the API server


def test_transition_rules_use_the_stored_object(tmp_path: Path) -> None:
    store = ObjectStore(SandboxPaths(tmp_path))
    store.apply(_cluster(bootstrap={"initdb": {"database": "orders"}}))
    with pytest.raises(ManifestRefused, match="bootstrap is immutable"):
        store.apply(_cluster(bootstrap={"initdb": {"database": "sales"}}))


def test_bad_manifest_is_refused_with_its_field(tmp_path: Path) -> None:
    store = ObjectStore(SandboxPaths(tmp_path))
    with pytest.raises(ManifestRefused, match=r"spec\.instances"):
        store.apply(_cluster(instances=40))
    assert not SandboxPaths(tmp_path).cluster_object.exists()


def test_backups_belong_to_this_cluster(tmp_path: Path) -> None:
    store = ObjectStore(SandboxPaths(tmp_path))
    store.apply(_cluster())
    backup = {
        "apiVersion": "pgherd.io/v1alpha1",
        "kind": "Backup",
        "metadata": {"name": "b1"},
        "spec": {"cluster": {"name": "other"}},
    }
    with pytest.raises(ValueError, match="for cluster 'other'"):
        store.apply(backup)
    backup["spec"] = {"cluster": {"name": "hippo"}}
    assert store.apply(backup) == "backup.pgherd.io/b1 created"
    store.update_status("Backup", "b1", phase="Completed", backupId="X")
    [listed] = store.backups()
    assert listed["status"] == {"phase": "Completed", "backupId": "X"}
    store.create_backup("hippo-scheduled-1")
    assert [b["metadata"]["name"] for b in store.backups()] == ["b1", "hippo-scheduled-1"] or len(
        store.backups()
    ) == 2


def test_switchover_requests(tmp_path: Path) -> None:
    store = ObjectStore(SandboxPaths(tmp_path))
    assert store.switchover_request() is None
    store.request_switchover("hippo-2")
    request = store.switchover_request()
    assert request is not None and request["to"] == "hippo-2"
    store.clear_switchover()
    assert store.switchover_request() is None


def test_annotations_change_no_generation_and_feed_the_view(tmp_path: Path) -> None:
    """`pgherd sandbox annotate` (ObjectStore.annotate) and annotations in an applied manifest, as
    `kubectl annotate` and `kubectl apply` do: the spec's generation stays, the engine's view reads them."""
    from pgherd.api.annotations import CONFIRM_UPGRADE, RETRY_UPGRADE, upgrade_requests

    store = ObjectStore(SandboxPaths(tmp_path))
    store.apply(_cluster(instances=3))
    assert store.annotate(CONFIRM_UPGRADE, "17") == "postgrescluster.pgherd.io/hippo annotated"
    stored = store.cluster()
    assert stored["metadata"]["generation"] == 1
    assert upgrade_requests(stored["metadata"])["confirm_upgrade"] == "17"
    manifest = _cluster(instances=3)
    manifest["metadata"]["annotations"] = {RETRY_UPGRADE: "1"}
    assert store.apply(manifest) == "postgrescluster.pgherd.io/hippo configured"
    requests = upgrade_requests(store.cluster()["metadata"])
    assert requests == {"confirm_upgrade": "17", "rollback_upgrade": None, "retry_upgrade": "1"}
    assert store.cluster()["metadata"]["generation"] == 1
    store.annotate(CONFIRM_UPGRADE, None)
    assert upgrade_requests(store.cluster()["metadata"])["confirm_upgrade"] is None
    # a lower major is refused by the CRD's transition rule, a higher one accepted
    with pytest.raises(ManifestRefused, match="postgresVersion may only go up"):
        store.apply(_cluster(instances=3, postgresVersion=15))
    assert store.apply(_cluster(instances=3, postgresVersion=17)).endswith("configured")
