"""Every member's log lines, interleaved by the time the API server gives each (``timestamps=true``),
each prefixed with its member, readable whether the line is plain text or a JSON document (the
agent's and the operator's `--log-format json`, PostgreSQL's jsonlog)."""

from __future__ import annotations

import heapq
import json
import queue
import re
import sys
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from pgherd.kube import names
from pgherd.plugin.errors import PluginError
from pgherd.plugin.gather import member_selector
from pgherd.plugin.kube import Kube

_STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)\s?(.*)$")
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d)")
_UNIT = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
# JSON keys, first found wins: the time, the level, who logged it, the message.
_TIME_KEYS = ("time", "ts", "timestamp", "@timestamp", "asctime")
_LEVEL_KEYS = ("level", "levelname", "severity", "error_severity", "lvl")
_LOGGER_KEYS = ("logger", "name", "backend_type", "component")
_MESSAGE_KEYS = ("message", "msg", "event")
# pgherd's own (`--log-format json`): the object a line is about, which the line's member prefix and the
# command's cluster already say; a traceback, shown below the message as it was logged.
_CONTEXT_KEYS = ("namespace", "cluster", "member")
_EXCEPTION_KEY = "exception"


@dataclass(frozen=True, order=True)
class Line:
    key: str  # the API server's time, sortable: seconds, then nanoseconds zero-padded
    member: str
    stamp: str  # as the API server wrote it
    text: str  # the line as logged


def since_seconds(text: str) -> int:
    """kubectl's --since: 30s, 10m, 1h30m, 2d."""
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text.strip():
        raise PluginError(f"--since {text!r}: expected a duration such as 30s, 10m, 1h30m")
    seconds = sum(int(n) * _UNIT[u] for n, u in parts)
    return max(1, int(seconds))


def parse(member: str, raw: str) -> Line:
    """One line of the API's log stream: ``<RFC 3339 time> <text>``."""
    match = _STAMP.match(raw)
    if match is None:  # no time (a continuation): sorts first among its own, kept as it is
        return Line("", member, "", raw)
    seconds, fraction, zone, text = match.groups()
    key = f"{seconds}.{(fraction or '').ljust(9, '0')[:9]}{zone}"
    # Shown to the microsecond, always six digits: the times read in order as they sort.
    return Line(key, member, f"{seconds}.{(fraction or '').ljust(6, '0')[:6]}{zone}", text)


def readable(text: str) -> str:
    """A JSON line as `LEVEL logger: message key=value ...`; plain text as it is."""
    stripped = text.strip()
    if not (stripped.startswith("{") and stripped.endswith("}")):
        return text
    try:
        doc = json.loads(stripped)
    except ValueError:
        return text
    if not isinstance(doc, dict):
        return text

    def take(keys: Sequence[str]) -> Any:
        for key in keys:
            if key in doc:
                return doc.pop(key)
        return None

    take(_TIME_KEYS)  # the API server's time is the one shown
    level, logger, message = take(_LEVEL_KEYS), take(_LOGGER_KEYS), take(_MESSAGE_KEYS)
    for key in _CONTEXT_KEYS:
        doc.pop(key, None)
    exception = doc.pop(_EXCEPTION_KEY, None)
    head = " ".join(str(part) for part in (str(level).upper() if level else None, logger) if part)
    rest = " ".join(
        f"{k}={json.dumps(v) if not isinstance(v, str) or ' ' in v else v}"
        for k, v in doc.items()
        if v is not None
    )
    body = " ".join(part for part in (str(message) if message is not None else "", rest) if part)
    if exception:
        body = f"{body}\n{str(exception).rstrip()}"
    return f"{head}: {body}" if head else body


def format_line(line: Line, width: int) -> str:
    return f"{line.member:<{width}} {line.stamp or '-':<27} {readable(line.text)}"


def interleave(streams: Iterable[Iterable[Line]]) -> Iterator[Line]:
    """Lines of every member in time order (each member's stream is in order already)."""
    return heapq.merge(*streams, key=lambda line: line.key)


def _member_pods(kube: Kube, name: str) -> list[str]:
    pods = sorted(p["metadata"]["name"] for p in kube.pods(member_selector(name)))
    if not pods:
        raise PluginError(f"{name} has no member pod in namespace {kube.namespace!r}")
    return pods


def show(
    kube: Kube,
    name: str,
    *,
    follow: bool,
    since: str | None,
    tail: int | None = None,
    out: TextIO = sys.stdout,
) -> int:
    kube.cluster(name)
    pods = _member_pods(kube, name)
    width = max(len(p) for p in pods)
    seconds = since_seconds(since) if since else None
    if not follow:
        streams = []
        for pod in pods:
            try:
                lines = [
                    parse(pod, raw)
                    for raw in kube.log_lines(
                        pod, names.CONTAINER_POSTGRES, since_seconds=seconds, tail_lines=tail
                    )
                ]
            except PluginError as exc:
                print(f"{pod}: no log: {exc}", file=sys.stderr)
                continue
            streams.append(lines)
        for line in interleave(streams):
            print(format_line(line, width), file=out)
        return 0
    return _follow(kube, pods, width, seconds, tail, out)


def _follow(
    kube: Kube, pods: list[str], width: int, seconds: int | None, tail: int | None, out: TextIO
) -> int:
    """Lines as they come, from every member at once (each member's in order; across members in the
    order they arrive, which is their time order but for network delays)."""
    lines: queue.Queue[Line | str | None] = queue.Queue()

    def read(pod: str) -> None:
        try:
            for raw in kube.log_lines(
                pod, names.CONTAINER_POSTGRES, follow=True, since_seconds=seconds, tail_lines=tail
            ):
                lines.put(parse(pod, raw))
        except PluginError as exc:
            lines.put(f"{pod}: no log: {exc}")
        finally:
            lines.put(None)

    for pod in pods:
        threading.Thread(target=read, args=(pod,), daemon=True, name=f"log-{pod}").start()
    open_streams = len(pods)
    while open_streams:
        item = lines.get()
        if item is None:
            open_streams -= 1
        elif isinstance(item, str):
            print(item, file=sys.stderr)
        else:
            print(format_line(item, width), file=out, flush=True)
    return 0
