"""Credentials that keep working, and throttling honoured, on the real API server.

- The operator's ServiceAccount token is a file the kubelet rewrites: its requests follow the file
  (KubeApi at once when the file changed, or after a 401; kopf through its login handler, which kopf
  calls again after a 401). A token is invalidated here as a pod's is when its pod goes: it is bound to
  a Secret (TokenRequest's boundObjectRef) and the Secret is deleted.
- API Priority and Fairness: a FlowSchema puts the test's ServiceAccount on a priority level of one
  seat that rejects the rest (429 with Retry-After); many requests at once all complete.
- The retry policy against a small aiohttp server on 127.0.0.1: 5xx, timeouts, Retry-After, creates.

What was sent is read from the API server's audit log (realkube.AuditLog), never from the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from pgherd.kube import names
from pgherd.kube.api import ApiError, Credentials, KubeApi, RetryPolicy

from .realkube import REPO, AuditLog, ChartIdentity, Kube, chart_election, running_as, token_credential
from .waiting import eventually

FLOW_SCHEMA_HEADER = "X-Kubernetes-PF-FlowSchema-UID"

# -- tokens that die ----------------------------------------------------------------------------------


def bound_token(kube: Kube, identity: ChartIdentity, holder: str) -> str:
    """A token of the operator's ServiceAccount that lives only as long as the Secret `holder`."""
    secret = kube.create(
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": holder, "namespace": identity.namespace}}
    )
    return kube.token(
        identity.namespace,
        identity.service_account,
        bound_to={"kind": "Secret", "name": holder, "uid": secret["metadata"]["uid"]},
    )


def read_clusters(identity: ChartIdentity, token: str) -> tuple[int, str]:
    """One list of the watched namespace's PostgresClusters with `token`, as urllib sends it (none of
    pgherd's code): the HTTP status, and the FlowSchema the API server classified it with (the uid in
    its X-Kubernetes-PF-FlowSchema-UID header)."""
    request = urllib.request.Request(identity.server + clusters_path(identity))
    request.add_header("Authorization", f"Bearer {token}")
    context = ssl.create_default_context(cafile=str(identity.ca_file))
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as response:
            return int(response.status), str(response.headers.get(FLOW_SCHEMA_HEADER, ""))
    except urllib.error.HTTPError as exc:
        return exc.code, str(exc.headers.get(FLOW_SCHEMA_HEADER, ""))


def clusters_path(identity: ChartIdentity) -> str:
    return f"/apis/{names.API_VERSION}/namespaces/{identity.watched}/{names.PLURAL_CLUSTERS}"


def invalidate(kube: Kube, identity: ChartIdentity, holder: str, token: str) -> None:
    """Delete the Secret the token is bound to; back once the API server refuses the token (it keeps
    a token it accepted for up to 10 s: kube-apiserver's authentication cache)."""
    kube.remove("secrets", identity.namespace, holder)
    eventually(lambda: read_clusters(identity, token)[0] == 401, timeout=30, what=f"{holder}'s token refused")


def rotate(path: Path, token: str) -> None:
    """As the kubelet writes a projected token: a new file put in place at once."""
    staging = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    staging.write_text(token)
    os.replace(staging, path)


def rewrite_unseen(path: Path, token: str) -> None:
    """The same file rewritten in place with the same size and modification time: a rewrite its stat
    cannot tell (a file system whose times are coarser than the rewrite). Only the 401 reveals it."""
    before = path.stat()
    text = token.ljust(before.st_size)  # tokens are read stripped: padding is harmless
    assert len(text) == before.st_size, "the new token is longer than the old one"
    with open(path, "r+", encoding="utf-8") as handle:
        handle.write(text)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, len(text), before.st_mtime_ns)


def test_kubeapi_follows_a_rotated_token_file(
    kube: Kube, chart_operator: ChartIdentity, audit: AuditLog, tmp_path: Path
) -> None:
    """The kubelet puts a new token in place and the old one dies: the next request is sent with the
    new one, no request is refused."""
    identity = chart_operator
    first = bound_token(kube, identity, "holder-1")
    token_file = tmp_path / "token"
    rotate(token_file, first)
    agent = f"pgherd-test-{uuid.uuid4().hex[:8]}"

    async def scenario() -> None:
        # `first` as the token too: what the operator had read once at its start.
        api = KubeApi(identity.credentials(first, token_file=token_file), user_agent=agent)
        try:
            await api.list("PostgresCluster", identity.watched)
            second = bound_token(kube, identity, "holder-2")
            rotate(token_file, second)
            invalidate(kube, identity, "holder-1", first)
            mark = audit.fence()
            for _ in range(3):
                await api.list("PostgresCluster", identity.watched)
            audit.fence()
            sent = [e for e in audit.of(identity.user, mark) if e.user_agent == agent]
            assert [(e.code, e.credential) for e in sent] == [(200, token_credential(second))] * 3
            assert not [e for e in audit.unauthenticated if e.user_agent == agent]
        finally:
            await api.close()

    asyncio.run(scenario())


