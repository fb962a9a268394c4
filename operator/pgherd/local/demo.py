"""`make demo` / `pgherd sandbox demo`: a guided tour of pgherd on real PostgreSQL processes.

Create a 3-member cluster, write rows, kill the primary and watch the failover, take a backup, lose
a majority of the members, recover from the chosen backup, and find the rows again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from pgherd.local.postgres.resolve import newest_machine_major
from pgherd.local.sandbox import Sandbox, SandboxError

CLUSTER = "demo"
BACKUP = "demo-backup"

MANIFEST: dict[str, Any] = {
    "apiVersion": "pgherd.io/v1alpha1",
    "kind": "PostgresCluster",
    "metadata": {"name": CLUSTER},
    "spec": {
        "instances": 3,
        "failover": {"detectionSeconds": 3},
        "recovery": {"onQuorumLoss": "RestoreFromBackup", "backup": BACKUP},
    },
}


def demo_manifest() -> dict[str, Any]:
    """MANIFEST on this machine's PostgreSQL when it has one (the newest), else on the API's default
    major, which `make setup` fetches (`pgherd sandbox fetch-postgres 16`)."""
    major = newest_machine_major()
    if major is None:
        return MANIFEST
    return {**MANIFEST, "spec": {**MANIFEST["spec"], "postgresVersion": major}}


class Tour:
    def __init__(self, root: Path) -> None:
        self.sandbox = Sandbox(root)
        self.started = time.monotonic()

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {text}", flush=True)

    def step(self, title: str) -> None:
        print(f"\n=== {title} " + "=" * max(0, 70 - len(title)), flush=True)

    def status(self) -> dict[str, Any]:
        return self.sandbox.status()

    def wait(
        self, what: str, predicate: Callable[[dict[str, Any]], bool], timeout: float = 180
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last_phase = None
        while time.monotonic() < deadline:
            status = self.status()
            if status["phase"] != last_phase:
                self.say(f"phase {status['phase']}  {status.get('message') or ''}".rstrip())
                last_phase = status["phase"]
            if predicate(status):
                return status
            time.sleep(0.3)
        raise SandboxError(
            f"timed out waiting for {what}: see `pgherd sandbox status --dir {self.sandbox.root}`"
        )

    def count(self, dsn: str) -> int:
        with psycopg.connect(dsn, connect_timeout=3) as conn:
            row = conn.execute("SELECT count(*) FROM orders").fetchone()
        return int(row[0]) if row else 0

    def write(self, first: int, last: int, note: str) -> None:
        with psycopg.connect(self.status()["rwDsn"], autocommit=True) as conn:
            conn.execute(
                "INSERT INTO orders SELECT g, %s FROM generate_series(%s::int, %s::int) g",
                (note, first, last),
            )

    def run(self) -> None:
        self.step("1. Create a 3-member cluster")
        self.say("quorum commits (a commit is acknowledged once 2 of 3 members have it), failover after 3s,")
        self.say(f"and, if a majority is lost, recovery from the Backup {BACKUP!r}")
        status = self.sandbox.up(demo_manifest(), timeout=240)
        self.say(
            f"Running: primary {status['primary']}, replicas "
            + ", ".join(m["name"] for m in status["members"] if m["role"] == "replica")
        )

        self.step("2. Write rows; they reach the replicas")
        with psycopg.connect(status["rwDsn"], autocommit=True) as conn:
            conn.execute("CREATE TABLE orders (id int PRIMARY KEY, note text)")
        self.write(1, 1000, "first batch")
        time.sleep(1)
        for member in self.status()["members"]:
            self.say(f"{member['name']:<8} ({member['role']}): {self.count(member['dsn'])} rows")

        self.step("3. kill -9 the primary")
        old = self.status()["primary"]
        killed_at = time.monotonic()
        self.sandbox.kill(old)
        self.say(f"killed {old}; the operator confirms the failure with the replicas, fences, promotes")
        status = self.wait(
            "a new primary", lambda s: s["primary"] not in (None, old) and s["phase"] != "FailingOver"
        )
        self.first_write_after(killed_at)
        self.say(f"new primary {status['primary']}; rows: {self.count(status['rwDsn'])}")
        status = self.wait(
            f"{old} back as a replica",
            lambda s: any(m["name"] == old and m["role"] == "replica" for m in s["members"]),
            timeout=120,
        )
        self.say(f"{old} is back as a replica (rewound onto timeline {status['timeline']})")

        self.step("3b. Crash only the primary's PostgreSQL, under its live agent")
        primary = status["primary"]
        self.wait("every replica streaming", lambda s: s["phase"] == "Running", timeout=120)
        killed_at = time.monotonic()
        self.sandbox.kill(primary, postgres_only=True)
        self.say(f"killed {primary}'s PostgreSQL; its agent restarts it read-only at once,")
        self.say("and the operator promotes it in place: it holds every commit it acknowledged")
        self.first_write_after(killed_at, what="the crash")
        status = self.wait("the cluster Running", lambda s: s["phase"] == "Running", timeout=120)
        self.say(f"primary still {status['primary']}, on timeline {status['timeline']}")

        self.step("4. Take a backup")
        self.sandbox.apply(
            {
                "apiVersion": "pgherd.io/v1alpha1",
                "kind": "Backup",
                "metadata": {"name": BACKUP},
                "spec": {"cluster": {"name": CLUSTER}},
            }
        )
        status = self.wait(
            "the backup",
            lambda s: any(
                b["name"] == BACKUP and b["phase"] in ("Completed", "Failed") for b in s["backups"]
            ),
        )
        backup = next(b for b in status["backups"] if b["name"] == BACKUP)
        if backup["phase"] != "Completed":
            raise SandboxError(f"the backup failed: {backup.get('error')}")
        self.say(f"Backup {BACKUP}: snapshot {backup['backupId']}, {backup['size']}, checksummed in S3")
        self.write(1001, 1500, "after the backup")
        with psycopg.connect(status["superuserDsn"], autocommit=True) as conn:
            conn.execute("SELECT pg_switch_wal()")  # archive the segment that holds the last rows
        self.say("500 more rows written after the backup; their WAL is archived to S3")
        time.sleep(2)

        self.step("5. Lose a majority: the primary and a replica, with their volumes")
        status = self.status()
        primary = status["primary"]
        replica = next(m["name"] for m in status["members"] if m["name"] != primary)
        for name in (primary, replica):
            self.sandbox.kill(name, wipe=True)
        self.say(f"killed {primary} and {replica} and wiped their data: no member may be promoted safely")
        self.wait("QuorumLost", lambda s: s["phase"] in ("QuorumLost", "Recovering"), timeout=60)
        self.say("nothing is promoted; the recovery policy restores from the chosen backup")

        self.step("6. Recover from the chosen backup")
        status = self.wait(
            "the recovery", lambda s: s["phase"] == "Running" and s["readyInstances"] == 3, timeout=300
        )
        self.say(f"Running again: primary {status['primary']} on timeline {status['timeline']}")
        with psycopg.connect(status["rwDsn"]) as conn:
            rows = conn.execute("SELECT note, count(*) FROM orders GROUP BY note ORDER BY min(id)").fetchall()
        for note, count in rows:
            self.say(f"  {count:>5} rows  {note}")
        self.say("the survivor's old data directory was kept aside, never deleted")

        self.step("Done")
        print(
            f"The cluster keeps running. Try:\n  pgherd sandbox status --dir {self.sandbox.root}\n"
            f'  psql "{status["rwDsn"]}"\n  pgherd sandbox down --dir {self.sandbox.root}'
        )

    def first_write_after(self, killed_at: float, what: str = "the failover") -> None:
        dsn = self.status()["rwDsn"]
        while time.monotonic() - killed_at < 120:
            try:
                with psycopg.connect(dsn, autocommit=True, connect_timeout=1) as conn:
                    conn.execute(
                        "INSERT INTO orders VALUES ((SELECT coalesce(min(id), 1) - 1 FROM orders), %s)",
                        (f"first write after {what}",),
                    )
                self.say(f"first successful write {time.monotonic() - killed_at:.1f}s after the kill")
                return
            except psycopg.Error:
                time.sleep(0.1)


def run_demo(root: Path) -> int:
    tour = Tour(root)
    if tour.sandbox.paths.state_file.exists():
        print(f"removing the previous demo in {root}")
        tour.sandbox.down()
    try:
        tour.run()
    except (SandboxError, psycopg.Error) as exc:
        print(f"\nThe demo stopped: {exc}")
        return 1
    return 0
