"""Shared fixtures: real PostgreSQL and a real S3 server, never mocks.

Backends (`PGHERD_TEST_BACKEND`): `local` runs PostgreSQL from this machine's binaries (as the
unprivileged `postgres` account when we are root) and `rclone serve s3` (moto's server mode as a
fallback) on 127.0.0.1; `containers` takes S3 from a MinIO container (testcontainers);
`auto` (default) uses containers only when a Docker engine answers. PostgreSQL always runs from
local binaries: the data-plane tests restore, rewind and archive from the data directory itself.

Fixtures for other suites: `pg_bin`, `work_root`, `discard`, `s3_server`, `s3_store`, `tls_s3_server`,
`tls_s3_store` (S3 over HTTPS with a private CA), `pg_factory`,
`pg_pair`, `agent`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pgherd.local.ports import free_port
from pgherd.local.s3server import S3Server, S3Tls
from pgherd_backup.postgres import config, postmaster, seed
from pgherd_backup.postgres.binaries import PgBinaries
from pgherd_backup.postgres.process import grant_traverse
from pgherd_backup.restore import agent_executable

BUCKET = "pgherd-test"


def _docker_answers() -> bool:
    try:
        import docker  # type: ignore[import-untyped]

        client = docker.from_env(timeout=3)
        client.ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def test_backend() -> str:
    choice = os.environ.get("PGHERD_TEST_BACKEND", "auto")
    if choice not in ("auto", "local", "containers"):
        raise pytest.UsageError("PGHERD_TEST_BACKEND must be local, containers or auto")
    if choice == "auto":
        return "containers" if _docker_answers() else "local"
    return choice


@pytest.fixture(scope="session")
def pg_bin() -> PgBinaries:
    """The PostgreSQL server programs (scripts/ensure-postgres.sh installs them)."""
    return PgBinaries.find()


@pytest.fixture(scope="session")
def work_root() -> Iterator[Path]:
    """A scratch directory the PostgreSQL account can traverse (pytest's tmp_path is private to root)."""
    root = Path(tempfile.mkdtemp(prefix="pgherd-tests-", dir=os.environ.get("PGHERD_TEST_TMP", "/tmp")))
    os.chmod(root, 0o755)
    # archive_command / restore_command run pgherd-backup as the PostgreSQL account
    grant_traverse(sys.executable, agent_executable())
    yield root
    shutil.rmtree(root, ignore_errors=True)


class Discard:
    """Deletes directories in a background thread: a test's data directories go while the next test
    runs, rather than all at the end of the session (seconds of unlinking on this disk)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Path | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="discard", daemon=True)
        self._thread.start()

    def __call__(self, path: Path) -> None:
        self._queue.put(path)

    def _run(self) -> None:
        while (path := self._queue.get()) is not None:
            shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


@pytest.fixture(scope="session")
def discard(work_root: Path) -> Iterator[Discard]:
    """discard(path): delete that directory soon, in the background; all done before work_root goes."""
    deleter = Discard()
    yield deleter
    deleter.close()


@pytest.fixture(scope="session")
def initdb_template(pg_bin: PgBinaries, work_root: Path) -> Callable[[], Path]:
    """template() -> a data directory made by initdb once per session (on first use), which
    PgInstance.initdb() copies: initdb's fsyncs cost about a second per member on this disk. A copy
    differs from its own initdb only by the system identifier, which every copy shares: each test
    archives under its own store path, and no test makes two clusters of its own with initdb."""
    made: list[Path] = []

    def template() -> Path:
        if not made:
            path = work_root / "initdb-template"
            seed.initdb(path, bins=pg_bin, settings={})
            made.append(path)
        return made[0]

    return template


@dataclass
class S3Endpoint:
    """Where the test S3 server is; `server` is set for local servers (stop/start for outages)."""

    endpoint_url: str
    bucket: str
    access_key: str
    secret_key: str = field(repr=False)
    region: str = "us-east-1"
    server: S3Server | None = None
    container: Any = None
    ca_bundle: str | None = None  # an HTTPS server's private CA (AWS_CA_BUNDLE)

    def env(self) -> dict[str, str]:
        env = {
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_REGION": self.region,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
        }
        if self.ca_bundle:
            env["AWS_CA_BUNDLE"] = self.ca_bundle
        return env

    @contextlib.contextmanager
    def outage(self) -> Iterator[None]:
        """The server stops answering for the duration of the block (stopped, or its container paused)."""
        if self.server is not None:
            self.server.stop()
            try:
                yield
            finally:
                self.server.start()
            return
        assert self.container is not None
        self.container.get_wrapped_container().pause()
        try:
            yield
        finally:
            self.container.get_wrapped_container().unpause()

    def client(self) -> Any:
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=self.region,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            verify=self.ca_bundle,
        )


@pytest.fixture(scope="session")
def s3_server(test_backend: str, work_root: Path) -> Iterator[S3Endpoint]:
    if test_backend == "containers":
        from testcontainers.minio import MinioContainer

        with MinioContainer() as minio:
            cfg = minio.get_config()
            endpoint = S3Endpoint(
                f"http://{cfg['endpoint']}", BUCKET, cfg["access_key"], cfg["secret_key"], container=minio
            )
            endpoint.client().create_bucket(Bucket=BUCKET)
            yield endpoint
        return
    server = S3Server(work_root / "s3", backend=os.environ.get("PGHERD_TEST_S3", "auto"))
    server.start()
    server.create_bucket(BUCKET)
    try:
        yield S3Endpoint(server.endpoint_url, BUCKET, server.access_key, server.secret_key, server=server)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tls_s3_server(work_root: Path) -> Iterator[S3Endpoint]:
    """A local S3 server over HTTPS whose certificate a private CA made here signs (a MinIO with its
    own CA); `ca_bundle` is that CA's file, readable by the PostgreSQL account."""
    tls = S3Tls.issue(work_root / "s3-tls-pki")
    server = S3Server(work_root / "s3-tls", tls=tls, backend=os.environ.get("PGHERD_TEST_S3", "auto"))
    server.start()
    server.create_bucket(BUCKET)
    try:
        yield S3Endpoint(
            server.endpoint_url,
            BUCKET,
            server.access_key,
            server.secret_key,
            server=server,
            ca_bundle=str(tls.ca),
        )
    finally:
        server.stop()


@dataclass
class StoreInfo:
    """One test's own archive: a unique path in the shared bucket, and the environment to reach it."""

    url: str
    cluster: str
    endpoint: S3Endpoint

    def env(self) -> dict[str, str]:
        return {**self.endpoint.env(), "PGHERD_STORE": self.url, "PGHERD_CLUSTER": self.cluster}

    @property
    def prefix(self) -> str:
        return self.url.split("/", 3)[3] + "/" + self.cluster + "/"

    def keys(self, contains: str = "") -> list[str]:
        client = self.endpoint.client()
        keys: list[str] = []
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=self.endpoint.bucket, Prefix=self.prefix
        ):
            keys.extend(item["Key"] for item in page.get("Contents", []) if contains in item["Key"])
        return keys


