"""The cluster loop's pace: what wakes it, and how often it asks agents when nothing wakes it."""

from __future__ import annotations

import asyncio
from typing import Any

from pgherd.kube.api import KubeApi
from pgherd.kube.loop import ClusterLoop, OperatorConfig, Wakeups


def _loop() -> ClusterLoop:
    body: dict[str, Any] = {"metadata": {"name": "c", "namespace": "ns"}}
    config = OperatorConfig(steady_interval=2.0, busy_interval=0.3)
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
