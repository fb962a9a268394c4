"""A crash point for tests, as the sandbox's supervisor has one (local/supervisor.py): with
``PGHERD_CRASH_POINT='{"step": "switchover-promote", "done": 0}'`` in the operator's environment, the
loop whose recorded operation reaches a step starting with ``step``, with at least ``done`` members
done (its status written, its actions applied), stops the whole operator there, as a kill would.

A process in a pod cannot kill itself exactly there (PID 1 ignores its own signals, and the kubelet
would restart the container at once), so it freezes instead: the event loop is blocked, nothing more
is written, no Lease is renewed, the liveness probe goes unanswered. The e2e drivers then delete the
frozen pod and scale the Deployment to 0, and start it again without the variable
(e2e/drivers/kube.py). Unset, this costs one dictionary lookup per tick."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass

from pgherd.engine.status import Operation

log = logging.getLogger("pgherd.kube.crashpoint")

ENV = "PGHERD_CRASH_POINT"
FROZEN_SECONDS = 24 * 3600.0


@dataclass(frozen=True)
class CrashPoint:
    step: str
    done: int = 0

    @classmethod
    def from_env(cls) -> CrashPoint | None:
        raw = os.environ.get(ENV, "").strip()
        if not raw:
            return None
        try:
            wanted = json.loads(raw)
            return cls(str(wanted["step"]), int(wanted.get("done", 0)))
        except (ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f'{ENV}={raw!r}: expected JSON {{"step": "...", "done": 0}} ({exc})') from exc

    def reached(self, operation: Operation) -> bool:
        return operation.step.startswith(self.step) and len(operation.done) >= self.done

    def freeze(self, operation: Operation) -> None:
        log.warning(
            "crash point: frozen at step %s (%d done), as if killed", operation.step, len(operation.done)
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        time.sleep(FROZEN_SECONDS)  # blocks the event loop: the whole operator stops here
