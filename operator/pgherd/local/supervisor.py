"""The sandbox supervisor: the same observe -> decide -> act loop as the Kubernetes operator.

It runs in the background (started by `pgherd sandbox up` or `resume`), owns the embedded S3 server,
drives the members' agents through the platform (platform.py), and writes the cluster status where `pgherd sandbox status` reads it. Killed at any moment, a new one
resumes from the recorded status: the engine's operation record says where it was.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from pgherd.agentview import isolation_order
from pgherd.api.annotations import rotate_request
from pgherd.api.cluster import PostgresClusterSpec
from pgherd.clusterstatus import cluster_status
from pgherd.engine import Decision, EngineStatus, decide, switchover
from pgherd.engine.actions import Action, RecordEvent, UpdateBackup, UpdateRestore
from pgherd.engine.lsn import parse_lsn
from pgherd.engine.status import OperationKind
from pgherd.engine.view import ClusterView
from pgherd.local.layout import SandboxPaths, read_json, write_json
from pgherd.local.objects import ObjectStore, now_iso
from pgherd.local.observe import Observation
from pgherd.local.platform import LocalPlatform
from pgherd.local.s3server import S3Server, S3Tls, answers
from pgherd.local.state import SandboxState
from pgherd_backup.agent.wire import Status

log = logging.getLogger("pgherd.sandbox")


def ensure_s3(paths: SandboxPaths, state: SandboxState) -> S3Server | None:
    """Start the embedded S3 server unless it already runs (a resumed supervisor reuses it). It serves
    HTTPS with the sandbox's certificate, or HTTP in a sandbox made before it had one."""
    if not state.s3.embedded:
        return None
    tls = S3Tls.in_dir(paths.s3_tls) if state.s3.endpoint.startswith("https:") else None
    if answers(state.s3.endpoint + "/", tls.client_context() if tls else None):
        return None
    server = S3Server(
        paths.s3_root,
        access_key=state.s3.access_key,
        secret_key=state.s3.secret_key,
        port=state.s3.port,
        log_file=paths.root / "s3server.log",
        tls=tls,
    )
    server.start()
    bucket = state.store_url.removeprefix("s3://").split("/", 1)[0]
    server.create_bucket(bucket)
    state.s3.pid = server._proc.pid if server._proc is not None else None
    state.save(paths)
    return server


class ActionTaker(Protocol):
    def apply(self, action: Action, spec: PostgresClusterSpec) -> None: ...


def apply_actions(
    platform: ActionTaker, actions: Sequence[Action], spec: PostgresClusterSpec, previous: set[str]
) -> set[str]:
    """Apply a decision's actions in order, stopping at the first that fails: the later ones may rely
    on it (no Promote after a failed SetSynchronousStandbys), and the engine re-issues whatever is still
    needed on the next tick. Returns the actions (as text) for the next tick's log filter.

    ``previous``: the actions issued on the last tick, logged again only when they change.
    """
    for index, action in enumerate(actions):
        if (
            not isinstance(action, RecordEvent | UpdateBackup | UpdateRestore)
            and repr(action) not in previous
        ):
            log.info("action %s", action)
        try:
            platform.apply(action, spec)
        except Exception as exc:
            skipped = ", ".join(type(a).__name__ for a in actions[index + 1 :]) or "none"
            log.warning("action %s failed: %s; not applied: %s", type(action).__name__, exc, skipped)
            break
    return {repr(a) for a in actions}