@pytest.fixture
def s3_store(s3_server: S3Endpoint) -> StoreInfo:
    return StoreInfo(f"s3://{s3_server.bucket}/t-{uuid.uuid4().hex[:10]}", "demo", s3_server)


@pytest.fixture
def tls_s3_store(tls_s3_server: S3Endpoint) -> StoreInfo:
    """This test's own archive on the HTTPS server of a private CA (`tls_s3_server`)."""
    return StoreInfo(f"s3://{tls_s3_server.bucket}/t-{uuid.uuid4().hex[:10]}", "demo", tls_s3_server)


class PgInstance:
    """A PostgreSQL member on 127.0.0.1, driven through pgherd_backup's own API."""

    def __init__(
        self,
        name: str,
        pgdata: Path,
        port: int,
        bins: PgBinaries,
        env: Mapping[str, str],
        template: Callable[[], Path] | None = None,
    ) -> None:
        self.name = name
        self.pgdata = pgdata
        self.port = port
        self.bins = bins
        self.env = dict(env)
        self.template = template

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def settings(self, archive: bool) -> dict[str, config.Setting]:
        command = config.archive_command(agent_executable()) if archive else None
        return config.member_settings(
            self.port, archive_command=command, wal_keep_size="256MB", extra={"shared_buffers": "32MB"}
        )

    def initdb(self, archive: bool = False) -> PgInstance:
        """A new cluster: initdb, or a copy of the session's initdb (initdb_template) with this member's
        settings, exactly what seed.initdb writes after its initdb."""
        if self.template is None:
            seed.initdb(self.pgdata, bins=self.bins, settings=self.settings(archive))
            return self
        assert not self.pgdata.exists(), f"{self.pgdata} exists already"
        subprocess.run(["cp", "-a", str(self.template()), str(self.pgdata)], check=True)
        config.write_pgherd_conf(self.pgdata, self.settings(archive))
        return self

    def start(self) -> PgInstance:
        postmaster.start(self.pgdata, bins=self.bins, env=self.env)
        return self

    def stop(self) -> None:
        postmaster.stop(self.pgdata, bins=self.bins)

    def kill(self) -> None:
        postmaster.kill(self.pgdata)

    def promote(self) -> None:
        postmaster.promote(self.pgdata, bins=self.bins)

    @property
    def log(self) -> str:
        path = postmaster.default_log_file(self.pgdata)
        return path.read_text(errors="replace") if path.exists() else ""

    def sql(self, query: str, params: tuple[Any, ...] | None = None) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.dsn, autocommit=True, connect_timeout=10) as conn, conn.cursor() as cur:
            cur.execute(query, params)
            return list(cur.fetchall()) if cur.description else []

    def value(self, query: str) -> Any:
        return self.sql(query)[0][0]

    def in_recovery(self) -> bool:
        return bool(self.value("SELECT pg_is_in_recovery()"))

    def timeline(self) -> int:
        """The timeline the server writes or replays now. pg_control's checkpoint lags a promotion until
        the end-of-recovery checkpoint completes, so a primary's timeline comes from its current WAL file."""
        return int(
            self.value(
                "SELECT CASE WHEN pg_is_in_recovery() THEN (SELECT timeline_id FROM pg_control_checkpoint())"
                " ELSE ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::int END"
            )
        )

    def wait_until(self, predicate: Callable[[], bool], what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                if predicate():
                    return
            except Exception as exc:  # not up yet
                last = exc
            time.sleep(0.1)
        raise AssertionError(
            f"{self.name}: timed out waiting for {what} ({last}); log tail:\n{self.log[-3000:]}"
        )

    def wait_promoted(self, timeout: float = 60) -> None:
        self.wait_until(lambda: not self.in_recovery(), "the end of recovery", timeout)

    def switch_and_wait_archived(self, timeout: float = 60) -> str:
        """Close the current WAL segment and wait until the archiver has pushed it."""
        self.sql("SELECT txid_current()")
        name = str(self.value("SELECT pg_walfile_name(pg_switch_wal())"))

        def archived() -> bool:
            last = self.value("SELECT last_archived_wal FROM pg_stat_archiver")
            return last is not None and str(last)[:24] >= name

        self.wait_until(archived, f"the archiving of {name}", timeout)
        return name

    def table_checksums(self) -> dict[str, str]:
        """One md5 per user table over its sorted rows: equal checksums, equal content."""
        tables = [
            r[0]
            for r in self.sql(
                "SELECT format('%I.%I', schemaname, relname) FROM pg_stat_user_tables ORDER BY 1"
            )
        ]
        return {
            t: str(
                self.value(f"SELECT md5(coalesce(string_agg(x::text, ',' ORDER BY x::text), '')) FROM {t} x")
            )
            for t in tables
        }


@pytest.fixture
def pg_factory(
    pg_bin: PgBinaries,
    work_root: Path,
    initdb_template: Callable[[], Path],
    discard: Discard,
    request: pytest.FixtureRequest,
) -> Iterator[Callable[..., PgInstance]]:
    """make(name, env=None) -> PgInstance (not initialised: call .initdb() or seed it); all are
    stopped at the end of the test, and their directories deleted in the background."""
    created: list[PgInstance] = []
    test_dir = work_root / f"{request.node.name[:40]}-{uuid.uuid4().hex[:6]}"
    test_dir.mkdir(mode=0o755)

    def make(name: str, env: Mapping[str, str] | None = None) -> PgInstance:
        instance = PgInstance(name, test_dir / name, free_port(), pg_bin, env or {}, initdb_template)
        created.append(instance)
        return instance

    yield make
    for instance in created:  # immediate: nothing to keep, no shutdown checkpoint nor final archiving
        with contextlib.suppress(Exception):
            postmaster.stop(instance.pgdata, bins=instance.bins, mode="immediate")
        with contextlib.suppress(Exception):
            instance.kill()
    discard(test_dir)


@pytest.fixture
def pg_pair(pg_factory: Callable[..., PgInstance]) -> tuple[PgInstance, PgInstance]:
    """A running primary and a streaming standby seeded from it with pg_basebackup."""
    primary = pg_factory("primary").initdb().start()
    standby = pg_factory("standby")
    seed.basebackup_seed(standby.pgdata, primary.dsn, bins=standby.bins, settings=standby.settings(False))
    standby.start()
    standby.wait_until(
        lambda: standby.value("SELECT status FROM pg_stat_wal_receiver") == "streaming", "streaming"
    )
    return primary, standby


@dataclass
class AgentRun:
    returncode: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        import json

        return json.loads(self.stdout)


@pytest.fixture
def agent(s3_store: StoreInfo) -> Callable[..., AgentRun]:
    """Run the `pgherd-backup` command against this test's store; agent(*args, env=..., cwd=...)."""

    def run(
        *args: str, env: Mapping[str, str] | None = None, cwd: str | None = None, timeout: float = 120
    ) -> AgentRun:
        full_env = {**os.environ, **s3_store.env(), **(env or {})}
        result = subprocess.run(
            [agent_executable(), *args],
            capture_output=True,
            text=True,
            env=full_env,
            cwd=cwd,
            timeout=timeout,
        )
        return AgentRun(result.returncode, result.stdout, result.stderr)

    return run
