"""A one-line progress display (bytes, rate, ETA) on stderr, only when stderr is a terminal."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def human_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """Thread-safe counters; renders at most every `interval` seconds."""

    def __init__(self, label: str, stream: TextIO | None = None, *, interval: float = 0.5) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty()
        self.interval = interval
        self.done = 0
        self.total: int | None = None
        self.started = time.monotonic()
        self._last = 0.0
        self._lock = threading.Lock()

    def set_total(self, total: int | None) -> None:
        self.total = total

    def advance(self, count: int) -> None:
        with self._lock:
            self.done += count
        self._maybe_render()

    def update(self, done: int) -> None:
        with self._lock:
            self.done = done
        self._maybe_render()

    def _maybe_render(self) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < self.interval:
            return
        self._last = now
        self.stream.write("\r" + self.line(now) + "\x1b[K")
        self.stream.flush()

    def line(self, now: float | None = None) -> str:
        elapsed = max(1e-6, (now or time.monotonic()) - self.started)
        rate = self.done / elapsed
        text = f"{self.label}: {human_bytes(self.done)}"
        if self.total:
            text += f" / {human_bytes(self.total)} ({min(100.0, 100.0 * self.done / self.total):.0f}%)"
        text += f"  {human_bytes(rate)}/s"
        if self.total and rate > 0 and self.done < self.total:
            text += f"  ETA {human_duration((self.total - self.done) / rate)}"
        return text

    def finish(self) -> None:
        if self.enabled:
            self.stream.write("\r" + self.line() + "\x1b[K\n")
            self.stream.flush()
