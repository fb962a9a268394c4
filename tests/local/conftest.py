"""`local_cluster(instances)`: the sandbox's platform in a scratch directory, its members (each its own
`pgherd instance run` process) created through its own CreateMember actions (initdb for the first,
pg_basebackup for the others)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from local_helpers import RESTART_DELAY, LocalCluster

from pgherd.api.cluster import PostgresClusterSpec
from pgherd.local.layout import SandboxPaths
from pgherd.local.objects import ObjectStore
from pgherd.local.platform import LocalPlatform
from pgherd.local.pods import MAX_MEMBERS
from pgherd.local.ports import free_port_range
from pgherd.local.postgres.resolve import resolve
from pgherd.local.state import S3Endpoint, SandboxState

CLUSTER = "demo"  # the s3_store fixture's cluster


@pytest.fixture(scope="session")
def sandbox_certs(work_root: Path) -> Path:
    """`pgherd instance certs` for every member a test cluster may have, made once: each sandbox gets a
    copy (the platform then keeps them and writes only its own passwords)."""
    folder = work_root / "sandbox-certs"
    command = [str(Path(sys.executable).parent / "pgherd"), "instance", "certs", "--cluster", CLUSTER]
    command += ["--out", str(folder)]
    for ordinal in range(MAX_MEMBERS):
        command += ["--member", f"{CLUSTER}-{ordinal}"]
    subprocess.run(command, check=True, capture_output=True, timeout=120)
    return folder


@pytest.fixture
def local_cluster(
    work_root: Path,
    s3_store: Any,
    sandbox_certs: Path,
    discard: Callable[[Path], None],
    request: pytest.FixtureRequest,
) -> Iterator[Callable[..., LocalCluster]]:
    """make(instances, parameters=None, postgres_version=15) -> a LocalCluster whose members run and
    stream, on that major's programs as `sandbox up` resolves them; at the end, its members are killed
    and its directory deleted in the background."""
    made: list[LocalCluster] = []
    assert s3_store.cluster == CLUSTER

    def make(
        instances: int, parameters: dict[str, str] | None = None, postgres_version: int = 15
    ) -> LocalCluster:
        postgres = resolve(postgres_version)
        root = work_root / f"sandbox-{request.node.name[:30]}-{uuid.uuid4().hex[:6]}"
        root.mkdir(mode=0o755)
        shutil.copytree(sandbox_certs, root / "certs")
        endpoint = s3_store.endpoint
        base_port = free_port_range(16)
        state = SandboxState(
            cluster=CLUSTER,
            base_port=base_port,
            agent_base_port=free_port_range(16),
            store_url=s3_store.url,
            s3=S3Endpoint(
                endpoint=endpoint.endpoint_url,
                access_key=endpoint.access_key,
                secret_key=endpoint.secret_key,
                embedded=False,
            ),
            superuser_password="pw-" + uuid.uuid4().hex[:12],
            app_user="app",
            app_database="app",
            app_password="app-" + uuid.uuid4().hex[:12],
            restart_delay=RESTART_DELAY,
            pg_bindir=str(postgres.bindir),
            pg_libdir=None if postgres.libdir is None else str(postgres.libdir),
            postgres_major=postgres.major,
        )
        paths = SandboxPaths(root)
        state.save(paths)
        objects = ObjectStore(paths)
        spec_fields: dict[str, Any] = {"instances": instances, "postgresVersion": postgres_version}
        spec_fields["parameters"] = {"shared_buffers": "16MB", "max_connections": "30", **(parameters or {})}
        objects.apply(
            {
                "apiVersion": "pgherd.io/v1alpha1",
                "kind": "PostgresCluster",
                "metadata": {"name": state.cluster},
                "spec": spec_fields,
            }
        )
        spec = PostgresClusterSpec.model_validate(objects.cluster()["spec"])
        cluster = LocalCluster(LocalPlatform(paths, state, objects), spec)
        made.append(cluster)
        cluster.create(instances)
        return cluster

    yield make
    for cluster in made:
        cluster.shut_down()
        discard(cluster.paths.root)