def test_kubeapi_sends_again_after_a_401_with_the_token_read_again(
    kube: Kube, chart_operator: ChartIdentity, audit: AuditLog, tmp_path: Path
) -> None:
    """The token file changed in a way stat cannot see, and the old token died: the request is refused
    once (401), the file read again, the request sent again with the new token; and from then on the
    new token is the one sent."""
    identity = chart_operator
    first = bound_token(kube, identity, "holder-1")
    token_file = tmp_path / "token"
    rotate(token_file, first)
    agent = f"pgherd-test-{uuid.uuid4().hex[:8]}"

    async def scenario() -> None:
        api = KubeApi(identity.credentials(first, token_file=token_file), user_agent=agent)
        try:
            await api.list("PostgresCluster", identity.watched)
            second = bound_token(kube, identity, "holder-2")
            rewrite_unseen(token_file, second)
            invalidate(kube, identity, "holder-1", first)
            mark, refused = audit.fence(), len(audit.unauthenticated)
            for _ in range(3):
                await api.list("PostgresCluster", identity.watched)
            audit.fence()
            sent = [e for e in audit.of(identity.user, mark) if e.user_agent == agent]
            assert [(e.code, e.credential) for e in sent] == [(200, token_credential(second))] * 3
            unauthorized = [e for e in audit.unauthenticated[refused:] if e.user_agent == agent]
            assert [(e.verb, e.resource) for e in unauthorized] == [("list", "postgresclusters")]
        finally:
            await api.close()

    asyncio.run(scenario())


def cluster_manifest(namespace: str) -> dict[str, Any]:
    doc = yaml.safe_load((REPO / "examples" / "cluster-minimal.yaml").read_text())
    doc["metadata"] = {"name": "db", "namespace": namespace}
    doc["spec"]["instances"] = 1
    return dict(doc)


