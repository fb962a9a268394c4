"""Running means clients are routed: the rw endpoint routes to the primary alone and every ready member is
ready for the platform's Services too (Kubernetes: the -rw EndpointSlice and the kubelet's Ready)."""

from __future__ import annotations

from dataclasses import replace

from pgherd.api.cluster import Phase
from pgherd.engine import actions as A
from pgherd.engine import decide
from pgherd.engine.conditions import ConditionType

from .builders import name, settled, with_members


def test_running_once_the_rw_endpoint_routes_to_the_primary_alone() -> None:
    spec, view, status = settled()
    decision = decide(spec, replace(view, rw_routes=frozenset({name(0)})), status)
    assert decision.phase is Phase.RUNNING and decision.actions == ()


def test_not_running_while_the_rw_endpoint_routes_to_nothing() -> None:
    spec, view, status = settled()
    decision = decide(spec, replace(view, rw_routes=frozenset()), status)
    assert decision.phase is Phase.DEGRADED
    assert f"the rw endpoint does not route to {name(0)} yet" in decision.message
    ready = decision.condition(ConditionType.READY)
    assert ready is not None and ready.status is False
    assert decision.actions == ()  # nothing to do but wait: the platform's own controllers route


def test_not_running_while_the_rw_endpoint_still_routes_to_the_former_primary() -> None:
    spec, view, status = settled()
    decision = decide(spec, replace(view, rw_routes=frozenset({name(0), name(1)})), status)
    assert decision.phase is Phase.DEGRADED
    assert f"the rw endpoint still routes to {name(1)}" in decision.message


def test_a_member_the_platform_does_not_find_ready_holds_running_back() -> None:
    spec, view, status = settled()
    view = with_members(view, replace(view.members[2], platform_ready=False))
    decision = decide(spec, view, status)
    assert decision.phase is Phase.DEGRADED
    assert f"{name(2)} not yet ready for its Services" in decision.message
    ready = with_members(view, replace(view.members[2], platform_ready=True))
    assert decide(spec, ready, status).phase is Phase.RUNNING


def test_a_requested_switchover_waits_for_the_route() -> None:
    spec, view, status = settled()
    asked = replace(view, rw_routes=frozenset(), switchover_to=name(1))
    assert not any(isinstance(a, A.Fence) for a in decide(spec, asked, status).actions)
    routed = replace(asked, rw_routes=frozenset({name(0)}))
    assert decide(spec, routed, status).status.operation is not None
