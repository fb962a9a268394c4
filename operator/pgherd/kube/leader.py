"""Leader election on a coordination.k8s.io/v1 Lease: only the holder acts.

The rules are client-go's (tools/leaderelection), because they are safe without synchronised clocks:

- a candidate takes the Lease only when its record (holder, renewTime) has not changed for a whole
  ``leaseDurationSeconds`` *as measured by the candidate's own clock* since it last saw it change;
- the holder renews every ``retry`` seconds with an update carrying the resourceVersion it read, so two
  writers never both win (the loser gets 409 Conflict);
- the holder stops acting once it has not renewed for ``renew_deadline`` seconds, which is shorter than
  the lease duration: it has stopped before any other replica can have taken over.

``holding()`` is what every action checks, at the moment it acts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import UTC, datetime
from typing import Any

from pgherd.kube.api import ApiError, KubeApi
from pgherd_backup.timestamps import rfc3339

log = logging.getLogger("pgherd.kube.leader")

LEASE_DURATION = 15.0
RENEW_DEADLINE = 10.0
RETRY = 2.0


def _micro_time(now: datetime | None = None) -> str:
    return rfc3339(now or datetime.now(UTC), 6)


class LeaderElector:
    def __init__(
        self,
        api: KubeApi,
        namespace: str,
        name: str,
        identity: str,
        *,
        lease_duration: float = LEASE_DURATION,
        renew_deadline: float = RENEW_DEADLINE,
        retry: float = RETRY,
    ) -> None:
        if not renew_deadline < lease_duration:
            raise ValueError("the renew deadline must be shorter than the lease duration")
        self.api, self.namespace, self.name, self.identity = api, namespace, name, identity
        self.lease_duration, self.renew_deadline, self.retry = lease_duration, renew_deadline, retry
        self._renewed_at: float | None = None  # monotonic time of our last successful write as holder
        self._observed: tuple[Any, ...] | None = None  # the other holder's record as last seen
        self._observed_at = 0.0
        self.changed = asyncio.Event()  # set whenever leadership is gained or lost

    def holding(self) -> bool:
        renewed = self._renewed_at
        return renewed is not None and time.monotonic() - renewed < self.renew_deadline

    async def run(self) -> None:
        """Try to acquire, then renew, forever (cancel to stop; a holder releases nothing: its Lease
        simply expires, which is safe whatever happened to it)."""
        was = False
        while True:
            try:
                # Bounded: an API server cut off answers nothing, and a request retried on its own
                # could outlast the renew deadline; the loss is then known, logged and signalled on time.
                await asyncio.wait_for(self._attempt(), timeout=self._attempt_timeout())
            except (ApiError, OSError, TimeoutError) as exc:
                log.warning("leader election: %s", str(exc) or "no answer from the API server in time")
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the election die: the operator would act on nothing forever
                log.exception("leader election failed; trying again")
            now = self.holding()
            if now != was:
                log.info(
                    "%s the leadership (Lease %s/%s)",
                    "acquired" if now else "lost",
                    self.namespace,
                    self.name,
                )
                was = now
                self.changed.set()
            await asyncio.sleep(self.retry)

    def _attempt_timeout(self) -> float:
        """Half the renew deadline, and never past the moment a holder stops holding."""
        bound = self.renew_deadline / 2
        if self._renewed_at is not None and self.holding():
            bound = min(bound, self._renewed_at + self.renew_deadline - time.monotonic())
        return max(bound, 0.05)

    async def _attempt(self) -> None:
        started = time.monotonic()
        lease = await self.api.find("Lease", self.namespace, self.name)
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(acquired=True, transitions=0),
            }
            try:
                await self.api.create("Lease", self.namespace, body)
            except ApiError as exc:
                if exc.conflict:
                    return  # another candidate created it first
                raise
            self._renewed_at = started
            return
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        record = (holder, spec.get("renewTime"), spec.get("leaseDurationSeconds"))
        if holder != self.identity:
            self._renewed_at = None
            if record != self._observed:
                self._observed, self._observed_at = record, started
                if holder:
                    return  # a live record: wait a whole lease duration without change
            duration = float(spec.get("leaseDurationSeconds") or self.lease_duration)
            if holder and started - self._observed_at < duration:
                return
        transitions = int(spec.get("leaseTransitions") or 0) + (0 if holder == self.identity else 1)
        lease["spec"] = {
            **spec,
            **self._spec(acquired=holder != self.identity, transitions=transitions),
        }
        if holder == self.identity:
            lease["spec"]["acquireTime"] = spec.get("acquireTime") or lease["spec"]["acquireTime"]
        try:
            await self.api.replace("Lease", self.namespace, self.name, lease)
        except ApiError as exc:
            if exc.conflict:
                self._renewed_at = None  # someone else wrote it: we are not the holder
                return
            raise
        self._renewed_at = started

    def _spec(self, *, acquired: bool, transitions: int) -> dict[str, Any]:
        now = _micro_time()
        spec: dict[str, Any] = {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": int(self.lease_duration),
            "renewTime": now,
            "leaseTransitions": transitions,
        }
        if acquired:
            spec["acquireTime"] = now
        return spec


class AlwaysLeader:
    """Without --leader-elect: this process is the only operator (the sandbox-like single replica)."""

    def __init__(self) -> None:
        self.changed = asyncio.Event()

    def holding(self) -> bool:
        return True

    async def run(self) -> None:
        await asyncio.Event().wait()
