"""The cyclic garbage collector under thousands of clusters.

Nearly all of the operator's heap lives as long as its clusters (each loop's state, kopf's memories,
the indexes), yet each of CPython's full collections walks all of it while every loop waits: a second
or so at 2,000 clusters, every few seconds while they are created. So the heap is collected and
frozen (``gc.freeze``) at an interval: the automatic collections then walk only what was allocated
since. Now and then it is thawed first, so that cycles that became garbage among the frozen objects (a
deleted cluster's loop) are collected too: nothing is kept longer than ``thaw_every``.
"""

from __future__ import annotations

import asyncio
import gc

FREEZE_EVERY = 30.0
THAW_EVERY = 600.0


async def keep_frozen(freeze_every: float = FREEZE_EVERY, thaw_every: float = THAW_EVERY) -> None:
    """Until cancelled: collect and freeze every ``freeze_every`` seconds; every ``thaw_every`` seconds
    the frozen objects are collected with the rest (one full walk of the heap)."""
    loop = asyncio.get_running_loop()
    thawed_at = loop.time()
    try:
        while True:
            await asyncio.sleep(freeze_every)
            if loop.time() - thawed_at >= thaw_every:
                gc.unfreeze()
                thawed_at = loop.time()
            gc.collect()
            gc.freeze()
    finally:
        gc.unfreeze()
