"""`--wait`: follow an object until it reaches its end, printing each change of what it is doing, and
end in failure (a non-zero exit, the reason printed) when it fails. One wait helper (tenacity's), for
every command that waits."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TextIO

from tenacity import RetryError, Retrying, retry_if_result, stop_after_delay, wait_fixed

from pgherd.plugin.errors import PluginError


@dataclass(frozen=True)
class Progress:
    line: str  # what it is doing now: printed each time it changes
    done: bool = False  # reached its end
    failed: str | None = None  # ... and failed, for this reason


def follow(
    read: Callable[[], Progress],
    *,
    timeout: float,
    interval: float = 1.0,
    out: TextIO | None = None,
    what: str = "it",
) -> Progress:
    """``read()`` every ``interval`` seconds until it is done; the last Progress. Failed: PluginError
    with its reason. Not done within ``timeout``: PluginError saying what it was doing then (the
    operation itself goes on)."""
    stream = out or sys.stdout
    started = time.monotonic()
    seen: list[Progress] = []

    def poll() -> Progress | None:
        progress = read()
        if not seen or seen[-1].line != progress.line:
            print(f"[{time.monotonic() - started:5.0f} s] {progress.line}", file=stream, flush=True)
        seen.append(progress)
        return progress if progress.done else None

    retrying = Retrying(
        stop=stop_after_delay(timeout),
        wait=wait_fixed(interval),
        retry=retry_if_result(lambda result: result is None),
    )
    try:
        final = retrying(poll)
    except RetryError:
        last = seen[-1].line if seen else "nothing read"
        raise PluginError(
            f"{what} is not done after {timeout:.0f} s (last: {last}); it goes on without us"
        ) from None
    assert final is not None  # retried while None
    if final.failed is not None:
        raise PluginError(final.failed)
    return final
