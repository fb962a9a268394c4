"""A 3-member Patroni cluster with a single-node etcd on 127.0.0.1, for the failover benchmark.

Debian's `patroni` and `etcd-server` packages, this machine's PostgreSQL, each member with its own
data directory, PostgreSQL port and REST port, run as the unprivileged `postgres` account. "Killing a
member" kills its whole process tree (Patroni, the postmaster and its backends) with SIGKILL, as a
node or pod dying would: killing PostgreSQL alone would only make Patroni restart it in place.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import yaml

from pgherd.local.ports import free_port
from pgherd_backup.postgres.binaries import PgBinaries
from pgherd_backup.postgres.process import process_table

PASSWORD = "bench"  # trust on 127.0.0.1 only; the password is for libpq's pgpass and Patroni's checks


@dataclass(frozen=True)
class Timing:
    """Patroni's dynamic settings that bound failover time (loop_wait + 2 * retry_timeout <= ttl)."""

    label: str
    ttl: int = 30
    loop_wait: int = 10
    retry_timeout: int = 10


DEFAULT = Timing("patroni-default")
TUNED = Timing("patroni-tuned", ttl=10, loop_wait=2, retry_timeout=4)


@dataclass
class PatroniMember:
    name: str
    pg_port: int
    rest_port: int
    home: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def config(self) -> Path:
        return self.home / "patroni.yml"

    @property
    def data_dir(self) -> Path:
        return self.home / "data"


def _descendants(root: int) -> list[int]:
    """root and every process below it (from /proc), parents first."""
    children: dict[int, list[int]] = {}
    for pid, entry in process_table().items():
        children.setdefault(entry.ppid, []).append(pid)
    found, queue = [], [root]
    while queue:
        pid = queue.pop()
        found.append(pid)
        queue.extend(children.get(pid, []))
    return found


