"""The PostgresCluster status document's change test: written only when something but a condition's
timestamp changed (every tick builds it; 500 clusters must not write 500 statuses a tick)."""

from __future__ import annotations

from datetime import UTC, datetime

from pgherd.clusterstatus import members
from pgherd.engine.view import ClusterView, MemberView, Role
from pgherd.kube.status import merge_patch, unchanged

CONDITION = {"type": "Ready", "status": "True", "reason": "Ok", "message": "", "observedGeneration": 1}


def test_only_a_new_timestamp_is_no_change() -> None:
    before = {"phase": "Running", "conditions": [{**CONDITION, "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    now = {"phase": "Running", "conditions": [{**CONDITION, "lastTransitionTime": "2026-01-01T00:00:09Z"}]}
    assert unchanged(now, before)


def test_any_other_difference_is_a_change() -> None:
    base = {"phase": "Running", "members": [{"name": "a"}], "conditions": [CONDITION], "engine": {"v": 1}}
    assert unchanged(base, base)
    assert not unchanged({**base, "phase": "Degraded"}, base)
    assert not unchanged({**base, "members": [{"name": "a", "ready": True}]}, base)
    assert not unchanged({**base, "conditions": [{**CONDITION, "status": "False"}]}, base)
    assert not unchanged({**base, "conditions": []}, base)
    assert not unchanged({**base, "conditions": [CONDITION, CONDITION]}, base)
    without_message = {k: v for k, v in CONDITION.items() if k != "message"}
    assert not unchanged({**base, "conditions": [without_message]}, base)  # a key gone
    assert not unchanged(base, {**base, "conditions": [without_message]})  # a key added
    stamped = {**without_message, "lastTransitionTime": "2026-01-01T00:00:00Z"}
    assert unchanged({**base, "conditions": [without_message]}, {**base, "conditions": [stamped]})
    assert not unchanged({**base, "conditions": [{**CONDITION, "reason": None}]}, base)
    assert not unchanged({**base, "lastSuccessfulBackup": "b1"}, base)  # a key the last write lacked
    # keys the document does not name stay as they were: a merge patch leaves them alone
    assert unchanged({"phase": "Running"}, base)


def test_a_status_write_removes_what_the_engine_no_longer_holds(kube, namespace) -> None:
    """The status is written as a JSON merge patch, which keeps every key it does not name: an engine
    field cleared (an operation finished, a primary no longer lost) must be written as null, else a
    restarted or newly elected operator reads it back from status.engine and resumes it."""
    from .test_operator import cluster_manifest

    kube.create(cluster_manifest(namespace))
    stored: dict = {}
    for document in (
        {
            "phase": "FailingOver",
            "engine": {
                "timeline": 1,
                "primaryLostSince": "2026-11-27T00:00:00+00:00",
                "operation": {"kind": "Failover", "step": "fence"},
            },
        },
        {"phase": "Running", "engine": {"timeline": 2}},
    ):
        kube.merge(
            "postgresclusters",
            namespace,
            "hippo",
            {"status": merge_patch(document, stored)},
            subresource="status",
        )
        stored = {**stored, **document}
    engine = (kube.read("postgresclusters", namespace, "hippo") or {})["status"]["engine"]
    assert engine == {"timeline": 2}


def test_the_merge_patch_nulls_nested_keys_only() -> None:
    stored = {"engine": {"a": 1, "op": {"x": 1, "y": 2}}, "written": "by someone else", "members": [{"n": 1}]}
    document = {"engine": {"op": {"x": 2}}, "members": []}
    assert merge_patch(document, stored) == {"engine": {"op": {"x": 2, "y": None}, "a": None}, "members": []}


def test_a_member_counts_as_ready_once_the_kubelet_says_so_too() -> None:
    def member(name: str, platform_ready: bool | None) -> MemberView:
        return MemberView(
            name, int(name[-1]), reachable=True, role=Role.REPLICA, ready=True, platform_ready=platform_ready
        )

    view = ClusterView(
        "db", datetime(2026, 11, 28, tzinfo=UTC), (member("db-0", True), member("db-1", False))
    )
    assert [m["ready"] for m in members(view, "db-0")] == [True, False]
