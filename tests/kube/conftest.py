"""Fixtures of the Kubernetes adapter's tests.

On the real API server (e2e/localkube/apiserver_only.py, helpers in realkube.py):

- ``control_plane`` (session): the real etcd, kube-apiserver and kube-controller-manager (its garbage
  collector and PVC protection only) on 127.0.0.1, started once for the session (its start time is
  printed), the CRDs of crds/ Established. Skips every test using it when the Kubernetes binaries are
  not built (`bash scripts/ensure-kubernetes.sh`).
- ``kube`` (session): the administrator's requests; ``audit`` (session): the API server's audit log.
- ``namespace``: a namespace of this test's own.
- ``chart_operator``: the operator's identity as the chart makes it (its ServiceAccount, ClusterRole,
  Roles and bindings, release namespace ``<namespace>-op``, watching ``namespace``), with a token;
  at teardown, no request of that identity may have been refused (403) by RBAC.
  ``chart_operator_factory(edit=...)`` makes more (with rendered documents changed first).
"""

from __future__ import annotations

import itertools
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:  # e2e.localkube; the `pytest` script does not put the working directory there
    sys.path.insert(0, ROOT)

from e2e.localkube import apiserver_only  # noqa: E402

from .realkube import AuditLog, ChartIdentity, Kube, install_chart_rbac  # noqa: E402

# -- the real API server -------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def control_plane(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[apiserver_only.ControlPlane]:
    reason = apiserver_only.unavailable()
    if reason is not None:
        pytest.skip(reason)
    plane = apiserver_only.start(
        tmp_path_factory.mktemp("control-plane"), controllers=apiserver_only.GC_CONTROLLERS
    )
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # shown with -q too, not only with -s
            reporter.write_line(
                f"\ncontrol plane (etcd, kube-apiserver, kube-controller-manager) at {plane.api_url}:"
                f" up in {plane.seconds:.1f} s, CRDs Established; logs and audit log in {plane.layout.root}"
            )
    yield plane
    plane.stop()


@pytest.fixture(scope="session")
def kube(control_plane: apiserver_only.ControlPlane) -> Kube:
    return Kube(control_plane.api_url, control_plane.tls())


@pytest.fixture(scope="session")
def audit(control_plane: apiserver_only.ControlPlane, kube: Kube) -> AuditLog:
    return AuditLog(control_plane.audit_log, kube)


_NUMBERS = itertools.count(1)


@pytest.fixture
def namespace(kube: Kube, request: pytest.FixtureRequest) -> str:
    """A namespace of this test's own (`t<n>-<test name>`); left in place at the end (its objects may
    carry the operator's finalizer, and the control plane goes with the session)."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")
    name = f"t{next(_NUMBERS)}-{slug}"[:40].rstrip("-")
    kube.make_namespace(name)
    return name


@pytest.fixture
def chart_operator_factory(
    kube: Kube, control_plane: apiserver_only.ControlPlane, namespace: str, audit: AuditLog
) -> Iterator[Callable[..., ChartIdentity]]:
    made: list[tuple[ChartIdentity, bool]] = []

    def make(
        *, edit: Callable[[list[dict[str, Any]]], None] | None = None, refusals: bool = False
    ) -> ChartIdentity:
        """The chart's RBAC for an operator watching `namespace`; `refusals`: 403s are expected."""
        suffix = f"-{len(made)}" if made else ""
        release_ns = f"{namespace}-op{suffix}"
        kube.make_namespace(release_ns)
        identity = install_chart_rbac(
            kube,
            server=control_plane.api_url,
            ca_file=control_plane.ca_file,
            release=f"pgherd-{namespace.split('-')[0]}{suffix}",  # its ClusterRole's name: unique
            namespace=release_ns,
            watched=namespace,
            edit=edit,
        )
        made.append((identity, refusals))
        return identity

    yield make
    audit.fence()
    for identity, refusals in made:
        refused = [e.short() for e in audit.of(identity.user) if e.code == 403]
        assert refusals or not refused, f"requests of {identity.user} refused by RBAC: {refused}"


@pytest.fixture
def chart_operator(chart_operator_factory: Callable[..., ChartIdentity]) -> ChartIdentity:
    return chart_operator_factory()
