"""The cluster loop's pace: what wakes it, and how often it asks agents when nothing wakes it."""

from __future__ import annotations

import asyncio
from typing import Any

from pgherd.kube.api import KubeApi
from pgherd.kube.loop import ClusterLoop, OperatorConfig, Wakeups


def _loop(**config_fields: float) -> ClusterLoop:
    body: dict[str, Any] = {"metadata": {"name": "c", "namespace": "ns"}}
    config = OperatorConfig(steady_interval=2.0, busy_interval=0.3, **config_fields)  # type: ignore[arg-type]
    api: Any = object.__new__(KubeApi)  # never called: interval() reads no API
    return ClusterLoop(api, config, holding=lambda: True, gather=lambda _: None, body=lambda: body)  # type: ignore[arg-type,return-value]


def test_busy_pace_only_while_agents_answer_what_an_operation_waits_for() -> None:
    loop = _loop()
    loop.last_phase = "Creating"
    loop.polled = False  # no pod has an address yet: pod events wake the loop, polling adds nothing
    assert loop.interval() == 2.0
    loop.polled = True  # agents to ask: their /status changes raise no watch event
    assert loop.interval() == 0.3
    loop.last_phase = "Running"
    assert loop.interval() == 2.0


def test_a_cluster_without_pods_or_operation_waits_for_what_wakes_it() -> None:
    """No pod: nothing to ask, and its pods, Jobs and spec wake it; ticking every 2 s would only decide
    the same again (2,000 such clusters: 1,000 ticks a second on the API server's cores). An operation in
    flight keeps its pace (its timeouts are clocks), and so does a cluster whose pods are back."""
    from datetime import UTC, datetime

    from pgherd.engine import EngineStatus
    from pgherd.engine.status import Operation, OperationKind

    loop = _loop()
    loop.last_phase, loop.polled, loop.had_pods = "Creating", False, False
    assert loop.interval() == 10.0
    loop.engine = EngineStatus()
    assert loop.interval() == 10.0
    loop.engine = EngineStatus(operation=Operation(OperationKind.SWITCHOVER, datetime.now(UTC)))
    assert loop.interval() == 2.0
    loop.engine, loop.had_pods = EngineStatus(), True
    assert loop.interval() == 2.0
    # The user's certificate Secrets are read again by time: never less often than that.
    loop = _loop(certificate_secrets_interval=4.0)
    loop.had_pods = False
    assert loop.interval() == 4.0
    loop = _loop(idle_interval=0.5)
    loop.had_pods = False
    assert loop.interval() == 2.0  # never faster than the steady pace


def test_a_lost_primary_is_looked_at_again_when_its_detection_ends() -> None:
    from datetime import UTC, datetime, timedelta

    from pgherd.engine import EngineStatus

    loop = _loop()
    loop.last_phase, loop.polled = "Degraded", True
    body = {
        "metadata": {"name": "c", "namespace": "ns", "generation": 1},
        "spec": {"failover": {"detectionSeconds": 3}},
    }
    loop._spec(body)  # the parsed spec, as a tick keeps it
    lost = datetime.now(UTC) - timedelta(seconds=2.9)  # the replicas lost it 2.9 s ago
    loop.engine = EngineStatus(primary_lost_since=lost)
    assert 0.05 < loop.interval() < 0.3  # the end of detection, not the busy pace after it
    loop.engine = EngineStatus(primary_lost_since=lost - timedelta(seconds=1))  # already due
    end = lost - timedelta(seconds=1) + timedelta(seconds=3)  # 0.9 s ago
    loop.ticked_at = end + timedelta(seconds=0.1)  # and a tick has started since
    assert loop.interval() == 0.3
    # The last tick started, and its statuses came in, before its end (a faster gathering than the one
    # before): that tick could confirm nothing, and the one that can comes at once, not at the busy pace
    # (the late decisions of session 38's back-off traces on localkube: +3.31 and +3.49 s after the kill,
    # against +3.14 to +3.25 s).
    loop.ticked_at = end - timedelta(seconds=0.05)
    assert loop.interval() < 0.03
    loop.ticked_at = None  # no tick yet
    assert loop.interval() < 0.03
    loop.engine = EngineStatus(primary_lost_since=lost + timedelta(seconds=2))
    assert loop.interval() == 0.3  # further than the pace
    # The decision is made once the tick's statuses are in: it starts as long before as the last
    # gathering took, never more than MAX_POLL_LEAD.
    loop.engine = EngineStatus(primary_lost_since=datetime.now(UTC) - timedelta(seconds=2.7))
    loop._poll_seconds = 0.15
    assert 0.1 < loop.interval() < 0.18  # 0.3 s to its end, less the 0.15 s the statuses take
    loop._poll_seconds = 0.5
    assert loop.interval() < 0.03  # the lead reaches before now: at once (the slack)


