"""CPython's cyclic collector against the operator's heap.

A full (oldest-generation) collection scans every tracked object and stops the event loop meanwhile:
with 2,000 clusters' objects (kopf's bodies, the indexes, each loop's status and parsed spec) each one
took 0.3-0.6 s every 3-6 s on a quiet machine (1.5-2.9 s on a loaded one), and every cluster whose watch
event came during one waited for it (docs/kube.md). Most of those objects live as long as their cluster. So, once the set of clusters has
stood still for ``SETTLE`` seconds with every loop past its first tick, the heap is collected and what
survives is frozen (``gc.freeze``): later collections scan only what came after.

A frozen object is still freed when its last reference goes; only a cycle among frozen objects waits.
What a tick had in flight at the freeze (futures, requests) and the loops of clusters deleted since
are such cycles: each later freeze, after the set of clusters changed, thaws and collects first. One
freeze's worth is the most that waits (a freeze every 30 s, tried once, kept twenty and grew the heap).

Once frozen, the collector runs less often than CPython's defaults (`tune_collector`): the oldest
generation then counts only what came after the freeze, so a quarter of it is soon reached, and a spec
change of 2,000 clusters made a full collection every 5 s, the collector an eighth of the operator's
CPU through the change (docs/kube.md, "The collector's thresholds"). Before the first freeze (the
clusters' creation), and again while loops start after it (new clusters), the defaults stand: the heap
grows, and its cycles are collected as often as before (one run that raised them from the start peaked
at 360 MB instead of 256-285 MB at 2,000 clusters).

Memory freed is given back to the kernel at every check (``release_free_memory``): glibc returns only
the top of its heap by itself, and what a burst (the clusters' creation, a spec change of every cluster)
freed below a chunk still in use stayed in the RSS until then.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import time
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field

log = logging.getLogger("pgherd.kube.heap")

SETTLE = 30.0  # seconds the clusters stand still (none added, none removed, none starting)
CHECK = 5.0
# gc.set_threshold for the operator (CPython's: 700, 10, 10): a young collection per 10,000 objects
# kept, a middle one per 20 of those, a full one per 100 middle ones (and, as always, only once what
# came into the oldest generation since the last is a quarter of what it holds).
THRESHOLDS = (10_000, 20, 100)
DEFAULT_THRESHOLDS = gc.get_threshold()  # CPython's, while clusters' loops start


@dataclass
class FreezePolicy:
    """When to freeze: the clusters unchanged and none starting for ``settle`` seconds, and not what
    the last freeze saw (at start, no cluster counts as what was frozen: nothing to do)."""

    settle: float = SETTLE
    _seen: frozenset[Hashable] | None = None
    _since: float = 0.0
    _frozen: frozenset[Hashable] = field(default_factory=frozenset)

    def due(self, clusters: Collection[Hashable], starting: bool, now: float) -> bool:
        current = frozenset(clusters)
        if starting or current != self._seen:
            self._seen, self._since = current, now
            return False
        return current != self._frozen and now - self._since >= self.settle

    def froze(self) -> None:
        self._frozen = self._seen if self._seen is not None else frozenset()


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS; Windows: no CDLL(None))
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _malloc_trim()


def release_free_memory() -> bool:
    """Give the pages of freed chunks back to the kernel (glibc's malloc_trim(0), about 1-4 ms at 2,000
    clusters): whether any were. 2,000 clusters' creation left 34-50 MB of them in the operator's RSS."""
    return _MALLOC_TRIM is not None and bool(_MALLOC_TRIM(0))


def tune_collector(frozen: bool) -> None:
    """The collector's thresholds: `THRESHOLDS` for a frozen heap, CPython's while loops start (a burst
    of new clusters after a freeze made its cycles at the defaults' pace, not a tenth of it)."""
    gc.set_threshold(*(THRESHOLDS if frozen else DEFAULT_THRESHOLDS))


def refreeze() -> tuple[int, float]:
    """Thaw, collect everything, freeze what is left: (objects frozen, seconds it took)."""
    started = time.monotonic()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count(), time.monotonic() - started


async def keep_frozen(
    clusters: Callable[[], Collection[Hashable]],
    starting: Callable[[], bool],
    policy: FreezePolicy | None = None,
    check: float = CHECK,
) -> None:
    """Until cancelled: freeze the heap each time the clusters have settled in a new set."""
    policy = policy or FreezePolicy()
    while True:
        await asyncio.sleep(check)
        loops_starting = starting()
        if loops_starting:
            tune_collector(frozen=False)
        if policy.due(clusters(), loops_starting, time.monotonic()):
            frozen, took = refreeze()
            tune_collector(frozen=True)
            policy.froze()
            log.info("heap frozen with %d clusters: %d objects, in %.2fs", len(clusters()), frozen, took)
        release_free_memory()