def held_elsewhere(kube: Kube, identity: ChartIdentity) -> None:
    """The chart's Lease, held by another replica for an hour: the operator under test follows (its
    election reads the Lease again and again) and its loops act on nothing."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    kube.create(
        {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {"name": identity.lease, "namespace": identity.namespace},
            "spec": {
                "holderIdentity": "another-replica",
                "leaseDurationSeconds": 3600,
                "acquireTime": now,
                "renewTime": now,
            },
        }
    )


def test_kopf_and_the_election_log_in_again_with_the_rotated_token(
    kube: Kube, chart_operator: ChartIdentity, audit: AuditLog, tmp_path: Path
) -> None:
    """The operator runs on a token file; its token dies and the file holds a new one. kopf's next
    request is refused (401), kopf calls the login handler again, which gives it the file's token: a
    cluster created afterwards gets kopf's finalizer. The leader election's reads of the Lease go on
    with the new token."""
    identity = chart_operator
    held_elsewhere(kube, identity)
    first = bound_token(kube, identity, "holder-1")
    token_file = tmp_path / "token"
    rotate(token_file, first)
    election = chart_election(identity, "follower", lease_duration=2.0, renew_deadline=1.5, retry=0.2)
    with running_as(identity, election=election, token=first, token_file=token_file):
        eventually(
            lambda: any(
                e.verb == "watch" and e.resource == names.PLURAL_CLUSTERS for e in audit.of(identity.user)
            ),
            timeout=30,
            what="kopf watching PostgresClusters",
        )
        audit.read()
        refused = len(audit.unauthenticated)
        second = bound_token(kube, identity, "holder-2")
        rotate(token_file, second)
        invalidate(kube, identity, "holder-1", first)
        mark = audit.fence()
        kube.create(cluster_manifest(identity.watched))

        def finalized() -> bool:
            cluster = kube.read(names.PLURAL_CLUSTERS, identity.watched, "db") or {}
            return names.FINALIZER in ((cluster.get("metadata") or {}).get("finalizers") or [])

        eventually(finalized, timeout=60, what="the cluster's finalizer, added by kopf")
        audit.fence()
        kopf_refused = [e for e in audit.unauthenticated[refused:] if e.user_agent.startswith("kopf/")]
        assert kopf_refused, "kopf was never refused: the test did not make it log in again"
        since = audit.of(identity.user, mark)
        patches = [
            e
            for e in since
            if e.user_agent.startswith("kopf/") and e.verb == "patch" and e.resource == names.PLURAL_CLUSTERS
        ]
        assert patches and all(e.credential == token_credential(second) for e in patches)
        election_reads = [
            e for e in since if e.user_agent == "pgherd-leader-election" and e.resource == "leases"
        ]
        assert election_reads
        assert all((e.code, e.credential) == (200, token_credential(second)) for e in election_reads)


# -- throttling: API Priority and Fairness ------------------------------------------------------------


def priority_level(name: str, shares: int, *, lendable: int) -> dict[str, Any]:
    """A priority level that rejects what does not fit its seats; lending `lendable` percent of them,
    borrowing none."""
    return {
        "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
        "kind": "PriorityLevelConfiguration",
        "metadata": {"name": name},
        "spec": {
            "type": "Limited",
            "limited": {
                "nominalConcurrencyShares": shares,
                "lendablePercent": lendable,
                "borrowingLimitPercent": 0,
                "limitResponse": {"type": "Reject"},
            },
        },
    }


def nominal_seats(kube: Kube, level: str) -> int | None:
    """The API server's seats for priority level `level` (its apiserver_flowcontrol_nominal_limit_seats
    metric), None while it has none."""
    request = urllib.request.Request(kube.url + "/metrics")
    with urllib.request.urlopen(request, context=kube.tls, timeout=30) as response:
        text = response.read().decode()
    prefix = f'apiserver_flowcontrol_nominal_limit_seats{{priority_level="{level}"}} '
    values = [line[len(prefix) :] for line in text.splitlines() if line.startswith(prefix)]
    return int(float(values[0])) if values else None


@contextlib.contextmanager
def throttled(kube: Kube, identity: ChartIdentity) -> Iterator[None]:
    """The operator's ServiceAccount held to one seat of the API server's 600, the rest rejected (429).

    A FlowSchema puts the ServiceAccount's requests on a priority level of the least share
    (nominalConcurrencyShares 1) that neither lends nor borrows and rejects what does not fit; a ballast
    level that no request uses takes nearly all the shares (and lends its seats to the other levels), so
    that the least share is 1 seat: two requests at once, one is rejected, however slowly the test
    sends them. Back once the API server has the seats so and classifies the ServiceAccount's
    requests with the FlowSchema; everything removed afterwards."""
    name = f"pgherd-test-{identity.namespace}"[:50]
    ballast = f"{name}-ballast"
    kube.create(priority_level(ballast, 2000, lendable=100))
    kube.create(priority_level(name, 1, lendable=0))
    schema = kube.create(
        {
            "apiVersion": "flowcontrol.apiserver.k8s.io/v1",
            "kind": "FlowSchema",
            "metadata": {"name": name},
            "spec": {
                "priorityLevelConfiguration": {"name": name},
                "matchingPrecedence": 1000,  # before service-accounts (9000) and global-default (9900)
                "rules": [
                    {
                        "subjects": [
                            {
                                "kind": "ServiceAccount",
                                "serviceAccount": {
                                    "name": identity.service_account,
                                    "namespace": identity.namespace,
                                },
                            }
                        ],
                        "resourceRules": [
                            {
                                "verbs": ["*"],
                                "apiGroups": ["*"],
                                "resources": ["*"],
                                "namespaces": ["*"],
                                "clusterScope": True,
                            }
                        ],
                    }
                ],
            },
        }
    )
    uid = str(schema["metadata"]["uid"])
    try:
        eventually(lambda: nominal_seats(kube, name) == 1, timeout=30, what=f"priority level {name}: 1 seat")
        eventually(
            lambda: read_clusters(identity, identity.token)[1] == uid,
            timeout=30,
            what=f"FlowSchema {name} in force",
        )
        yield
    finally:
        kube.remove("flowschemas", None, name)
        for level in (name, ballast):
            kube.remove("prioritylevelconfigurations", None, level)


def test_many_requests_at_once_all_complete_when_throttled(
    kube: Kube, chart_operator: ChartIdentity, audit: AuditLog
) -> None:
    """80 reads and 20 creates at once, from a ServiceAccount held to one seat: the API server
    rejects many (429), every one of them completes, each create exactly once."""
    identity = chart_operator
    kube.create(cluster_manifest(identity.watched))
    agent = f"pgherd-test-{uuid.uuid4().hex[:8]}"
    reads, creates = 80, 20

    async def scenario() -> tuple[list[Any], list[Any]]:
        api = KubeApi(identity.credentials(), user_agent=agent)
        secret = {"apiVersion": "v1", "kind": "Secret"}
        try:
            listed = [api.list("PostgresCluster", identity.watched) for _ in range(reads)]
            made = [
                api.create("Secret", identity.watched, {**secret, "metadata": {"name": f"made-{i}"}})
                for i in range(creates)
            ]
            results: list[Any] = await asyncio.gather(*listed, *made)
            return results[:reads], results[reads:]
        finally:
            await api.close()

    with throttled(kube, identity):
        mark = audit.fence()
        started = time.monotonic()
        listed, made = asyncio.run(scenario())
        seconds = time.monotonic() - started
    audit.fence()
    assert [[c["metadata"]["name"] for c in items] for items in listed] == [["db"]] * reads
    assert [s["metadata"]["name"] for s in made] == [f"made-{i}" for i in range(creates)]
    sent = [e for e in audit.of(identity.user, mark) if e.user_agent == agent]
    rejected = [e for e in sent if e.code == 429]
    assert rejected, "no request was throttled: the FlowSchema did not hold the ServiceAccount"
    done = sorted((e.verb, e.name) for e in sent if e.code in (200, 201))
    assert done == sorted([("list", "")] * reads + [("create", f"made-{i}") for i in range(creates)])
    assert not [e.short() for e in sent if e.code not in (200, 201, 429)]
    print(f"{len(sent)} requests sent for {reads + creates}, {len(rejected)} rejected (429), {seconds:.1f} s")


# -- the retry policy, against a small HTTP server ---------------------------------------------------

FAST = RetryPolicy(attempts=4, max_retry_after=2.0, backoff=0.05, max_backoff=0.2)
Handler = Callable[[web.Request, int], Awaitable[web.StreamResponse]]


@contextlib.asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[tuple[KubeApi, list[str]]]:
    """A server on 127.0.0.1 answering with `handler(request, n)` (n: 1 for the first request); a
    KubeApi for it (timeout 0.5 s) and the list of requests it received ("METHOD path")."""
    seen: list[str] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        seen.append(f"{request.method} {request.path}")
        return await handler(request, len(seen))

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    api = KubeApi(Credentials(server=f"http://127.0.0.1:{port}"), timeout=0.5, retry=FAST)
    try:
        yield api, seen
    finally:
        await api.close()
        await runner.cleanup()


def status(code: int, reason: str, **headers: str) -> web.Response:
    body = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason, "code": code}
    return web.json_response(body, status=code, headers=headers)


OK = web.json_response  # an object, as the API server answers


def test_a_read_is_sent_again_after_5xx() -> None:
    async def scenario() -> None:
        async def flaky(request: web.Request, n: int) -> web.StreamResponse:
            return status((503, 502, 500)[n - 1], "ServiceUnavailable") if n <= 3 else OK({"n": n})

        async with serving(flaky) as (api, seen):
            assert await api.get("Pod", "ns", "p") == {"n": 4}
            assert seen == ["GET /api/v1/namespaces/ns/pods/p"] * 4

    asyncio.run(scenario())


def test_attempts_are_bounded() -> None:
    async def scenario() -> None:
        async def down(request: web.Request, n: int) -> web.StreamResponse:
            return status(504, "Timeout")

        async with serving(down) as (api, seen):
            with pytest.raises(ApiError) as refused:
                await api.get("Pod", "ns", "p")
            assert refused.value.status == 504
            assert len(seen) == FAST.attempts

    asyncio.run(scenario())


def test_a_read_is_sent_again_after_a_timeout() -> None:
    async def scenario() -> None:
        async def slow_first(request: web.Request, n: int) -> web.StreamResponse:
            if n == 1:
                await asyncio.sleep(2)  # past the client's 0.5 s read timeout
            return OK({"n": n})

        async with serving(slow_first) as (api, seen):
            assert await api.list("Pod", "ns") == []
            assert len(seen) == 2

    asyncio.run(scenario())


def test_429_waits_for_retry_after_and_then_any_verb_is_sent_again() -> None:
    async def scenario() -> None:
        async def throttling(request: web.Request, n: int) -> web.StreamResponse:
            return status(429, "TooManyRequests", **{"Retry-After": "1"}) if n == 1 else OK({"n": n})

        async with serving(throttling) as (api, seen):
            started = time.monotonic()
            assert await api.create("Pod", "ns", {"metadata": {"name": "p"}}) == {"n": 2}
            waited = time.monotonic() - started
            assert 1.0 <= waited < 1.5 + 0.5, waited  # Retry-After, plus at most half of it (jitter)
            assert seen == ["POST /api/v1/namespaces/ns/pods"] * 2

    asyncio.run(scenario())


def test_retry_after_is_bounded() -> None:
    async def scenario() -> None:
        async def throttling(request: web.Request, n: int) -> web.StreamResponse:
            return status(429, "TooManyRequests", **{"Retry-After": "600"}) if n == 1 else OK({})

        async with serving(throttling) as (api, seen):
            started = time.monotonic()
            await api.get("Pod", "ns", "p")
            assert time.monotonic() - started < FAST.max_retry_after * 1.5 + 0.5
            assert len(seen) == 2

    asyncio.run(scenario())


def test_a_create_is_not_sent_again_after_5xx_or_a_timeout() -> None:
    """The API server may have made the object: the caller's next pass reads what is there."""

    async def scenario() -> None:
        async def failing(request: web.Request, n: int) -> web.StreamResponse:
            if n == 2:
                await asyncio.sleep(2)
            return status(500, "InternalError")

        async with serving(failing) as (api, seen):
            with pytest.raises(ApiError):
                await api.create("Pod", "ns", {"metadata": {"name": "p"}})
            with pytest.raises(TimeoutError):
                await api.create("Pod", "ns", {"metadata": {"name": "p"}})
            assert len(seen) == 2

    asyncio.run(scenario())


