"""Create a cluster: Running with one primary and ready replicas, writes visible on every replica, and a
bad manifest refused with a message that names the field."""

from __future__ import annotations

from typing import Any

import pytest

from e2e import manifests
from e2e.checks import in_recovery, insert_ids, scalar, wait_ids_on_member
from e2e.driver import Driver, ManifestRefused, NewCluster, condition, healthy, replicas

pytestmark = pytest.mark.e2e

NAME = "e2e-create"


@pytest.fixture(scope="module")
def manifest(pg_version: int) -> dict[str, Any]:
    return manifests.cluster(NAME, postgres_version=pg_version, instances=3)


@pytest.fixture(scope="module")
def cluster(new_cluster: NewCluster, manifest: dict[str, Any]) -> Driver:
    return new_cluster(manifest)


def test_created_cluster_is_running_with_one_primary(cluster: Driver) -> None:
    status = cluster.status()
    names = sorted(m["name"] for m in status["members"])
    assert names == [f"{NAME}-{i}" for i in range(3)], status
    assert status["phase"] == "Running"
    assert status["instances"] == 3 and status["readyInstances"] == 3, status
    primary = status["primary"]
    assert primary in names
    ready = condition(status, "Ready")
    assert ready is not None and ready["status"] == "True", status["conditions"]
    # The roles in the status are the roles PostgreSQL reports, read on each member.
    assert not in_recovery(cluster, primary)
    for name in replicas(status):
        assert in_recovery(cluster, name), f"{name} is reported replica but is not in recovery"
    assert scalar(cluster.rw_dsn(), "SELECT pg_is_in_recovery()") is False


def test_writes_are_visible_on_every_replica(cluster: Driver) -> None:
    ids = insert_ids(cluster.rw_dsn(), range(1, 201))
    status = cluster.status()
    for name in [status["primary"], *replicas(status)]:
        wait_ids_on_member(cluster, str(name), ids, timeout=30)


def test_replicas_refuse_writes(cluster: Driver) -> None:
    import psycopg

    name = replicas(cluster.status())[0]
    with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
        insert_ids(cluster.member_dsn(name), [10_000])


def test_a_manifest_setting_an_operator_owned_parameter_is_refused(
    cluster: Driver, manifest: dict[str, Any]
) -> None:
    bad = manifests.with_changes(manifest, parameters={"port": "5433"})
    with pytest.raises(ManifestRefused, match="parameters"):
        cluster.apply(bad)
    # Nothing changed: the cluster stays healthy and keeps serving writes.
    cluster.wait_for(healthy(3), 30, "the cluster to stay healthy after a refused manifest")
    insert_ids(cluster.rw_dsn(), [20_000])
