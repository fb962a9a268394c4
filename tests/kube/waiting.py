"""Waiting for a condition in the kube tests: poll a probe until it returns something true."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(
    probe: Callable[[], T | None],
    timeout: float = 20.0,
    what: str = "",
    *,
    interval: float = 0.1,
    tolerate: tuple[type[BaseException], ...] = (),
) -> T:
    """The probe's first true value within ``timeout`` seconds; ``tolerate``: errors that mean "not yet"
    (shown if time runs out)."""
    deadline = time.monotonic() + timeout
    while True:
        error: BaseException | None = None
        try:
            last = probe()
        except tolerate as exc:
            last, error = None, exc
        if last:
            return last
        if time.monotonic() > deadline:
            shown = f", {error!r}" if error is not None else ""
            raise AssertionError(
                f"timed out after {timeout:.0f} s waiting for {what or probe} (last: {last!r}{shown})"
            )
        time.sleep(interval)