def test_a_create_is_sent_again_when_no_connection_was_made(unused_tcp_port: int) -> None:
    """Nothing listening yet: nothing was sent, so a create is tried again, and reaches the server
    once it listens."""

    async def scenario() -> None:
        seen: list[str] = []

        async def answer(request: web.Request) -> web.StreamResponse:
            seen.append(request.method)
            return OK({"made": True})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", answer)
        runner = web.AppRunner(app)
        await runner.setup()
        api = KubeApi(
            Credentials(server=f"http://127.0.0.1:{unused_tcp_port}"),
            retry=RetryPolicy(attempts=6, backoff=0.3, max_backoff=0.3),
        )

        async def listen_soon() -> None:
            await asyncio.sleep(0.05)
            await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()

        try:
            opening = asyncio.create_task(listen_soon())
            assert await api.create("Pod", "ns", {"metadata": {"name": "p"}}) == {"made": True}
            await opening
            assert seen == ["POST"]
        finally:
            await api.close()
            await runner.cleanup()

    asyncio.run(scenario())


def test_a_write_whose_answer_is_not_wanted_returns_nothing_and_is_still_refused_as_before(
    kube: Kube, chart_operator: ChartIdentity
) -> None:
    """`answer=False` (the loop's status patch, the owned objects' patches): the write is made and its
    answer, the whole object, is not parsed; a refusal is the same ApiError as with the answer."""
    identity = chart_operator
    kube.create(cluster_manifest(identity.watched))

    async def scenario() -> tuple[dict[str, Any], dict[str, Any], ApiError]:
        api = KubeApi(identity.credentials())
        try:
            patch = {"status": {"message": "written without an answer"}}
            quiet = await api.patch("PostgresCluster", identity.watched, "db", patch, "status", answer=False)
            loud = await api.patch("PostgresCluster", identity.watched, "db", patch, "status")
            try:
                await api.patch("PostgresCluster", identity.watched, "nowhere", patch, "status", answer=False)
            except ApiError as exc:
                return quiet, loud, exc
            raise AssertionError("a patch of no object passed")
        finally:
            await api.close()

    quiet, loud, refused = asyncio.run(scenario())
    assert quiet == {}
    assert loud["metadata"]["name"] == "db" and loud["status"]["message"] == "written without an answer"
    stored = kube.read("postgresclusters", identity.watched, "db")
    assert stored is not None and stored["status"]["message"] == "written without an answer"
    assert refused.not_found and refused.reason == "NotFound", refused
