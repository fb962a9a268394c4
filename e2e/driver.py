"""The driver interface the e2e scenarios are written against, and what every driver shares.

A driver runs one PostgresCluster (and its Backups and Restores) on a platform: `local` runs the
`pgherd sandbox` on this machine (CI), `kind` runs the operator's Helm chart on a kind cluster. The
scenarios only see this interface, so that both run the very same tests.

The status a driver returns is the sandbox's `status --json` shape (see `ClusterStatus`); the kind
driver builds it from the PostgresCluster's `.status` and the Backup and Restore objects.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypedDict, runtime_checkable

import psycopg

Manifest = Mapping[str, Any]


class MemberStatus(TypedDict, total=False):
    name: str
    role: str  # primary | replica | unknown | fenced
    ready: bool
    port: int | None
    dsn: str | None
    lagBytes: int | None
    timeline: int | None
    version: str | None  # the server's MAJOR.MINOR, while it answers


class ObjectStatus(TypedDict, total=False):
    name: str
    phase: str | None
    backupId: str | None  # Backups
    verified: bool | None  # Backups: every object of the snapshot read back (None: not checked yet)
    postgresVersion: str | None  # Backups: the server version the snapshot was taken from (MAJOR.MINOR)
    error: str | None
    keptData: list[str] | None  # Restores: where the survivors' data directories were kept aside


class ClusterStatus(TypedDict, total=False):
    phase: str | None
    message: str | None  # why the phase is what it is
    primary: str | None
    members: list[MemberStatus]
    rwDsn: str | None
    backups: list[ObjectStatus]
    restores: list[ObjectStatus]
    conditions: list[dict[str, Any]]
    operation: dict[str, Any] | None
    instances: int | None
    readyInstances: int | None
    postgresVersion: int | None  # the major the cluster's data is on


class ManifestRefused(Exception):
    """The platform refused a manifest (admission or the sandbox's own check); the message names the field."""


class DriverError(Exception):
    """A platform command failed; the message says which and carries its output."""


class WaitTimeout(AssertionError):
    """A condition was not reached in time; the message carries the last status seen."""


@runtime_checkable
class Driver(Protocol):
    """One cluster on one platform. Member names are those of StatefulSet pods: `<cluster>-<ordinal>`."""

    name: str  # the driver's name: local, kind
    postgres_version: int  # the PostgreSQL major the platform runs, for manifests

    def apply(self, manifest: Manifest) -> None:
        """Create or change a PostgresCluster, or create a Backup or a Restore. The first PostgresCluster
        applied is this driver's cluster. Raises ManifestRefused when the platform refuses it."""
        ...

    def status(self) -> ClusterStatus:
        """The cluster's status now (phase, primary, members, backups, restores, conditions, operation)."""
        ...

    def backup_store(self) -> dict[str, Any]:
        """The spec.backup.store.s3 the cluster runs with: the manifest's, or the one the platform gave a
        manifest without (the sandbox's embedded store, the driver's S3 server)."""
        ...

    def wait_for(
        self, predicate: Callable[[ClusterStatus], bool], timeout: float, what: str
    ) -> ClusterStatus:
        """Poll status() until predicate(status) holds and return that status; raise WaitTimeout naming
        `what` and showing the last status (and the last error reading it) after `timeout` seconds."""
        ...

    def kill(self, member: str, wipe: bool = False, keep_down: bool = False) -> None:
        """Kill -9 that member (its pod); with wipe, its data (the PVC) goes too. The platform restarts it;
        with keep_down, not until bring_back(member) (its pod cannot be scheduled: its node is gone)."""
        ...

    def bring_back(self, member: str) -> None:
        """A member kept down by kill(keep_down=True) may start again (its node is back)."""
        ...

    def switchover(self, to: str | None = None) -> None:
        """Request a planned switchover, to `to` or to the replica the operator chooses; returns once the
        request is recorded (wait_for the new primary)."""
        ...

    def kill_operator(self, at_step: str | None = None, done: int = 0) -> None:
        """Kill the operator (the sandbox's supervisor), leaving the cluster running, and keep it down: at
        once, or (``at_step``) when its recorded operation reaches a step starting with ``at_step`` with at
        least ``done`` members done. The sandbox crashes exactly there (a crash point armed in the
        supervisor); a real cluster's operator is killed as soon as its status shows that step."""
        ...

    def arm_operator_kill(self, at_step: str, done: int = 0) -> None:
        """Kill the operator as kill_operator(at_step, done) does, but return at once: call it before the
        change that starts the operation (the step may pass within a second), then wait_operator_killed()."""
        ...

    def wait_operator_killed(self, timeout: float = 200) -> None:
        """Wait until the armed kill happened; raises when it did not."""
        ...

    def resume_operator(self) -> None:
        """Start the operator again; it resumes any recorded operation."""
        ...

    def annotate(self, key: str, value: str | None) -> None:
        """Set (None: remove) an annotation of the cluster, as a person does (`kubectl annotate`,
        `pgherd sandbox annotate`): pgherd.io/confirm-upgrade, rollback-upgrade, retry-upgrade."""
        ...

    def break_upgrade(self, member: str, major: int) -> None:
        """Fault injection: remove the pg_control of the new cluster that `pg_upgrade --check` made on
        the member's volume (``upgrade/pgdata-<major>``), so that pg_upgrade itself fails once writes
        stopped."""
        ...

    def rw_dsn(self) -> str:
        """A libpq DSN that always reaches the current primary (the -rw Service)."""
        ...

    def member_dsn(self, name: str) -> str:
        """A libpq DSN to one member only (read-only on replicas)."""
        ...

    def superuser_value(self, query: str) -> str | None:
        """The one value (as text) `query` returns, run as the superuser on the primary, where the
        platform lets the superuser in: its Unix socket (the sandbox's superuserDsn, psql in the pod)."""
        ...

    def describe(self) -> str:
        """Where to look when a scenario fails: logs, directories, kubectl commands."""
        ...

    def down(self, *, keep: bool = False) -> None:
        """Stop and delete everything this driver created; safe to call twice and after a failure. With
        keep, leave the data and logs in place for a post-mortem (the suite does so when a test failed)."""
        ...


class NewCluster(Protocol):
    """The `new_cluster` fixture: create a cluster from a manifest, wait until it is healthy, return its
    driver. `prepare(driver)` runs first, in the cluster's namespace before the cluster exists (objects
    the manifest names, such as Secrets of the user's)."""

    def __call__(self, manifest: Manifest, prepare: Callable[[Driver], None] | None = None) -> Driver: ...


class PollingDriver:
    """What drivers share: wait_for over status(), and helpers on the normalised status."""

    poll_interval = 0.5
    _armed_kill: tuple[threading.Thread, list[BaseException]] | None = None

    def kill_operator(self, at_step: str | None = None, done: int = 0) -> None:  # pragma: no cover
        raise NotImplementedError

    def arm_operator_kill(self, at_step: str, done: int = 0) -> None:
        """kill_operator(at_step, done) in a thread, started now: it sees the operation from before the change."""
        errors: list[BaseException] = []

        def run() -> None:
            try:
                self.kill_operator(at_step, done)
            except BaseException as exc:  # reported by wait_operator_killed
                errors.append(exc)

        thread = threading.Thread(target=run, name="operator-kill", daemon=True)
        thread.start()
        self._armed_kill = (thread, errors)

    def wait_operator_killed(self, timeout: float = 200) -> None:
        if self._armed_kill is None:
            raise DriverError("no operator kill was armed")
        thread, errors = self._armed_kill
        thread.join(timeout)
        self._armed_kill = None
        if thread.is_alive():
            raise DriverError(f"the armed operator kill did not happen within {timeout:.0f} s")
        if errors:
            raise errors[0]

    def status(self) -> ClusterStatus:  # pragma: no cover - provided by the concrete driver
        raise NotImplementedError

    def describe(self) -> str:  # pragma: no cover - provided by the concrete driver
        raise NotImplementedError

    def wait_for(
        self, predicate: Callable[[ClusterStatus], bool], timeout: float, what: str
    ) -> ClusterStatus:
        deadline = time.monotonic() + timeout
        last: ClusterStatus | None = None
        last_error: str | None = None
        while True:
            try:
                last = self.status()
                last_error = None
                if predicate(last):
                    return last
            except (DriverError, LookupError, TypeError, ValueError, OSError, psycopg.Error) as exc:
                # The platform may be mid-restart (supervisor killed, pod deleted), a member mid-restart
                # for a predicate that reads PostgreSQL: keep polling, and show the error if time runs out.
                last_error = f"{type(exc).__name__}: {exc}"
            if time.monotonic() > deadline:
                shown = (
                    json.dumps(last, indent=2, sort_keys=True, default=str) if last is not None else "none"
                )
                error = f"\nlast error reading status: {last_error}" if last_error else ""
                raise WaitTimeout(
                    f"timed out after {timeout:.0f} s waiting for {what}.{error}\nlast status:\n{shown}\n"
                    f"{self.describe()}"
                )
            time.sleep(self.poll_interval)


# -- predicates and accessors on a ClusterStatus, shared by scenarios -------------------------------------


def operation_at(step: str, done: int = 0) -> Callable[[ClusterStatus], bool]:
    """The recorded operation is at a step starting with ``step``, ``done`` members or more done."""

    def check(status: ClusterStatus) -> bool:
        operation = status.get("operation") or {}
        return str(operation.get("step") or "").startswith(step) and len(operation.get("done") or []) >= done

    return check


def member(status: ClusterStatus, name: str) -> MemberStatus | None:
    return next((m for m in status.get("members") or [] if m.get("name") == name), None)


def replicas(status: ClusterStatus) -> list[str]:
    return [m["name"] for m in status.get("members") or [] if m.get("role") == "replica"]


def condition(status: ClusterStatus, kind: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), None)