def test_the_loops_own_status_writes_do_not_wake_it() -> None:
    async def scenario() -> list[bool]:
        wakeups = Wakeups()
        event = wakeups.get("ns", "c")
        woken = []
        for fingerprint in ((1, None, "{}"), (1, None, "{}"), (2, None, "{}"), (2, None, "{'a': 'b'}")):
            event.clear()
            wakeups.wake_on_change("ns", "c", fingerprint)
            woken.append(event.is_set())
        return woken

    # first sight, a status-only change (same generation and annotations), a spec change, an annotation
    assert asyncio.run(scenario()) == [True, False, True, True]


def test_watch_handlers_run_in_the_event_loop_not_in_threads() -> None:
    """kopf runs a plain-function handler in a thread pool: a thread hop per watch event, and the
    loops' asyncio.Events set from another thread (not thread-safe). Every watch-fed handler (the
    indexes, the wake-up) is a coroutine."""
    from pgherd.kube.handlers import Operator, build

    registry, _ = build(Operator())
    handlers = [*registry._indexing.get_all_handlers(), *registry._watching.get_all_handlers()]
    assert len(handlers) >= 7
    plain = [str(h.id) for h in handlers if not asyncio.iscoroutinefunction(h.fn)]
    assert not plain, plain


def test_watches_are_reopened_every_minute() -> None:
    """The API server gives a watch a buffer sized at its opening from its cache's recent event rate,
    10 events for one opened while nothing changed (k8s.io/apiserver's suggestedWatchChannelSize). At
    2,000 clusters the operator's watch, opened before they existed, kept 10 through a spec change of
    every cluster and was closed as unresponsive, holding the API server's dispatch to every watcher for
    up to 100 ms (docs/kube.md; the slow runs stayed slow without it). Reopened at least every minute,
    it gets the buffer the rate calls for."""
    from pgherd.kube.handlers import Operator, build

    _, settings = build(Operator())
    assert settings.watching.server_timeout is not None and settings.watching.server_timeout <= 60


