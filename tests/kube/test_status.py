"""The PostgresCluster status document's change test: written only when something but a condition's
timestamp changed (every tick builds it; 500 clusters must not write 500 statuses a tick)."""

from __future__ import annotations

from pgherd.kube.status import unchanged

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
    assert not unchanged({**base, "lastSuccessfulBackup": "b1"}, base)  # a key the last write lacked
    # keys the document does not name stay as they were: a merge patch leaves them alone
    assert unchanged({"phase": "Running"}, base)