def is_healthy(status: ClusterStatus, instances: int) -> bool:
    """Running, no operation in progress, `instances` members all ready, exactly one primary and every
    other member a ready replica."""
    members = status.get("members") or []
    primaries = [m for m in members if m.get("role") == "primary"]
    return (
        status.get("phase") == "Running"
        and not status.get("operation")
        and len(members) == instances
        and len(primaries) == 1
        and status.get("primary") == primaries[0].get("name")
        and all(m.get("ready") and m.get("role") in ("primary", "replica") for m in members)
    )


def healthy(instances: int) -> Callable[[ClusterStatus], bool]:
    return lambda status: is_healthy(status, instances)


class ClusterFailed(AssertionError):
    """The cluster reached phase Failed (an aborted operation): no point waiting any longer."""


def unless_failed(predicate: Callable[[ClusterStatus], bool]) -> Callable[[ClusterStatus], bool]:
    """`predicate`, but a status in phase Failed ends the wait at once with the operator's message."""

    def check(status: ClusterStatus) -> bool:
        if status.get("phase") == "Failed":
            operation = status.get("operation") or {}
            raise ClusterFailed(
                f"the cluster is Failed: {status.get('message') or operation.get('failed') or ''}\n"
                f"operation: {json.dumps(operation, default=str)}\nconditions: {status.get('conditions')}"
            )
        return predicate(status)

    return check


def backup_phase(status: ClusterStatus, name: str) -> str | None:
    found = next((b for b in status.get("backups") or [] if b.get("name") == name), None)
    return found.get("phase") if found else None


def restore_phase(status: ClusterStatus, name: str) -> str | None:
    found = next((r for r in status.get("restores") or [] if r.get("name") == name), None)
    return found.get("phase") if found else None
