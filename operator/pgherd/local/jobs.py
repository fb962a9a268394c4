"""Snapshot and restore Jobs as detached processes: like Kubernetes Jobs, they outlive the operator.

Each job has a directory (jobs/<kind>-<name>/) holding its command, pid, stdout, stderr and, once it
exits, its exit code; a restarted supervisor finds them there.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pgherd.engine.view import JobKind, JobState, JobView
from pgherd.local.layout import SandboxPaths, read_json, write_json

_WRAPPER = 'cd "$1" && shift && "$@" >stdout 2>stderr; echo $? >rc.tmp && mv rc.tmp rc'


def agent_executable() -> str:
    """The pgherd-backup console script of this installation."""
    beside = Path(sys.executable).with_name("pgherd-backup")
    if beside.exists():
        return str(beside)
    found = shutil.which("pgherd-backup")
    if found is None:
        raise FileNotFoundError("pgherd-backup is not installed (pip install -e . installs it)")
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours still answers kill(0): reap it if it is ours.
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return True
    return done == 0


@dataclass(frozen=True)
class Job:
    kind: JobKind
    name: str
    folder: Path

    @property
    def rc(self) -> int | None:
        try:
            return int((self.folder / "rc").read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    @property
    def meta(self) -> dict[str, Any]:
        data: dict[str, Any] = read_json(self.folder / "job.json", {})
        return data

    def set_meta(self, **fields: Any) -> None:
        write_json(self.folder / "job.json", {**self.meta, **fields})

    @property
    def running(self) -> bool:
        if self.rc is not None:
            return False
        pid = self.meta.get("pid")
        return pid is not None and _alive(int(pid))

    def stdout_json(self) -> dict[str, Any] | None:
        try:
            text = (self.folder / "stdout").read_text()
        except FileNotFoundError:
            return None
        start = text.find("{")
        if start < 0:
            return None
        try:
            value = json.loads(text[start:])
        except json.JSONDecodeError:
            return None
        return value if isinstance(value, dict) else None

    def error_text(self) -> str:
        try:
            lines = [line for line in (self.folder / "stderr").read_text().splitlines() if line.strip()]
        except FileNotFoundError:
            lines = []
        if lines:
            return lines[-1][:500]
        return f"exit code {self.rc}" if self.rc is not None else "the job process disappeared"

    def kill(self) -> None:
        pid = self.meta.get("pid")
        if pid and self.rc is None and _alive(int(pid)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pid), signal.SIGKILL)


class LocalJobs:
    def __init__(self, paths: SandboxPaths) -> None:
        self.paths = paths

    def job(self, kind: JobKind, name: str) -> Job:
        return Job(kind, name, self.paths.jobs / f"{kind.value}-{name}")

    def all(self) -> list[Job]:
        if not self.paths.jobs.is_dir():
            return []
        found: list[Job] = []
        for folder in sorted(self.paths.jobs.iterdir()):
            kind_text, _, name = folder.name.partition("-")
            if folder.is_dir() and kind_text in {k.value for k in JobKind}:
                found.append(Job(JobKind(kind_text), name, folder))
        return found

    def task(self, name: str) -> Job:
        """A side task (verify, prune): run like a job, but not one the engine follows."""
        return Job(JobKind.SNAPSHOT, name, self.paths.jobs / f"task-{name}")

    def tasks(self, prefix: str) -> list[Job]:
        """The side tasks whose name starts with ``prefix``, oldest name first."""
        if not self.paths.jobs.is_dir():
            return []
        return [
            self.task(folder.name.removeprefix("task-"))
            for folder in sorted(self.paths.jobs.glob(f"task-{prefix}*"))
            if folder.is_dir()
        ]

    def start_task(self, name: str, command: Sequence[str], env: Mapping[str, str], **meta: Any) -> Job:
        return self._launch(self.task(name), command, env, **meta)

    def start(
        self, kind: JobKind, name: str, command: Sequence[str], env: Mapping[str, str], **meta: Any
    ) -> Job:
        """Start the job unless it already exists (starting twice is a no-op, as the engine expects)."""
        return self._launch(self.job(kind, name), command, env, **meta)

    def record(self, kind: JobKind, name: str, **meta: Any) -> Job:
        """A job carried out elsewhere (a restore, by its member's agent): its folder and what it is,
        no process. Recording it twice keeps the first record."""
        job = self.job(kind, name)
        if not (job.folder / "job.json").exists():
            job.folder.mkdir(parents=True, exist_ok=True)
            job.set_meta(**meta)
        return job

    def fail(self, kind: JobKind, name: str, message: str, **meta: Any) -> Job:
        """A job that failed before it could start (its message in stderr, exit code 1)."""
        job = self.job(kind, name)
        job.folder.mkdir(parents=True, exist_ok=True)
        (job.folder / "stderr").write_text(message + "\n")
        (job.folder / "rc").write_text("1\n")
        job.set_meta(**meta)
        return job

    def _launch(self, job: Job, command: Sequence[str], env: Mapping[str, str], **meta: Any) -> Job:
        if (job.folder / "job.json").exists():
            return job
        job.folder.mkdir(parents=True, exist_ok=True)
        process = subprocess.Popen(
            ["/bin/sh", "-c", _WRAPPER, "job", str(job.folder), *command],
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        job.set_meta(pid=process.pid, command=list(command), **meta)
        return job

    def view(self, job: Job, *, stage: str | None = None, done: bool | None = None) -> JobView:
        """The JobView of a job; ``done`` overrides success for jobs with a platform part (restore)."""
        rc = job.rc
        member = job.meta.get("member")
        summary = job.stdout_json() or {}
        if rc is None:
            state = JobState.RUNNING if job.running else JobState.FAILED
        elif rc != 0:
            state = JobState.FAILED
        elif done is False:
            state = JobState.RUNNING
        else:
            state = JobState.SUCCEEDED
        message = job.error_text() if state is JobState.FAILED else ""
        return JobView(
            kind=job.kind,
            name=job.name,
            state=state,
            member=member,
            stage=stage,
            message=message,
            backup_id=summary.get("id"),
            timeline=summary.get("timeline"),
        )
