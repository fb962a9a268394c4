"""A person's rolling restart (annotation pgherd.io/restart, `kubectl pgherd restart`): its value is part
of the spec revision, so the ordinary rollout restarts every member in the engine's safe order."""

from __future__ import annotations

from dataclasses import replace

from pgherd.api.cluster import Phase
from pgherd.engine import actions as A
from pgherd.engine import decide
from pgherd.engine.revision import spec_revision

from .builders import make_spec, settled, with_members

ASKED = "2026-01-01T12:00:00Z"


def test_a_revision_without_a_restart_request_is_the_one_before_the_annotation_existed() -> None:
    """Upgrading the operator restarts no cluster: the digests of clusters never restarted by hand are
    those the operator computed before pgherd.io/restart existed (computed then, written down here)."""
    spec = make_spec(parameters={"max_connections": "200"})
    assert spec_revision(spec) == spec_revision(spec, restart=None) == spec_revision(spec, restart="")
    assert spec_revision(spec) == "d33241c8f2d9"
    assert spec_revision(spec, "reg/pgherd:1") == "52318e2b1240"
    assert spec_revision(spec, restart=ASKED) not in ("d33241c8f2d9", spec_revision(spec, restart="later"))


def test_a_restart_request_rolls_every_member_replicas_first_most_lagging_first() -> None:
    spec, view, status = settled(lsns={1: 990, 2: 900})
    revision = spec_revision(spec, view.image, ASKED)
    decision = decide(spec, replace(view, restart=ASKED), status)
    assert decision.phase is Phase.UPGRADING
    operation = decision.status.operation
    assert operation is not None and operation.revision == revision
    assert operation.plan == ("pg-2", "pg-1", "pg-0")  # the primary last
    assert decision.actions == (A.RestartMember("pg-2", revision, reason=operation.reason),)


def test_a_restart_request_already_carried_out_restarts_nothing() -> None:
    spec, view, status = settled()
    revision = spec_revision(spec, view.image, ASKED)
    restarted = tuple(replace(m, revision=revision) for m in view.members)
    decision = decide(spec, replace(with_members(view, *restarted), restart=ASKED), status)
    assert decision.phase is Phase.RUNNING
    assert decision.status.operation is None
    assert not [a for a in decision.actions if isinstance(a, A.RestartMember)]


def test_a_new_request_after_an_aborted_restart_tries_again() -> None:
    """An aborted rollout is reported until its cause goes away: a new request is a new revision."""
    spec, view, status = settled()
    first = decide(spec, replace(view, restart=ASKED), status)
    assert first.status.operation is not None
    aborted = replace(
        first.status, operation=None, aborted=replace(first.status.operation, failed="pg-2 down")
    )
    again = decide(spec, replace(view, restart=ASKED), aborted)
    assert again.phase is Phase.FAILED and again.status.operation is None
    retried = decide(spec, replace(view, restart="2026-01-01T12:05:00Z"), aborted)
    assert retried.phase is Phase.UPGRADING and retried.status.aborted is None
    assert [type(a) for a in retried.actions] == [A.RestartMember]
