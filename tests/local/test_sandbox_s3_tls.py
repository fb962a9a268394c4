"""The sandbox's backups over HTTPS with a private CA, as on Kubernetes with backup.store.s3.endpointCA.

- Its embedded S3 server serves HTTPS with a certificate of a CA the sandbox makes, and its cluster's
  store names that CA (the endpointCA of the manifest it admits): WAL is archived and a Backup completes
  through it, so that `make demo` and every backup scenario of the local e2e suite go over TLS.
- An external store with endpointCA takes the CA's file from AWS_CA_BUNDLE (the sandbox's stand-in for
  the Secret, as AWS_ACCESS_KEY_ID is for the credentials), copied into the sandbox: here the tests'
  HTTPS server with its own CA. Without AWS_CA_BUNDLE, `up` refuses, saying so.
"""

from __future__ import annotations

import contextlib
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pgherd.local.s3server import S3ServerUnavailable, choose_backend
from pgherd.local.sandbox import Sandbox, SandboxError

try:
    choose_backend()
except S3ServerUnavailable as exc:  # pragma: no cover - the CI image has rclone
    pytest.skip(f"no embedded S3 server here: {exc}", allow_module_level=True)


def _manifest(name: str, store: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "instances": 1,
        "postgresVersion": 15,
        "parameters": {"shared_buffers": "16MB", "max_connections": "40"},
    }
    if store is not None:
        spec["backup"] = {"store": store}
    return {
        "apiVersion": "pgherd.io/v1alpha1",
        "kind": "PostgresCluster",
        "metadata": {"name": name},
        "spec": spec,
    }


@pytest.fixture
def sandbox(work_root: Path) -> Iterator[Sandbox]:
    made = Sandbox(work_root / f"s3tls-{uuid.uuid4().hex[:6]}")
    yield made
    with contextlib.suppress(Exception):
        made.down()


def _wait(
    sandbox: Sandbox, predicate: Callable[[dict[str, Any]], bool], what: str, timeout: float = 120
) -> None:
    deadline = time.monotonic() + timeout
    status: dict[str, Any] = {}
    while time.monotonic() < deadline:
        status = sandbox.status()
        if predicate(status):
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}: {status.get('phase')} {status.get('conditions')}")


def _backs_up_and_archives(sandbox: Sandbox, cluster: str) -> None:
    sandbox.apply(
        {
            "apiVersion": "pgherd.io/v1alpha1",
            "kind": "Backup",
            "metadata": {"name": "first"},
            "spec": {"cluster": {"name": cluster}},
        }
    )
    _wait(
        sandbox,
        lambda s: any(b["name"] == "first" and b["phase"] in ("Completed", "Failed") for b in s["backups"]),
        "the Backup",
    )
    [backup] = sandbox.status()["backups"]
    assert backup["phase"] == "Completed", backup["error"]

    def archiving(status: dict[str, Any]) -> bool:
        found = [c for c in status["conditions"] if c["type"] == "ContinuousArchiving"]
        return bool(found) and found[0]["status"] == "True"

    _wait(sandbox, archiving, "ContinuousArchiving True")


def test_the_embedded_store_serves_https_with_the_sandboxs_own_ca(sandbox):
    name = f"tls{uuid.uuid4().hex[:4]}"
    sandbox.up(_manifest(name), timeout=240)
    state = sandbox.state()
    assert state.s3.endpoint.startswith("https://127.0.0.1:")
    assert state.s3.ca_file is not None and Path(state.s3.ca_file).is_file()
    assert stat.S_IMODE(Path(state.s3.ca_file).stat().st_mode) == 0o644
    assert state.s3.env()["AWS_CA_BUNDLE"] == state.s3.ca_file
    s3 = sandbox.objects.cluster()["spec"]["backup"]["store"]["s3"]
    assert s3["endpoint"] == state.s3.endpoint and "secretName" in s3["endpointCA"]
    _backs_up_and_archives(sandbox, name)


def test_an_external_store_with_an_endpoint_ca_takes_its_file_from_aws_ca_bundle(
    sandbox, tls_s3_store, monkeypatch
):
    endpoint = tls_s3_store.endpoint
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", endpoint.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", endpoint.secret_key)
    monkeypatch.delenv("AWS_CA_BUNDLE", raising=False)
    name = f"ext{uuid.uuid4().hex[:4]}"
    store = {
        "s3": {
            "bucket": endpoint.bucket,
            "path": tls_s3_store.url.split("/", 3)[3],
            "endpoint": endpoint.endpoint_url,
            "forcePathStyle": True,
            "credentials": {"secretName": "s3-keys"},
            "endpointCA": {"secretName": "s3-ca"},
        }
    }
    with pytest.raises(SandboxError, match="AWS_CA_BUNDLE"):
        sandbox.up(_manifest(name, store), timeout=240)
    assert not sandbox.root.exists()  # refused before anything was written

    monkeypatch.setenv("AWS_CA_BUNDLE", str(endpoint.ca_bundle))
    sandbox.up(_manifest(name, store), timeout=240)
    state = sandbox.state()
    assert state.s3.ca_file is not None and Path(state.s3.ca_file).is_relative_to(sandbox.root)
    assert Path(state.s3.ca_file).read_bytes() == Path(str(endpoint.ca_bundle)).read_bytes()
    _backs_up_and_archives(sandbox, name)