def _kill_tree(root: int) -> None:
    for pid in _descendants(root):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _postmaster_pid(data_dir: Path) -> int | None:
    try:
        pid = int((data_dir / "postmaster.pid").read_text().splitlines()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return None
    return pid


class PatroniCluster:
    def __init__(
        self, timing: Timing, *, synchronous: bool, members: int = 3, workdir: Path | None = None
    ) -> None:
        self.timing = timing
        self.synchronous = synchronous
        self.root = Path(workdir or tempfile.mkdtemp(prefix="pgherd-bench-patroni-"))
        self.scope = "bench"
        self.bindir = PgBinaries.find().bindir
        self.etcd_port = free_port()
        self.etcd_peer_port = free_port()
        self.etcd: subprocess.Popen[bytes] | None = None
        self.members = [
            PatroniMember(f"{self.scope}-{i}", free_port(), free_port(), self.root / f"{self.scope}-{i}")
            for i in range(members)
        ]
        try:
            self._account: pwd.struct_passwd | None = pwd.getpwnam("postgres") if os.geteuid() == 0 else None
        except KeyError as exc:
            raise RuntimeError("running as root needs a `postgres` account to run PostgreSQL") from exc

    # -- life cycle ---------------------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        self._start_etcd()
        for m in self.members:
            self._write_config(m)
        self._start_member(self.members[0])
        self._wait(
            lambda: self.leader() == self.members[0].name, timeout, "the first Patroni member to bootstrap"
        )
        for m in self.members[1:]:
            self._start_member(m)
        self.wait_healthy(timeout)

    def stop(self) -> None:
        for m in self.members:
            self.kill(m.name)
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.kill()
            self.etcd.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)

    def _start_etcd(self) -> None:
        etcd = shutil.which("etcd")
        if etcd is None:
            raise RuntimeError("etcd not found: apt-get install -y etcd-server")
        peer = f"http://127.0.0.1:{self.etcd_peer_port}"
        client = f"http://127.0.0.1:{self.etcd_port}"
        argv = [
            etcd, "--name", "bench", "--data-dir", str(self.root / "etcd"),
            "--listen-client-urls", client, "--advertise-client-urls", client,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"bench={peer}", "--initial-cluster-state", "new",
        ]  # fmt: skip
        log = (self.root / "etcd.log").open("wb")
        self.etcd = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._wait(lambda: http_json(f"{client}/health") is not None, 30, "etcd to answer")

    def _write_config(self, m: PatroniMember) -> None:
        m.home.mkdir(parents=True, exist_ok=True)
        config: dict[str, Any] = {
            "scope": self.scope,
            "namespace": "/pgherd-bench/",
            "name": m.name,
            "log": {"level": "INFO"},
            "restapi": {"listen": f"127.0.0.1:{m.rest_port}", "connect_address": f"127.0.0.1:{m.rest_port}"},
            "etcd3": {"hosts": [f"127.0.0.1:{self.etcd_port}"]},
            "bootstrap": {
                "dcs": {
                    "ttl": self.timing.ttl,
                    "loop_wait": self.timing.loop_wait,
                    "retry_timeout": self.timing.retry_timeout,
                    "maximum_lag_on_failover": 1048576,
                    "synchronous_mode": self.synchronous,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "use_slots": True,
                        "parameters": {
                            "wal_level": "replica",
                            "hot_standby": "on",
                            "wal_log_hints": "on",
                            "max_wal_senders": 10,
                            "max_replication_slots": 10,
                            "max_connections": 100,
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C"}],
            },
            "postgresql": {
                "listen": f"127.0.0.1:{m.pg_port}",
                "connect_address": f"127.0.0.1:{m.pg_port}",
                "data_dir": str(m.data_dir),
                "bin_dir": str(self.bindir),
                "pgpass": str(m.home / "pgpass"),
                "authentication": {
                    "superuser": {"username": "postgres", "password": PASSWORD},
                    "replication": {"username": "replicator", "password": PASSWORD},
                    "rewind": {"username": "postgres", "password": PASSWORD},
                },
                "pg_hba": [
                    "local all all trust",
                    "host all all 127.0.0.1/32 trust",
                    "host replication all 127.0.0.1/32 trust",
                ],
                "parameters": {"unix_socket_directories": str(m.home)},
            },
            "tags": {},
        }
        m.config.write_text(yaml.safe_dump(config, sort_keys=False))
        if self._account is not None:
            for path in (m.home, m.config):
                os.chown(path, self._account.pw_uid, self._account.pw_gid)
        os.chmod(m.home, 0o700)

    def _start_member(self, m: PatroniMember) -> None:
        patroni = shutil.which("patroni")
        if patroni is None:
            raise RuntimeError("patroni not found: apt-get install -y patroni")
        log = (self.root / f"{m.name}.log").open("ab")
        env = {**os.environ, "HOME": str(m.home), "PGPASSFILE": str(m.home / "pgpass")}
        extra: dict[str, Any] = {}
        if self._account is not None:
            extra = {"user": self._account.pw_uid, "group": self._account.pw_gid, "extra_groups": []}
        m.proc = subprocess.Popen(
            [patroni, str(m.config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=m.home,
            start_new_session=True,
            **extra,
        )

    # -- what the benchmark does ------------------------------------------------------------------------

    def rw_dsn(self) -> str:
        hosts = ",".join("127.0.0.1" for _ in self.members)
        ports = ",".join(str(m.pg_port) for m in self.members)
        return (
            f"host={hosts} port={ports} dbname=postgres user=postgres password={PASSWORD}"
            " target_session_attrs=read-write"
        )

    def member(self, name: str) -> PatroniMember:
        return next(m for m in self.members if m.name == name)

    def cluster_view(self) -> dict[str, Any] | None:
        """Patroni's own view (GET /cluster) from the first member whose REST API answers."""
        for m in self.members:
            if m.proc is None or m.proc.poll() is not None:
                continue
            view = http_json(f"http://127.0.0.1:{m.rest_port}/cluster")
            if isinstance(view, dict):
                return view
        return None

    def leader(self) -> str | None:
        return view_leader(self.cluster_view())

    def healthy(self) -> bool:
        replicas = settled_replicas(self.cluster_view(), len(self.members), synchronous=self.synchronous)
        if replicas is None:
            return False
        # Patroni's lag compares with the leader's optime as of its last loop: a replica that is not
        # streaming yet (its slot is created on the leader's next loop) still shows lag 0. Ask PostgreSQL.
        return all(self._streaming(self.member(str(x["name"]))) for x in replicas)

    def _streaming(self, m: PatroniMember) -> bool:
        try:
            with psycopg.connect(
                f"host=127.0.0.1 port={m.pg_port} dbname=postgres user=postgres password={PASSWORD}",
                connect_timeout=2,
                autocommit=True,
            ) as conn:
                row = conn.execute("SELECT status FROM pg_stat_wal_receiver").fetchone()
        except psycopg.Error:
            return False
        return row is not None and row[0] == "streaming"

    def wait_healthy(self, timeout: float = 180.0) -> None:
        self._wait(
            self.healthy, timeout, "a healthy Patroni cluster (a leader, replicas streaming with no lag)"
        )

    def kill(self, name: str) -> None:
        m = self.member(name)
        postmaster = _postmaster_pid(m.data_dir)
        # Patroni detaches the postmaster from its own tree on purpose: kill both trees.
        if m.proc is not None:
            _kill_tree(m.proc.pid)
            m.proc.wait(timeout=10)
            m.proc = None
        if postmaster is not None:
            _kill_tree(postmaster)

    def kill_postgres(self, name: str) -> None:
        """kill -9 of the member's PostgreSQL alone, under a live Patroni (a crashed server)."""
        postmaster = _postmaster_pid(self.member(name).data_dir)
        if postmaster is not None:
            _kill_tree(postmaster)

    def restart(self, name: str) -> None:
        self._start_member(self.member(name))

    def switchover(self, attempts: int = 3) -> None:
        """patronictl switchover --force from the current leader; retried while a just-restarted member's
        REST API is not listening yet."""
        for attempt in range(1, attempts + 1):
            leader = self.leader()
            config = next(m.config for m in self.members if m.proc is not None)
            result = subprocess.run(
                [
                    "patronictl",
                    "-c",
                    str(config),
                    "switchover",
                    "--force",
                    *(["--leader", leader] if leader else []),
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if result.returncode == 0 and "Successfully" in result.stdout:
                return
            if attempt == attempts:
                raise RuntimeError(
                    f"patronictl switchover failed ({result.returncode}): {result.stdout[-1500:]}{result.stderr[-1500:]}"
                )
            time.sleep(2)
            self.wait_healthy()

    def describe(self) -> str:
        return f"Patroni cluster under {self.root} (etcd.log, {self.scope}-N.log)"

    def _wait(self, check: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            if time.monotonic() > deadline:
                view = json.dumps(self.cluster_view(), indent=1)
                raise TimeoutError(
                    f"timed out after {timeout:.0f} s waiting for {what}; {self.describe()}\n{view}"
                )
            time.sleep(0.5)


def view_leader(view: dict[str, Any] | None) -> str | None:
    """The leader's name in Patroni's GET /cluster answer."""
    members = (view or {}).get("members", [])
    return next((str(x["name"]) for x in members if x.get("role") == "leader"), None)


def settled_replicas(
    view: dict[str, Any] | None, size: int, *, synchronous: bool
) -> list[dict[str, Any]] | None:
    """The replicas of Patroni's GET /cluster answer when it says the cluster is whole (``size`` members,
    one leader, replicas running with no lag, a sync standby when ``synchronous``); None otherwise."""
    members = (view or {}).get("members", [])
    if len(members) != size or sum(x.get("role") == "leader" for x in members) != 1:
        return None
    replicas = [x for x in members if x.get("role") != "leader"]
    if not all(x.get("state") in ("running", "streaming") and x.get("lag") == 0 for x in replicas):
        return None
    if synchronous and not any(x.get("role") == "sync_standby" for x in replicas):
        return None
    return replicas


def http_json(url: str) -> Any:
    """A JSON answer, or None when nothing (or no JSON) answers within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return json.loads(response.read())
    except (OSError, urllib.error.URLError, ValueError):
        return None