class Supervisor:
    def __init__(self, root: Path) -> None:
        self.paths = SandboxPaths(root)
        self.state = SandboxState.load(self.paths)
        self.objects = ObjectStore(self.paths)
        self.platform = LocalPlatform(self.paths, self.state, self.objects)
        self.stopping = False
        self.last_phase: str | None = None
        self.last_message: str | None = None
        self.last_actions: set[str] = set()
        self._any_since: float | None = None  # when a switchover request for any member was first seen

    def engine_status(self) -> EngineStatus:
        recorded = read_json(self.paths.status_file, {}) or {}
        return EngineStatus.from_dict(recorded.get("engine", {}))

    def switchover_target(self, request: dict[str, Any] | None) -> str | None:
        if request is None:
            self._any_since = None
            return None
        target = request.get("to")
        if target:
            return str(target)
        if self._any_since is None:
            self._any_since = time.monotonic()
        best = self._best_switchover_target()
        if best is not None:  # resolved once, so that the target stays put during the switchover
            request["to"] = best
            write_json(self.paths.switchover_request, request)
        return best

    def _best_switchover_target(self) -> str | None:
        """`switchover` without --to: the streaming replica with the most WAL (the engine still checks
        that it is streaming and caught up before it promotes it)."""
        recorded = read_json(self.paths.status_file, {}) or {}
        return switchover.any_target(
            {
                str(m["name"]): _received(m)
                for m in recorded.get("members", [])
                if m.get("role") == "replica" and m.get("streaming")
            }
        )

    def run(self) -> None:
        ensure_s3(self.paths, self.state)
        self.paths.pid_file.write_text(f"{os.getpid()}\n")
        log.info("supervisor started (pid %d) for cluster %s", os.getpid(), self.state.cluster)
        while not self.stopping:
            started = time.monotonic()
            try:
                self.tick()
            except Exception:
                log.exception("supervisor tick failed; trying again")
            elapsed = time.monotonic() - started
            # Faster while something is in flight: each step of a failover waits for an observation.
            busy = self.last_phase not in (None, "Running", "Paused")
            interval = min(self.state.tick, 0.2) if busy else self.state.tick
            time.sleep(max(0.02, interval - elapsed))
        log.info("supervisor stopped")

    def tick(self) -> None:
        cluster = self.objects.cluster()
        spec = PostgresClusterSpec.model_validate(cluster.get("spec") or {})
        status = self.engine_status()
        self.platform.current_primary = status.current_primary
        self.platform.isolation = isolation_order(
            spec.failover.detection_seconds, len(status.voters), steady=status.operation is None
        )
        self.platform.rotate_certificates(rotate_request(cluster["metadata"]), spec)
        if not spec.paused:
            self.platform.keep_running(spec)
            self.platform.advance_restores(spec)
            self.platform.advance_retention()  # first: a snapshot retention deleted fails no verify
            self.platform.advance_verifications()
        # One snapshot of the request per tick: a request written during this tick waits for the next.
        request = self.objects.switchover_request()
        target = self.switchover_target(request)
        view, seen = self.platform.view(spec, target)
        decision = decide(spec, view, status)
        self.write_status(decision, view, seen)
        for event in decision.events:  # what the engine decided, told once (events.log)
            self.platform.apply(event, spec)
        self.platform.current_primary = decision.status.current_primary
        self._clear_switchover(decision, request, target)
        self.last_actions = apply_actions(self.platform, decision.actions, spec, self.last_actions)
        self._crash_if_armed(decision)
        if decision.phase.value != self.last_phase or decision.message != self.last_message:
            log.info("phase %s: %s", decision.phase.value, decision.message)
            self.last_phase, self.last_message = decision.phase.value, decision.message

    def _crash_if_armed(self, decision: Decision) -> None:
        """A crash point for tests: once the recorded operation reaches the armed step (its status
        written, its actions applied) with at least ``done`` members done, exit at once, as SIGKILL."""
        armed = self.paths.crash_point
        if not armed.exists():
            return
        want = read_json(armed) or {}
        operation = decision.status.operation
        if (
            operation is None
            or not operation.step.startswith(str(want.get("step", "")))
            or len(operation.done) < int(want.get("done", 0))
        ):
            return
        write_json(self.paths.crash_reached, want)
        armed.unlink(missing_ok=True)
        log.warning(
            "crash point: exiting at step %s (%d done), as if killed", operation.step, len(operation.done)
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(137)

    def _clear_switchover(
        self, decision: Decision, request: dict[str, Any] | None, target: str | None
    ) -> None:
        if request is None or self.objects.switchover_request() != request:
            return
        aborted = decision.status.aborted
        done = (
            target is not None
            and decision.status.current_primary == target
            and decision.status.operation is None
        )
        refused = (
            aborted is not None and aborted.kind is OperationKind.SWITCHOVER and aborted.target == target
        )
        waited = time.monotonic() - self._any_since if self._any_since is not None else 0.0
        if done or refused or (target is None and switchover.refuse_any(waited)):
            result = "done" if done else ("refused: " + (aborted.failed or "") if aborted else "no candidate")
            write_json(
                self.paths.objects / "switchover-result.json",
                {"to": target, "result": result, "at": now_iso(), "id": request.get("id")},
            )
            self.objects.clear_switchover()

    def write_status(self, decision: Decision, view: ClusterView, seen: dict[str, Observation]) -> None:
        """status.json: the document Kubernetes writes too (pgherd/clusterstatus.py), each member with
        the sandbox's own keys beside (its port, DSN, agent, whether its worker is busy)."""
        previous = read_json(self.paths.status_file, {}) or {}
        status = cluster_status(decision, view, previous, statuses=self.platform.observed_statuses())
        for member in status["members"]:
            name = member["name"]
            local = self.platform.members.get(name)
            member.update(
                {
                    "port": None if local is None else local.port,
                    "dsn": self.platform.app_dsn(name),
                    "streaming": seen.get(name, Observation(False)).receiver_streaming,
                    "revision": None if local is None else local.revision,
                    "busy": self.platform.busy(name),
                    "agent": self.platform.agent_url(name),
                    "metrics": self.platform.metrics_url(name),
                    "startError": _start_error(self.platform.status(name)),
                }
            )
        status["updatedAt"] = now_iso()
        status["supervisorPid"] = os.getpid()
        write_json(self.paths.status_file, status)


def _received(member: dict[str, Any]) -> int:
    """A member's receivedLSN in status.json as a number (text as PostgreSQL prints it; a status.json
    from before the shared status builder holds integers)."""
    value = member.get("receivedLSN")
    if isinstance(value, int):
        return value
    return parse_lsn(value) if value else 0


def _start_error(status: Status | None) -> str | None:
    """Why the member's PostgreSQL did not start (its agent's startError), shown instead of a bare
    not-ready."""
    return status.start_error if status is not None else None


def _configure_logging(paths: SandboxPaths) -> None:
    handler = logging.FileHandler(paths.supervisor_log)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    for noisy in ("botocore", "urllib3", "psycopg"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pgherd-sandbox-supervisor")
    parser.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args(argv)
    paths = SandboxPaths(args.dir.resolve())
    _configure_logging(paths)
    supervisor = Supervisor(paths.root)

    def stop(signum: int, _frame: object) -> None:
        supervisor.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    supervisor.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