def test_kopfs_own_annotations_do_not_wake_the_loop_a_switchover_request_does() -> None:
    """kopf writes its last-handled-configuration annotation after every spec change: that write must
    not cost each cluster a second tick. A user's switchover annotation wakes it at once. The handler's
    filter (kopf's `when`) already turns the others away: running the handler itself for each event,
    the operator's own status writes included, cost about a tenth of the operator's CPU in a spec change
    of 2,000 clusters."""
    import kopf

    from pgherd.kube import names
    from pgherd.kube.handlers import Operator, build

    operator = Operator()
    registry, _ = build(operator)
    (handler,) = [h for h in registry._watching.get_all_handlers() if str(h.id) == "wake"]
    assert handler.when is not None

    async def scenario() -> tuple[list[bool], list[bool]]:
        event = operator.wakeups.get("ns", "c")
        woken, ran = [], []
        for marks in (
            {},
            {f"{names.PROGRESS_PREFIX}/last-handled-configuration": '{"spec": {"instances": 4}}'},
            {f"{names.PROGRESS_PREFIX}/last-handled-configuration": '{"spec": {"instances": 5}}'},
            {names.ANNOTATION_RESTORE: '{"restore": "r"}'},  # the loop's own record
            {names.ANNOTATION_SWITCHOVER: "c-1"},
        ):
            event.clear()
            raw = {
                "metadata": {
                    "name": "c",
                    "namespace": "ns",
                    "generation": 2,
                    "annotations": marks,
                    "managedFields": [{"manager": "pgherd"}],
                },
                "status": {"phase": "Running"},
            }
            body = kopf.Body(raw)
            ran.append(handler.when(body=body, namespace="ns", name="c"))  # type: ignore[misc]
            # kept by kopf for the cluster's daemon: without the write history or the status
            assert "managedFields" not in raw["metadata"] and "status" not in raw
            if ran[-1]:
                await handler.fn(body=body, namespace="ns", name="c")
            woken.append(event.is_set())
        return woken, ran

    woken, ran = asyncio.run(scenario())
    assert woken == [True, False, False, False, True]
    assert ran == woken


def test_the_body_a_loop_reads_and_the_diff_base_keys_are_kopfs() -> None:
    """Both made cheaply (the body's top level copied at once, the diff-base annotation's names formed
    once), each as kopf's own would be."""
    import kopf

    from pgherd.kube import names
    from pgherd.kube.handlers import ConstantDiffBase, _plain

    raw: dict[str, Any] = {"metadata": {"name": "c", "annotations": {"a": "b"}}, "spec": {"instances": 3}}
    body = kopf.Body(raw)
    plain = _plain(body)
    assert plain == raw and plain is not raw and plain["metadata"] is raw["metadata"]
    raw["spec"] = {"instances": 4}  # the next watch event's object: the copy taken before stays
    assert plain["spec"] == {"instances": 3}
    ours = ConstantDiffBase(prefix=names.PROGRESS_PREFIX, key="last-handled-configuration")
    theirs = kopf.AnnotationsDiffBaseStorage(prefix=names.PROGRESS_PREFIX, key="last-handled-configuration")
    assert list(ours.make_keys(ours.key, body=body)) == list(theirs.make_keys(theirs.key, body=body))
    assert ours.make_keys(ours.key, body=body) is ours.make_keys(ours.key, body=body)
    assert ours.fetch(body=body) is None and ours.build(body=body) == {}


def test_the_cluster_ref_is_made_again_only_when_a_part_changes() -> None:
    """A settled tick asks for the ClusterRef with the spec parsed once per generation: the same object
    is returned; another spec, image, revision or uid makes a new one."""
    from pgherd.api.cluster import PostgresClusterSpec
    from pgherd.kube.objects import OwnedObjects

    api: Any = object.__new__(KubeApi)
    owned = OwnedObjects(api, OperatorConfig())
    body: dict[str, Any] = {"metadata": {"name": "c", "namespace": "ns", "uid": "u1"}}
    spec = PostgresClusterSpec.model_validate(
        {"instances": 3, "postgresVersion": 16, "storage": {"size": "1Gi"}}
    )
    ref = owned.ref(body, spec, "image:1", "r1")
    assert owned.ref(body, spec, "image:1", "r1") is ref
    other = PostgresClusterSpec.model_validate(
        {"instances": 4, "postgresVersion": 16, "storage": {"size": "1Gi"}}
    )
    assert owned.ref(body, other, "image:1", "r1").spec is other
    assert owned.ref(body, other, "image:2", "r1").image == "image:2"
    assert owned.ref(body, other, "image:2", "r2").revision == "r2"
    again = {"metadata": {"name": "c", "namespace": "ns", "uid": "u2"}}
    assert owned.ref(again, other, "image:2", "r2").uid == "u2"
